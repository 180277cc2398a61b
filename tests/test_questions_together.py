"""``kv.questions: together``: the questions of one prefill are read exactly, then share one re-tier.

Every first answer token must still be the full cache's; the shared tiers are made once (not once per question) and
stay put while the questions are answered; with budgets that hold everything the answers are the full cache's.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import DynamicCache

from docfuse.runtime.kv import KVConfig, TieredCache, read_question, read_questions
from tests.test_layer_prefill import doc, tiny
from tests.test_question_fidelity import KV, forward, token_major

TOGETHER = {**KV, "questions": "together"}


def decode(model, cache, first: torch.Tensor, steps: int = 6) -> list[int]:
    tokens = [int(first.argmax())]
    for _ in range(steps):
        tokens.append(int(forward(model, cache, torch.tensor([[tokens[-1]]])).argmax()))
    return tokens


def test_every_question_is_read_exactly_and_the_document_re_tiers_once() -> None:
    model = tiny()
    document = doc(700, 1, 1)
    questions = [doc(12, 1, seed)[0].tolist() for seed in (2, 3, 4)]
    cache = token_major(model, document, TOGETHER)
    before = cache.retiers
    reads = read_questions(model, cache, questions)
    assert cache.retiers == before + 1 and cache.get_seq_length() == 700
    assert cache.tier_tokens()["core"] < 700 // 2  # really tiered
    for question, read in zip(questions, reads):
        full = DynamicCache(config=model.config)
        forward(model, full, document)
        expected = forward(model, full, torch.tensor([question]))
        torch.testing.assert_close(read.logits, expected, rtol=1e-4, atol=1e-4)
        assert len(read.keys) == 3 and read.keys[0].shape[2] == 12
    for question, read in zip(questions, reads):  # one pass for all: each question's K/V as if it were read alone
        alone = token_major(model, document, TOGETHER)
        (single,) = read_questions(model, alone, [question])
        for a, b in zip(read.keys + read.values, single.keys + single.values):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    tiers = cache.membership(0).clone()
    for read in reads:  # each answer decodes on the shared tiers, then leaves them as they were
        cache.append_read(read)
        assert cache.get_seq_length() == 712 and bool((cache.membership(0)[0][:, 700:] == 0).all())
        decode(model, cache, read.logits)
        cache.rollback(700)
        assert torch.equal(cache.membership(0), tiers)


def test_the_shared_re_tier_ranks_by_every_questions_own_queries(monkeypatch) -> None:
    """Each layer re-tiers from each question's last ``query_tokens`` queries, as its own read records them, even
    when the questions together are longer than ``query_tokens`` (the pass records all of them, then picks)."""
    from docfuse.runtime.kv import record_queries

    model = tiny()
    document = doc(500, 1, 1)
    questions = [doc(n, 1, seed)[0].tolist() for n, seed in ((30, 2), (8, 3), (20, 4))]  # 58 tokens > 24
    expected = []
    for question in questions:
        cache = token_major(model, document, TOGETHER)
        with torch.no_grad(), cache.exact_view(), record_queries(model, cache, tokens=len(question)):
            forward(model, cache, torch.tensor([question]))
        expected.append(cache.take_queries())
    cache = token_major(model, document, TOGETHER)
    seen = {}
    retier_layer = cache.retier_layer
    monkeypatch.setattr(cache, "retier_layer", lambda i, q, keep_from=None: (seen.__setitem__(i, q),
                                                                             retier_layer(i, q, keep_from))[1])
    read_questions(model, cache, questions)
    assert sorted(seen) == [0, 1, 2]
    for i, got in seen.items():
        want = torch.cat([e[i][:, :, -24:] for e in expected], dim=2)
        assert got.shape[2] == 24 + 8 + 20
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_question_after_the_shared_re_tier_decodes_as_if_it_had_just_been_read() -> None:
    """append_read puts back exactly what the question's read left in the core: its answer then equals the answer of
    the same question read over the same tiers (the tiers are not re-chosen in between)."""
    model = tiny()
    document = doc(600, 1, 1)
    question = doc(10, 1, 5)
    cache = token_major(model, document, TOGETHER)
    (read,) = read_questions(model, cache, [question[0].tolist()])
    cache.append_read(read)
    ours = decode(model, cache, read.logits)
    cache.rollback(600)
    # the same tiers, the question appended by an ordinary forward over them (exactly: its K/V do not depend on them)
    with cache.exact_view():
        logits = forward(model, cache, question)
    theirs = decode(model, cache, logits)
    assert ours == theirs


def test_with_budgets_that_hold_everything_the_answers_are_the_full_cache() -> None:
    model = tiny()
    document = doc(500, 1, 1)
    kv = {**TOGETHER, "core_tokens": 1.0, "association_tokens": 0.0}
    cache = token_major(model, document, kv)
    questions = [doc(8, 1, seed)[0].tolist() for seed in (6, 7)]
    for question, read in zip(questions, read_questions(model, cache, questions)):
        full = DynamicCache(config=model.config)
        forward(model, full, document)
        expected = decode(model, full, forward(model, full, torch.tensor([question])))
        cache.append_read(read)
        assert decode(model, cache, read.logits) == expected
        cache.rollback(500)


def test_together_differs_from_each_only_after_the_first_token() -> None:
    model = tiny()
    document, question = doc(700, 1, 1), doc(12, 1, 3)
    each = token_major(model, document, KV)
    first_each = read_question(model, each, question)
    together = token_major(model, document, TOGETHER)
    (read,) = read_questions(model, together, [question[0].tolist()])
    torch.testing.assert_close(read.logits, first_each, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_question_mask_keeps_questions_apart(impl) -> None:
    from docfuse.runtime.kv.queries import question_mask

    mask = question_mask(4, [2, 3], "cpu", torch.float32 if impl == "eager" else None)[0, 0]
    attends = mask if impl == "sdpa" else mask == 0
    assert attends.shape == (5, 9) and bool(attends[:, :4].all())
    assert attends[0, 4:].tolist() == [True, False, False, False, False]
    assert attends[1, 4:].tolist() == [True, True, False, False, False]
    assert attends[4, 4:].tolist() == [False, False, True, True, True]
    model = tiny()
    model.config._attn_implementation = impl
    document, question = doc(300, 1, 1), doc(9, 1, 8)[0].tolist()
    full = DynamicCache(config=model.config)
    forward(model, full, document)
    expected = forward(model, full, torch.tensor([question]))
    cache = token_major(model, document, TOGETHER)
    reads = read_questions(model, cache, [doc(5, 1, 9)[0].tolist(), question])
    torch.testing.assert_close(reads[1].logits, expected, rtol=1e-4, atol=1e-4)


def test_the_kv_block_refuses_together_without_exact_reads() -> None:
    with pytest.raises(ValidationError, match="question: exact"):
        KVConfig(questions="together", question="tiered")
    with pytest.raises(ValidationError, match="retier_every"):
        KVConfig(questions="together", retier_every=16)
    assert KVConfig().questions == "each"
    with pytest.raises(ValueError, match="layers"):
        TieredCache(tiny().config, TOGETHER).append_read(type("R", (), {"keys": [1], "values": [1]})())
