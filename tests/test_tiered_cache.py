"""Tiered KV cache: exactness where promised, tier invariants, re-tiering without prefill, accounting, baseline.

Most tests use a tiny random Llama (fast); one slow test checks the real embedded model.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StoppingCriteriaList

from docfuse.runtime.kv import KVConfig, SnapKVCache, TieredCache, make_cache, prepare_question, record_queries
from docfuse.runtime.kv.association import AssociationStore
from docfuse.runtime.kv.background import ExactArchive, pack_exact, unpack_exact
from docfuse.runtime.kv.quant import pack_codes, quantize_keys, quantize_values, unpack_codes
from docfuse.runtime.kv.summaries import PageTable, page_minmax, upper_bounds
from docfuse.runtime.kv.tiered import RetierOnSchedule
from docfuse.runtime.kv.votes import nominate, token_votes

IMPLS = ["eager", "sdpa"]


def tiny_model(impl: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=2048)
    config._attn_implementation = impl
    return LlamaForCausalLM(config).eval()


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, cache=cache, use_cache=True).logits


def reference_kv(model, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = DynamicCache(config=model.config)
    run(model, cache, tokens)
    return [(layer.keys, layer.values) for layer in cache.layers]


def small(**overrides) -> dict:
    # vote_pool 7: these caches hold 16-token pages and tens of core tokens, which the default pool (15) would blur
    kv = {"core_tokens": 40, "association_tokens": 50, "sink_tokens": 4, "recent_tokens": 8, "page_tokens": 16,
          "vote_pool": 7}
    kv.update(overrides)
    return kv


# ---- background tier ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_background_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    x = (torch.randn(2, 3, 77, 64) * 5).to(dtype)
    x[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    blob = pack_exact(x)
    y = unpack_exact(blob)
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.view(int_type), x.view(int_type))
    assert blob.nbytes() <= blob.raw_nbytes() + len(blob.planes)  # an incompressible plane is stored raw
    if dtype != torch.float16:  # fp16's high byte carries mantissa bits: random data barely compresses
        assert blob.nbytes() < 0.97 * blob.raw_nbytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_shuffle_makes_the_hosts_planes_and_undoes_them(dtype: torch.dtype) -> None:
    """``planes_of``/``tensor_of_planes`` are what ``pack_exact``/``unpack_exact`` run on a GPU (a KV store entry
    saved or loaded by the engine); run here in torch on the CPU, they must give the numpy path's bytes, so that an
    entry written on a card loads on a CPU and back."""
    import numpy as np

    from docfuse.runtime.kv.background import planes_of, tensor_of_planes

    x = (torch.randn(1, 3, 45, 64) * 3).to(dtype)[:, :, 5:40]  # a block: a view into a longer layer
    host = pack_exact(x)
    planes = planes_of(x)
    raw = [np.frombuffer(plane, dtype=np.uint8) for plane in _raw_planes(host)]
    assert planes.shape == (x.element_size(), x.numel())
    assert all(torch.equal(planes[i], torch.from_numpy(raw[i].copy())) for i in range(len(raw)))
    back = tensor_of_planes(planes, dtype, tuple(x.shape))
    int_type = {2: torch.int16, 4: torch.int32}[x.element_size()]
    assert back.dtype == dtype and torch.equal(back.view(int_type), x.contiguous().view(int_type))


@pytest.mark.parametrize("kernels", ["1", "0"])  # the numba pass, and three copies without it
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_unpacks_into_a_slice_of_the_cache_bit_for_bit(dtype, kernels, monkeypatch) -> None:
    """``unpack_exact_into`` (a question's exact read, a KV store load) writes a block straight into the cache's
    K/V at its positions: the same bytes as ``unpack_exact``, neighbours untouched, inside inference mode too."""
    from docfuse.runtime.kv import plane_kernels
    from docfuse.runtime.kv.background import unpack_exact_into

    monkeypatch.setenv("DOCFUSE_CODE_KERNELS", kernels)
    x = (torch.randn(2, 3, 77, 64) * 5).to(dtype)
    x[1, 2, 3, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    blob = pack_exact(x)
    int_type = {2: torch.int16, 4: torch.int32}[x.element_size()]
    with torch.inference_mode():
        cache = torch.zeros(2, 3, 200, 64, dtype=dtype)
        assert plane_kernels.takes(cache[:, :, 50:127]) == (kernels == "1")
        unpack_exact_into(blob, cache[:, :, 50:127])
    assert torch.equal(cache[:, :, 50:127].view(int_type), x.view(int_type))
    assert torch.equal(cache[:, :, 50:127].view(int_type), unpack_exact(blob).view(int_type))
    assert not cache[:, :, :50].any() and not cache[:, :, 127:].any()
    with pytest.raises(ValueError, match="the block holds"):
        unpack_exact_into(blob, cache[:, :, 50:128])


def _raw_planes(blob) -> list[bytes]:
    import lz4.block

    return [lz4.block.decompress(p[1:]) if p[:1] == b"\x01" else bytes(p[1:]) for p in blob.planes]


def test_archive_append_read_truncate_exact() -> None:
    k, v = torch.randn(1, 2, 700, 16), torch.randn(1, 2, 700, 16)
    archive = ExactArchive(block_tokens=256)
    archive.append(k[:, :, :100], v[:, :, :100])
    archive.append(k[:, :, 100:700], v[:, :, 100:700])
    assert archive.length == 700
    archive.truncate(333)
    got_k = torch.cat([archive.read(i)[2] for i in range(len(archive.blocks))], dim=2)
    got_v = torch.cat([archive.read(i)[3] for i in range(len(archive.blocks))], dim=2)
    assert torch.equal(got_k, k[:, :, :333]) and torch.equal(got_v, v[:, :, :333])
    assert archive.block_of(torch.tensor([0, 255, 256, 332])).tolist() == [0, 0, 1, 1]


# ---- association tier --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (2, 3, 5, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantisation_error_is_within_half_a_step(bits: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 70, 64)
    x[..., 5] += 20.0  # an outlier channel, as real keys have
    levels = (1 << bits) - 1
    keys = quantize_keys(x, bits, group=32)
    err = (keys.dequantize(torch.float32) - x).abs()
    pad = torch.cat([x, x[:, :, -1:].expand(-1, -1, 26, -1)], dim=2).reshape(1, 3, 3, 32, 64)
    step = (pad.amax(3, keepdim=True) - pad.amin(3, keepdim=True)) / levels
    bound = (0.5 * step + 2e-3 * pad.abs().amax(3, keepdim=True) + 1e-6).expand(-1, -1, -1, 32, -1)
    assert (err <= bound.reshape(1, 3, 96, 64)[:, :, :70]).all()
    values = quantize_values(x, bits)
    err_v = (values.dequantize(torch.float32) - x).abs().reshape(1, 3, 70, 2, 32)
    grouped = x.reshape(1, 3, 70, 2, 32)
    step_v = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / levels
    assert (err_v <= 0.5 * step_v + 2e-3 * grouped.abs().amax(-1, keepdim=True) + 1e-6).all()
    # more bits, smaller error; 4-bit keys with an outlier channel stay well under 10% relative error
    rel = (err.pow(2).mean() / x.pow(2).mean()).sqrt().item()
    assert rel < {2: 0.35, 4: 0.08, 8: 0.005}[bits]


def test_differential_encoding_reconstructs_and_counts_anchor_bytes() -> None:
    torch.manual_seed(0)
    base = torch.randn(1, 2, 4, 1, 64) * 3  # four pages with distinct means
    x = (base + 0.3 * torch.randn(1, 2, 4, 16, 64)).reshape(1, 2, 64, 64)
    pages = torch.arange(64).div(16, rounding_mode="floor").expand(1, 2, -1)
    plain = AssociationStore.build(x, x, 4, 32)
    diff = AssociationStore.build(x, x, 4, 32, pages)
    for store in (plain, diff):
        k, v = store.dequantize(torch.float32)
        assert k.shape == x.shape and (k - x).abs().max() < 0.1 * x.abs().max()
        assert (v - x).abs().max() < 0.1 * x.abs().max()
    assert diff.nbytes() > plain.nbytes()  # anchors are paid for on the device
    _, v_diff = diff.dequantize(torch.float32)
    _, v_plain = plain.dequantize(torch.float32)
    assert (v_diff - x).pow(2).mean() < (v_plain - x).pow(2).mean()  # per-token values gain from page anchors


# ---- summaries ---------------------------------------------------------------------------------------------------
def test_page_table_with_explicit_spans_and_upper_bound() -> None:
    table = PageTable(4, [(5, 12), (20, 30)])
    assert table.starts(26) == [0, 4, 5, 12, 16, 20]
    assert table.page_ids(26).tolist()[:13] == [0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 3]
    with pytest.raises(ValueError, match="overlaps"):
        PageTable(4, [(0, 10), (5, 12)])
    keys = torch.randn(1, 2, 26, 8)
    ids_ = table.page_ids(26)
    lo, hi = page_minmax(keys, ids_, 6)
    q = torch.randn(1, 2, 3, 8)
    bound = upper_bounds(q, lo, hi)  # [1, 2, 3, 6]
    exact = q @ keys.transpose(-1, -2)  # [1, 2, 3, 26]
    for page in range(6):
        assert (exact[..., ids_ == page].amax(-1) <= bound[..., page] + 1e-5).all()


# ---- the cache inside a model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_full_budget_logits_identical_to_dynamic_cache(impl: str) -> None:
    model = tiny_model(impl)
    tokens = ids(230)
    dyn = DynamicCache(config=model.config)
    want = [run(model, dyn, tokens[:, :150]), run(model, dyn, tokens[:, 150:200])]
    want += [run(model, dyn, tokens[:, i:i + 1]) for i in range(200, 230)]
    tiered = TieredCache(model.config, {"core_tokens": 4096, "association_tokens": 4096})
    got = [run(model, tiered, tokens[:, :150])]
    tiered.retier()  # between prefill chunks: all still core
    got.append(run(model, tiered, tokens[:, 150:200]))
    tiered.retier()
    got += [run(model, tiered, tokens[:, i:i + 1]) for i in range(200, 230)]
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert tiered.tier_tokens() == {"core": 230, "association": 0, "background": 0, "total": 230}


@pytest.mark.parametrize("impl", IMPLS)
def test_tiered_attention_matches_manual_attention_over_tiers(impl: str) -> None:
    """After re-tiering, the model's output equals attention computed by hand over core + dequantised association."""
    model = tiny_model(impl)
    tokens = ids(200)
    cache = TieredCache(model.config, small())
    run(model, cache, tokens[:, :180])
    cache.retier()
    assert cache.get_seq_length() == 180
    assert cache.get_mask_sizes(1, 0) == (40 + 50 + 1, 180 - 90)
    assert cache.get_mask_sizes(7, 0) == (97, 90)
    # reference: a DynamicCache-free forward where attention sees exactly the tiered K/V (eager = sdpa here)
    other = tiny_model("eager" if impl == "sdpa" else "sdpa")
    copy = TieredCache(model.config, small())
    run(other, copy, tokens[:, :180])
    copy.retier()
    a = run(model, cache, tokens[:, 180:200])
    b = run(other, copy, tokens[:, 180:200])
    assert torch.allclose(a, b, atol=1e-5)
    assert cache.get_seq_length() == 200 and cache.tier_tokens()["core"] == 60


def test_seq_length_positions_and_mask_after_retier() -> None:
    """Positions keep counting the background tokens: the next token's RoPE position is the logical length."""
    model = tiny_model("eager")
    tokens = ids(120)
    cache = TieredCache(model.config, small(core_tokens=20, association_tokens=10))
    run(model, cache, tokens[:, :100])
    cache.retier()
    assert cache.get_seq_length() == 100
    seen = {}
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, k: seen.update(cos=k["position_embeddings"][0]), with_kwargs=True)
    run(model, cache, tokens[:, 100:101])
    hook.remove()
    want_cos = model.model.rotary_emb(torch.zeros(1, 1, 64), torch.tensor([[100]]))[0]
    assert torch.equal(seen["cos"], want_cos)
    assert cache.get_seq_length() == 101 and cache.get_mask_sizes(1, 1) == (20 + 10 + 1 + 1, 101 - 31)


