"""The engine: spec round trip, validation, streaming execution, error rows, cache and resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tests.engine_stages as toy
from docfuse.pipelines import Pipeline
from docfuse.pipelines.executor import LocalExecutor
from docfuse.pipelines.sources import SOURCE_SCHEMA, doc_id_for, read_batches
from docfuse.pipelines.validate import PipelineInvalid, validate

ROOT = Path(__file__).resolve().parents[1]

TOY_YAML = """
name: toy
params: {question: hi}
stages:
  lines: {stage: test.lines, with: {delay_s: 0}}
  counts: {stage: test.count, from: lines, with: {upper: false}}
outputs: [counts]
"""


def write_docs(folder: Path, n: int, bad: tuple[int, ...] = ()) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"doc{i:03d}.txt"
        p.write_text(("BAD\n" if i in bad else "") + f"first line of {i}\nsecond line {'x' * i}\n")
        paths.append(p)
    return paths


# ---- spec -----------------------------------------------------------------------------------------------------
def test_yaml_and_python_build_the_same_pipeline_and_round_trip():
    from_yaml = Pipeline.from_yaml(TOY_YAML)
    built = Pipeline("toy", params={"question": "hi"})
    built.add("lines", "test.lines", delay_s=0)
    built.add("counts", "test.count", from_="lines", upper=False)
    built.outputs = ["counts"]
    assert from_yaml == built
    assert Pipeline.from_yaml(built.to_yaml()) == built


def test_set_reaches_nested_keys_and_null_removes_a_block():
    p = Pipeline.from_yaml(TOY_YAML)
    p.set("counts.kv.core_tokens", 256)
    p.set("params.questions", ["a", "b"])
    p.set("lines.delay_s", 0.5)
    assert p.stages["counts"].params["kv"] == {"core_tokens": 256}
    assert p.params["questions"] == ["a", "b"] and p.stages["lines"].params["delay_s"] == 0.5
    p.set("counts.kv", None)
    assert "kv" not in p.stages["counts"].params
    with pytest.raises(KeyError, match="no stage named 'nope'"):
        p.set("nope.x", 1)


def test_builtin_pipelines_load_by_name_and_validate():
    for name in ("pdf_extract", "pdf_qa", "text_qa"):
        p = Pipeline.from_yaml(name)
        assert validate(p) == [], name


# ---- validation -----------------------------------------------------------------------------------------------
def test_validation_reports_every_problem_at_once_with_fixes():
    yaml_text = """
name: broken
stages:
  lines: {stage: test.lines, with: {delay_s: "slow", colour: red}}
  lines: {stage: test.lines}
  counts: {stage: test.cuont, from: lines}
  orphan: {stage: test.count, from: missing}
  a: {stage: test.count, from: b}
  b: {stage: test.count, from: a}
  ints: {stage: test.needs_ints, from: lines}
