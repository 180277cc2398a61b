"""The decode engine (runtime.engine) on CPU: many streams at once give the answers one Session gives each alone.

CI has no GPU, so this runs the engine's scheduling (admission by pages, ragged counts, slot reuse, bucket choice,
stop handling) through the CPU paths: the step's torch fallbacks and the row-by-row reference attention. One test
runs the paged Triton kernel itself under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from docfuse.runtime.engine import Document, Engine, engine_unsupported
from docfuse.runtime.engine.pool import PagePool, PoolShape, StreamPages
from docfuse.runtime.kv import TieredCache, as_kv_config, read_question
from docfuse.runtime.kv.code_attention import reading_codes
from docfuse.runtime.session import fill_cache, forward_tokens
from tests.test_decode_step import tiny

KV = {"core_tokens": 0.1, "association_tokens": 0.5, "recent_tokens": 16, "query_tokens": 24,
      "association_bits": 4, "association_key_bits": 8}
ROOT = Path(__file__).resolve().parents[1]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def alone(model, kv: dict, prefix: list[int], question: list[int], max_new: int, stops: set[int]) -> list[int]:
    """What Session does for one question: prefill, read the question exactly, decode greedily over the codes."""
    cache = TieredCache(model.config, kv)
    fill_cache(model, cache, prefix, 64)
    token = int(read_question(model, cache, torch.tensor([question])).argmax())
    out: list[int] = []
    with reading_codes(model, cache):
        while token not in stops:
            out.append(token)
            if len(out) >= max_new:
                break
            token = int(forward_tokens(model, cache, [token]).argmax())
    return out


def documents() -> list[Document]:
    """Short and long documents, one to three questions each, different answer budgets."""
    return [Document(ids(300, 1), [ids(9, 11), ids(14, 12)], max_new_tokens=12),
            Document(ids(700, 2), [ids(12, 21)], max_new_tokens=20),
            Document(ids(150, 3), [ids(7, 31), ids(20, 32), ids(11, 33)], max_new_tokens=8),
            Document(ids(520, 4), [ids(10, 41)], max_new_tokens=16)]


def test_many_streams_answer_as_each_alone_with_queueing_and_slot_reuse() -> None:
    model = tiny(seed=3)
    docs = documents()
    expected = [[alone(model, KV, list(d.prefix), list(q), d.max_new_tokens, set()) for q in d.questions]
                for d in docs]
    # a stop token that some answers reach early: every stream then stops at its own length
    stop = next(t for answers in expected for a in answers for t in a[2:5])
    expected = [[alone(model, KV, list(d.prefix), list(q), d.max_new_tokens, {stop}) for q in d.questions]
                for d in docs]
    assert any(len(a) < d.max_new_tokens for d, answers in zip(docs, expected) for a in answers)
    engine = Engine(model, KV, {stop}, max_streams=4, archive="device")
    shape = PoolShape.of(model.config, engine.kv, model.dtype)
    # a pool that holds about three streams: documents wait for pages, finished streams hand theirs on
    engine.pool_bytes = 3 * (3 * shape.core_page_bytes + 3 * shape.assoc_page_bytes)
    got = engine.run(docs)
    assert [[o.tokens for o in d] for d in got] == expected
    assert all(o.error is None and o.finish_reason in ("eos", "length") for d in got for o in d)
    stats = engine.stats
    assert 1 < stats["max_live"] <= 4
    assert len(stats["buckets"]) >= 2  # the batch shrank and grew through buckets
    assert len(engine.pool.free_core) == engine.pool.core_total  # every page came back
    assert len(engine.pool.free_assoc) == engine.pool.assoc_total


def test_a_buckets_graph_capture_is_not_counted_as_decode_time(monkeypatch) -> None:
    """A capture (on CUDA: a warm-up step and the recording, ~0.3 s for an 8B model) is a one-off per bucket; inside
    the first step's time it read as a third slower decode at batch 1 (bench/RESULTS.md, issue 23)."""
    from docfuse.runtime.engine import step as step_module

    taken: set[int] = set()

    def slow_capture(self) -> None:  # stands in for CUDA's: once per step object, slow
        if id(self) not in taken:
            taken.add(id(self))
            time.sleep(0.4)

    monkeypatch.setattr(step_module.BatchStep, "capture", slow_capture)
    model = tiny(seed=3)
    engine = Engine(model, KV, set(), max_streams=1)
    out = engine.run([Document(ids(200, 5), [ids(8, 51)], max_new_tokens=6)])[0][0]
    assert engine.stats["capture_s"] >= 0.4 and len(taken) == 1
    assert engine.stats["step_s"] < 0.4, engine.stats
    assert out.decode_tokens_per_s > 5 / 0.4, out.decode_tokens_per_s  # 5 steps, none of them waiting on the capture