def test_every_token_in_exactly_one_tier_with_exact_values() -> None:
    model = tiny_model()
    tokens = ids(200)
    ref = reference_kv(model, tokens[:, :190])
    cache = TieredCache(model.config, small(association_bits=8))
    run(model, cache, tokens[:, :190])
    cache.retier()
    run(model, cache, tokens[:, 190:200])  # decode tokens join the core
    cache.rollback(190)
    for i, layer in enumerate(cache.layers):
        tiers = layer.membership()
        assert tiers.shape == (1, 2, 190)
        counts = [(tiers == t).sum(-1) for t in (0, 1, 2)]
        assert all(len(torch.unique(c)) == 1 for c in counts)  # same count in every head
        assert [int(c.flatten()[0]) for c in counts] == [40, 50, 100]
        # core is exact, background (archive) is exact, association is close
        k_ref, v_ref = ref[i]
        pos = layer.core_pos[:, :, : layer.n_core]
        assert torch.equal(layer.keys[:, :, : layer.n_core], k_ref.gather(2, pos[..., None].expand(-1, -1, -1, 16)))
        full_k, full_v = layer._materialize(tiers == 2)
        bg = (tiers == 2)[..., None].expand(-1, -1, -1, 16)
        assert torch.equal(full_k[bg], k_ref[bg]) and torch.equal(full_v[bg], v_ref[bg])
        ak, _ = layer.assoc.dequantize(torch.float32)
        want = k_ref.gather(2, layer.assoc_pos[..., None].expand(-1, -1, -1, 16))
        assert (ak - want).abs().max() < 0.05 * want.abs().max()


