"""decode.generate: parameters, grouping of pages into documents, error rows, answers with the real model."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError

from docfuse.pipelines.registry import find_stage
from docfuse.stages import schemas
from docfuse.stages.decode import DecodeGenerate, group_pages

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def pages_table(rows: list[tuple[str, int, str]], extra: bool = True) -> pa.Table:
    """PAGE_TEXT rows ``(doc_id, page, text)``; ``extra`` adds columns a producer may carry beyond those read."""
    data = {
        "doc_id": [r[0] for r in rows],
        "source": [f"{r[0]}.pdf" for r in rows],
        "page": pa.array([r[1] for r in rows], pa.int32()),
        "text": [r[2] for r in rows],
    }
    if extra:
        data["image_only"] = [not r[2] for r in rows]
        data["n_words"] = pa.array([len(r[2].split()) for r in rows], pa.int32())
        data["page_width"] = pa.array([612.0] * len(rows), pa.float32())
    return pa.table(data)


def stage(question=None, questions=None, **params) -> DecodeGenerate:
    context = {k: v for k, v in {"question": question, "questions": questions}.items() if v is not None}
    return DecodeGenerate(context=context, **params)


# ---------------------------------------------------------------- no model needed

def test_registered_with_its_contract():
    cls = find_stage("decode.generate")
    assert cls is DecodeGenerate
    assert cls.output_schema == schemas.QA
    assert cls.inputs["pages"].names == ["doc_id", "source", "page", "text"]
    assert set(cls.reads_params) == {"question", "questions", "safe_mode"}
    assert cls.resources["num_cpus"] >= 1


@pytest.mark.parametrize("params, message", [
    ({"prompt": "Answer: {q}"}, "only {question}"),
    ({"prompt": "Answer briefly."}, "never uses {question}"),
    ({"max_new_tokens": 0}, "greater than 0"),
    ({"truncate": "middle"}, "none"),
    ({"dtype": "int8"}, "bfloat16"),
    ({"kv_bits": 4}, "Extra inputs"),
    ({"prefill_chunk": 0}, "positive token count, or auto"),
    ({"prefill_chunk": "big"}, "auto"),
])
def test_bad_params_are_refused_with_the_reason(params, message):
    with pytest.raises(ValidationError, match=message):
        stage("q", **params)


def test_prefill_chunk_auto_is_the_devices_default_and_a_number_is_kept():
    from docfuse.runtime.engine import Engine
    from docfuse.runtime.loading import prefill_chunk_for
    from tests.test_decode_step import tiny

    assert stage("q").params.prefill_chunk == "auto"
    assert prefill_chunk_for("auto", "cpu") == 512 and prefill_chunk_for("auto", "cuda:0") == 131072
    assert prefill_chunk_for("auto", torch.device("cuda", 1)) == 131072 and prefill_chunk_for("auto", "mps") == 512
    assert prefill_chunk_for(64, "cuda") == 64 and stage("q", prefill_chunk=64).params.prefill_chunk == 64
    assert Engine(tiny(seed=3), {}, set()).prefill_chunk == 512  # the engine's own default follows the device too
    # auto reaches the engine as auto (it may chunk where one pass would take its streams' memory); a number is kept
    assert Engine(tiny(seed=3), {}, set(), prefill_chunk="auto")._auto_chunk
    assert not Engine(tiny(seed=3), {}, set(), prefill_chunk=64)._auto_chunk


@pytest.mark.slow
def test_the_stage_hands_an_automatic_prefill_chunk_to_the_engine_as_automatic():
    """The engine may chunk an automatic prefill where one pass would take its streams' memory; a number is kept."""
    for chunk, auto in (("auto", True), (64, False)):
        decode = stage("q", engine="on", kv={}, prefill_chunk=chunk)
        decode.setup()
        assert decode.engine is not None and decode.engine._auto_chunk is auto