def test_a_stream_that_can_never_fit_is_an_error_row_and_the_rest_finish() -> None:
    model = tiny(seed=3)
    docs = [Document(ids(200, 5), [ids(8, 51)], max_new_tokens=6),
            Document(ids(3000, 6), [ids(8, 61), ids(9, 62)], max_new_tokens=6),
            Document(ids(4100, 7), [ids(8, 71)], max_new_tokens=6)]  # past the 4096-position context
    engine = Engine(model, KV, set())
    shape = PoolShape.of(model.config, engine.kv, model.dtype)
    engine.pool_bytes = int(2.5 * (shape.core_page_bytes + shape.assoc_page_bytes))
    got = engine.run(docs)
    assert got[0][0].error is None and got[0][0].tokens == alone(model, KV, list(docs[0].prefix),
                                                                 list(docs[0].questions[0]), 6, set())
    assert all(o.error.startswith("kv_too_large:") and "kv.core_tokens" in o.error for o in got[1])
    assert got[2][0].error.startswith("context_too_long:") and "truncate" in got[2][0].error


def test_the_pool_keeps_a_streams_tiers_exactly() -> None:
    model = tiny(seed=3)
    kv = as_kv_config(KV)
    cache = TieredCache(model.config, kv)
    with torch.inference_mode():
        fill_cache(model, cache, ids(333, 8), 64)
        read_question(model, cache, torch.tensor([ids(10, 81)]))
    pool = PagePool(PoolShape.of(model.config, kv, model.dtype), 8, 8, "cpu")
    pool.allocate(1, 2)  # someone else's pages first: the stream's are not the first ones
    stream = pool.load(cache, core_extra=5)
    for i, layer in enumerate(cache.layers):
        k, v = pool.core_of(i, stream, layer.n_core)
        assert torch.equal(k, layer.keys[:, :, : layer.n_core]) and torch.equal(v, layer.values[:, :, : layer.n_core])
        a, b = pool.assoc_of(i, stream).dequantize(torch.float32), layer.assoc.dequantize(torch.float32)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    free, held = (len(pool.free_core), len(pool.free_assoc)), (len(stream.core), len(stream.assoc))
    assert held == (-(-(cache.layers[0].n_core + 5) // 128), -(-cache.layers[0].n_assoc // 128))
    pool.release(stream)
    assert (len(pool.free_core), len(pool.free_assoc)) == (free[0] + held[0], free[1] + held[1])


def test_what_the_engine_does_not_serve_is_named() -> None:
    model = tiny()
    assert engine_unsupported(model, KV) is None
    assert "kv: null" in engine_unsupported(model, None)
    assert "retier_every" in engine_unsupported(model, {**KV, "retier_every": 8})
    assert "evict" in engine_unsupported(model, {"method": "evict"})
    assert "temperature" in engine_unsupported(model, KV, temperature=0.7)
    with pytest.raises(ValueError, match="Session"):
        Engine(model, {**KV, "differential": True}, set())


def under_triton_interpreter(code: str, timeout: int = 900) -> list[str]:
    """Run ``code`` in a new Python with ``TRITON_INTERPRET=1`` (Triton kernels on the CPU); its output lines."""
    pytest.importorskip("triton")
    # the repository goes last: an installed docfuse (editable here, a target folder on a lent GPU) must win
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_the_paged_kernel_matches_the_reference_under_the_triton_interpreter() -> None:
    lines = under_triton_interpreter("from tests.test_engine_decode import kernel_vs_reference\n"
                                     "print(kernel_vs_reference())\n", timeout=600)
    assert float(lines[-1]) < 1e-4


def kernel_vs_reference() -> float:
    """Largest relative error of the paged kernel against the row-by-row reference, over ragged rows, for 4- and
    8-bit codes, page indices loaded in their tile or prefetched (run under TRITON_INTERPRET=1 by the test above)."""
    from docfuse.runtime.engine.step import BatchStep
    from docfuse.runtime.gpu.paged_kernel import TUNED, paged_decode_attention

    torch.manual_seed(0)
    worst = 0.0
    default = TUNED["prefetch_pages"]
    for key_bits, bits in ((8, 4), (4, 8), (8, 8)):
        config = tiny().config
        config.head_dim = 32
        kv = as_kv_config({**KV, "association_key_bits": key_bits, "association_bits": bits})
        shape = PoolShape(layers=1, kv_heads=2, head_dim=32, dtype=torch.float32, key_bits=key_bits,
                          value_bits=bits, group=32, page=32)
        pool = PagePool(shape, 12, 12, "cpu")
        streams = []
        for n_core, n_assoc in ((5, 0), (100, 70), (33, 96)):  # 100: two core pages in one split
            cache_k = torch.randn(1, 2, n_core, 32)
            cache_v = torch.randn(1, 2, n_core, 32)
            core, assoc = pool.allocate(-(-n_core // 32), -(-n_assoc // 32))
            pages = StreamPages(core, assoc, n_core, n_assoc)
            rows = pool.rows(core, n_core)
            pool.core_k[0].index_copy_(0, rows, cache_k[0].transpose(0, 1))
            pool.core_v[0].index_copy_(0, rows, cache_v[0].transpose(0, 1))
            if n_assoc:
                from docfuse.runtime.kv.association import AssociationStore

                store = AssociationStore.build(torch.randn(1, 2, n_assoc, 32) * 2, torch.randn(1, 2, n_assoc, 32),
                                               bits, 32, key_bits=key_bits)
                padded = store.keys.codes.shape[2]
                pool._load_assoc(0, store, pool.rows(assoc, padded), pool.rows(assoc, padded // 32, 1),
                                 pool.rows(assoc, n_assoc))
            streams.append(pages)
        step = BatchStep.__new__(BatchStep)
        step.pool, step.rows = pool, streams + [None]
        step.host_core = [p.n_core - 1 for p in streams] + [0]
        q = torch.randn(4, 8, 32)
        ref = step.reference_attention(q, 0, 32 ** -0.5)[:3]
        ct = torch.zeros(4, 4, dtype=torch.int32)
        at = torch.zeros(4, 4, dtype=torch.int32)
        for r, p in enumerate(streams):
            ct[r, : len(p.core)] = torch.tensor(p.core)
            if p.assoc:
                at[r, : len(p.assoc)] = torch.tensor(p.assoc)
        nc = torch.tensor([p.n_core for p in streams] + [1], dtype=torch.int32)
        na = torch.tensor([p.n_assoc for p in streams] + [0], dtype=torch.int32)
        for prefetch in (0, 1):  # the page index loaded in its tile, or one tile ahead
            TUNED["prefetch_pages"] = prefetch
            try:
                out = paged_decode_attention(q, pool, 0, ct, nc, at, na, 32 ** -0.5, splits=2)[:3]
            finally:
                TUNED["prefetch_pages"] = default
            worst = max(worst, float((out - ref).norm() / ref.norm()))
        del kv
    return worst


def test_the_pool_is_no_larger_than_every_stream_at_once_needs() -> None:
    model = tiny(seed=3)
    docs = [Document(ids(300, 1), [ids(9, 11)], max_new_tokens=12)]
    engine = Engine(model, KV, set())
    engine.pool_bytes = 1 << 30
    engine.run(docs)
    shape = engine.shape
    need = engine.stream_pages(300, 9, 12)
    assert engine.pool.nbytes() <= (need[0] + 4) * shape.core_page_bytes + (need[1] + 4) * shape.assoc_page_bytes


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_llama_family_models_answer_as_alone(family) -> None:
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Mistral run the engine's written-out step as they run alone."""
    import transformers

    common = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=256, max_position_embeddings=4096)
    torch.manual_seed(7)
    if family == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        model = transformers.Qwen2ForCausalLM(config)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16, use_sliding_window=False)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    model.eval()
    docs = [Document(ids(260, 1), [ids(9, 11), ids(6, 12)], max_new_tokens=8),
            Document(ids(130, 2), [ids(7, 21)], max_new_tokens=10)]
    expected = [[alone(model, KV, list(d.prefix), list(q), d.max_new_tokens, set()) for q in d.questions]
                for d in docs]
    got = Engine(model, KV, set(), archive="device").run(docs)
    assert [[o.tokens for o in d] for d in got] == expected


def test_a_fused_document_prefills_from_its_embedding_rows() -> None:
    """A document given as embedding rows (fusion.gate's stream) answers as the same ids do when the rows are the
    model's own embeddings, and differently when they are not."""
    model = tiny(seed=3)
    prefix = ids(240, 9)
    with torch.inference_mode():
        rows = model.get_input_embeddings()(torch.tensor(prefix))
    plain = Engine(model, KV, set()).run([Document(prefix, [ids(8, 91)], max_new_tokens=8)])
    fused = Engine(model, KV, set()).run([Document(prefix, [ids(8, 91)], max_new_tokens=8, embeds=rows)])
    assert fused[0][0].tokens == plain[0][0].tokens
    other = Engine(model, KV, set()).run([Document(prefix, [ids(8, 91)], max_new_tokens=8, embeds=rows * 3.0)])
    assert other[0][0].tokens != plain[0][0].tokens


def test_the_open_documents_archive_stays_on_the_card_when_it_fits_beside_the_streams(monkeypatch) -> None:
    """archive: auto on CUDA: the device when the document's full K/V take an eighth of the card or less, or when
    they fit in what the run's streams leave (one long document alone), else the host. The rule, on the CPU with the
    card's sizes stood in."""
    from types import SimpleNamespace

    model = tiny()
    engine = Engine(model, KV, set())
    assert not engine._device_archive(100)  # off CUDA: the host, whatever the sizes
    engine.device = torch.device("cuda")
    card = 8 * engine._full_bytes(1000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=card))
    assert engine._device_archive(1000) and not engine._device_archive(1001)  # an eighth of the card
    engine._archive_room = engine._full_bytes(5000)  # room left beside the streams
    assert engine._device_archive(5000) and not engine._device_archive(5001)
    assert Engine(model, KV, set(), archive="host")._device_archive(10) is False


def on_a_card(monkeypatch, engine: Engine, free: int) -> Engine:
    """``engine`` as if on a CUDA card with ``free`` bytes beside its prefill (pool sizing only; nothing runs)."""
    from docfuse.runtime.loading import AUTO_PREFILL_CHUNK

    engine.device = torch.device("cuda")
    engine.prefill_chunk = engine._chunk_setting = AUTO_PREFILL_CHUNK["cuda"]
    monkeypatch.setattr(engine, "_cuda_pool_bytes",
                        lambda longest, wanted: free - engine.prefill_reserve(longest, archive=False))
    return engine


def test_an_automatic_prefill_chunk_is_one_pass_unless_the_streams_need_that_memory(monkeypatch) -> None:
    """prefill_chunk auto on CUDA: a document prefilled token by token in one pass of up to 131,072 tokens (the
    fastest attention there), unless that pass's activations would leave the pool short of what the run's streams
    need: then 8,192. A given chunk is kept; a layer-major prefill reserves at most MAX_CHUNK tokens' activations.
    The rule, on the CPU with the card's free memory stood in."""
    from docfuse.runtime.layer_prefill import MAX_CHUNK
    from docfuse.runtime.loading import AUTO_PREFILL_CHUNK, TIGHT_PREFILL_CHUNK

    model = tiny()
    auto = Engine(model, KV, set())
    assert auto.prefill_chunk == AUTO_PREFILL_CHUNK["cpu"] and auto._auto_pool_bytes(40000, 1 << 20) == 1 << 30
    streams = 1 << 30

    def card(engine: Engine, free: int) -> Engine:
        return on_a_card(monkeypatch, engine, free)

    card(auto, 0)
    one_pass = auto.prefill_reserve(40000, archive=False)
    card(auto, streams + one_pass)  # room for the streams beside one pass
    assert auto._auto_pool_bytes(40000, streams) >= streams and auto.prefill_chunk == AUTO_PREFILL_CHUNK["cuda"]
    card(auto, streams + one_pass - 1)  # one byte short: chunks, and the pool gets what chunking frees
    nbytes = auto._auto_pool_bytes(40000, streams)
    assert auto.prefill_chunk == TIGHT_PREFILL_CHUNK and nbytes == streams + one_pass - 1 - auto.prefill_reserve(
        40000, archive=False) > streams - 1
    given = Engine(model, KV, set(), prefill_chunk=AUTO_PREFILL_CHUNK["cuda"])
    card(given, streams + one_pass - 1)
    given._auto_chunk = False
    assert given._auto_pool_bytes(40000, streams) < streams and given.prefill_chunk == AUTO_PREFILL_CHUNK["cuda"]
    # the reserve follows the chunk for a token-major prefill, and stops at MAX_CHUNK for a layer-major one
    auto.prefill_chunk = AUTO_PREFILL_CHUNK["cuda"]
    assert auto.prefill_reserve(40000, archive=False) > auto.prefill_reserve(20000, archive=False)
    layers = Engine(model, {**KV, "prefill": "layers"}, set(), prefill_chunk=AUTO_PREFILL_CHUNK["cuda"])
    small = Engine(model, {**KV, "prefill": "layers"}, set(), prefill_chunk=MAX_CHUNK)
    assert layers.prefill_reserve(40000, archive=False) == small.prefill_reserve(40000, archive=False)


def test_a_long_document_prefills_token_major_when_the_card_has_room_beside_the_streams(monkeypatch) -> None:
    """layer_major_from None on CUDA: a long document prefills token by token in one pass (the fastest) when its full
    cache and that pass fit beside every stream of the run, else layer by layer from LAYER_MAJOR_FROM tokens (and a
    shorter one keeps one pass while it fits). A given layer_major_from is kept. On the CPU with free memory stood in."""
    from docfuse.runtime.engine.engine import LAYER_MAJOR_FROM
    from docfuse.runtime.loading import AUTO_PREFILL_CHUNK

    model = tiny(layers=32)  # an 8B's layer count: one layer's K/V is a small share of the whole cache
    long = 200_000
    streams = 1 << 30

    def card(engine: Engine, free: int) -> Engine:
        return on_a_card(monkeypatch, engine, free)

    probe = card(Engine(model, KV, set(), archive="device"), 0)
    probe._layer_from = long + 1
    token_major = probe.prefill_reserve(long, archive=False)
    probe._layer_from = LAYER_MAJOR_FROM
    layer_major = probe.prefill_reserve(long, archive=False)
    assert layer_major < token_major  # one layer's full K/V and a 64K call's activations, not the whole cache

    roomy = card(Engine(model, KV, set(), archive="device"), streams + token_major)
    assert roomy._auto_pool_bytes(long, streams) >= streams
    assert not roomy._layer_major(long) and roomy.prefill_chunk == AUTO_PREFILL_CHUNK["cuda"]
    # the same room, but the exact K/V would go to the host archive (packed at the re-tier): layer by layer
    host = card(Engine(model, KV, set(), archive="host"), streams + token_major)
    host._auto_pool_bytes(long, streams)
    assert host._layer_major(long)
    tight = card(Engine(model, KV, set(), archive="device"), streams + token_major - 1)
    assert tight._auto_pool_bytes(long, streams) >= streams
    assert tight._layer_major(long) and not tight._layer_major(LAYER_MAJOR_FROM - 1)
    assert tight.prefill_chunk == AUTO_PREFILL_CHUNK["cuda"]
    given = card(Engine(model, KV, set(), archive="device", layer_major_from=LAYER_MAJOR_FROM),
                 streams + token_major)
    given._auto_pool_bytes(long, streams)
    assert given._layer_major(long)
    cpu = Engine(model, KV, set())
    cpu._auto_pool_bytes(long, streams)
    assert cpu._layer_major(long) and not cpu._layer_major(LAYER_MAJOR_FROM - 1)
    # a token-major document's device archive fills as its core empties: it adds to the reserve only past the
    # prefill's activations
    probe._layer_from = long + 1
    assert probe.prefill_reserve(long, archive=True) - token_major < probe._full_bytes(long) // 4



@torch.inference_mode()
def together_alone(model, kv: dict, prefix: list[int], questions: list[list[int]], max_new: int,
                   stops: set[int]) -> list[list[int]]:
    """What Session does with ``kv.questions: together``: read every question, re-tier once, answer each."""
    from docfuse.runtime.kv import read_questions

    cache = TieredCache(model.config, kv)
    fill_cache(model, cache, prefix, 64)
    answers = []
    for read in read_questions(model, cache, questions):
        cache.append_read(read)
        token, out = int(read.logits.argmax()), []
        with reading_codes(model, cache):
            while token not in stops:
                out.append(token)
                if len(out) >= max_new:
                    break
                token = int(forward_tokens(model, cache, [token]).argmax())
        cache.rollback(len(prefix))
        answers.append(out)
    return answers


def test_questions_together_share_one_copy_of_the_documents_tiers() -> None:
    """kv.questions: together: each stream answers as Session does in that mode, the document's tiers are loaded
    into pages once for all its questions, and every page comes back when the last of them ends."""
    model = tiny(seed=3)
    kv = {**KV, "questions": "together"}
    docs = documents() + [Document(ids(2600, 5), [ids(9, 51), ids(12, 52), ids(8, 53), ids(15, 54)],
                                   max_new_tokens=10)]
    expected = [together_alone(model, kv, list(d.prefix), [list(q) for q in d.questions], d.max_new_tokens, set())
                for d in docs]
    stop = next(t for answers in expected for a in answers for t in a[2:5])
    expected = [together_alone(model, kv, list(d.prefix), [list(q) for q in d.questions], d.max_new_tokens, {stop})
                for d in docs]
    engine = Engine(model, kv, {stop}, max_streams=8, archive="device")
    # room for the long document's four streams only if they share its tiers
    each = Engine(model, KV, set())
    alone_pages = each.document_pages(docs[-1])
    shared_pages = engine.document_pages(docs[-1])
    assert shared_pages[1] * 4 == alone_pages[1] and shared_pages[0] < alone_pages[0]
    s = engine.shape
    # half as much again as one copy of its tiers (the pool splits its bytes between the tiers by the run's needs)
    engine.pool_bytes = int(1.5 * (shared_pages[0] * s.core_page_bytes + shared_pages[1] * s.assoc_page_bytes))
    assert engine.pool_bytes < alone_pages[0] * s.core_page_bytes + alone_pages[1] * s.assoc_page_bytes
    got = engine.run(docs)
    assert [[o.tokens for o in d] for d in got] == expected
    assert all(o.error is None for d in got for o in d)
    assert engine.stats["max_live"] >= 4 and engine.stats["max_live_documents"] >= 1
    assert len(engine.pool.free_core) == engine.pool.core_total
    assert len(engine.pool.free_assoc) == engine.pool.assoc_total


def test_the_cascade_kernel_answers_as_session_under_the_triton_interpreter() -> None:
    """kv.questions: together through the paged kernel (run by Triton's interpreter on the CPU): a document's streams
    read its shared pages in one program each (the cascade), and every stream answers as Session does. A document
    with more questions than one program serves takes two programs over the same pages."""
    worst, verdict = under_triton_interpreter("from tests.test_engine_decode import cascade_vs_plain, "
                                              "cascade_vs_session\n"
                                              "print(cascade_vs_plain())\n"
                                              "print(cascade_vs_session())\n")[-2:]
    assert float(worst) < 1e-5 and verdict == "ok"


def cascade_vs_session() -> str:
    """Run by the test above under TRITON_INTERPRET=1: the engine's kernel path with shared tiers against Session."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from docfuse.runtime.engine import engine as engine_module

    torch.manual_seed(3)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-5)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()  # heads of 32 channels: the kernel's smallest
    kv = {**KV, "questions": "together"}
    docs = [Document(ids(700, 2), [ids(12, 21), ids(9, 22), ids(14, 23)], max_new_tokens=6),
            Document(ids(300, 1), [ids(9, 11)], max_new_tokens=5),
            Document(ids(520, 4), [ids(10, 41), ids(7, 42)], max_new_tokens=4)]
    expected = [together_alone(model, kv, list(d.prefix), [list(q) for q in d.questions], d.max_new_tokens, set())
                for d in docs]
    engine_module.MAX_MEMBERS = 2  # the three-question document needs two programs over its pages
    engine = Engine(model, kv, set(), max_streams=8, archive="device")
    got = engine.run(docs)
    steps = list(engine.steps.values())
    assert steps and all(s.kernel and s.members == 2 for s in steps), "the cascade kernel did not run"
    answers = [[o.tokens for o in d] for d in got]
    assert answers == expected, (answers, expected)
    assert len(engine.pool.free_core) == engine.pool.core_total
    return "ok"


def cascade_vs_plain(device: str = "cpu") -> float:
    """Largest relative difference between the cascade kernel and the plain kernel over the same rows' pages: three
    streams on one document's shared pages (two table rows of at most two members), each with its own core pages
    past them, a stream of its own, an idle row; then again after the counts advance a token."""
    from docfuse.runtime.engine.pool import SharedTiers
    from docfuse.runtime.engine.step import BatchStep
    from docfuse.runtime.gpu.paged_kernel import cascade_decode_attention, paged_decode_attention

    torch.manual_seed(1)
    shape = PoolShape(layers=1, kv_heads=2, head_dim=32, dtype=torch.float32, key_bits=8, value_bits=4, group=32,
                      page=32)
    pool = PagePool(shape, 24, 12, device)
    pool.core_k.normal_()
    pool.core_v.normal_()
    pool.key_codes.random_(0, 256)
    pool.value_codes.random_(0, 256)
    pool.key_scale.uniform_(0.01, 0.05)
    pool.value_scale.uniform_(0.01, 0.05)
    pool.key_zero.uniform_(-1, 1)
    pool.value_zero.uniform_(-1, 1)
    core, assoc = pool.allocate(3, 4)
    shared = SharedTiers(core, assoc, n_core=3 * 32 + 5, n_assoc=110)
    streams = []
    for extra in (9, 40, 70):  # the document core's last 5 tokens, the question and the answer so far: own pages
        own, _ = pool.allocate(-(-(5 + extra) // 32), 0)
        streams.append(StreamPages(core + own, assoc, shared.n_core + extra, shared.n_assoc, shared))
    alone_core, alone_assoc = pool.allocate(2, 2)
    streams.insert(1, StreamPages(alone_core, alone_assoc, 50, 64))
    step = BatchStep(None, pool, 8, core_width=6, assoc_width=4, members=2)
    assert step.kernel and step.members == 2
    step.bind([(p, 0, 0, p.n_core - 1) for p in streams])
    worst = 0.0
    for _ in range(2):
        step.n_core += 1  # what the step does before attention: the token it feeds is in the core
        step._counts()
        q = torch.randn(8, 4, 32, device=device)
        plain = paged_decode_attention(q, pool, 0, step.core_table, step.n_core, step.assoc_table, step.n_assoc,
                                       32 ** -0.5, splits=2)
        got = cascade_decode_attention(q, pool, 0, step.shared_tables, step.group_rows, step.own_tables, 32 ** -0.5,
                                       splits=2)
        worst = max(worst, float((got - plain).norm() / plain.norm()))
    assert step.group_rows[:, :2].ne(-1).sum() == 8  # every row in one table row: 4 streams and 4 idle rows
    return worst


@pytest.mark.parametrize("archive", ["host", "device"])
def test_a_stored_document_is_loaded_instead_of_prefilled_and_answers_the_same(tmp_path, archive) -> None:
    """Issue 24 on the engine: a token-major prefill is stored; a new engine (a new run) loads it and skips the
    prefill; every answer equals a fresh prefill's; a damaged entry is refused, prefilled again and stored again."""
    from docfuse.runtime.kv_store import KVStore

    model = tiny(seed=3)
    docs = documents()
    fresh = [[o.tokens for o in d] for d in Engine(model, KV, set(), max_streams=4, archive=archive).run(docs)]
    first = Engine(model, KV, set(), max_streams=4, archive=archive, kv_store=KVStore(tmp_path / "kv"))
    assert [[o.tokens for o in d] for d in first.run(docs)] == fresh
    assert first.stats["kv_store_saves"] == len(docs) and "kv_store_hits" not in first.stats
    entries = sorted((tmp_path / "kv").glob("*.dfkv"))
    assert len(entries) == len(docs)
    second = Engine(model, KV, set(), max_streams=4, archive=archive, kv_store=KVStore(tmp_path / "kv"))
    assert [[o.tokens for o in d] for d in second.run(docs)] == fresh
    assert second.stats["kv_store_hits"] == len(docs) and "kv_store_saves" not in second.stats
    data = bytearray(entries[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    entries[0].write_bytes(bytes(data))
    third = Engine(model, KV, set(), max_streams=4, archive=archive, kv_store=KVStore(tmp_path / "kv"))
    with pytest.warns(UserWarning, match="damaged"):
        got = [[o.tokens for o in d] for d in third.run(docs)]
    assert got == fresh
    assert third.stats["kv_store_hits"] == len(docs) - 1 and third.stats["kv_store_saves"] == 1
    # a layer-major prefill tiers as it goes: nothing is stored or loaded
    layers = Engine(model, {**KV, "prefill": "layers"}, set(), max_streams=4, archive=archive,
                    kv_store=KVStore(tmp_path / "layers"))
    layers.run(docs)
    assert "kv_store_saves" not in layers.stats and not (tmp_path / "layers").exists()
