"""The KV store (runtime.kv_store): a stored prefill loads bit for bit, keys miss on any change, a damaged entry is
never used, concurrent writers leave one whole entry, the folder keeps to its size.

Store-level tests use a tiny random Llama; one slow test runs the embedded model through ``Session``.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from docfuse.runtime.kv_store import KVStore, cache_layers, fill_dynamic, model_fingerprint
from docfuse.runtime.session import fill_cache


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval().to(dtype)


def prefilled(model, ids: list[int], chunk: int = 16) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        fill_cache(model, cache, ids, chunk)
    return cache


def next_logits(model, cache, token: int = 7) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]


IDS = list(range(3, 60))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stored_prefill_answers_bit_for_bit_as_a_fresh_one(tmp_path, dtype):
    model = tiny(dtype=dtype)
    store = KVStore(tmp_path)
    key = store.key(model, IDS, chunk_size=16)
    assert store.load(key) is None and store.misses == 1
    fresh = prefilled(model, IDS)
    store.save(key, cache_layers(fresh))
    loaded = fill_dynamic(model.config, store.load(key), torch.device("cpu"))
    assert store.hits == 1 and loaded.get_seq_length() == len(IDS)
    assert torch.equal(next_logits(model, loaded), next_logits(model, prefilled(model, IDS)))


TIERED_KV = {"core_tokens": 0.2, "association_tokens": 0.3, "association_bits": 4, "page_tokens": 8}
TIERED_IDS = list(range(3, 200))


def fresh_tiered(model):
    """A tiered cache straight after a token-major prefill of ``TIERED_IDS`` (the state the store keeps)."""
    from docfuse.runtime.kv import make_cache

    cache = make_cache(model.config, TIERED_KV)
    with torch.inference_mode():
        fill_cache(model, cache, TIERED_IDS, 16)
    return cache


def archive_is_mapped(cache) -> bool:
    """Whether every layer's archive is blocks that are views of a memory-mapped entry, not the process's copies."""
    planes = [p for layer in cache.layers for b in layer.archive.blocks for p in (*b.keys.planes, *b.values.planes)]
    return bool(planes) and all(isinstance(p, memoryview) and isinstance(p.obj, mmap.mmap) for p in planes)


def two_questions(model, cache) -> list[torch.Tensor]:
    """Two questions in turn (each re-tiering the document, the second from the first's state), each with one decode
    step over the re-tiered cache: their logits."""
    from docfuse.runtime.kv import read_question

    out = []
    with torch.inference_mode():
        for question in ([9, 4, 11], [5, 6]):
            cache.rollback(len(TIERED_IDS))
            out.append(read_question(model, cache, torch.tensor([question])))
            out.append(next_logits(model, cache, 13))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stored_tiered_prefill_answers_bit_for_bit_as_a_fresh_one(tmp_path, dtype):
    """A tiered cache after a token-major prefill is stored as its exact core; loaded, two questions in turn (each
    re-tiering the document, the second from the first's state) and the answers' decode steps give the logits a
    fresh prefill gives."""
    from docfuse.runtime.kv import make_cache
    from docfuse.runtime.kv_store import fill_tiered, tiered_layers

    model = tiny(dtype=dtype)
    ids = TIERED_IDS
    store = KVStore(tmp_path)
    key = store.key(model, ids, chunk_size=16, kind="tiered")
    assert key != store.key(model, ids, chunk_size=16)  # a full cache's entry is another entry
    store.save(key, tiered_layers(fresh_tiered(model)), tokens=len(ids))
    assert [e.tokens for e in store.entries()] == [len(ids)]  # what kv-store list shows, not one block's length
    loaded = fill_tiered(make_cache(model.config, TIERED_KV), store.load(key, blobs=True), torch.device("cpu"))
    # the archive came packed from the store: the first re-tier finds every position archived already
    assert all(layer.archive.length == len(ids) for layer in loaded.layers)
    # ... and its blocks are views of the memory-mapped entry, not copies in the process's memory
    assert archive_is_mapped(loaded)
    runs = [two_questions(model, cache) for cache in (fresh_tiered(model), loaded)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    tiers = loaded.tier_tokens()
    assert tiers["association"] > 0 and tiers["background"] > 0  # the questions did read through all three tiers


def test_a_first_run_takes_its_just_stored_entry_as_its_archive(tmp_path):
    """Right after a tiered prefill is stored, the entry's blocks (memory-mapped) become the cache's archive: the
    first re-tier compresses nothing, the archive is file-backed, and the answers are a fresh cache's, bit for bit.
    Blocks cut otherwise are refused and change nothing."""
    from docfuse.runtime.kv_store import adopt_archives, tiered_layers

    model = tiny()
    ids = TIERED_IDS
    store = KVStore(tmp_path)
    cache = fresh_tiered(model)
    key = store.key(model, ids, chunk_size=16, kind="tiered")
    store.save(key, tiered_layers(cache), tokens=len(ids))
    blocks = store.load(key, blobs=True)
    assert not adopt_archives(cache, blocks[1:])  # one block short: not this cache's cut
    assert all(layer.archive.length == 0 for layer in cache.layers)
    assert adopt_archives(cache, blocks)
    assert all(layer.archive.length == len(ids) for layer in cache.layers)
    assert archive_is_mapped(cache)
    runs = [two_questions(model, c) for c in (fresh_tiered(model), cache)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_keys_miss_on_any_change_that_shapes_the_state(tmp_path):
    store = KVStore(tmp_path)
    model = tiny()
    base = store.key(model, IDS, chunk_size=16)
    assert store.key(model, IDS, chunk_size=16) == base
    other = tiny()
    assert store.key(other, IDS, chunk_size=16) == base  # same weights, another object: a hit
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # fine-tuned: every value moves
    assert store.key(tiny(seed=1), IDS, chunk_size=16) != base
    assert model_fingerprint(other) != model_fingerprint(model)
    assert store.key(model, IDS[:-1], chunk_size=16) != base
    assert store.key(model, IDS, chunk_size=32) != base  # another chunking is another bf16 state
    assert store.key(model, IDS, chunk_size=16, embeds=torch.zeros(len(IDS), 64)) != base
    assert store.key(tiny(dtype=torch.bfloat16), IDS, chunk_size=16) != base


def test_damaged_entries_are_never_used(tmp_path):
    """1,000 entries, each with random bytes changed or cut off: every load either refuses (and deletes the file,
    with a warning naming it) or returns exactly the stored tensors."""
    model = tiny()
    store = KVStore(tmp_path)
    key = store.key(model, IDS[:20], chunk_size=16)
    good = cache_layers(prefilled(model, IDS[:20]))
    store.save(key, good)
    pristine = store.path(key).read_bytes()
    rng = random.Random(0)
    refused = 0
    for trial in range(1000):
        data = bytearray(pristine)
        if trial % 4 == 3:
            data = data[: rng.randrange(len(data))]  # torn write
        else:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        store.path(key).write_bytes(bytes(data))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = store.load(key)
        if got is None:
            refused += 1
            assert not store.path(key).exists() and any(key in str(w.message) for w in caught)
        else:
            assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(got, good) for a, b in ((ka, kb), (va, vb)))
    assert refused == 1000


def test_entries_of_the_previous_file_format_are_listed_and_never_read(tmp_path):
    """Format 1 entries (SHA-256) are not looked up under today's keys, show as old in the listing, and go with
    prune."""
    from docfuse.runtime.kv_store import MAGIC, OLD_MAGICS

    model = tiny()
    store = KVStore(tmp_path)
    key = store.key(model, IDS[:20], chunk_size=16)
    store.save(key, cache_layers(prefilled(model, IDS[:20])))
    old = store.path("0" * 64)
    old.write_bytes(OLD_MAGICS[0] + store.path(key).read_bytes()[len(MAGIC):])
    os.utime(old, (old.stat().st_mtime - 3600,) * 2)  # written by an earlier release
    listed = {e.path.name: e.source for e in store.entries()}
    assert listed[old.name] == "(old format, not used)" and listed[store.path(key).name] == ""
    assert store.load(key) is not None
    size = old.stat().st_size
    assert store.prune(max_bytes=store.path(key).stat().st_size) == (1, size) and not old.exists()


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    model = tiny()
    store = KVStore(tmp_path)
    key = store.key(model, IDS, chunk_size=16)
    layers = cache_layers(prefilled(model, IDS))
    threads = [threading.Thread(target=store.save, args=(key, layers)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in tmp_path.iterdir()] == [store.path(key).name]  # no temporary file left behind
    got = store.load(key)
    assert got is not None and all(torch.equal(a, b) for (a, _), (b, _) in zip(got, layers))


def test_least_recently_used_entries_go_first(tmp_path):
    import os
    import time

    model = tiny()
    store = KVStore(tmp_path)
    keys = [store.key(model, IDS[:n], chunk_size=16) for n in (20, 30, 40)]
    for i, (key, n) in enumerate(zip(keys, (20, 30, 40))):
        store.save(key, cache_layers(prefilled(model, IDS[:n])))
        os.utime(store.path(key), (time.time() - 100 + i, time.time() - 100 + i))
    store.load(keys[0])  # used now: the newest
    sizes = {k: store.path(k).stat().st_size for k in keys}
    gone, _ = store.prune(sizes[keys[0]] + sizes[keys[2]])
    assert gone == 1 and not store.path(keys[1]).exists() and store.path(keys[0]).exists()
    assert [e.tokens for e in store.entries()] == [20, 40]
    assert store.clear()[0] == 2 and store.entries() == []


def test_keep_and_restore_warn_and_fall_back_to_a_prefill(tmp_path):
    """The store's two sides for a prefill: an unwritable folder only warns (the next run prefills again); an entry
    its cache cannot take is refused with a warning naming it (this run prefills)."""
    model = tiny()
    layers = cache_layers(prefilled(model, IDS[:40]))
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    store = KVStore(blocked / "kv")
    with pytest.warns(UserWarning, match="could not store"):
        assert store.keep("k", layers, source="doc", tokens=40) is False
    assert KVStore(tmp_path).keep("k", None, source="doc", tokens=40) is False
    good = KVStore(tmp_path / "kv")
    key = good.key(model, IDS[:40], chunk_size=16)
    assert good.keep(key, layers, source="doc", tokens=40)

    def refuse(_layers):
        raise ValueError("another shape")

    with pytest.warns(UserWarning, match=f"{key}.*does not fit this cache"):
        assert good.restore(key, refuse) is None
    restored = good.restore(key, lambda stored: fill_dynamic(model.config, stored, torch.device("cpu")))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(cache_layers(restored), layers))
    assert good.restore("missing", refuse) is None


def test_an_entry_larger_than_an_eighth_of_the_cap_is_not_stored_and_says_so(tmp_path):
    model = tiny()
    layers = cache_layers(prefilled(model, IDS[:40]))
    raw = sum(t.numel() * t.element_size() for pair in layers for t in pair)
    store = KVStore(tmp_path, max_bytes=8 * raw - 1)
    with pytest.warns(UserWarning, match="larger than an eighth.*kv_store_max_gb"):
        assert store.save(store.key(model, IDS[:40], chunk_size=16), layers) is None
    assert store.too_large == 1 and store.entries() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per store
        assert store.save(store.key(model, IDS[:41], chunk_size=16), layers) is None
    roomy = KVStore(tmp_path, max_bytes=8 * raw)
    assert roomy.save(roomy.key(model, IDS[:40], chunk_size=16), layers) is not None and roomy.too_large == 0


@pytest.mark.slow
@pytest.mark.parametrize("kv", [None, {}], ids=["full", "tiered"])
def test_session_loads_a_stored_document_and_answers_the_same(smollm2, tmp_path, kv):
    from docfuse.runtime.session import Session

    model, tokenizer = smollm2
    document = "The monthly fee is 4,250 euros. " * 40 + "The agreement is governed by Dutch law."
    answers = []
    for run in range(2):
        session = Session(model, tokenizer, kv=kv, kv_store=KVStore(tmp_path))
        session.prefill(session.fit_document(document, max_new_tokens=16), source="agreement.pdf")
        assert session.loaded_from_store == (run == 1) and session.document_prefills == (1 - run)
        if kv is not None:  # both runs: the archive is the stored entry, memory-mapped, before any question
            assert archive_is_mapped(session.cache)
        answers.append(session.ask("Which law governs the agreement?", 16))
    assert answers[0].text == answers[1].text and answers[0].new_tokens == answers[1].new_tokens
    assert [e.source for e in KVStore(tmp_path).entries()] == ["agreement.pdf"]


def test_the_cli_points_decode_stages_at_the_store_unless_told_otherwise(tmp_path):
    from docfuse.pipelines.cli import _use_kv_store, load_pipeline
    from docfuse.stages.decode import DecodeParams

    pipe = load_pipeline("pdf_qa", [])
    _use_kv_store(pipe, None, tmp_path)
    assert pipe.stages["answer"].params["kv_store"] == str(tmp_path / "kv")
    off = load_pipeline("pdf_qa", ["answer.kv_store=false"])
    _use_kv_store(off, None, tmp_path)
    assert DecodeParams(**off.stages["answer"].params).kv_store is None
    none = load_pipeline("pdf_extract", [])
    _use_kv_store(none, tmp_path / "elsewhere", None)  # no decode stage: nothing to point
    assert all("kv_store" not in s.params for s in none.stages.values())
    nocache = load_pipeline("text_qa", [])
    _use_kv_store(nocache, None, None)  # --no-cache
    assert "kv_store" not in nocache.stages["answer"].params


@pytest.mark.slow
def test_a_long_pass_out_of_memory_is_prefilled_again_in_smaller_passes_and_stored_as_such(smollm2, tmp_path,
                                                                                        monkeypatch):
    """``prefill_chunk: auto`` is 65,536 on CUDA: where one pass does not fit beside what the card holds, the
    session says so and prefills in 8,192-token passes (the engine chooses before it starts; a Session finds out).
    The stored entry is keyed by the passes that made it, so a later run with 8,192 loads it."""
    from docfuse.runtime import session as session_module
    from docfuse.runtime.loading import TIGHT_PREFILL_CHUNK
    from docfuse.runtime.session import Session

    model, tokenizer = smollm2
    fill = session_module.fill_cache
    passes = []

    def short_of_memory(model, cache, ids, chunk_size, *args, **kwargs):
        passes.append(chunk_size)
        if chunk_size > TIGHT_PREFILL_CHUNK:
            cache.update(torch.zeros(1, 3, 5, 64), torch.zeros(1, 3, 5, 64), 0)  # a failed pass leaves some state
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return fill(model, cache, ids, chunk_size, *args, **kwargs)

    monkeypatch.setattr(session_module, "fill_cache", short_of_memory)
    document = "The monthly fee is 4,250 euros. " * 30
    session = Session(model, tokenizer, kv_store=KVStore(tmp_path))
    prefix = session.fit_document(document, max_new_tokens=8)
    with pytest.warns(UserWarning, match="passes of 8192 instead"):
        session.prefill(prefix, chunk_size=65536)
    assert passes == [65536, TIGHT_PREFILL_CHUNK] and session.cache.get_seq_length() == len(prefix.ids)
    answer = session.ask("What is the monthly fee?", 8).text
    again = Session(model, tokenizer, kv_store=KVStore(tmp_path))
    again.prefill(prefix, chunk_size=TIGHT_PREFILL_CHUNK)
    assert again.loaded_from_store and again.ask("What is the monthly fee?", 8).text == answer

    def always_short(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(session_module, "fill_cache", always_short)
    with pytest.raises(torch.OutOfMemoryError):  # passes of 8,192 or fewer have nothing smaller to try
        Session(model, tokenizer).prefill(prefix, chunk_size=TIGHT_PREFILL_CHUNK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_entry_written_from_a_card_loads_bit_for_bit_on_the_card_and_on_the_host(tmp_path):
    """On a GPU the byte planes are shuffled on the card (``planes_of``) and interleaved there on load
    (``unpack_exact(device=...)``); the file is the same format, so the host reads it too."""
    from docfuse.runtime.kv.background import unpack_exact

    store = KVStore(tmp_path)
    k = torch.randn(1, 3, 300, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 3, 300, 64, device="cuda", dtype=torch.bfloat16)
    store.save("e", [(k[:, :, :256], v[:, :, :256]), (k[:, :, 256:], v[:, :, 256:])])
    blobs = store.load("e", blobs=True)
    on_card = [unpack_exact(b, device="cuda") for pair in blobs for b in pair]
    on_host = [t for pair in store.load("e") for t in pair]
    want = [k[:, :, :256], v[:, :, :256], k[:, :, 256:], v[:, :, 256:]]
    for got, host, x in zip(on_card, on_host, want):
        assert got.is_cuda and torch.equal(got.view(torch.int16), x.contiguous().view(torch.int16))
        assert torch.equal(host.view(torch.int16), x.cpu().view(torch.int16))