def test_the_kv_store_is_off_on_a_gpu_unless_asked_for(tmp_path):
    """On a GPU a fresh prefill beats loading an entry (issue 24's H100 figures): the store is used there only with
    kv_store_gpu; on the CPU whenever kv_store names a folder."""
    from docfuse.runtime.kv_store import KVStore
    from docfuse.stages.decode import DecodeParams, kv_store_for

    folder = str(tmp_path / "kv")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(kv_store_for(DecodeParams(kv_store=folder), cpu), KVStore)
    assert kv_store_for(DecodeParams(kv_store=folder), cuda) is None
    assert isinstance(kv_store_for(DecodeParams(kv_store=folder, kv_store_gpu=True), cuda), KVStore)
    assert kv_store_for(DecodeParams(kv_store=False), cpu) is None


def test_questions_list_wins_over_question():
    assert stage("one", ["a", "b"]).questions() == ["a", "b"]
    assert stage("one").questions() == ["one"]
    assert stage(questions="solo").questions() == ["solo"]
    with pytest.raises(ValueError, match=r"--set params.question="):
        stage().questions()


def test_missing_question_gives_one_error_row_per_document_without_loading_a_model():
    out = stage().run(pages_table([("a", 0, "x"), ("b", 0, "y"), ("a", 1, "z")]))
    assert out.schema == schemas.QA
    assert out.column("doc_id").to_pylist() == ["a", "b"]
    assert all(e.startswith("no_question: ") and "--set params.question=" in e for e in out.column("error").to_pylist())
    assert out.column("answer").null_count == 2


def test_empty_batch_gives_an_empty_table():
    out = stage("q").run(pages_table([]))
    assert out.num_rows == 0 and out.schema == schemas.QA


def test_unknown_model_fails_setup_with_the_fix():
    from docfuse.runtime.loading import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="model: default"):
        stage("q", model="./no/such/model").setup()


def test_group_pages_keeps_document_order_and_sorts_pages():
    table = pages_table([("b", 2, "b3"), ("a", 1, "a2"), ("b", 0, "b1"), ("a", 0, "a1"), ("b", 1, "b2")])
    docs = group_pages(table)
    assert list(docs) == ["b", "a"]
    assert docs["b"]["pages"] == [(0, "b1"), (1, "b2"), (2, "b3")]
    assert docs["a"] == {"source": "a.pdf", "pages": [(0, "a1"), (1, "a2")]}


def test_document_without_text_is_an_error_row_per_question_without_loading_a_model():
    out = stage(questions=["q1", "q2"]).run(pages_table([("scan", 0, ""), ("scan", 1, "   ")]))
    assert out.column("question").to_pylist() == ["q1", "q2"]
    for error in out.column("error").to_pylist():
        assert error.startswith("no_text: ") and "OCR or the fusion stage" in error


# ---------------------------------------------------------------- the real model (slow)

@pytest.fixture(scope="module")
def passkey_pages() -> list[tuple[str, int, str]]:
    return [
        ("key", 1, FILLER * 4 + "The pass key is 71432. Remember it. 71432 is the pass key. " + FILLER * 4),
        ("key", 0, "# Security note\n\n" + FILLER * 2),
        ("key", 2, ""),  # an image-only page contributes nothing
    ]


@pytest.mark.slow
def test_answers_one_row_per_document_and_question(passkey_pages):
    decode = stage(questions=["What is the pass key?", "What color is the sky?"], max_new_tokens=16)
    decode.setup()
    table = pages_table([("sky", 0, "# Weather\n\nThe sky is blue today. It rained yesterday.")] + passkey_pages)
    out = decode.run(table)
    assert out.schema == schemas.QA
    rows = out.to_pylist()
    assert [(r["doc_id"], r["question"]) for r in rows] == [
        ("sky", "What is the pass key?"), ("sky", "What color is the sky?"),
        ("key", "What is the pass key?"), ("key", "What color is the sky?")]
    assert all(r["error"] is None for r in rows)
    assert "blue" in rows[1]["answer"].lower()
    assert "71432" in rows[2]["answer"]
    assert rows[2]["ttft_s"] > rows[3]["ttft_s"]  # the first question carries the document prefill
    assert decode.session.document_prefills == 2  # once per document, not per question
    for r in rows:
        assert r["source"] == f"{r['doc_id']}.pdf"
        assert r["prompt_tokens"] > 0 and r["ttft_s"] > 0 and r["decode_tokens_per_s"] >= 0
        assert r["kv_device_bytes"] == r["kv_full_bytes"] > 0 and r["kv_host_bytes"] == 0
        assert r["peak_memory_bytes"] > 0 and r["skipped_fraction"] == 0.0