def synthetic_cache(kv: dict, length: int = 256, marked: dict[int, int] | None = None) -> tuple[TieredCache, list]:
    """A TieredCache filled through ``update`` (as attention layers do) with keys where page p leans on channel c."""
    config = tiny_model().config
    cache = TieredCache(config, kv)
    torch.manual_seed(0)
    ref = []
    for layer in range(config.num_hidden_layers):
        k, v = torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
        for page, channel in (marked or {}).items():
            k[:, :, page * 16: page * 16 + 16, channel] += 6.0
        cache.update(k, v, layer)
        ref.append((k, v))
    return cache, ref


def question_on(cache: TieredCache, channel: int) -> list[torch.Tensor]:
    """Query vectors (2 query heads per KV head) pointing along one channel."""
    q = torch.zeros(1, 4, 1, 16)
    q[..., channel] = 10.0
    return [q for _ in cache.layers]


def test_retier_for_second_question_moves_pages_without_prefill() -> None:
    cache, ref = synthetic_cache(small(core_tokens=28, association_tokens=16, recent_tokens=4), marked={5: 0, 11: 1})
    cache.retier(question_on(cache, 0))
    core_a = cache.membership(0) == 0
    assert core_a[:, :, 80:96].all()  # page 5 promoted
    assert cache.tier_tokens() == {"core": 28, "association": 16, "background": 212, "total": 256}
    cache.retier(question_on(cache, 1))  # a second question: nothing is recomputed, only moved
    core_b = cache.membership(0) == 0
    assert core_b[:, :, 176:192].all() and not core_b[:, :, 80:96].any()  # page 11 in, page 5 demoted
    assert cache.get_seq_length() == 256
    # page 5 was demoted, not dropped: promote it again and its keys are exact
    cache.retier(question_on(cache, 0))
    for layer, (k, v) in zip(cache.layers, ref):
        pos = layer.core_pos[:, :, : layer.n_core]
        assert torch.equal(layer.keys[:, :, : layer.n_core], k.gather(2, pos[..., None].expand(-1, -1, -1, 16)))
        assert torch.equal(layer.values[:, :, : layer.n_core], v.gather(2, pos[..., None].expand(-1, -1, -1, 16)))


@pytest.mark.parametrize("scoring", ["pages", "tokens"])
def test_rollback_serves_many_questions_from_one_prefill(scoring: str) -> None:
    model = tiny_model()
    doc, question = ids(180), ids(12, seed=7)
    cache = TieredCache(model.config, small(scoring=scoring))
    run(model, cache, doc)
    prepare_question(model, cache, question)
    assert cache.get_seq_length() == 180
    tiers = [cache.membership(i).clone() for i in range(len(cache.layers))]
    first = run(model, cache, question)
    decoded = [run(model, cache, ids(1, seed=s)) for s in range(5)]
    assert cache.get_seq_length() == 197 and decoded[-1].shape == (1, 1, 256)
    cache.rollback(180)
    prepare_question(model, cache, question)
    again = run(model, cache, question)
    if scoring == "pages":  # page summaries do not depend on the tiers: same tiers, same answer
        assert torch.equal(first, again)
    else:
        # Token votes see the keys of the current tiers (association codes instead of exact keys) and the queries
        # were recorded over them: the core may move a little, the answer barely.
        for i, before in enumerate(tiers):
            core_before, core_now = before == 0, cache.membership(i)[:, :, :180] == 0
            assert (core_before & core_now).sum() >= 0.9 * core_before.sum()
        assert torch.allclose(first, again, atol=0.05)


def test_rollback_rebalances_when_heads_lost_different_tiers() -> None:
    model = tiny_model()
    tokens = ids(200)
    cache = TieredCache(model.config, small(recent_tokens=0, sink_tokens=0, core_tokens=30, association_tokens=30))
    run(model, cache, tokens)
    cache.retier()  # tokens 160..199 are scored like any others: heads place them differently
    cache.rollback(160)
    for layer in cache.layers:
        tiers = layer.membership()
        assert tiers.shape[-1] == 160
        for t in (0, 1, 2):
            assert len(torch.unique((tiers == t).sum(-1))) == 1
    logits = run(model, cache, tokens[:, 160:161])
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 161


