"""A question reads the document exactly, whatever the tiers hold (issue 29).

The first answer token of every question must be the full cache's, also for the second question of a prefill (whose
tiers the first question chose) and after a layer-major prefill (whose tiers were chosen layer by layer); and the two
prefills must leave the same tiers, so that whole answers agree.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from docfuse.runtime.kv import TieredCache, prepare_question, read_question
from docfuse.runtime.kv.eviction import SnapKVCache
from docfuse.runtime.kv.tiered import make_cache
from docfuse.runtime.layer_prefill import layer_major_prefill
from docfuse.runtime.session import cache_kwarg
from tests.test_layer_prefill import doc, tiny

KV = {"core_tokens": 0.1, "association_tokens": 0.25, "recent_tokens": 16, "query_tokens": 24}


def ids(n: int, seed: int) -> torch.Tensor:
    return doc(n, 1, seed)


@torch.no_grad()
def forward(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    past = cache.get_seq_length()
    positions = torch.arange(past, past + tokens.shape[1]).unsqueeze(0)
    out = model(input_ids=tokens, position_ids=positions, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0, -1]


def token_major(model, document: torch.Tensor, kv: dict) -> TieredCache:
    cache = TieredCache(model.config, kv)
    for s in range(0, document.shape[1], 256):
        forward(model, cache, document[:, s: s + 256])
    return cache


def prefilled(model, document: torch.Tensor, kv: dict, prefill: str) -> TieredCache:
    """The document in a TieredCache, token-major in 256-token chunks or layer-major (``prefill``)."""
    if prefill == "tokens":
        return token_major(model, document, kv)
    cache = TieredCache(model.config, kv)
    layer_major_prefill(model, cache, document, chunk=256)
    return cache


def answer(model, cache, question: torch.Tensor, steps: int = 6, exact: bool = True) -> tuple[torch.Tensor, list]:
    """First-token logits and the greedy tokens after them; the cache is rolled back to the document after."""
    prefix = cache.get_seq_length()
    if exact:
        logits = read_question(model, cache, question)
    else:
        prepare_question(model, cache, question)
        logits = forward(model, cache, question)
    first, tokens = logits, [int(logits.argmax())]
    for _ in range(steps):
        tokens.append(int(forward(model, cache, torch.tensor([[tokens[-1]]])).argmax()))
    cache.rollback(prefix)
    return first, tokens


def test_every_question_reads_the_document_as_the_full_cache_does() -> None:
    model = tiny()
    document = ids(700, 1)
    cache = token_major(model, document, KV)
    for n, seed in enumerate((2, 3, 4)):  # the second and third questions find tiers the earlier ones chose
        question = ids(12, seed)
        full = DynamicCache(config=model.config)
        forward(model, full, document)
        expected = forward(model, full, question)
        logits, _ = answer(model, cache, question)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert cache.get_seq_length() == 700
        if n:  # the cache really is tiered: most of the document is not in the core
            assert cache.tier_tokens()["core"] < 700 // 2


def test_the_question_stays_in_the_core_and_the_budget_grows_for_a_long_one() -> None:
    model = tiny()
    cache = token_major(model, ids(600, 1), KV)
    read_question(model, cache, ids(40, 5))  # longer than recent_tokens (16)
    tiers = cache.membership(0)[0]
    assert bool((tiers[:, 600:] == 0).all()) and cache.get_seq_length() == 640
    assert cache.tier_tokens()["core"] >= 40 + KV["recent_tokens"] // 4


@pytest.mark.parametrize("pool", [15, 1])
def test_layer_major_prefill_answers_as_token_major_prefill(pool: int) -> None:
    """The new user's report: ``prefill: layers`` changed an answer. The question now reads both caches exactly
    and ranks every token from exact keys, so both leave the same tiers and give the same tokens."""
    model = tiny()
    document = ids(800, 1)
    kv = {**KV, "candidate_tokens": 1.0, "vote_pool": pool}
    usual = token_major(model, document, kv)
    layered = TieredCache(model.config, kv)
    layer_major_prefill(model, layered, document, chunk=256)
    for seed in (7, 8):
        question = ids(10, seed)
        a_logits, a_tokens = answer(model, usual, question)
        b_logits, b_tokens = answer(model, layered, question)
        torch.testing.assert_close(a_logits, b_logits, rtol=1e-4, atol=1e-4)
        assert a_tokens == b_tokens
        for la, lb in zip(usual.layers, layered.layers):
            assert torch.equal(la.membership(), lb.membership())


def test_the_old_question_path_tiers_layer_major_prefill_differently() -> None:
    """What the test above guards against: the question reading the tiers, with a quarter of the background scored
    exactly, leaves other tiers after a layer-major prefill than after the usual one."""
    model = tiny()
    document = ids(800, 1)
    kv = {**KV, "question": "tiered", "candidate_tokens": 0.25}
    usual, layered = token_major(model, document, kv), TieredCache(model.config, kv)
    layer_major_prefill(model, layered, document, chunk=256)
    question = ids(10, 7)
    answer(model, usual, question, exact=False)
    answer(model, layered, question, exact=False)
    assert any(not torch.equal(la.membership(), lb.membership()) for la, lb in zip(usual.layers, layered.layers))


def test_method_evict_gives_the_snapkv_baseline_through_the_kv_block() -> None:
    model = tiny()
    cache = make_cache(model.config, {"method": "evict", "core_tokens": 0.2, "query_tokens": 16})
    assert isinstance(cache, SnapKVCache) and not cache.maybe_retier()
    forward(model, cache, ids(500, 1))
    prepare_question(model, cache, ids(10, 2))
    assert cache.layers[0].kept == 100 and cache.get_seq_length() == 500
    with pytest.raises(ValueError, match="not auto"):
        make_cache(model.config, {"method": "evict", "core_tokens": "auto"})


def test_the_question_pass_re_tiers_each_layer_from_its_own_read() -> None:
    """read_question re-tiers every layer inside the question's pass, from the exact read its attention made: the
    same tiers and logits as a re-tier after the pass (which reads the archive a second time), for two questions."""
    from docfuse.runtime.kv.queries import record_queries

    model = tiny()
    document = ids(700, 4)
    inside, after = token_major(model, document, KV), token_major(model, document, KV)
    for seed in (5, 6):
        question = ids(12, seed)
        prefix = inside.get_seq_length()
        reads = {"n": 0}
        original = type(inside.layers[0])._materialize

        def counting(self, *args, **kwargs):
            reads["n"] += self._all is None
            return original(self, *args, **kwargs)

        type(inside.layers[0])._materialize = counting
        try:
            got = read_question(model, inside, question)
        finally:
            type(inside.layers[0])._materialize = original
        assert reads["n"] == len(inside.layers), "one read of the document per layer: the question's own"
        positions = torch.arange(prefix, prefix + question.shape[1]).unsqueeze(0)
        with torch.no_grad(), after.exact_view(), record_queries(model, after, tokens=after.kv.query_tokens):
            want = model(input_ids=question, position_ids=positions, use_cache=True,
                         **{cache_kwarg(model): after}).logits[0, -1]
        after.retier(queries=after.take_queries(), keep_from=prefix)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float noise of another memory layout
        assert inside.retiers == after.retiers and inside.retiered_at == after.retiered_at
        for a, b in zip(inside.layers, after.layers):
            assert torch.equal(a.membership(), b.membership())
        for tokens in ([[7]], [[9]]):
            torch.testing.assert_close(forward(model, inside, torch.tensor(tokens)),
                                       forward(model, after, torch.tensor(tokens)), rtol=1e-5, atol=1e-5)
        inside.rollback(prefix)
        after.rollback(prefix)


@pytest.mark.parametrize("prefill", ["tokens", "layers"])
def test_the_device_re_tier_chooses_the_tiers_the_general_path_chooses(monkeypatch, prefill) -> None:
    """With every exact key at hand, the re-tier runs where the keys are (runtime.kv.layer.ALL_ON_DEVICE); the tiers,
    codes and answers must be those of the general path, bit for bit."""
    from docfuse.runtime.kv import layer as layer_module

    model = tiny()
    document = ids(650, 3)
    kv = {**KV, "association_bits": 4, "association_key_bits": 8, "vote_sharing": 0.25}

    def run(on_device: bool):
        monkeypatch.setattr(layer_module, "ALL_ON_DEVICE", on_device)
        cache = prefilled(model, document, kv, prefill)
        out = []
        for seed in (5, 6):
            first, tokens = answer(model, cache, ids(11, seed), steps=4)
            read_question(model, cache, ids(9, seed + 10))  # leave this one's tiers in place to compare
            layers = [(l.core_pos[:, :, : l.n_core].clone(), l.assoc_pos.clone(), l.keys[:, :, : l.n_core].clone(),
                       l.assoc.keys.codes.clone(), l.assoc.values.codes.clone()) for l in cache.layers]
            cache.rollback(650)
            out.append((first, tokens, layers))
        return out

    fast, general = run(True), run(False)
    for (f_first, f_tokens, f_layers), (g_first, g_tokens, g_layers) in zip(fast, general):
        assert torch.equal(f_first, g_first) and f_tokens == g_tokens
        for a, b in zip(f_layers, g_layers):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kv_extra", [{}, {"candidate_tokens": 0.3}, {"association_tokens": 1.0, "association_bits": 8}])
@pytest.mark.parametrize("prefill", ["tokens", "layers"])
def test_a_re_tier_after_the_read_chooses_what_the_re_tier_inside_it_chooses(monkeypatch, kv_extra, prefill
                                                                            ) -> None:
    """read_question(retier=False) then retier_after_read (the GPU engine's order when the exact K/V are device
    slices: first token, then re-tier) must leave the tiers, codes, first logits and answers that the re-tier inside
    the pass leaves, bit for bit: for the first question and for later ones (which read the archive), with every
    token a candidate or only some (where the inside path scores from the pass's whole exact read)."""
    from docfuse.runtime.kv import layer as layer_module
    from docfuse.runtime.kv import retier_after_read

    # archive blocks of 16 tokens: a later question's general path then reads only some of them exactly
    monkeypatch.setattr(layer_module, "ARCHIVE_BLOCK", 16)
    model = tiny()
    document = ids(650, 3)
    kv = {**KV, **kv_extra}

    def run(inside: bool):
        cache = prefilled(model, document, kv, prefill)
        out = []
        for seed in (5, 6, 7):
            question = ids(11, seed)
            first = read_question(model, cache, question, retier=inside)
            if not inside:
                retier_after_read(cache, 650)
            assert all(layer.queries is None for layer in cache.layers)
            tokens = [int(first.argmax())]
            for _ in range(4):
                tokens.append(int(forward(model, cache, torch.tensor([[tokens[-1]]])).argmax()))
            layers = [(l.core_pos[:, :, : l.n_core].clone(), l.assoc_pos.clone(), l.keys[:, :, : l.n_core].clone(),
                       l.assoc.keys.codes.clone(), l.assoc.values.codes.clone()) for l in cache.layers]
            cache.rollback(650)
            out.append((first, tokens, layers, cache.retiers))
        return out

    for (i_first, i_tokens, i_layers, i_n), (a_first, a_tokens, a_layers, a_n) in zip(run(True), run(False)):
        assert torch.equal(i_first, a_first) and i_tokens == a_tokens and i_n == a_n
        for a, b in zip(i_layers, a_layers):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