@pytest.mark.slow
def test_too_long_document_is_an_error_row_and_other_documents_still_answer():
    decode = stage("What color is the sky?", max_new_tokens=8)
    decode.setup()
    huge = FILLER * 420  # about 9,700 tokens: more than the 8,192 the model holds (only tokenised, never run)
    out = decode.run(pages_table([("huge", 0, huge), ("sky", 0, "The sky is blue.")])).to_pylist()
    assert out[0]["doc_id"] == "huge" and out[0]["answer"] is None
    assert out[0]["error"].startswith("context_too_long: document is ")
    assert "the model holds 8192" in out[0]["error"] and "truncate" in out[0]["error"]
    assert out[1]["error"] is None and out[1]["answer"]


@pytest.mark.slow
def test_truncate_head_fits_the_document_into_the_context():
    decode = stage("What color is the sky?", max_new_tokens=8, truncate="head", prompt="Briefly: {question}")
    decode.setup()
    decode.session.limit = 256  # a small context keeps the prefill short; the model's own is 8192
    out = decode.run(pages_table([("long", 0, "The sky is blue. " + FILLER * 40)])).to_pylist()
    assert out[0]["error"] is None and out[0]["answer"]
    assert out[0]["question"] == "What color is the sky?"  # the question, not the formatted prompt
    assert out[0]["prompt_tokens"] + 8 <= 256


@pytest.mark.slow
@pytest.mark.parametrize("questions_mode", ["each", "together"])
def test_the_engine_answers_every_document_and_question_as_the_session_does(passkey_pages, questions_mode):
    """engine: on (the batched engine, which a GPU uses by default with kv:) gives the rows engine: off gives, with
    a re-tier per question or one shared by a document's questions (kv.questions: together)."""
    kv = {"core_tokens": 0.1, "association_tokens": 0.5, "questions": questions_mode}
    questions = ["What is the pass key?", "What color is the sky?"]
    table = pages_table([("sky", 0, "# Weather\n\nThe sky is blue today. It rained yesterday."),
                         ("huge", 0, FILLER * 420)] + passkey_pages)
    rows = {}
    for mode in ("off", "on"):
        decode = stage(questions=questions, max_new_tokens=16, kv=kv, engine=mode, dtype="float32")
        decode.setup()
        assert (decode.engine is not None) == (mode == "on")
        rows[mode] = decode.run(table).to_pylist()
        if mode == "off":  # the last document's cache: one re-tier for its two questions, or one each
            assert decode.session.cache.retiers == (1 if questions_mode == "together" else 2)
    assert [(r["doc_id"], r["question"]) for r in rows["on"]] == [(r["doc_id"], r["question"]) for r in rows["off"]]
    assert [r["answer"] for r in rows["on"]] == [r["answer"] for r in rows["off"]]
    assert "71432" in rows["on"][4]["answer"]
    huge = [r for r in rows["on"] if r["doc_id"] == "huge"]
    assert len(huge) == 2 and all(r["error"].startswith("context_too_long:") for r in huge)
    for r in rows["on"]:
        if r["error"] is None:
            assert 0 < r["kv_device_bytes"] and r["ttft_s"] > 0 and r["peak_memory_bytes"] > 0
            # a few dozen tokens fit in the forced core (sinks, recent tokens) whole; from a page on, tiers are smaller
            assert r["kv_device_bytes"] < r["kv_full_bytes"] or r["prompt_tokens"] < 200


@pytest.mark.slow
def test_the_engine_loads_a_document_its_kv_store_holds_and_answers_the_same(passkey_pages, tmp_path):
    """decode.generate's kv_store reaches the engine: the first run stores each document's prefill, a new stage
    (a new run) loads it instead of prefilling, and every answer is the same."""
    kv = {"core_tokens": 0.1, "association_tokens": 0.5}
    table = pages_table([("sky", 0, "# Weather\n\nThe sky is blue today. It rained yesterday.")] + passkey_pages)
    rows, stats = [], []
    for _ in range(2):
        decode = stage(questions=["What is the pass key?"], max_new_tokens=12, kv=kv, engine="on", dtype="float32",
                       kv_store=str(tmp_path / "kv"))
        decode.setup()
        rows.append(decode.run(table).to_pylist())
        stats.append(dict(decode.engine.stats))
    assert stats[0].get("kv_store_saves") == 2 and "kv_store_hits" not in stats[0]
    assert stats[1].get("kv_store_hits") == 2 and "kv_store_saves" not in stats[1]
    assert [r["answer"] for r in rows[1]] == [r["answer"] for r in rows[0]] and "71432" in rows[1][1]["answer"]


