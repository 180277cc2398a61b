"""Layer-major prefill, the asynchronous archive writer, and many documents in one decode batch.

The layer-major prefill must equal the usual token-major chunked prefill followed by a re-tier from the last tokens'
queries: same logits, same tiers, same archive. CPU tests cover all of it through the reference attention path; the
GPU tests (bf16, CUDA graph with a skip set) skip cleanly without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from docfuse.runtime.gpu import attention_kernel as ak
from docfuse.runtime.gpu.batch import stack_caches
from docfuse.runtime.gpu.kernel_cache import KernelTieredCache, register_attention
from docfuse.runtime.kv import TieredCache, record_queries
from docfuse.runtime.kv.background import ArchiveWriter, ExactArchive
from docfuse.runtime.layer_prefill import layer_major_prefill
from docfuse.runtime.llama_block import causal_attention
from docfuse.runtime.session import cache_kwarg

GPU = pytest.mark.skipif(not (ak.HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and a CUDA GPU")
KV = {"core_tokens": 0.1, "association_tokens": 0.25, "recent_tokens": 16, "query_tokens": 24}


def tiny(seed: int = 0, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=256, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def doc(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def token_major(model, ids: torch.Tensor, chunk: int, cache_type=TieredCache):
    """The usual path: chunked prefill through the model, recording the last queries, then one re-tier."""
    cache = cache_type(model.config, KV)
    with torch.no_grad(), record_queries(model, cache, tokens=KV["query_tokens"]):
        for s in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[:, s: s + chunk], use_cache=True, **{cache_kwarg(model): cache})
    cache.retier(cache.take_queries())
    return cache, out.logits[:, -1]


@pytest.mark.parametrize("length,chunk,batch", [(700, 256, 1), (530, 1000, 2), (600, 12, 1)])
def test_layer_major_prefill_equals_token_major_prefill_and_retier(length: int, chunk: int, batch: int) -> None:
    model = tiny()
    ids = doc(length, batch)
    ref, ref_logits = token_major(model, ids, 256)
    cache = TieredCache(model.config, KV)
    with ArchiveWriter(workers=2) as writer:
        logits = layer_major_prefill(model, cache, ids, chunk=chunk, writer=writer)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert cache.tier_tokens() == ref.tier_tokens() and cache.get_seq_length() == length
    for a, b in zip(ref.layers, cache.layers):
        assert torch.equal(a.membership(), b.membership())
        torch.testing.assert_close(b.keys[:, :, : b.n_core], a.keys[:, :, : a.n_core], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.assoc.dequantize(torch.float32)[1], a.assoc.dequantize(torch.float32)[1],
                                   rtol=1e-3, atol=1e-3)
        assert [(x.start, x.end) for x in a.archive.blocks] == [(x.start, x.end) for x in b.archive.blocks]
        for i in range(len(a.archive.blocks)):
            torch.testing.assert_close(b.archive.read(i)[2], a.archive.read(i)[2], rtol=1e-4, atol=1e-5)


def test_decoding_after_layer_major_prefill_follows_the_usual_path() -> None:
    model = tiny(seed=3)
    ids = doc(640, seed=5)
    ref, ref_logits = token_major(model, ids, 200)
    cache = TieredCache(model.config, KV)
    logits = layer_major_prefill(model, cache, ids, chunk=300)  # synchronous archive
    kw_ref, kw = {cache_kwarg(model): ref}, {cache_kwarg(model): cache}
    tok_ref, tok = ref_logits.argmax(-1, keepdim=True), logits.argmax(-1, keepdim=True)
    with torch.no_grad():
        for _ in range(6):
            assert torch.equal(tok, tok_ref)
            a = model(input_ids=tok_ref, use_cache=True, **kw_ref).logits[:, -1]
            b = model(input_ids=tok, use_cache=True, **kw).logits[:, -1]
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            tok_ref, tok = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
    # a question re-tiers the same cache from the archive, as after the usual prefill
    ref.retier()
    cache.retier()
    for a, b in zip(ref.layers, cache.layers):
        assert torch.equal(a.membership(), b.membership())


def test_layer_major_prefill_refuses_bad_calls() -> None:
    model = tiny(layers=1)
    cache = TieredCache(model.config, KV)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        layer_major_prefill(model, cache)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        layer_major_prefill(model, cache, doc(10), chunk=0)
    layer_major_prefill(model, cache, doc(40))
    with pytest.raises(ValueError, match="fills an empty cache"):
        layer_major_prefill(model, cache, doc(10))
    with pytest.raises(ValueError, match="Llama-family decoder"):
        layer_major_prefill(torch.nn.Linear(2, 2), TieredCache(model.config, KV), doc(10))


def test_layer_major_prefill_takes_embeddings_and_leaves_them_alone() -> None:
    model = tiny(layers=2)
    ids = doc(300)
    embeds = model.model.embed_tokens(ids).detach()
    before = embeds.clone()
    a = layer_major_prefill(model, TieredCache(model.config, KV), ids, chunk=128)
    b = layer_major_prefill(model, TieredCache(model.config, KV), inputs_embeds=embeds, chunk=128)
    assert torch.equal(embeds, before)
    torch.testing.assert_close(a, b)


def test_a_layer_major_prefill_takes_at_most_max_chunk_tokens_a_call(monkeypatch) -> None:
    """``prefill_chunk: auto`` is 131,072 on CUDA (one pass for a token-major document); a layer-major call that
    large was slower than two of 65,536 (bench/RESULTS.md), so ``fill_cache`` gives it at most ``MAX_CHUNK``."""
    from docfuse.runtime import layer_prefill, session

    seen = []
    monkeypatch.setattr(layer_prefill, "layer_major_prefill", lambda model, cache, chunk, **kw: seen.append(chunk))
    assert layer_prefill.MAX_CHUNK < 131072
    for chunk in (131072, layer_prefill.MAX_CHUNK, 100):
        session.fill_cache(tiny(), TieredCache(tiny().config, {}), list(range(10)), chunk, layers=True)
    assert seen == [layer_prefill.MAX_CHUNK, layer_prefill.MAX_CHUNK, 100]


def test_causal_attention_aligns_the_diagonal_bottom_right() -> None:
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    out = causal_attention(q, k, v, 0.25)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)
    w = ((q @ kk.transpose(-1, -2)) * 0.25).masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, w @ vv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_archive_writer_is_exact_and_tops_up_short_blocks(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 3, n, 16, generator=g).to(dtype) for n in (600, 70, 300)]
    values = [p * 2 for p in parts]
    archive = ExactArchive(block_tokens=128)
    with ArchiveWriter(workers=3, staging=1) as writer:
        for k, v in zip(parts, values):
            writer.submit(archive, k, v)  # the second starts on a block boundary; the third must top up block 5
            k.zero_()  # the caller may reuse its buffers at once (the writer copied them)
        assert archive.length == 970
    whole = torch.cat([torch.cat([archive.read(i)[2] for i in range(len(archive.blocks))], 2)])
    g = torch.Generator().manual_seed(0)
    expect = torch.cat([torch.randn(2, 3, n, 16, generator=g).to(dtype) for n in (600, 70, 300)], 2)
    assert torch.equal(whole, expect)
    assert [b.end - b.start for b in archive.blocks] == [128] * 7 + [74]
    assert archive.nbytes() < archive.raw_nbytes() or dtype == torch.float32


def test_archive_writer_sends_long_tensors_in_pieces_of_whole_blocks(monkeypatch) -> None:
    from docfuse.runtime.kv import background

    monkeypatch.setattr(background, "STAGING_BYTES", 2 * 3 * 16 * 4 * 100)  # 100 tokens a piece -> 64-token pieces
    k = torch.randn(1, 3, 1000, 16)
    archive = ExactArchive(block_tokens=64)
    with ArchiveWriter(workers=2, staging=2) as writer:
        writer.submit(archive, k, k * 3)
        assert len(archive._pending) == 16 and archive.length == 1000
    assert torch.equal(torch.cat([archive.read(i)[3] for i in range(len(archive.blocks))], 2), k * 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arena", ["new", None])
def test_archive_writer_blocks_are_byte_for_byte_those_of_the_host_packer(dtype: torch.dtype, arena) -> None:
    from docfuse.runtime.kv.background import pack_blocks
    from docfuse.runtime.kv.host_arena import HostArena

    k = (torch.randn(2, 3, 530, 16) * 3).to(dtype)  # four whole 128-token blocks and a short one
    v = torch.randn(2, 3, 530, 16).to(dtype)
    archive = ExactArchive(block_tokens=128)
    arena = HostArena(chunk_bytes=20000) if arena else None  # small chunks: blocks span several
    with ArchiveWriter(workers=2, arena=arena) as writer:
        writer.submit(archive, k, v)
    kind = memoryview if arena else bytes
    assert all(isinstance(p, kind) for b in archive.blocks for p in b.keys.planes + b.values.planes)
    assert arena is None or arena.mapped_bytes >= archive.nbytes()
    assert torch.equal(torch.cat([archive.read(i)[2] for i in range(len(archive.blocks))], 2), k)
    want = pack_blocks(k, v, 0, 128, "lz4")
    assert [(b.start, b.end) for b in archive.blocks] == [(b.start, b.end) for b in want]
    for got, exp in zip(archive.blocks, want):
        for a, b in ((got.keys, exp.keys), (got.values, exp.values)):
            assert a.planes == b.planes and a.shape == b.shape and a.dtype == b.dtype


def test_archive_writer_errors_surface_where_blocks_are_read(monkeypatch) -> None:
    from docfuse.runtime.kv import background

    def broken(*_args, **_kwargs):
        raise RuntimeError("worker died")

    archive = ExactArchive(block_tokens=4)
    with ArchiveWriter(workers=1) as writer:
        writer.submit(archive, torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4))
        archive.settle()
        monkeypatch.setattr(background, "planes_blob", broken)
        writer.submit(archive, torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4))  # fails in a worker thread
        assert archive.length == 16 and archive.pending
        with pytest.raises(RuntimeError, match="worker died"):
            archive.settle()


def test_stacked_documents_decode_and_retier_like_each_alone() -> None:
    model = tiny(seed=7)
    model.config._attn_implementation = register_attention()
    docs = [doc(500, seed=s) for s in (11, 12, 13)]
    alone, first = [], []
    for ids in docs:
        c = KernelTieredCache(model.config, KV)
        first.append(layer_major_prefill(model, c, ids, chunk=200))
        alone.append(c)
    singles = []
    for ids in docs:
        c = KernelTieredCache(model.config, KV)
        layer_major_prefill(model, c, ids, chunk=200)
        singles.append(c)
    stacked = stack_caches(alone)
    assert stacked.tier_tokens() == singles[0].tier_tokens()
    tok = torch.cat([f.argmax(-1, keepdim=True) for f in first])
    with torch.no_grad():
        for _ in range(4):
            batch = model(input_ids=tok, use_cache=True, **{cache_kwarg(model): stacked}).logits[:, -1]
            for i, c in enumerate(singles):
                one = model(input_ids=tok[i: i + 1], use_cache=True, **{cache_kwarg(model): c}).logits[:, -1]
                torch.testing.assert_close(batch[i: i + 1], one, rtol=1e-4, atol=1e-4)
            tok = batch.argmax(-1, keepdim=True)
    stacked.retier()  # reads each document's own archive for the promoted tokens
    for i, c in enumerate(singles):
        c.retier()
        for a, b in zip(c.layers, stacked.layers):
            assert torch.equal(b.membership()[i: i + 1], a.membership())
    assert stacked.host_bytes() >= sum(c.layers[0].archive.nbytes() for c in singles)


def test_stacking_refuses_documents_of_different_sizes() -> None:
    model = tiny(layers=1)
    a, b = KernelTieredCache(model.config, KV), KernelTieredCache(model.config, KV)
    layer_major_prefill(model, a, doc(300))
    layer_major_prefill(model, b, doc(400))
    with pytest.raises(ValueError, match="different sizes cannot share a decode batch"):
        stack_caches([a, b])
    with pytest.raises(ValueError, match="at least one cache"):
        stack_caches([])


@GPU
def test_layer_major_prefill_matches_the_model_in_bf16_on_gpu() -> None:
    model = tiny(seed=2).to("cuda", torch.bfloat16)
    ids = doc(3000).cuda()
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, -1].float()
    with ArchiveWriter() as writer:
        cache = KernelTieredCache(model.config, KV)
        out = layer_major_prefill(model, cache, ids, chunk=1024, writer=writer).float()
    assert float((out - ref).norm() / ref.norm()) < 2e-2
    assert cache.layers[0].archive.length == 3000
    inline = KernelTieredCache(model.config, KV)  # tiering in line, not on a side stream
    again = layer_major_prefill(model, inline, ids, chunk=1024, overlap=False).float()
    assert torch.equal(again, out)
    for a, b in zip(inline.layers, cache.layers):
        assert torch.equal(a.membership(), b.membership()) and torch.equal(a.keys, b.keys)


@GPU
def test_graph_with_a_skip_set_leaves_the_model_intact() -> None:
    from docfuse.runtime.gpu.decode_graph import GraphDecoder

    model = tiny(seed=4).to("cuda", torch.bfloat16)
    model.config._attn_implementation = register_attention()
    cache = KernelTieredCache(model.config, KV)
    tok = layer_major_prefill(model, cache, doc(800).cuda(), chunk=512).argmax(-1, keepdim=True)
    mlps = [b.mlp for b in model.model.layers]
    dec = GraphDecoder(model, cache, max_new=8, first_token=tok, skip_mlp=[1])
    for _ in range(4):
        dec.step()
    dec.close()
    assert [b.mlp for b in model.model.layers] == mlps
    assert cache.get_seq_length() == 800 + 6
    with pytest.raises(ValueError, match="skip_mlp names layers"):
        GraphDecoder(model, cache, max_new=4, first_token=tok, skip_mlp=[7])
    assert [b.mlp for b in model.model.layers] == mlps


def test_auto_core_budget_gives_every_layer_the_same_tiers(monkeypatch) -> None:
    from docfuse.runtime.kv import config as kv_config

    free = iter(range(300_000, 0, -40_000))  # free memory shrinks as layers fill: sizes must not follow it
    monkeypatch.setattr(kv_config, "free_device_bytes", lambda _device: next(free))
    model = tiny(layers=3)
    cache = TieredCache(model.config, {**KV, "core_tokens": "auto"})
    layer_major_prefill(model, cache, doc(900), chunk=256)
    cores = {layer.n_core for layer in cache.layers}
    assoc = {layer.n_assoc for layer in cache.layers}
    assert len(cores) == 1 and len(assoc) == 1 and cache.pinned_budgets is None


def test_the_timeline_says_where_each_layers_time_went() -> None:
    model = tiny(layers=3)
    timeline: list[dict[str, float]] = []
    with ArchiveWriter(workers=2) as writer:
        layer_major_prefill(model, TieredCache(model.config, KV), doc(700), chunk=256, writer=writer,
                            timeline=timeline)
        assert writer.pack_s > 0 and writer.wait_s >= 0
    assert len(timeline) == 3
    for record in timeline:
        assert record["tier"] > 0 and record["archive_wait"] >= 0 and "compute" not in record  # no GPU: no events


def test_the_gil_hands_off_quickly_while_helper_threads_run_and_the_setting_comes_back() -> None:
    import sys

    model = tiny(layers=2)
    seen: list[float] = []
    proj = model.model.layers[1].self_attn.q_proj  # called while layer 1 computes
    handle = proj.register_forward_hook(lambda *_: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    try:
        with ArchiveWriter(workers=2) as writer:
            layer_major_prefill(model, TieredCache(model.config, KV), doc(300), chunk=128, writer=writer,
                                handoff_s=2e-4)
        assert seen and all(s == pytest.approx(2e-4) for s in seen)
        assert sys.getswitchinterval() == before
        seen.clear()
        layer_major_prefill(model, TieredCache(model.config, KV), doc(300), chunk=128, writer=None)
        assert seen and all(s == before for s in seen)  # no helper threads: nothing to hand off to
        with pytest.raises(ValueError, match="handoff_s"):
            with ArchiveWriter(workers=1) as writer:
                layer_major_prefill(model, TieredCache(model.config, KV), doc(300), writer=writer, handoff_s=0)
        assert sys.getswitchinterval() == before
    finally:
        handle.remove()


def test_host_arena_hands_out_disjoint_slices_and_gives_large_pieces_their_own_map() -> None:
    import numpy as np

    from docfuse.runtime.kv.host_arena import HostArena

    arena = HostArena(chunk_bytes=1000, first_chunk_bytes=250)
    views = [arena.take(90) for _ in range(30)]  # chunks of 250, 500, 1000, 1000, 1000: 2 + 5 + 11 + 11 + 1 slices
    for i, view in enumerate(views):
        view[:] = bytes([i]) * 90
    assert all(bytes(view) == bytes([i]) * 90 for i, view in enumerate(views))
    assert arena.mapped_bytes == 3750
    big = arena.take(600)  # over a quarter of a chunk: a map of its own, the open chunk is left as it was
    assert len(big) == 600 and arena.mapped_bytes == 4350
    assert len(arena.take(90)) == 90 and arena.mapped_bytes == 4350
    assert bytes(arena.tagged(b"\x01", b"abc")) == b"\x01abc"
    payload = np.arange(7, dtype=np.uint8)
    assert bytes(arena.tagged(b"\x00", payload)) == b"\x00" + payload.tobytes()
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostArena(chunk_bytes=0)
    with pytest.raises(ValueError, match="first_chunk_bytes"):
        HostArena(first_chunk_bytes=-1)


def test_overlapping_prefills_restore_the_gil_interval_only_when_the_last_one_ends() -> None:
    import sys

    from docfuse.runtime.layer_prefill import _quick_handoff

    before = sys.getswitchinterval()
    with _quick_handoff(3e-4):
        assert sys.getswitchinterval() == pytest.approx(3e-4)
        inner = _quick_handoff(1e-4)
        inner.__enter__()
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        with _quick_handoff(2e-4):
            assert sys.getswitchinterval() == pytest.approx(1e-4)  # the shortest asked for wins
        inner.__exit__(None, None, None)  # ends before the outer one: the outer interval is back
        assert sys.getswitchinterval() == pytest.approx(3e-4)
    assert sys.getswitchinterval() == before
