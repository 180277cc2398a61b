"""End to end through the installed `docfuse` command: real PDFs, the real embedded model, real Parquet."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from docfuse.stages import pdf_ocr

from tests import pdf_fixtures as fx

ROOT = Path(__file__).resolve().parents[1]
DOCFUSE = str(Path(sys.executable).parent / "docfuse")
EXTRACT_COLUMNS = ["doc_id", "source", "page", "text", "image_only", "n_words", "text_source", "ocr_confidence",
                   "warning", "error"]
QA_COLUMNS = ["doc_id", "source", "question", "answer", "prompt_tokens", "ttft_s", "decode_tokens_per_s",
              "kv_device_bytes", "kv_host_bytes", "kv_full_bytes", "skipped_fraction", "peak_memory_bytes", "pages_used",
              "truncated", "cited_pages", "error"]


def docfuse(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # Greedy answers of a bf16 model depend on torch's thread count (it splits the reductions); docfuse picks the
    # count from the load average, so pin it: the answers checked below must not change with what else runs.
    env = {**os.environ, "DOCFUSE_THREADS": os.environ.get("DOCFUSE_THREADS", "2")}
    return subprocess.run([DOCFUSE, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pdfs")
    files = fx.write_all(folder)
    unreadable = folder / "unreadable.pdf"
    unreadable.write_bytes(files["born_digital"].read_bytes())
    unreadable.chmod(0)
    files["unreadable"] = unreadable
    return files


def by_source(table) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in table.to_pylist():
        out.setdefault(Path(row["source"]).stem, []).append(row)
    return out


@pytest.mark.slow
def test_pdf_extract_keeps_every_good_page_and_gives_each_bad_file_an_error_row(fixtures, tmp_path):
    out = tmp_path / "pages.parquet"
    res = docfuse("run", "pdf_extract", "-i", str(fixtures["born_digital"].parent), "-o", str(out),
                  "--batch-docs", "3", "--no-cache")
    assert res.returncode == 3, res.stderr  # some rows failed, the rest finished
    table = pq.read_table(out)
    assert table.schema.names == EXTRACT_COLUMNS
    rows = by_source(table)
    expected = {"empty": "empty_file", "header_only": "no_pages", "encrypted": "encrypted",
                "text_named_pdf": "not_pdf", "corrupt": "corrupt"}
    rows = {name: rows[path.stem] for name, path in fixtures.items()}
    for name, kind in expected.items():
        assert [r["error"].split(":")[0] for r in rows[name]] == [kind], (name, rows[name])
    if os.geteuid() != 0:  # root reads files whatever their mode
        assert rows["unreadable"][0]["error"].startswith("unreadable:")
    assert len(rows["born_digital"]) == 3 and all(r["error"] is None for r in rows["born_digital"])
    assert len(rows["broken_xref"]) == 3 and all(r["error"] is None and r["n_words"] > 0 for r in rows["broken_xref"])
    scan = rows["image_only"]
    assert [r["image_only"] for r in scan] == [True]
    if pdf_ocr.available():  # the scan is read by OCR (ocr: auto), else it says what to install
        assert scan[0]["text_source"] == "ocr" and "quick brown fox" in scan[0]["text"]
    else:
        assert scan[0]["error"].startswith("ocr_unavailable:") and "apt-get install" in scan[0]["error"]
    assert rows["type3_no_tounicode"][0]["error"] is None and rows["type3_no_tounicode"][0]["image_only"]
    # huge page: extraction is fine (rendering is what fails on it, tested with pdf.render)
    assert all(r["error"] is None for r in rows["huge_page"])
    assert "| " in rows["ruled_table"][0]["text"]


@pytest.mark.slow
def test_encrypted_pdf_opens_with_password_from_set(fixtures, tmp_path):
    out = tmp_path / "enc.parquet"
    res = docfuse("run", "pdf_extract", "-i", str(fixtures["encrypted"]), "-o", str(out), "--no-cache",
                  "--set", f"pages.password={fx.USER_PASSWORD}")
    assert res.returncode == 0, res.stderr
    assert pq.read_table(out).num_rows == 2
    wrong = docfuse("run", "pdf_extract", "-i", str(fixtures["encrypted"]), "-o", str(out), "--no-cache",
                    "--set", "pages.password=nope")
    assert wrong.returncode == 3
    assert pq.read_table(out).column("error")[0].as_py().startswith("wrong_password:")


@pytest.mark.slow
def test_unreadable_path_is_an_error_row_through_the_cli(fixtures, tmp_path):
    out = tmp_path / "u.parquet"
    res = docfuse("run", "pdf_extract", "-i", str(fixtures["born_digital"]), "-i", str(tmp_path / "missing.pdf"),
                  "-o", str(out), "--no-cache")
    assert res.returncode == 3
    errors = [e for e in pq.read_table(out).column("error").to_pylist() if e]
    assert len(errors) == 1 and errors[0].startswith("unreadable:")


@pytest.mark.slow
def test_validate_and_stages_commands(tmp_path):
    assert docfuse("validate", "pdf_qa").returncode == 0
    bad = docfuse("validate", "pdf_qa", "--set", "answer.colour=red", "--set", "text.tables=sometimes")
    assert bad.returncode == 2
    assert "unknown parameter 'colour'" in bad.stderr and "tables" in bad.stderr
    listing = docfuse("stages", "--json")
    kinds = {d["kind"] for d in json.loads(listing.stdout)}
    assert {"pdf.open", "pdf.text", "pdf.render", "vision.patches", "text.pages", "decode.generate"} <= kinds


@pytest.mark.slow
def test_ask_answers_from_the_sample_pdf():
    res = docfuse("ask", "data/sample.pdf", "What is the monthly fee?", "--no-cache")
    assert res.returncode == 0, res.stderr
    # the fee is on the first page, counted from 1; which cited page comes first depends on the CPU's bf16 kernels
    # (an AMD EPYC put page 2 first, an Intel Xeon page 1), so the test asks that page 1 is cited at all
    cited = re.search(r"\(pages? ([\d, ]+)\)", res.stdout)
    assert "4,250" in res.stdout and cited and "1" in cited.group(1).split(", "), res.stdout
    res = docfuse("ask", "data/sample.pdf", "What is the monthly fee?", "--no-cache", "--json", "--max-new-tokens", "12")
    row = json.loads(res.stdout)
    assert res.returncode == 0 and "4,250" in row["answer"] and row["pages_used"] and row["truncated"] is False
    assert row["cited_pages"] and 0 in row["cited_pages"]
    assert len(row["answer"].split()) <= 12


@pytest.mark.slow
def test_pdf_qa_two_questions_one_prefill_and_error_rows_per_question(fixtures, tmp_path):
    out = tmp_path / "qa.parquet"
    res = docfuse("run", "pdf_qa", "-i", "data/sample.pdf", "-i", str(fixtures["encrypted"]), "-o", str(out),
                  "--no-cache", "--set", 'params.questions=["What is the monthly fee?", "Which law governs the agreement?"]',
                  "--set", "answer.max_new_tokens=24")
    assert res.returncode == 3, res.stderr
    table = pq.read_table(out)
    assert table.schema.names == QA_COLUMNS
    rows = by_source(table)
    sample, enc = rows["sample"], rows["encrypted"]
    assert [r["question"] for r in sample] == ["What is the monthly fee?", "Which law governs the agreement?"]
    # the second question, asked after the first over the same prefill, answers as it does asked alone. (What it
    # answers is the dtype's: bf16 on an AVX512-BF16 CPU said "Ireland", float32 on an AVX2 CPU, where dtype auto
    # is float32, "the Civil Law (Celtic Law)"; the 135M model's own error, not the pipeline's.)
    alone = tmp_path / "alone.parquet"
    res = docfuse("run", "pdf_qa", "-i", "data/sample.pdf", "-o", str(alone), "--no-cache",
                  "--set", "params.question=Which law governs the agreement?", "--set", "answer.max_new_tokens=24")
    assert res.returncode == 0, res.stderr
    assert "4,250" in sample[0]["answer"] and "law" in sample[1]["answer"].lower()
    assert sample[1]["answer"] == pq.read_table(alone).column("answer")[0].as_py()
    assert all(r["error"] is None and r["prompt_tokens"] > 500 for r in sample)
    # the document is prefilled once: the second question's time to first token excludes it
    assert sample[1]["ttft_s"] < sample[0]["ttft_s"]
    assert sample[0]["kv_device_bytes"] > 0 and sample[0]["kv_full_bytes"] >= sample[0]["kv_device_bytes"]
    assert [r["error"].split(":")[0] for r in enc] == ["encrypted", "encrypted"]
    assert [r["question"] for r in enc] == [r["question"] for r in sample]


@pytest.mark.slow
def test_document_longer_than_the_context_reads_its_best_pages_or_is_an_error_row_when_asked(tmp_path):
    long_doc = tmp_path / "long.txt"
    long_doc.write_text(" ".join(f"Sentence {i} talks about nothing in particular." for i in range(4000)))
    out = tmp_path / "long.parquet"
    res = docfuse("run", "text_qa", "-i", str(long_doc), "-o", str(out), "--no-cache",
                  "--set", "answer.max_new_tokens=8", "--set", "answer.truncate=none")
    assert res.returncode == 3
    error = pq.read_table(out).column("error")[0].as_py()
    assert error.startswith("context_too_long:") and "truncate: retrieve" in error
    res = docfuse("run", "text_qa", "-i", str(long_doc), "-o", str(out), "--no-cache",
                  "--set", "answer.max_new_tokens=8", "--set", "params.question=What does sentence 3999 talk about?")
    assert res.returncode == 0, res.stderr
    row = pq.read_table(out).to_pylist()[0]
    assert row["error"] is None and row["truncated"] and row["pages_used"] and row["prompt_tokens"] <= 8192


@pytest.mark.slow
def test_pdf_qa_with_tiered_kv_cache_answers_and_reports_tier_bytes(tmp_path):
    out, full_out = tmp_path / "kv.parquet", tmp_path / "full.parquet"
    ask = ["--no-cache", "--set", 'params.questions=["What is the monthly fee?", "Which law governs the agreement?"]',
           "--set", "answer.max_new_tokens=24", "--set", "answer.dtype=float32"]
    # the defaults (issue 29): every non-core token stays on the device as 8-bit codes; with a quarter of them
    # (association_tokens: 0.25) the law answer lost "Ireland", and with 4-bit values (8-bit keys) the fee read
    # "42,500". In float32 the defaults answer as the full cache does (issue 29's check half); in bf16 the dtype's
    # own noise moves answers between CPUs (an AMD EPYC's full and tiered bf16 answers parted after 15 tokens), so
    # the comparison is made in float32, against the full cache on the same machine.
    res = docfuse("run", "pdf_qa", "-i", "data/sample.pdf", "-o", str(out), *ask, "--set", "answer.kv={}")
    assert res.returncode == 0, res.stderr
    full = docfuse("run", "pdf_qa", "-i", "data/sample.pdf", "-o", str(full_out), *ask)
    assert full.returncode == 0, full.stderr
    fee, law = pq.read_table(out).to_pylist()
    assert "4,250" in fee["answer"] and "Law" in law["answer"]
    assert [r["answer"] for r in (fee, law)] == [r["answer"] for r in pq.read_table(full_out).to_pylist()]
    for row in (fee, law):
        assert row["kv_host_bytes"] > 0, "the background tier holds the exact copy in host memory"
        assert row["kv_device_bytes"] < 0.7 * row["kv_full_bytes"]  # ~0.63 at 8-bit codes
    bad = docfuse("validate", "pdf_qa", "--set", "answer.kv.association_bits=3")
    assert bad.returncode == 2 and "association_bits" in bad.stderr
