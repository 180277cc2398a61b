"""runtime/: model loading and its cache, prompt prefix/suffix split, sessions, metrics.

Fast tests need no weights (the prompt tests use the real tokenizer only). Tests marked slow load the embedded
SmolLM2-135M-Instruct (converted once into $DOCFUSE_HOME; about 30 s on a fresh machine, then ~1 s).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from docfuse.runtime import loading, metrics
from docfuse.runtime.prompt import ChatPrompt, DocumentPrefix, document_text, page_marker, truncate_prefix
from docfuse.runtime.session import ContextTooLong, Session, cache_kwarg, crop_cache

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "The pass key is 71432. Remember it. 71432 is the pass key. "
PASSKEY_DOC = FILLER * 8 + KEY + FILLER * 8  # about 480 prompt tokens
SHORT_DOC = FILLER * 3 + KEY + FILLER * 3


# ---------------------------------------------------------------- loading (no weights)

def test_default_model_dir_follows_docfuse_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCFUSE_HOME", str(tmp_path))
    assert loading.default_model_dir() == tmp_path / "models" / loading.DEFAULT_NAME
    monkeypatch.delenv("DOCFUSE_HOME")
    assert loading.default_model_dir() == Path.home() / ".cache" / "docfuse" / "models" / loading.DEFAULT_NAME


def test_unknown_model_name_names_the_fix(tmp_path):
    with pytest.raises(loading.ModelNotFoundError, match="model: default.*folder"):
        loading.load_model("no-such-model")
    with pytest.raises(loading.ModelNotFoundError, match="without config.json"):
        loading.load_model(str(tmp_path))


def test_atomic_dir_leaves_nothing_when_the_conversion_fails(tmp_path):
    dest = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError, match="killed"):
        with loading.atomic_dir(dest) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half a file")
            raise RuntimeError("killed half way")
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


def test_atomic_dir_publishes_and_replaces_an_outdated_cache(tmp_path):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "stale.txt").write_text("old format")
    with loading.atomic_dir(dest) as tmp:
        assert tmp.parent == dest.parent and tmp != dest
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in dest.iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_stale_tmp_of_a_killed_conversion_is_removed_and_never_used(tmp_path):
    dest = tmp_path / "m"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".m{loading.TMP_TAG}{dead.stdout.strip()}-abcd1234"
    live = tmp_path / f".m{loading.TMP_TAG}{__import__('os').getpid()}-abcd1234"
    for folder in (stale, live):
        folder.mkdir()
        (folder / loading.MARKER).write_text("{}")
    source = tmp_path / "x.gguf"
    source.write_bytes(b"gguf")
    assert not loading.is_converted(dest, source)
    loading.clean_stale_tmp(dest)
    assert not stale.exists() and live.exists()


def test_is_converted_checks_format_and_source(tmp_path):
    source = tmp_path / "x.gguf"
    source.write_bytes(b"1234")
    dest = tmp_path / "m"
    dest.mkdir()
    assert not loading.is_converted(dest, source)
    (dest / loading.MARKER).write_text(json.dumps({"format": loading.CACHE_FORMAT, "source_size": 4}))
    assert loading.is_converted(dest, source)
    source.write_bytes(b"12345")  # a new version of the package's file
    assert not loading.is_converted(dest, source)


def test_resolve_dtype(monkeypatch):
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: False)
    assert loading.resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: True)
    assert loading.resolve_dtype("auto", "cpu") is torch.bfloat16
    assert loading.resolve_dtype("auto", "cuda") is torch.bfloat16
    assert loading.resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        loading.resolve_dtype("int3", "cpu")


# ---------------------------------------------------------------- metrics and cache handling (no weights)

def _filled_cache(layers: int, tokens: int, dtype=torch.float32) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(layers):
        k = torch.randn(1, 3, tokens, 64, dtype=dtype)
        cache.update(k, k.clone(), layer)
    return cache


def test_kv_bytes_equals_a_plain_cache_for_those_tokens():
    config = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=3, num_attention_heads=9, hidden_size=576,
                             head_dim=64)
    cache = _filled_cache(4, 10, torch.bfloat16)
    assert metrics.kv_bytes(cache) == 4 * 2 * 3 * 10 * 64 * 2
    assert metrics.kv_bytes(cache) == metrics.full_kv_bytes(config, 10, torch.bfloat16)


def test_crop_cache_restores_the_prefix_length():
    cache = _filled_cache(2, 12)
    prefix_keys = cache.layers[0].keys[..., :7, :].clone()
    crop_cache(cache, 7)
    assert cache.get_seq_length() == 7
    assert torch.equal(cache.layers[0].keys, prefix_keys)
    crop_cache(cache, 7)  # nothing to drop
    assert cache.get_seq_length() == 7
    with pytest.raises(ValueError, match="cannot crop"):
        crop_cache(cache, 9)


def test_cache_argument_name_follows_the_models_forward():
    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert cache_kwarg(New()) == "cache" and cache_kwarg(Old()) == "past_key_values"


def test_peak_memory_on_cpu_is_the_process_rss():
    peak = metrics.peak_memory_bytes("cpu")
    assert peak > 10 * 2**20  # torch alone holds more than 10 MiB


# ---------------------------------------------------------------- prompt (pure logic)

def test_document_text_orders_pages_and_skips_empty_ones():
    text = document_text([(2, "third"), (0, "first\n"), (1, "  "), (3, "")])
    assert text == f"{page_marker(0)}\nfirst\n\n{page_marker(2)}\nthird"
    assert page_marker(2) == "--- page 3 ---"
    assert document_text([(0, ""), (1, " \n")]) == ""


def test_truncate_prefix_head_and_head_tail():
    prefix = DocumentPrefix(tuple([1, 2]) + tuple(range(100, 120)), body_start=2)
    assert truncate_prefix(prefix, 50, "head") is prefix  # fits already
    head = truncate_prefix(prefix, 10, "head")
    assert head.ids == (1, 2, *range(100, 108)) and head.truncated and head.body_start == 2
    both = truncate_prefix(prefix, 10, "head_tail", elision=[9])
    assert len(both) == 10
    assert both.ids == (1, 2, 100, 101, 102, 103, 9, 117, 118, 119)
    assert truncate_prefix(prefix, 10, "none") is prefix
    with pytest.raises(ValueError, match="no room"):
        truncate_prefix(prefix, 2, "head")


# ---------------------------------------------------------------- prompt with the real tokenizer

@pytest.fixture(scope="session")
def tokenizer():
    return loading.load_tokenizer("default")


def test_prefix_is_shared_and_split_keeps_the_chat_template_tokens(tokenizer):
    prompt = ChatPrompt(tokenizer)
    doc = document_text([(0, "# Report\n| a | b |\n|---|---|\n| 1 | 2 |"), (1, "Revenue rose 5%.")])
    prefix = prompt.prefix(doc)
    for question in ("What rose?", "How much did revenue rise?"):
        assert prompt.prefix(doc).ids == prefix.ids
        content = "Document:\n" + doc + "\n\nQuestion: " + question
        whole = tokenizer.apply_chat_template(
            [{"role": "system", "content": prompt.system}, {"role": "user", "content": content}],
            tokenize=False, add_generation_prompt=True)
        assert list(prefix.ids) + prompt.suffix(question) == tokenizer(whole, add_special_tokens=False).input_ids
    head = tokenizer.decode(prefix.ids[:prefix.body_start])
    assert "answer" in head.lower() and head.endswith("user\nDocument:\n")
    assert tokenizer.decode(prefix.ids[prefix.body_start:]).startswith("--- page 1 ---\n# Report")
    assert tokenizer.decode(prompt.suffix("Q?")).endswith("<|im_start|>assistant\n")


def test_no_system_message_falls_back_to_the_models_default(tokenizer):
    prefix = ChatPrompt(tokenizer, system=None).prefix("doc")
    assert "SmolLM" in tokenizer.decode(prefix.ids)  # the template's own system line


# ---------------------------------------------------------------- the real model (slow)

@pytest.fixture(scope="session")
def model_and_tokenizer(smollm2):
    return smollm2


@pytest.mark.slow
def test_converted_model_reproduces_the_gguf_logits(model_and_tokenizer):
    model, _ = model_and_tokenizer
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.hidden_size, config.max_position_embeddings) == (576, 8192)
    assert not hasattr(config, "quantization_config")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied survived
    reference = loading.load_reference(loading.default_model_dir())  # computed from the GGUF model
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"][None]).logits[0, -4:]
    assert torch.allclose(logits, reference["logits"], atol=1e-4)


@pytest.mark.slow
def test_a_local_model_folder_loads_by_path():
    model, tokenizer = loading.load_model(str(loading.default_model_dir()), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_session_finds_the_pass_key(model_and_tokenizer):
    session = Session(*model_and_tokenizer)
    assert session._cache_kwarg == "cache"  # transformers 5.2x: past_key_values= would log a deprecation
    prefix = session.fit_document(PASSKEY_DOC, questions=["What is the pass key?"], max_new_tokens=16)
    session.prefill(prefix)
    logged = _TransformersLog()
    with logged:
        answer = session.ask("What is the pass key?", max_new_tokens=16)
    assert not [m for m in logged.messages if "deprecated" in m]
    assert "71432" in answer.text
    assert answer.prompt_tokens == len(prefix) + len(session.prompt.suffix("What is the pass key?"))
    assert answer.ttft_s >= session.document_prefill_s > 0
    assert answer.kv_device_bytes == answer.kv_full_bytes > 0 and answer.kv_host_bytes == 0
    assert answer.peak_memory_bytes > 0 and answer.skipped_fraction == 0.0
    assert session.cache.get_seq_length() == len(prefix)  # cropped back to the document


class _TransformersLog(logging.Handler):
    """Collects what transformers logs (its logger does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "_TransformersLog":
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("transformers").removeHandler(self)


@pytest.mark.slow
def test_two_questions_on_one_prefill_equal_two_fresh_prefills(model_and_tokenizer):
    questions = ["What is the pass key?", "What color is the sky?"]
    shared = Session(*model_and_tokenizer)
    prefix = shared.fit_document(SHORT_DOC, questions=questions, max_new_tokens=12)
    shared.prefill(prefix, chunk_size=64)  # chunked prefill must not change anything
    answers = [shared.ask(q, max_new_tokens=12) for q in questions]
    assert shared.document_prefills == 1
    assert answers[1].ttft_s < shared.document_prefill_s  # the second question paid no document prefill
    for question, answer in zip(questions, answers):
        fresh = Session(*model_and_tokenizer)
        fresh.prefill(prefix)
        assert fresh.ask(question, max_new_tokens=12).text == answer.text


@pytest.mark.slow
def test_context_overflow_raises_with_numbers_and_truncation_fits(model_and_tokenizer):
    session = Session(*model_and_tokenizer, max_context=300)
    with pytest.raises(ContextTooLong, match=r"document is \d+ tokens .* the model holds 300"):
        session.fit_document(PASSKEY_DOC, questions=["Q?"], max_new_tokens=8)
    prefix = session.fit_document(PASSKEY_DOC, questions=["Q?"], max_new_tokens=8, truncate="head_tail")
    assert prefix.truncated and len(prefix) + len(session.prompt.suffix("Q?")) + 8 <= 300
    session.prefill(prefix)
    with pytest.raises(ContextTooLong):
        session.ask("Q?", max_new_tokens=64)
    assert session.ask("Q?", max_new_tokens=8).new_tokens <= 8


@pytest.mark.slow
def test_tiered_session_with_budgets_covering_the_document_answers_like_the_plain_one():
    from docfuse.runtime.loading import load_model
    from docfuse.runtime.session import Session

    model, tokenizer = load_model("default")
    doc = "Notes. " * 40 + "The pass key is 58213. Remember it. " + "More notes. " * 40
    answers = []
    for kv in (None, {"core_tokens": 1.0, "association_tokens": 0},
               {"core_tokens": 1.0, "association_tokens": 0, "prefill": "layers"}):
        session = Session(model, tokenizer, kv=kv)
        session.prefill(session.fit_document(doc, questions=["What is the pass key?"], max_new_tokens=16))
        answers.append(session.ask("What is the pass key?", max_new_tokens=16).text)
    assert answers[0] == answers[1] == answers[2] and "58213" in answers[0]


@pytest.mark.slow
def test_tiered_session_re_tiers_during_decode_from_the_answers_queries(model_and_tokenizer, monkeypatch):
    from docfuse.runtime.kv import TieredCache
    from docfuse.runtime.session import Session

    model, tokenizer = model_and_tokenizer
    ranked_by: list = []
    original = TieredCache.retier_layer
    monkeypatch.setattr(TieredCache, "retier_layer", lambda self, i, q, *rest: (ranked_by.append(q), original(self, i, q, *rest))[1])
    doc = "Notes. " * 300 + "The pass key is 58213. Remember it. " + "More notes. " * 300
    kv = {"core_tokens": 0.1, "association_tokens": 0.25, "retier_every": 4}
    session = Session(model, tokenizer, kv=kv)
    session.prefill(session.fit_document(doc, questions=["What is the pass key?"], max_new_tokens=16))
    first = session.ask("What is the pass key?", max_new_tokens=16)
    retiers = session.cache.retiers
    second = session.ask("What is the pass key?", max_new_tokens=16)
    assert "58213" in first.text and second.text == first.text  # nothing of the first answer leaks
    steps = first.new_tokens - 1  # decode steps after the first token (a stop token also ends one)
    assert retiers == 1 + (steps + (first.finish_reason == "eos")) // 4  # the question's, then one per 4 steps
    assert session.cache.get_seq_length() == session.prefix_length
    assert all(q is not None for q in ranked_by)  # real queries, never the newest keys standing in


@pytest.mark.slow
def test_tiered_session_decodes_from_the_codes_as_it_would_from_dequantised_tiers(model_and_tokenizer, monkeypatch):
    from docfuse.runtime.kv import code_attention
    from docfuse.runtime.session import Session

    model, tokenizer = model_and_tokenizer
    calls = []
    real = code_attention.code_attention
    monkeypatch.setattr(code_attention, "code_attention", lambda *a: calls.append(1) or real(*a))
    doc = "Notes. " * 300 + "The pass key is 58213. Remember it. " + "More notes. " * 300
    answers = {}
    for decode in ("dequantise", "codes"):
        session = Session(model, tokenizer, kv={"core_tokens": 0.1, "association_tokens": 0.25, "decode": decode})
        session.prefill(session.fit_document(doc, questions=["What is the pass key?"], max_new_tokens=16))
        answers[decode] = session.ask("What is the pass key?", max_new_tokens=16)
        assert bool(calls) == (decode == "codes")
    steps = answers["codes"].new_tokens - 1 + (answers["codes"].finish_reason == "eos")
    assert len(calls) == steps * model.config.num_hidden_layers  # every decode step of every layer read the codes
    assert answers["codes"].text == answers["dequantise"].text and "58213" in answers["codes"].text
    assert model.config._attn_implementation == "sdpa"


def test_thread_count_follows_env_and_leaves_busy_cores_alone(monkeypatch):
    import torch

    from docfuse.runtime import loading

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("DOCFUSE_THREADS", "1")
        assert loading.configure_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.delenv("DOCFUSE_THREADS")
        monkeypatch.setattr(loading.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
        monkeypatch.setattr(loading.os, "getloadavg", lambda: (2.2, 0.0, 0.0))
        assert loading.configure_threads() == 2
        monkeypatch.setattr(loading.os, "getloadavg", lambda: (0.1, 0.0, 0.0))
        assert loading.configure_threads() == 4
        monkeypatch.setattr(loading.os, "getloadavg", lambda: (9.0, 0.0, 0.0))
        assert loading.configure_threads() == 1
    finally:
        torch.set_num_threads(before)