def test_record_queries_matches_model_attention() -> None:
    """Recorded queries . cached keys reproduce the model's own eager attention weights."""
    model = tiny_model("eager")
    tokens = ids(40)
    cache = TieredCache(model.config, small())
    with record_queries(model, cache, tokens=5), torch.no_grad():
        out = model(input_ids=tokens, cache=cache, output_attentions=True)
    q = cache.layers[1].queries  # [1, 4, 5, D], positions 35..39
    assert cache.layers[1].query_pos.tolist() == [35, 36, 37, 38, 39]
    k = cache.layers[1].keys[:, :, :40].repeat_interleave(2, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(16)
    logits = logits.masked_fill(torch.arange(40) > torch.arange(35, 40)[:, None], -math.inf)
    assert torch.allclose(torch.softmax(logits, -1), out.attentions[1][:, :, -5:], atol=1e-5)


def test_generate_runs_with_the_cache() -> None:
    model = tiny_model()
    doc, question = ids(150), ids(10, seed=3)
    full = torch.cat([doc, question], dim=1)
    want = model.generate(full, max_new_tokens=6, do_sample=False, cache=DynamicCache(config=model.config))
    big = TieredCache(model.config, {"core_tokens": 4096})
    run(model, big, doc)
    prepare_question(model, big, question)
    got = model.generate(full, max_new_tokens=6, do_sample=False, cache=big)
    assert torch.equal(got, want)
    tight = TieredCache(model.config, small(retier_every=3))
    run(model, tight, doc)
    prepare_question(model, tight, question)
    schedule = StoppingCriteriaList([RetierOnSchedule(tight)])
    out = model.generate(full, max_new_tokens=7, do_sample=False, cache=tight, stopping_criteria=schedule)
    assert out.shape == (1, 167) and tight.get_seq_length() == 166
    assert tight.retiers >= 3  # prepare_question + every 3 tokens during generate
    assert tight.tier_tokens()["association"] == 50
    # beam search from an empty cache: reorders tiered rows, re-tiering on schedule
    beams = TieredCache(model.config, small(retier_every=2))
    out = model.generate(full, max_new_tokens=4, num_beams=2, do_sample=False, cache=beams,
                         stopping_criteria=StoppingCriteriaList([RetierOnSchedule(beams)]))
    assert out.shape == (1, 164) and beams.retiers >= 1


def test_decode_retier_counts_decode_steps_and_ranks_by_the_answers_own_queries(monkeypatch) -> None:
    """What Session does with ``retier_every``: queries recorded through the decode drive each re-tier."""
    model = tiny_model()
    cache = TieredCache(model.config, small(retier_every=3, query_tokens=8))
    doc, question = ids(160), ids(6, seed=2)
    run(model, cache, doc)
    prepare_question(model, cache, question)
    seen: list[torch.Tensor | None] = []
    original = TieredCache.retier_layer
    monkeypatch.setattr(TieredCache, "retier_layer",
                        lambda self, i, q, *rest: (seen.append(q), original(self, i, q, *rest))[1])
    with record_queries(model, cache, tokens=cache.kv.query_tokens):
        logits = run(model, cache, question)
        cache.start_decode()  # the question's 6 tokens do not count as decode steps
        assert not cache.maybe_retier()
        fired = []
        for _ in range(7):
            logits = run(model, cache, logits[:, -1:].argmax(-1))
            fired.append(cache.maybe_retier())
    assert fired == [False, False, True, False, False, True, False]
    assert len(seen) == 2 * model.config.num_hidden_layers
    assert all(q is not None and q.shape[2] == 8 for q in seen)  # the newest 8 queries, not key stand-ins
    newest = cache.layers[0].query_pos
    assert newest[-1] == cache.get_seq_length() - 1 and len(newest) == 8
    cache.rollback(160)  # the answer is forgotten, and so are its queries
    assert cache.layers[0].queries is None or cache.layers[0].query_pos.numel() == 0
    assert cache.get_seq_length() == 160 and cache.tier_tokens()["total"] == 160


def test_accounting_and_auto_budget() -> None:
    model = tiny_model()
    cache = TieredCache(model.config, small(core_tokens=0.1, association_tokens=0.25, association_bits=4))
    run(model, cache, ids(400))
    per_token = 2 * 2 * 2 * 16 * 4  # layers * (K,V) * kv heads * head_dim * fp32
    assert cache.full_bytes() == 400 * per_token == cache.device_bytes()  # before re-tiering: all core
    cache.retier()
    tiers = cache.tier_bytes()
    assert cache.tier_tokens() == {"core": 40, "association": 100, "background": 260, "total": 400}
    assert tiers["core"] == 40 * per_token
    assert 0 < tiers["association"] < 100 * per_token * 0.3
    assert cache.device_bytes() == tiers["core"] + tiers["association"] + tiers["summaries"]
    assert cache.device_bytes() < 0.3 * cache.full_bytes()
    assert cache.host_bytes() >= tiers["background_host"] > 0
    assert set(cache.accounting()) >= {"kv_device_bytes", "kv_host_bytes", "kv_full_bytes"}
    assert cache.accounting()["kv_peak_device_bytes"] == 400 * per_token  # the prefill, before re-tiering
    auto = TieredCache(model.config, {"core_tokens": "auto"})
    run(model, auto, ids(100))
    assert auto.budgets() == (100, 0)  # plenty of free memory: everything fits the core
    assert isinstance(make_cache(model.config, None), DynamicCache)
    assert isinstance(make_cache(model.config, {"core_tokens": 8}), TieredCache)


@pytest.mark.parametrize("bad, key", [
    ({"association_bits": 3}, "association_bits"),
    ({"association_key_bits": 5}, "association_key_bits"),
    ({"core_tokens": -1}, "core_tokens"),
    ({"association_tokens": -0.5}, "association_tokens"),
    ({"association_tokens": "auto"}, "association_tokens"),
    ({"core_tokens": 1.5}, "core_tokens"),
    ({"core_token": 10}, "core_token"),
    ({"retier_every": 0}, "retier_every"),
    ({"background": "zstd"}, "background"),
    ({"core_tokens": "lots"}, "core_tokens"),
    ({"scoring": "attention"}, "scoring"),
    ({"candidate_tokens": -3}, "candidate_tokens"),
    ({"vote_pool": 8}, "vote_pool"),
    ({"vote_pool": 0}, "vote_pool"),
    ({"vote_sharing": 1.5}, "vote_sharing"),
    ({"decode": "fast"}, "decode"),
])
def test_config_errors_name_the_key(bad: dict, key: str) -> None:
    with pytest.raises(ValidationError) as err:
        KVConfig(**bad)
    assert key in str(err.value)


def test_config_accepts_counts_fractions_and_auto() -> None:
    kv = KVConfig(core_tokens="auto", association_tokens=0.25, association_bits=2, background=None)
    assert kv.core_tokens == "auto" and kv.association_tokens == 0.25
    assert KVConfig(core_tokens=1024.0).core_tokens == 1024
    assert KVConfig(core_tokens="256", association_tokens="0.5").core_tokens == 256  # --set values arrive as text


def test_explicit_page_spans_drive_selection() -> None:
    kv = small(core_tokens=12 + 30, association_tokens=0, page_tokens=64, scoring="pages")
    cache, _ = synthetic_cache(kv, length=200)
    for layer in cache.layers:  # the span 50..80 leans on channel 3
        layer.keys[:, :, 50:80, 3] += 6.0
    cache.set_pages([(50, 80), (80, 150)])
    cache.retier(question_on(cache, 3))
    core = cache.membership(0) == 0
    assert core[:, :, 50:80].all() and int(core.sum(-1).flatten()[0]) == 42  # the whole span fits and wins
    assert cache.layers[0].kmin.shape[2] == len(cache.pages.starts(200)) == 4  # [0, 50, 80, 150]


def test_snapkv_baseline_keeps_budget_and_drops_rest() -> None:
    model = tiny_model("eager")
    doc, question = ids(200), ids(8, seed=5)
    full = DynamicCache(config=model.config)
    run(model, full, doc)
    want = run(model, full, question)[:, -1]
    same = SnapKVCache(model.config, budget_tokens=4096)
    run(model, same, doc)
    prepare_question(model, same, question)
    assert torch.equal(run(model, same, question)[:, -1], want)  # nothing evicted: exact
    snap = SnapKVCache(model.config, budget_tokens=50)
    run(model, snap, doc)
    prepare_question(model, snap, question)
    assert snap.get_seq_length() == 200 and snap.layers[0].kept == 50
    assert snap.get_mask_sizes(8, 0) == (58, 150)
    logits = run(model, snap, question)
    assert torch.isfinite(logits).all() and snap.device_bytes() == 50 * 2 * 2 * 2 * 16 * 4 + 8 * 2 * 2 * 2 * 16 * 4
    snap.rollback(200)
    assert snap.layers[0].kept == 50


@pytest.fixture(scope="module")
def real_model():
    loading = pytest.importorskip("docfuse.runtime.loading")
    try:
        return loading.load_model("default")
    except FileNotFoundError as exc:  # ModelNotFoundError: the embedded model package is not installed
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_real_model_full_budget_identical(impl: str, real_model) -> None:
    model, tokenizer = real_model
    model.config._attn_implementation = impl
    text = "<|im_start|>user\n" + "The archive opens at nine. " * 20 + "What time does it open?<|im_end|>\n"
    tokens = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    n = tokens.shape[1]
    dyn, tiered = DynamicCache(config=model.config), TieredCache(model.config, {"core_tokens": 1.0})
    want = [run(model, dyn, tokens[:, : n - 3])] + [run(model, dyn, tokens[:, i:i + 1]) for i in range(n - 3, n)]
    got = [run(model, tiered, tokens[:, : n - 3])]
    tiered.retier()
    got += [run(model, tiered, tokens[:, i:i + 1]) for i in range(n - 3, n)]
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # and a tight budget still runs on the real model with re-tiering
    tight = TieredCache(model.config, {"core_tokens": 0.3, "association_tokens": 0.3, "recent_tokens": 16,
                                       "association_bits": 4})
    run(model, tight, tokens[:, : n - 3])
    tight.retier()
    assert tight.device_bytes() < 0.5 * tight.full_bytes()
    assert torch.isfinite(run(model, tight, tokens[:, n - 3:])).all()


# ---- token votes ---------------------------------------------------------------------------------------------------
def test_token_votes_follow_attention_and_ignore_unknown_keys() -> None:
    keys = torch.randn(1, 1, 40, 8) * 0.1
    keys[0, 0, 20, 0] = 5.0  # the token the query reads
    keys[0, 0, 30, 0] = 9.0  # would win, but its key is not known
    known = torch.ones(1, 1, 40, dtype=torch.bool)
    known[0, 0, 30] = False
    q = torch.zeros(1, 1, 2, 8)
    q[..., 0] = 4.0
    raw = token_votes(q, keys, known, kernel=1)
    assert int(raw.argmax()) == 20 and raw[0, 0, 30] == 0
    assert torch.allclose(raw.sum(), torch.tensor(2.0))  # each query spreads one unit of mass
    pooled = token_votes(q, keys, known, kernel=7)
    assert pooled[0, 0, 17:24].min() > pooled[0, 0, 5]  # neighbours of the hit rise with it


def test_vote_sharing_keeps_what_one_head_found_in_the_other_heads() -> None:
    """Head 0's query reads page 5 (channel 0 there), head 1's reads page 11: with sharing, each head's core holds
    both pages; without it, only its own."""
    kv = small(core_tokens=4 + 4 + 32, association_tokens=0, recent_tokens=4, vote_pool=1)
    q = torch.zeros(1, 4, 1, 16)
    q[:, :2, :, 0] = 10.0  # query heads 0-1 -> KV head 0
    q[:, 2:, :, 1] = 10.0  # query heads 2-3 -> KV head 1
    core = {}
    for sharing in (0.0, 1.0):
        cache, _ = synthetic_cache({**kv, "vote_sharing": sharing}, marked={5: 0, 11: 1})
        cache.retier([q for _ in cache.layers])
        core[sharing] = cache.membership(0)[0] == 0  # [H, T]
    page5, page11 = slice(80, 96), slice(176, 192)
    # alone, a head fills its spare core slots with weak votes: a few tokens of the other head's page at most
    assert core[0.0][0, page5].all() and core[0.0][1, page5].sum() < 8
    assert core[0.0][1, page11].all() and core[0.0][0, page11].sum() < 8
    assert core[1.0][0, page5].all() and core[1.0][1, page5].all()
    assert core[1.0][0, page11].all() and core[1.0][1, page11].all()


def test_nominate_takes_best_pages_among_eligible_only() -> None:
    score = torch.tensor([[[5.0, 5.0, 1.0, 1.0, 9.0, 9.0, 3.0, 3.0]]])
    eligible = torch.tensor([[[True, True, True, True, False, False, True, True]]])
    assert nominate(score, eligible, 4).nonzero()[:, 2].tolist() == [0, 1, 6, 7]
    assert nominate(score, eligible, 99).sum() == 6  # capped at what is eligible
    assert not nominate(score, eligible, 0).any()


def _diluted_page_cache(scoring: str) -> TieredCache:
    """Page 2 (32..47) has one big channel per token (loose bound, small dot products); token 90 matches the query
    on all four channels (tight bound, the real winner)."""
    kv = small(core_tokens=4 + 8 + 16, association_tokens=0, page_tokens=16, scoring=scoring)
    cache, _ = synthetic_cache(kv, length=160)
    for layer in cache.layers:
        layer.keys[:, :, :, :4] *= 0.05
        for i in range(32, 48):
            layer.keys[:, :, i, i % 4] = 6.0
        layer.keys[:, :, 90, :4] = 4.0
    return cache


def test_token_scoring_finds_the_token_a_loose_page_bound_hides() -> None:
    q = torch.zeros(1, 4, 1, 16)
    q[..., :4] = 3.0
    pages, tokens = _diluted_page_cache("pages"), _diluted_page_cache("tokens")
    pages.retier([q for _ in pages.layers])
    tokens.retier([q for _ in tokens.layers])
    page_core, token_core = pages.membership(0) == 0, tokens.membership(0) == 0
    assert page_core[:, :, 32:48].all() and not page_core[:, :, 90].any()  # the bound picked the diluted page
    assert token_core[:, :, 90].all()  # the votes picked the real match
    assert tokens.tier_tokens() == pages.tier_tokens()  # same budgets either way


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("length", [5, 64, 77])
def test_dequantize_into_a_buffer_view_matches_dequantize(bits: int, length: int) -> None:
    x = torch.randn(1, 3, length, 64) * 3
    for q in (quantize_keys(x, bits, 32), quantize_values(x, bits)):
        want = q.dequantize(torch.float32)
        buf = torch.full((1, 3, length + 9, 64), float("nan"))
        q.dequantize_into(buf[:, :, :length])
        assert torch.equal(buf[:, :, :length], want) and buf[:, :, length:].isnan().all()  # exact, and in place
        low = torch.empty(1, 3, length, 64, dtype=torch.bfloat16)
        q.dequantize_into(low)  # fp32 multiply-add, one rounding to bf16
        assert torch.equal(low, want.to(torch.bfloat16))


def test_retier_shortcuts_give_the_sorts_and_gathers_numbers() -> None:
    """The re-tier's faster forms (page-level ranks, row selects, mask-ordered positions, keys read pre-padded) must
    give exactly what the argsorts, gathers, sorts and padding copy they replace give: fidelity was measured on those."""
    from docfuse.runtime.kv.layer import _ascending, _page_rank, _rows, _top_mask

    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        pages = int(torch.randint(1, 12, (1,), generator=g))
        sizes = torch.randint(0, 20, (pages,), generator=g)
        sizes[0] += 1
        page_ids = torch.repeat_interleave(torch.arange(pages), sizes)
        per_page = torch.randint(0, 4, (2, 3, pages), generator=g).float()  # many ties, across and within heads
        per_token = per_page.gather(2, page_ids.expand(2, 3, -1)).double()
        expected = torch.argsort(torch.argsort(per_token, dim=-1, stable=True), dim=-1, stable=True)
        assert torch.equal(_page_rank(per_page, page_ids), expected), trial
    buffer = torch.randn(2, 3, 50, 8, generator=g)
    for x in (buffer, buffer[:, :, :30]):  # contiguous, and a slice of a larger buffer (the core's)
        chosen = torch.stack([torch.stack([torch.randperm(30, generator=g)[:7] for _ in range(3)]) for _ in range(2)])
        assert torch.equal(_rows(x, chosen), x.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, 8)))
        assert torch.equal(_ascending(chosen, 30), chosen.sort(dim=-1).values)
    for trial in range(200):  # the core chosen by a partial selection: the first k of the stable sort, as a set
        t = int(torch.randint(1, 400, (1,), generator=g))
        k = int(torch.randint(0, t + 1, (1,), generator=g))
        priority = torch.randint(0, 5, (2, 3, t), generator=g).double() / 4  # ties within and across heads
        priority[..., :4] = priority[..., -3:] = float("inf")  # forced tokens: ties at infinity
        if trial % 2:
            priority += torch.rand(2, 3, t, generator=g, dtype=torch.float64)
        order = torch.sort(-priority, dim=-1, stable=True).indices[..., :k]
        first_k = torch.zeros_like(priority, dtype=torch.bool).scatter_(2, order, True)
        assert torch.equal(_top_mask(priority, k), first_k), trial
    keys = torch.randn(1, 2, 45, 16, generator=g)
    padded = torch.cat([keys, keys[:, :, -1:].expand(-1, -1, 19, -1)], dim=2)
    for bits in (4, 8):
        a, b = quantize_keys(keys, bits, 32), quantize_keys(padded, bits, 32, length=45)
        assert b.length == 45 and all(torch.equal(x, y) for x, y in ((a.codes, b.codes), (a.scale, b.scale),
                                                                     (a.zero, b.zero)))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_keys(padded[:, :, :50], 4, 32, length=45)