def test_the_engine_is_named_when_it_cannot_serve_the_settings():
    from transformers import LlamaConfig, LlamaForCausalLM

    from docfuse.runtime.engine import engine_unsupported

    decode = stage("q?", engine="on", kv={"retier_every": 8})
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=64))
    assert "retier_every" in engine_unsupported(model, decode.params.kv)
    assert "pruning" in engine_unsupported(model, {}, {"threshold": 0.1})
    assert decode.params.engine == "on" and decode.params.max_streams == 64


@pytest.mark.slow
def test_retrieve_reads_each_questions_best_pages_of_a_document_past_the_context():
    filler = "The committee reviewed the general budget and the usual items of business. " * 6
    rows_in = [("long", i, filler) for i in range(12)]
    rows_in[8] = ("long", 8, filler[:200] + " The pass key is 71432. Remember it. " + filler[:200])
    rows_in[2] = ("long", 2, filler[:200] + " The sky looked green today. " + filler[:200])
    table = pages_table(rows_in)
    got = {}
    for mode in ("off", "on"):
        decode = stage(questions=["What is the pass key?", "What color was the sky today?"], max_new_tokens=12,
                       truncate="retrieve", engine=mode, dtype="float32")
        decode.setup()
        decode.session.limit = 700  # the 12 pages need about 1,100 tokens: the document does not fit
        got[mode] = decode.run(table).to_pylist()
        if mode == "off":
            assert decode.session.document_prefills == 2  # the two questions chose different pages
    key, sky = got["off"]
    assert key["error"] is None and "71432" in key["answer"] and 8 in key["pages_used"] and key["truncated"]
    assert sky["error"] is None and 2 in sky["pages_used"] and 8 not in sky["pages_used"] and sky["truncated"]
    assert key["pages_used"] != sky["pages_used"] and key["pages_used"] == sorted(key["pages_used"])
    assert [r["answer"] for r in got["on"]] == [key["answer"], sky["answer"]]
    assert [r["pages_used"] for r in got["on"]] == [key["pages_used"], sky["pages_used"]]


@pytest.mark.slow
def test_a_document_that_fits_reports_every_page_read_and_nothing_truncated(passkey_pages):
    decode = stage("What is the pass key?", max_new_tokens=8, truncate="retrieve")
    decode.setup()
    row = decode.run(pages_table(passkey_pages)).to_pylist()[0]
    assert row["pages_used"] == [0, 1] and row["truncated"] is False  # page 2 has no text


@pytest.mark.slow
def test_progress_reports_the_prefill_in_tokens_and_the_answer_as_it_comes(passkey_pages):
    """What docfuse ask shows on a terminal: pipelines.progress.LIVE sees every prefill chunk and every new piece of
    the answer, through the pipeline's decode stage (which hands it to runtime.session.PROGRESS)."""
    from docfuse.pipelines.progress import LIVE as PROGRESS, Live as Progress

    seen: list[tuple[int, int]] = []
    pieces: list[str] = []
    decode = stage("What is the pass key?", max_new_tokens=16, prefill_chunk=64)
    decode.setup()
    token = PROGRESS.set(Progress(on_prefill=lambda done, total: seen.append((done, total)), on_text=pieces.append))
    try:
        row = decode.run(pages_table(passkey_pages)).to_pylist()[0]
    finally:
        PROGRESS.reset(token)
    assert len(seen) > 2 and seen[-1][0] == seen[-1][1] == row["prompt_tokens"] - len(
        decode.session.prompt.suffix("What is the pass key?"))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert "".join(pieces).strip().startswith(row["answer"][:10]) and "71432" in "".join(pieces)