outputs: [counts, nowhere]
"""
    problems = validate(Pipeline.from_yaml(yaml_text))
    text = "\n".join(problems)
    assert "duplicate name 'lines'" in text
    assert "unknown stage kind 'test.cuont'; did you mean 'test.count'?" in text
    assert "input 'missing' names no stage" in text
    assert "cycle between stages" in text and "a" in text and "b" in text
    assert "column 'text' is string but int64 is needed" in text
    assert "output 'nowhere' names no stage" in text
    # the duplicate 'lines' was overwritten by the second definition, so check parameters on a fresh one
    params = validate(Pipeline.from_yaml(
        "name: p\nstages:\n  l: {stage: test.lines, with: {delay_s: slow, colour: red}}\noutputs: [l]\n"))
    joined = "\n".join(params)
    assert "unknown parameter 'colour'; accepted: delay_s, fail_on" in joined
    assert "parameter 'delay_s'" in joined and "'slow'" in joined


def test_executor_refuses_an_invalid_pipeline_before_running():
    with pytest.raises(PipelineInvalid) as info:
        LocalExecutor(Pipeline.from_yaml("name: p\nstages:\n  x: {stage: test.lines, from: y}\noutputs: [x]\n"))
    assert any("'y' names no stage" in p for p in info.value.problems)


# ---- sources --------------------------------------------------------------------------------------------------
def test_sources_read_files_folders_globs_and_datasets_in_bounded_batches(tmp_path):
    docs = write_docs(tmp_path / "docs", 5)
    batches = list(read_batches([tmp_path / "docs"], batch_docs=2))
    assert [b.num_rows for b in batches] == [2, 2, 1]
    assert batches[0].schema == SOURCE_SCHEMA
    globbed = pa.concat_tables(read_batches([str(tmp_path / "docs" / "doc00[12].txt")]))
    assert globbed.column("source").to_pylist() == [str(docs[1]), str(docs[2])]
    # a dataset of bytes and a dataset of paths name the same documents
    pq.write_table(pa.table({"path": [str(p) for p in docs]}), tmp_path / "paths.parquet")
    pq.write_table(pa.table({"data": [p.read_bytes() for p in docs], "source": [str(p) for p in docs]}),
                   tmp_path / "bytes.parquet")
    by_path = pa.concat_tables(read_batches([tmp_path / "paths.parquet"]))
    by_bytes = pa.concat_tables(read_batches([tmp_path / "bytes.parquet"]))
    assert by_path.column("doc_id").to_pylist() == by_bytes.column("doc_id").to_pylist()
    assert by_path.column("doc_id")[0].as_py() == doc_id_for(docs[0].read_bytes(), str(docs[0]))


def test_unreadable_path_is_an_error_row(tmp_path):
    write_docs(tmp_path, 1)
    table = pa.concat_tables(read_batches([tmp_path / "doc000.txt", tmp_path / "missing.pdf"]))
    assert table.column("error").to_pylist()[0] is None
    assert table.column("error").to_pylist()[1].startswith("unreadable: ")


# ---- execution ------------------------------------------------------------------------------------------------
def test_run_streams_batches_and_keeps_error_rows(tmp_path):
    write_docs(tmp_path / "docs", 6, bad=(2,))
    out = tmp_path / "out.parquet"
    report = Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs", tmp_path / "gone.txt"], out, batch_docs=2)
    table = pq.read_table(out)
    assert report.batches == 4 and report.documents == 7
    errors = [e for e in table.column("error").to_pylist() if e]
    assert len(errors) == 2 and any(e.startswith("bad_doc:") for e in errors)
    assert any(e.startswith("unreadable:") for e in errors)
    assert table.num_rows == 5 * 2 + 2 and report.exit_code == 3
    assert table.schema.names == toy.COUNTS.names


def test_a_stage_that_raises_fails_only_its_document(tmp_path):
    write_docs(tmp_path / "docs", 4)
    (tmp_path / "docs" / "doc001.txt").write_text("boom\n")
    pipe = Pipeline.from_yaml(TOY_YAML)
    pipe.set("lines.fail_on", "boom")
    report = pipe.run([tmp_path / "docs"], batch_docs=4)
    table = report.tables["counts"]
    failed = [r for r in table.to_pylist() if r["error"]]
    assert len(failed) == 1 and failed[0]["error"].startswith("stage_failed: stage 'lines'")
    assert failed[0]["source"].endswith("doc001.txt")
    assert table.num_rows == 3 * 2 + 1


def test_cache_is_keyed_by_params_and_input(tmp_path):
    write_docs(tmp_path / "docs", 3)
    cache = tmp_path / "cache"
    first = Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], cache_dir=cache)
    again = Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], cache_dir=cache)
    assert first.batches_from_cache == 0 and again.batches_from_cache == 1
    assert again.tables["counts"].equals(first.tables["counts"])
    changed = Pipeline.from_yaml(TOY_YAML)
    changed.set("counts.upper", True)
    assert changed.run([tmp_path / "docs"], cache_dir=cache).batches_from_cache == 0
    (tmp_path / "docs" / "doc000.txt").write_text("new content\n")
    assert Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], cache_dir=cache).batches_from_cache == 0


def test_setup_runs_once_per_stage_instance(tmp_path):
    write_docs(tmp_path / "docs", 5)
    before = toy.SplitLines.setups
    Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], batch_docs=1)
    assert toy.SplitLines.setups == before + 1


def test_two_input_stage_receives_both_tables(tmp_path):
    write_docs(tmp_path / "docs", 2)
    pipe = Pipeline.from_yaml(TOY_YAML)
    pipe.add("joined", "test.join", from_=["lines", "counts"])
    pipe.outputs = ["joined"]
    assert pipe.run([tmp_path / "docs"]).tables["joined"].num_rows == 4


PICK_YAML = TOY_YAML.replace("outputs: [counts]", "  pick: {stage: test.pick, from: [lines, counts]}\n"
                                                "outputs: [pick]")


def test_a_stage_feeding_only_an_unread_input_never_runs(tmp_path, caplog):
    """Planned before the first batch: the consumer gets an empty table there, the report says what was skipped,
    and the warning says what to set and what it costs."""
    write_docs(tmp_path / "docs", 2)
    pipe = Pipeline.from_yaml(PICK_YAML)
    pipe.set("pick.use", "lines")
    runs, toy.PickCounts.seen_counts = toy.CountChars.runs, []
    report = pipe.run([tmp_path / "docs"], cache_dir=tmp_path / "cache")
    assert toy.CountChars.runs == runs and toy.PickCounts.seen_counts == [0]
    assert report.tables["pick"].column("n_chars").to_pylist() == [-1] * 4
    assert list(report.skipped) == ["counts"] and "told to use lines only" in report.skipped["counts"]
    assert ("stage 'pick' (test.pick) will not read its input 'counts': told to use lines only. Stage(s) counts do "
            "not run. To read it anyway, --set pick.use=both: counting every line.") in caplog.text
    pipe.set("pick.use", "both")  # read again: the counts run
    report = pipe.run([tmp_path / "docs"], cache_dir=tmp_path / "cache")
    assert toy.CountChars.runs == runs + 1 and report.skipped == {}
    assert report.tables["pick"].column("n_chars").to_pylist() == [15, 12, 15, 13]  # "first line of 0", "second line "


def test_an_unread_input_still_runs_for_another_reader_and_a_plain_choice_is_not_warned(tmp_path, caplog):
    write_docs(tmp_path / "docs", 1)
    pipe = Pipeline.from_yaml(PICK_YAML)
    pipe.set("pick.use", "lines quietly")
    assert LocalExecutor(pipe).order == ["lines", "pick"] and caplog.text == ""
    pipe.outputs = ["pick", "counts"]
    executor = LocalExecutor(pipe)
    assert executor.order == ["lines", "counts", "pick"] and executor.plan.skipped == {}
    assert [s.unread for s in executor.steps][-1].keys() == {1}  # pick still ignores them


def _cli(*args: str) -> list[str]:
    code = "import sys, tests.engine_stages; from pipelines.cli import app; sys.argv=['docfuse', *sys.argv[1:]]; app()"
    return [sys.executable, "-c", code, *args]


@pytest.mark.slow  # the CLI end to end, in a subprocess
def test_killed_run_resumes_from_cache_with_every_row_exactly_once(tmp_path):
    n_docs = 16
    write_docs(tmp_path / "docs", n_docs)
    (tmp_path / "toy.yaml").write_text(TOY_YAML)
    cache, out = tmp_path / "cache", tmp_path / "out.parquet"
    args = _cli("run", str(tmp_path / "toy.yaml"), "-i", str(tmp_path / "docs"), "-o", str(out),
                "--batch-docs", "2", "--cache-dir", str(cache), "--set", "lines.delay_s=0.25")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        done = list((cache / "counts").glob("*.arrow")) if (cache / "counts").exists() else []
        if len(done) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {proc.stderr.read()}"
    assert not out.exists(), "a killed run must not leave a final output"
    finished_before_kill = len(list((cache / "counts").glob("*.arrow")))
    assert 2 <= finished_before_kill < n_docs // 2

    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "from cache" in result.stderr
    table = pq.read_table(out)
    keys = list(zip(table.column("doc_id").to_pylist(), table.column("page").to_pylist()))
    assert len(keys) == len(set(keys)) == n_docs * 2
    assert not list(cache.rglob("*.tmp")) and not Path(str(out) + ".partial").exists()


@pytest.mark.slow  # the CLI end to end, in a subprocess
def test_cli_exit_codes_and_validate(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: b\nstages:\n  x: {stage: test.linse}\noutputs: [x]\n")
    res = subprocess.run(_cli("validate", str(tmp_path / "bad.yaml")), cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "did you mean 'test.lines'" in res.stderr
    (tmp_path / "toy.yaml").write_text(TOY_YAML)
    res = subprocess.run(_cli("validate", str(tmp_path / "toy.yaml")), cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0
    write_docs(tmp_path / "docs", 2)
    ok = subprocess.run(_cli("run", str(tmp_path / "toy.yaml"), "-i", str(tmp_path / "docs"), "-o",
                             str(tmp_path / "o.parquet"), "--no-cache"), cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    partial = subprocess.run(_cli("run", str(tmp_path / "toy.yaml"), "-i", str(tmp_path / "docs"),
                                  "-i", str(tmp_path / "nothere.txt"), "-o", str(tmp_path / "o.parquet"),
                                  "--no-cache"), cwd=ROOT, capture_output=True, text=True)
    assert partial.returncode == 3
    usage = subprocess.run(_cli("run", str(tmp_path / "toy.yaml"), "-i", str(tmp_path / "docs"), "-o",
                                str(tmp_path / "o.parquet"), "--set", "nostage.x=1"), cwd=ROOT,
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "no stage named 'nostage'" in usage.stderr
    assert os.path.exists(tmp_path / "o.parquet")


def test_a_pipeline_parameter_no_stage_reads_is_a_problem_with_a_suggestion():
    qa = Pipeline.from_yaml("pdf_qa")
    qa.set("params.qestion", "What is the fee?")
    problems = validate(qa)
    assert len(problems) == 1 and problems[0].startswith("params.qestion: no stage of this pipeline reads it")
    assert "did you mean 'question'?" in problems[0] and "questions" in problems[0]
    qa.params.pop("qestion")
    assert validate(qa) == []
    toy = Pipeline.from_yaml(TOY_YAML)  # no stage reads params: a pipeline may carry any
    assert validate(toy) == []


def test_run_warns_on_error_rows_by_default_and_can_raise_or_stay_silent(tmp_path):
    import warnings

    from docfuse.pipelines.pipeline import RowErrors, RowErrorsWarning

    docs = write_docs(tmp_path / "docs", 3, bad=(1,))
    pipe = Pipeline.from_yaml(TOY_YAML)
    with pytest.warns(RowErrorsWarning, match=r"1 row\(s\) failed: .*doc001.txt"):
        report = pipe.run(docs)
    assert report.error_rows == 1
    with pytest.raises(RowErrors, match="1 row") as info:
        pipe.run(docs, errors="raise")
    assert info.value.report.error_rows == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.run(docs, errors="ignore")
        pipe.run(docs[:1])  # no error row: no warning
    with pytest.raises(ValueError, match="errors="):
        pipe.run(docs, errors="loud")


def test_a_stage_description_is_its_whole_first_paragraph():
    from docfuse.pipelines.stage import _summary

    assert _summary("""Answer the questions about each document, one prefill a document,
    and one row per question.

    Details that stay out of the listing.""") == ("Answer the questions about each document, one prefill a document, "
                                                   "and one row per question.")
    assert _summary(None) == ""


def test_a_live_caller_hears_each_stage_as_it_starts(tmp_path):
    """``docfuse ask`` shows which stage is working (a model load or OCR is otherwise a silent wait): the local
    executor names each stage, in plan order, through progress.LIVE; without a listener nothing is called."""
    from docfuse.pipelines.progress import LIVE, Live
    from tests.pdf_fixtures import write_two_column

    pdf = write_two_column(tmp_path)
    heard: list[tuple[str, str]] = []
    token = LIVE.set(Live(on_stage=lambda name, kind: heard.append((name, kind))))
    try:
        Pipeline.from_yaml("pdf_extract").run([str(pdf)])
    finally:
        LIVE.reset(token)
    assert heard == [("pages", "pdf.open"), ("text", "pdf.text")]