# ---- fixed codes (issue 29): the association quantised once per document ---------------------------------------
def _answer(model, cache: TieredCache, prefix: int, question: torch.Tensor, steps: int = 4) -> list[torch.Tensor]:
    """Read ``question`` the Session way, decode ``steps`` greedy tokens through the packed codes, roll back."""
    from docfuse.runtime.kv import code_attention, read_question

    out = [read_question(model, cache, question)]
    with code_attention.reading_codes(model, cache):
        for _ in range(steps):
            out.append(run(model, cache, out[-1].argmax().view(1, 1))[0, -1])
    cache.rollback(prefix)
    return out


def test_fixed_codes_are_made_once_and_hide_the_core(monkeypatch) -> None:
    """With the association taking every non-core token (the default), a later question's re-tier quantises nothing:
    it only moves positions into and out of the core, which the codes hide. Every position stays in one tier, attention
    over the codes skips the hidden positions, and the answers stay those of the re-quantising path."""
    import docfuse.runtime.kv.layer as layer_mod

    model = tiny_model()
    doc = ids(300)
    questions = [ids(9, seed=s) for s in (7, 8, 9)]
    kv = small(association_tokens=1.0, association_bits=8)
    builds = []
    real_build = AssociationStore.build.__func__
    monkeypatch.setattr(AssociationStore, "build",
                        classmethod(lambda cls, *a, **k: builds.append(1) or real_build(cls, *a, **k)))
    answers = {}
    for fixed in (True, False):
        monkeypatch.setattr(layer_mod, "FIXED_CODES", fixed)
        cache = TieredCache(model.config, kv)
        run(model, cache, doc)
        builds.clear()
        answers[fixed] = []
        for n, q in enumerate(questions):
            answers[fixed].append(_answer(model, cache, 300, q))
            if fixed:
                # codes of the whole document made at the first question only, one store a layer
                assert len(builds) == len(cache.layers), n
                for layer in cache.layers:
                    assert layer.assoc.hidden is not None and layer.assoc.length == 300
                    tiers = layer.membership()
                    core = (tiers == 0).sum(-1)  # the question's tokens took part of the core until the rollback
                    assert len(torch.unique(core)) == 1 and 20 <= int(core.flatten()[0]) <= 40
                    assert int((tiers == 2).sum()) == 0  # nothing in the background: every position coded or exact
                    hidden = layer.assoc.hidden
                    assert torch.equal(hidden, tiers == 0)  # what the codes hide is exactly the core
        if not fixed:
            assert len(builds) == 3 * len(cache.layers)  # the other path quantises at every question
    for a, b in zip(answers[True], answers[False]):
        for x, y in zip(a, b):
            assert x.argmax() == y.argmax()
            assert torch.allclose(x, y, atol=2e-2)
        assert torch.equal(a[0], b[0])  # the question's own read is exact either way


