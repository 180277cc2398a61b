"""The Ray engine: same rows as the local engine, whole documents per call, one model load per actor, the CLI.

One local Ray serves the whole module (starting it is the slow part). Tests that need Ray skip when it is not
installed; the spec and missing-Ray tests run either way. The stages below are registered here, and Ray's
workers import them from this module (the fixture puts the project root on their PYTHONPATH).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import Field
from typer.testing import CliRunner

import tests.engine_stages as toy
from docfuse.pipelines import Pipeline
from docfuse.pipelines.cli import app
from docfuse.pipelines.executor import StageSetupError
from docfuse.pipelines.executor_ray import RayExecutor, RayUnavailable
from docfuse.pipelines.registry import register
from docfuse.pipelines.sources import read_batches
from docfuse.pipelines.stage import Stage, StageParams
from tests.pdf_fixtures import write_all
from tests.test_engine import PICK_YAML, TOY_YAML, write_docs

ROOT = Path(__file__).resolve().parents[1]
PAIR = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("n_lines", pa.int64()),
                  ("n_counted", pa.int64()), ("error", pa.string())])
TAGGED = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("page", pa.int32()),
                    ("pid", pa.int64()), ("loads", pa.int64()), ("error", pa.string())])


@register
class PairCounts(Stage):
    """Two inputs joined per document: how many line rows and how many count rows each document has."""

    kind = "test.ray_pair"
    inputs = {"lines": pa.schema([("doc_id", pa.string()), ("source", pa.string())]),
              "counts": pa.schema([("doc_id", pa.string()), ("n_chars", pa.int64())])}
    output_schema = PAIR

    def run(self, lines: pa.Table, counts: pa.Table) -> pa.Table:
        docs: dict[str, dict] = {}
        for table, field in ((lines, "n_lines"), (counts, "n_counted")):
            for row in table.select(["doc_id", "source"]).to_pylist():
                doc = docs.setdefault(row["doc_id"], {**row, "n_lines": 0, "n_counted": 0, "error": None})
                doc[field] += 1
        return pa.Table.from_pylist(list(docs.values()), schema=PAIR)

    def pass_errors(self, errors: pa.Table) -> pa.Table:
        """One error row per document, though both inputs carry it."""
        rows = {r["doc_id"]: r for r in errors.to_pylist()}
        return pa.Table.from_pylist(list(rows.values()), schema=PAIR)


class ModelParams(StageParams):
    log: str = Field(description="File each setup() appends its process id to.")
    fail: bool = Field(False, description="setup() raises, as a missing checkpoint would.")


@register
class FakeModel(Stage):
    """A model stage for the engine: setup() 'loads weights' (logged), run() tags rows with who loaded them."""

    kind = "test.ray_model"
    Params = ModelParams
    inputs = {"lines": pa.schema([("doc_id", pa.string()), ("page", pa.int32())])}
    output_schema = TAGGED

    def setup(self) -> None:
        if self.params.fail:
            raise FileNotFoundError("weights.bin is missing; run `make weights`")
        with open(self.params.log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        self.loads = getattr(self, "loads", 0) + 1

    def run(self, lines: pa.Table) -> pa.Table:
        n = lines.num_rows
        return pa.table({"doc_id": lines.column("doc_id"), "source": lines.column("source"),
                         "page": lines.column("page"), "pid": [os.getpid()] * n, "loads": [self.loads] * n,
                         "error": pa.nulls(n, pa.string())}, schema=TAGGED)


MODEL_YAML = """
name: model
stages:
  lines: {stage: test.lines, resources: {num_cpus: 0.25}}
  tagged: {stage: test.ray_model, from: lines, with: {log: LOG}, resources: {num_cpus: 0.25, concurrency: 2}}
outputs: [tagged]
"""
PAIR_YAML = """
name: pair
stages:
  lines: {stage: test.lines, resources: {num_cpus: 0.5}}
  counts: {stage: test.count, from: lines}
  pair: {stage: test.ray_pair, from: [lines, counts]}