def test_fixed_codes_attention_skips_hidden_positions() -> None:
    """code_attention over a fixed store equals softmax attention over [visible dequantised rows, core] by hand."""
    from docfuse.runtime.kv.code_attention import code_attention

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 70, 32, generator=g), torch.randn(1, 2, 70, 32, generator=g)
    store = AssociationStore.build(k, v, 8, 32)
    core_pos = torch.stack([torch.randperm(70, generator=g)[:11].sort().values for _ in range(2)]).unsqueeze(0)
    hidden = torch.zeros(1, 2, 70, dtype=torch.bool).scatter_(2, core_pos, True)
    store.hidden = hidden
    core_k = k.gather(2, core_pos[..., None].expand(-1, -1, -1, 32))
    core_v = v.gather(2, core_pos[..., None].expand(-1, -1, -1, 32))
    q = torch.randn(1, 4, 32, generator=g)
    got = code_attention(q, core_k, core_v, 11, store, 32 ** -0.5)
    dk, dv = store.dequantize(torch.float32)
    visible = (~hidden).nonzero()[:, 2].view(1, 2, 59)
    keys = torch.cat([dk.gather(2, visible[..., None].expand(-1, -1, -1, 32)), core_k], dim=2)
    values = torch.cat([dv.gather(2, visible[..., None].expand(-1, -1, -1, 32)), core_v], dim=2)
    qg = q.view(1, 2, 2, 32) * 32 ** -0.5
    want = (qg @ keys.transpose(-1, -2)).softmax(-1) @ values
    assert torch.allclose(got, want.view(1, 4, 32), atol=1e-4)


def test_fixed_codes_survive_rollbacks_and_are_remade_when_cut() -> None:
    """Rolling back into the coded prefix leaves valid tiers (attention still runs) and the next re-tier makes the
    codes again for the shorter document; rolling back to the prefix keeps them."""
    model = tiny_model()
    doc = ids(260)
    cache = TieredCache(model.config, small(association_tokens=1.0, association_bits=8))
    run(model, cache, doc)
    _answer(model, cache, 260, ids(9, seed=7))
    store = cache.layers[0].assoc
    _answer(model, cache, 260, ids(9, seed=8))
    assert cache.layers[0].assoc is store  # same codes, new core
    cache.rollback(200)
    for layer in cache.layers:
        tiers = layer.membership()
        assert tiers.shape[-1] == 200 and int((tiers == 2).sum()) == 0
        # cut codes wait to be made again; where heads lost different tiers the rollback re-tiered (and made them)
        assert layer.assoc.length == 200 and (layer._codes_stale or layer.assoc is not store)
    assert torch.isfinite(run(model, cache, doc[:, 200:201])).all()  # reads the cut codes
    cache.rollback(200)
    _answer(model, cache, 200, ids(9, seed=9))
    for layer in cache.layers:
        assert layer.assoc is not store and layer.assoc.length == 200 and not layer._codes_stale
        tiers = layer.membership()
        assert torch.equal(layer.assoc.hidden, tiers == 0)