outputs: [pair, counts]
"""


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module: 2 CPUs, workers that can import this project's tests package."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray
    ray.shutdown()


def _sorted(table: pa.Table, keys: list[str]) -> pa.Table:
    return table.sort_by([(k, "ascending") for k in keys])


# ---- spec: resources (no Ray needed) ---------------------------------------------------------------------------
def test_resources_block_round_trips_and_is_validated():
    p = Pipeline.from_yaml(MODEL_YAML)
    assert p.stages["tagged"].resources == {"num_cpus": 0.25, "concurrency": 2}
    assert Pipeline.from_yaml(p.to_yaml()) == p
    built = Pipeline("model")
    built.add("lines", "test.lines", resources_={"num_cpus": 0.25})
    built.add("tagged", "test.ray_model", from_="lines", log="LOG", resources_={"num_cpus": 0.25, "concurrency": 2})
    built.outputs = ["tagged"]
    assert built == p
    bad = Pipeline.from_yaml("name: b\nstages:\n  l: {stage: test.lines, resources: {num_gpu: 1, num_cpus: -1, "
                             "concurrency: [3, 2]}}\noutputs: [l]\n")
    text = "\n".join(bad.validate())
    assert "unknown resource 'num_gpu'; allowed are num_cpus, num_gpus, memory, concurrency" in text
    assert "resources.num_cpus must be a number >= 0" in text
    assert "resources.concurrency must be a whole number of actors >= 1 or [min, max]" in text
    assert "'resources' must be a mapping" in "\n".join(
        Pipeline.from_yaml("name: b\nstages:\n  l: {stage: test.lines, resources: 2}\noutputs: [l]\n").validate())


def test_missing_ray_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail, installed or not
    write_docs(tmp_path / "docs", 1)
    (tmp_path / "toy.yaml").write_text(TOY_YAML)
    res = CliRunner().invoke(app, ["run", str(tmp_path / "toy.yaml"), "-i", str(tmp_path / "docs"), "-o",
                                   str(tmp_path / "o.parquet"), "--engine", "ray"])
    assert res.exit_code == 2 and "pip install 'docfuse[ray]'" in res.output
    with pytest.raises(RayUnavailable, match=r"pip install 'docfuse\[ray\]'"):
        Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], engine="ray")
    with pytest.raises(ValueError, match="use engine='local' or engine='ray'"):
        Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], engine="spark")


# ---- compiling ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_model_stages_become_actor_pools_with_the_spec_resources(ray_cluster):
    import ray.data

    qa = Pipeline.from_yaml("pdf_qa")
    qa.stages["answer"].resources = {"num_gpus": 0.5, "concurrency": [1, 3]}
    ex = RayExecutor(qa)
    assert not ex.stateful("pages") and not ex.stateful("text") and ex.stateful("answer")
    assert ex.ray_args("pages") == {"num_cpus": 1}
    answer = ex.ray_args("answer")
    assert answer["num_cpus"] == 1 and answer["num_gpus"] == 0.5
    assert isinstance(answer["compute"], ray.data.ActorPoolStrategy)
    assert (answer["compute"].min_size, answer["compute"].max_size) == (1, 3)
    # without a size, the pool grows up to what the cluster holds (2 CPUs here, 1 per actor)
    pool = RayExecutor(Pipeline.from_yaml("pdf_qa")).ray_args("answer")["compute"]
    assert (pool.min_size, pool.max_size) == (1, 2)
    # a DAG's blocks carry only the tables still needed downstream
    live = [[name for _, name, _ in b.tables] for b in RayExecutor(Pipeline.from_yaml(PAIR_YAML)).bundles()]
    assert live == [["__sources__"], ["lines"], ["lines", "counts"], ["counts", "pair"]]


# ---- running -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pdf_extract_gives_the_local_rows_including_error_rows(ray_cluster, tmp_path):
    docs = tmp_path / "pdfs"
    docs.mkdir()
    write_all(docs)
    inputs = [docs, tmp_path / "missing.pdf"]
    local = Pipeline.from_yaml("pdf_extract").run(inputs, batch_docs=3)
    on_ray = Pipeline.from_yaml("pdf_extract").run(inputs, tmp_path / "ray.parquet", batch_docs=3, engine="ray")
    written = pq.read_table(tmp_path / "ray.parquet")
    a, b = _sorted(local.tables["text"], ["doc_id", "page"]), _sorted(written, ["doc_id", "page"])
    assert b.schema == a.schema and b.equals(a)
    assert sum(e is not None for e in a.column("error").to_pylist()) >= 4  # encrypted, corrupt, empty, missing
    for attr in ("rows", "error_rows", "documents", "batches", "exit_code"):
        assert getattr(on_ray, attr) == getattr(local, attr), attr


@pytest.mark.slow
def test_documents_stay_whole_and_multi_input_stages_get_both_tables(ray_cluster, tmp_path):
    import ray.data

    paths = write_docs(tmp_path / "docs", 9, bad=(4,))
    (tmp_path / "docs" / "doc007.txt").write_text("boom\n" + "line\n" * 30)
    ctx = ray.data.DataContext.get_current()
    saved, ctx.target_max_block_size = ctx.target_max_block_size, 256  # Ray would cut every block at 256 bytes
    try:
        pipe = Pipeline.from_yaml(PAIR_YAML)
        pipe.set("lines.fail_on", "boom")
        report = pipe.run([tmp_path / "docs"], batch_docs=4, engine="ray")
    finally:
        ctx.target_max_block_size = saved
    local = pipe.run([tmp_path / "docs"], batch_docs=4)
    for name, keys in (("pair", ["doc_id"]), ("counts", ["doc_id", "page"])):
        assert _sorted(report.tables[name], keys).equals(_sorted(local.tables[name], keys)), name
    pair = {r["source"]: r for r in report.tables["pair"].to_pylist()}
    assert len(pair) == report.tables["pair"].num_rows == 9  # one call saw each document whole
    for i, path in enumerate(paths):
        row = pair[str(path)]
        if i in (4, 7):
            assert row["error"].startswith("bad_doc:" if i == 4 else "stage_failed: stage 'lines'")
        else:
            assert row["n_lines"] == row["n_counted"] == 2 and row["error"] is None
    assert report.exit_code == local.exit_code == 3


@pytest.mark.slow
def test_a_stage_feeding_only_an_unread_input_is_planned_out_as_locally(ray_cluster, tmp_path):
    write_docs(tmp_path / "docs", 3)
    pipe = Pipeline.from_yaml(PICK_YAML)
    pipe.set("pick.use", "lines")
    assert RayExecutor(pipe).order == ["lines", "pick"]
    ray, local = (pipe.run([tmp_path / "docs"], engine=e, batch_docs=2) for e in ("ray", "local"))
    assert list(ray.skipped) == list(local.skipped) == ["counts"]
    assert ray.tables["pick"].sort_by("doc_id").equals(local.tables["pick"].sort_by("doc_id"))
    assert set(ray.tables["pick"].column("n_chars").to_pylist()) == {-1}


@pytest.mark.slow
def test_a_model_stage_loads_once_per_actor(ray_cluster, tmp_path):
    write_docs(tmp_path / "docs", 12)
    log = tmp_path / "loads.log"
    report = Pipeline.from_yaml(MODEL_YAML.replace("LOG", str(log))).run([tmp_path / "docs"], batch_docs=1,
                                                                          engine="ray")
    table = report.tables["tagged"]
    loaded_by = [int(x) for x in log.read_text().split()]
    assert table.num_rows == 24 and report.batches == 12 and report.exit_code == 0
    assert len(loaded_by) == len(set(loaded_by)) <= 2  # each actor loaded once, at most 2 actors
    assert set(table.column("pid").to_pylist()) <= set(loaded_by) and set(table.column("loads").to_pylist()) == {1}
    assert os.getpid() not in loaded_by  # the driver never loads a model


@pytest.mark.slow
def test_cache_is_shared_with_the_local_engine(ray_cluster, tmp_path):
    write_docs(tmp_path / "docs", 5)
    cache = tmp_path / "cache"
    local = Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], cache_dir=cache, batch_docs=2)
    again = Pipeline.from_yaml(TOY_YAML).run([tmp_path / "docs"], cache_dir=cache, batch_docs=2, engine="ray")
    assert local.batches_from_cache == 0 and again.batches_from_cache == again.batches == 3
    assert _sorted(again.tables["counts"], ["doc_id", "page"]).equals(
        _sorted(local.tables["counts"], ["doc_id", "page"]))


@pytest.mark.slow
def test_a_stage_that_cannot_set_up_stops_the_run(ray_cluster, tmp_path):
    write_docs(tmp_path / "docs", 2)
    pipe = Pipeline.from_yaml(MODEL_YAML.replace("LOG", str(tmp_path / "log")))
    pipe.set("tagged.fail", True)
    with pytest.raises(StageSetupError, match=r"stage 'tagged' \(test.ray_model\) could not set up: "
                                              r"weights.bin is missing; run `make weights`"):
        pipe.run([tmp_path / "docs"], tmp_path / "out.parquet", engine="ray")
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "out.parquet.partial").exists()


# ---- the command line ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_engine_ray_exit_codes(ray_cluster, tmp_path):
    write_docs(tmp_path / "docs", 3)
    (tmp_path / "toy.yaml").write_text(TOY_YAML)
    (tmp_path / "model.yaml").write_text(MODEL_YAML.replace("LOG", str(tmp_path / "log")))
    base = ["run", str(tmp_path / "toy.yaml"), "-i", str(tmp_path / "docs"), "-o", str(tmp_path / "o.parquet"),
            "--no-cache", "--engine", "ray"]
    runner = CliRunner()
    ok = runner.invoke(app, base)
    assert ok.exit_code == 0, ok.output
    assert pq.read_table(tmp_path / "o.parquet").num_rows == 6 and "6 row(s) from 3 document(s)" in ok.output
    partial = runner.invoke(app, [*base, "-i", str(tmp_path / "nothere.txt")])
    assert partial.exit_code == 3 and "1 row(s) failed" in partial.output
    broken = runner.invoke(app, ["run", str(tmp_path / "model.yaml"), "-i", str(tmp_path / "docs"), "-o",
                                 str(tmp_path / "m.parquet"), "--engine", "ray", "--set", "tagged.fail=true"])
    assert broken.exit_code == 2 and "could not set up" in broken.output
    invalid = runner.invoke(app, [*base, "--set", "lines.delay_s=slow"])
    assert invalid.exit_code == 2 and "parameter 'delay_s'" in invalid.output
    local_address = runner.invoke(app, [*base[:-2], "--address", "auto"])
    assert local_address.exit_code == 2 and "only --engine ray uses" in local_address.output


@pytest.mark.slow
def test_cli_joins_a_running_cluster_with_address(ray_cluster, tmp_path):
    write_docs(tmp_path / "docs", 2, bad=(1,))
    (tmp_path / "toy.yaml").write_text(TOY_YAML)
    address = ray_cluster.get_runtime_context().gcs_address
    code = "import sys, tests.engine_stages; from pipelines.cli import app; sys.argv=['docfuse', *sys.argv[1:]]; app()"
    res = subprocess.run([sys.executable, "-c", code, "run", str(tmp_path / "toy.yaml"), "-i", str(tmp_path / "docs"),
                          "-o", str(tmp_path / "o.parquet"), "--no-cache", "--engine", "ray", "--address", address],
                         cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 3, res.stderr
    errors = [e for e in pq.read_table(tmp_path / "o.parquet").column("error").to_pylist() if e]
    assert len(errors) == 1 and errors[0].startswith("bad_doc:")
    assert toy.COUNTS.names == pq.read_table(tmp_path / "o.parquet").schema.names


@pytest.mark.slow
def test_a_source_table_in_memory_with_repeated_batches(ray_cluster, tmp_path):
    write_docs(tmp_path / "docs", 3, bad=(1,))
    once = pa.concat_tables(read_batches([tmp_path / "docs"]))
    twice = pa.concat_tables([once, once])  # two batches of 3 with the same documents, so the same cache key
    local = Pipeline.from_yaml(TOY_YAML).run(twice, batch_docs=3)
    on_ray = Pipeline.from_yaml(TOY_YAML).run(twice, batch_docs=3, engine="ray")
    keys = ["doc_id", "page", "error"]
    assert _sorted(on_ray.tables["counts"], keys).equals(_sorted(local.tables["counts"], keys))
    assert on_ray.tables["counts"].num_rows == 2 * (2 * 2 + 1) and on_ray.batches == 2
    empty = Pipeline.from_yaml(TOY_YAML).run(once.slice(0, 0), engine="ray")
    assert empty.rows == empty.batches == 0 and empty.tables["counts"].schema == toy.COUNTS