@pytest.mark.parametrize("fixed", [True, False])
def test_rollback_without_background_rebalances_heads(monkeypatch, fixed: bool) -> None:
    """The association taking every non-core token, heads that lost different numbers of core and association
    tokens must re-balance into exactly the positions left (the two per-tier maxima once asked for more)."""
    import docfuse.runtime.kv.layer as layer_mod

    monkeypatch.setattr(layer_mod, "FIXED_CODES", fixed)
    model = tiny_model()
    tokens = ids(260)
    cache = TieredCache(model.config, small(association_tokens=1.0, recent_tokens=0, sink_tokens=0))
    run(model, cache, tokens)
    cache.retier()  # tokens 200..259 are ranked like any others: heads place them differently
    assert any(len(torch.unique((layer.membership()[:, :, 200:] == 0).sum(-1))) > 1 for layer in cache.layers)
    cache.rollback(200)
    for layer in cache.layers:
        tiers = layer.membership()
        assert tiers.shape[-1] == 200 and int((tiers == 2).sum()) == 0
        assert len(torch.unique((tiers == 0).sum(-1))) == 1
    assert torch.isfinite(run(model, cache, tokens[:, 200:201])).all()


@pytest.mark.parametrize("threads", [True, False])
def test_archive_blocks_read_ahead_by_threads_come_back_in_order_and_exact(monkeypatch, threads: bool) -> None:
    """read_blocks_into unpacks host blocks in a thread pool (or, on fewer than POOL_FROM_CORES cores, in the
    caller's thread) and writes each at its positions; the spans must come back in the order asked and the blocks
    bit-exact, including blocks still pending from the ArchiveWriter; positions of blocks not asked stay untouched."""
    from concurrent.futures import ThreadPoolExecutor

    from docfuse.runtime.kv import background
    from docfuse.runtime.kv.background import ArchiveWriter, ExactArchive, read_blocks_into

    monkeypatch.setattr(background, "_READERS", [ThreadPoolExecutor(2) if threads else None])
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 1000, 8, dtype=torch.bfloat16), torch.randn(1, 2, 1000, 8, dtype=torch.bfloat16)
    order = [15, 0, 3, 3, 7, 1, 14, 2, 9, 8, 4, 5, 6, 10, 11, 12, 13]
    archive = ExactArchive(block_tokens=64)
    with ArchiveWriter(workers=2) as writer:
        writer.submit(archive, k, v)
        out_k, out_v = torch.zeros_like(k), torch.zeros_like(v)
        spans = read_blocks_into(archive, order, out_k, out_v)
    assert [start for start, _ in spans] == [64 * i for i in order]
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    fresh = ExactArchive(block_tokens=64)
    with ArchiveWriter(workers=2) as writer:
        writer.submit(fresh, k, v)
        out_k, out_v = torch.zeros_like(k), torch.zeros_like(v)
        spans = read_blocks_into(fresh, [15, 0, 3, 9], out_k, out_v)
    assert spans == [(960, 1000), (0, 64), (192, 256), (576, 640)]
    written = torch.zeros(1000, dtype=torch.bool)
    for start, end in spans:
        written[start:end] = True
    assert torch.equal(out_k[:, :, written], k[:, :, written]) and torch.equal(out_v[:, :, written], v[:, :, written])
    assert not out_k[:, :, ~written].any()


def test_an_archive_adopts_only_blocks_that_tile_its_positions() -> None:
    from docfuse.runtime.kv.background import ExactArchive, pack_exact

    k = torch.randn(1, 1, 10, 4)
    blob = pack_exact(k)
    archive = ExactArchive(block_tokens=8)
    with pytest.raises(ValueError, match="tile"):
        archive.adopt([(0, 10, blob, blob)])  # longer than a block
    with pytest.raises(ValueError, match="tile"):
        archive.adopt([(2, 10, blob, blob)])  # not from 0
    archive.adopt([(0, 8, pack_exact(k[:, :, :8]), pack_exact(k[:, :, :8])),
                   (8, 10, pack_exact(k[:, :, 8:]), pack_exact(k[:, :, 8:]))])
    assert archive.length == 10 and torch.equal(archive.read(1)[2], k[:, :, 8:])
    with pytest.raises(ValueError, match="empty"):
        archive.adopt([])


@pytest.mark.parametrize("layout", ["fixed", "fixed_short_last", "one_page", "uneven", "empty_page", "unsorted"])
def test_page_summaries_fast_path_gives_the_scatters_numbers(layout) -> None:
    """page_minmax reduces fixed-size pages in order over a reshaped view; every layout must give exactly what the
    general scatter gives (including the pages it cannot take: uneven, empty, out of order)."""
    import math

    from docfuse.runtime.kv import summaries

    torch.manual_seed(1)
    t = {"fixed": 256, "fixed_short_last": 250, "one_page": 40}.get(layout, 256)
    keys = torch.randn(2, 3, t, 8, dtype=torch.bfloat16)
    ids = torch.arange(t) // 64 if layout != "one_page" else torch.zeros(t, dtype=torch.long)
    if layout == "uneven":
        ids = torch.searchsorted(torch.tensor([0, 50, 64 + 50, 200]), torch.arange(t), right=True) - 1
    if layout == "empty_page":
        ids = ids + (ids >= 2).long()
    if layout == "unsorted":
        ids = ids.flip(0)
    pages = int(ids.max()) + 1

    def scatter(k, page_ids, n):
        b, h, _, d = k.shape
        idx = page_ids.view(1, 1, -1, 1).expand(b, h, -1, d)
        lo = torch.full((b, h, n, d), math.inf, dtype=k.dtype).scatter_reduce_(2, idx, k, "amin")
        return lo, torch.full((b, h, n, d), -math.inf, dtype=k.dtype).scatter_reduce_(2, idx, k, "amax")

    fast = summaries._fixed_page_size(ids, pages) is not None
    assert fast == (layout in ("fixed", "fixed_short_last", "one_page"))
    got, want = summaries.page_minmax(keys, ids, pages), scatter(keys, ids, pages)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
