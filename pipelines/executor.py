"""The local engine: stream batches of documents through the DAG, one stage after another.

Each batch holds whole documents (never half a document), so a stage that groups pages by document sees them
all. Per batch and stage: rows with an ``error`` skip the stage and are carried on in its output schema; the
good rows go to ``run``; if ``run`` raises, the batch is retried one document at a time and the documents that
still fail become error rows. Every stage output is cached (see cache.py), so a killed run resumes where it
stopped, and the output file is written under a temporary name and renamed at the end, so it holds every row
exactly once.

Which stages run is planned before the first batch (planning.py): a stage that feeds only inputs their consumer
will not read does not run. What one stage does to one batch (cache lookup, error routing, per-document retry, conformance) lives in
``StageStep`` and ``run_stage``, which the Ray engine (executor_ray.py) calls too, so both engines agree row for row.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from docfuse.pipelines.cache import StageCache, stable_hash
from docfuse.pipelines.planning import Plan, make_plan
from docfuse.pipelines.progress import LIVE
from docfuse.pipelines.sources import SOURCES, read_batches, table_batches
from docfuse.pipelines.stage import Stage, conform, error_value
from docfuse.pipelines.validate import PipelineInvalid, check
from docfuse.pipelines.writers import TableWriter, open_writer, output_format

if TYPE_CHECKING:
    from docfuse.pipelines.spec import PipelineSpec


class StageSetupError(RuntimeError):
    """A stage could not load its heavy state (a missing checkpoint, say): the whole run stops, exit code 2."""


@dataclass
class RunReport:
    """What a run did. ``tables`` holds the outputs when no output path was given."""

    rows: int = 0
    error_rows: int = 0
    documents: int = 0
    batches: int = 0
    batches_from_cache: int = 0
    seconds: float = 0.0
    outputs: dict[str, Path] = field(default_factory=dict)
    tables: dict[str, pa.Table] = field(default_factory=dict)
    #: Stages the plan left out (they fed only inputs that are not read), each with why.
    skipped: dict[str, str] = field(default_factory=dict)
    #: The first failed rows, as (source, error), to name them in a warning or an exception.
    first_errors: list[tuple[str | None, str]] = field(default_factory=list)

    def errors_summary(self, limit: int = 3) -> str:
        """One line naming how many rows failed and the first few of them."""
        named = "; ".join(f"{src or '?'}: {err}" for src, err in self.first_errors[:limit])
        more = f" (and {self.error_rows - limit} more)" if self.error_rows > limit else ""
        return f"{self.error_rows} row(s) failed: {named}{more}"

    @property
    def exit_code(self) -> int:
        """0 when every row succeeded, 3 when some rows carry an error."""
        return 3 if self.error_rows else 0


def sources_key(sources: pa.Table) -> str:
    """The cache key of one batch of documents: their ids and read errors, so new bytes mean a new key."""
    return stable_hash(sources.column("doc_id").to_pylist(), sources.column("error").to_pylist())


def stage_key(stage: Stage) -> str:
    """What identifies a configured stage in the cache: kind, version, parameters, params read, weights."""
    return stable_hash(stage.kind, stage.version, stage.params.model_dump(mode="json"), stage.context,
                       stage.cache_salt())


#: The cache key of an input the stage does not read: its producer did not run, so it has no key of its own.
UNREAD_KEY = "unread"


@dataclass
class StageStep:
    """One stage as every engine runs it on one batch of whole documents.

    The local engine calls it for each stage of each batch; the Ray engine calls it inside the ``map_batches``
    task or actor of its stage, so error routing, per-document retry, schema conformance and the cache behave
    the same on both.
    """

    name: str
    stage: Stage
    upstream: list[str]  # stage names, or SOURCES, in port order
    key: str  # stage_key(stage)
    #: Ports the stage will not read (planning.py), with the schema of the empty table they receive instead.
    unread: dict[int, pa.Schema] = field(default_factory=dict)

    def batch_key(self, keys: dict[str, str]) -> str:
        """This stage's cache key on one batch, from the keys of its inputs on that batch."""
        return stable_hash(self.key, [UNREAD_KEY if i in self.unread else keys[u] for i, u in enumerate(self.upstream)])

    def inputs(self, tables: dict[str, pa.Table]) -> list[pa.Table]:
        """The tables ``run`` gets, in port order: an unread port gets an empty table of its producer's schema."""
        return [self.unread[i].empty_table() if i in self.unread else tables[u] for i, u in enumerate(self.upstream)]

    def __call__(self, tables: dict[str, pa.Table], keys: dict[str, str], cache: StageCache,
                 prepare: Callable[[], None]) -> bool:
        """Add this stage's output to ``tables`` and its key to ``keys``; True when it came from the cache.

        ``prepare`` is called before the first ``run`` that has good rows (it sets the stage up, or raises
        StageSetupError); a batch whose rows all failed upstream never loads a model.
        """
        keys[self.name] = self.batch_key(keys)
        cached = cache.get(self.name, keys[self.name])
        if cached is not None:
            tables[self.name] = cached
            return True
        tables[self.name] = run_stage(self.name, self.stage, self.inputs(tables), prepare)
        cache.put(self.name, keys[self.name], tables[self.name])
        return False


def plan_steps(pipeline: PipelineSpec, stages: dict[str, Stage], plan: Plan) -> list[StageStep]:
    """One StageStep per planned stage; its unread ports get their producer's schema, for the empty table."""
    steps = []
    for name in plan.order:
        inputs = list(pipeline.stages[name].inputs)
        unread = {i: stages[inputs[i]].output() for i in plan.unread.get(name, {})}
        steps.append(StageStep(name, stages[name], inputs or [SOURCES], stage_key(stages[name]), unread))
    return steps


def run_stage(name: str, stage: Stage, inputs: list[pa.Table], prepare: Callable[[], None]) -> pa.Table:
    """Run one stage on one batch: error rows skip it (conformed by ``pass_errors``), good rows go to ``run``."""
    schema = stage.output()
    good = [t.filter(pc.is_null(t.column("error"))) if "error" in t.column_names else t for t in inputs]
    bad = [t.filter(pc.is_valid(t.column("error"))) for t in inputs if "error" in t.column_names]
    parts: list[pa.Table] = []
    if any(t.num_rows for t in good):
        live = LIVE.get()
        if live is not None and live.on_stage is not None:
            live.on_stage(name, stage.kind)
        prepare()
        parts.append(_run_isolated(name, stage, good, schema))
    errors = [t for t in bad if t.num_rows]
    if errors:
        merged = pa.concat_tables([conform(t, _common_schema(t, schema)) for t in errors], promote_options="default")
        parts.append(conform(stage.pass_errors(merged), schema))
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts)


def setup_stage(name: str, stage: Stage) -> None:
    """``stage.setup()``, with a failure turned into StageSetupError (the run stops, exit code 2)."""
    try:
        stage.setup()
    except Exception as exc:
        raise StageSetupError(f"stage '{name}' ({stage.kind}) could not set up: {exc}") from exc


def _run_isolated(name: str, stage: Stage, good: list[pa.Table], schema: pa.Schema) -> pa.Table:
    try:
        return _checked_output(name, stage.run(*good), schema)
    except Exception:  # noqa: BLE001 - retried per document below, so one bad document fails alone
        pass
    doc_ids = list(dict.fromkeys(d for t in good for d in t.column("doc_id").to_pylist()))
    parts = []
    for doc in doc_ids:
        tables = [t.filter(pc.equal(t.column("doc_id"), doc)) for t in good]
        try:
            parts.append(_checked_output(name, stage.run(*tables), schema))
        except Exception as exc:  # noqa: BLE001
            src = next((t.column("source")[0].as_py() for t in tables if t.num_rows and "source" in t.column_names), None)
            msg = error_value("stage_failed", f"stage '{name}' ({stage.kind}) raised {type(exc).__name__}: {exc}; "
                              "the rest of the batch went on. Report it with this document if it is a bug")
            row = pa.table({"doc_id": [doc], "source": [src], "error": [msg]})
            parts.append(conform(stage.pass_errors(conform(row, _common_schema(row, schema))), schema))
    return pa.concat_tables(parts) if parts else schema.empty_table()


def count_rows(report: RunReport, table: pa.Table) -> None:
    """Add one output table's rows, and its error rows, to the report."""
    report.rows += table.num_rows
    failed = table.num_rows - table.column("error").null_count
    report.error_rows += failed
    if failed and len(report.first_errors) < 10:
        sources = table.column("source").to_pylist() if "source" in table.column_names else [None] * table.num_rows
        for src, err in zip(sources, table.column("error").to_pylist()):
            if err is not None and len(report.first_errors) < 10:
                report.first_errors.append((src, err))


class LocalExecutor:
    def __init__(self, pipeline: PipelineSpec, *, cache_dir: str | os.PathLike | None = None) -> None:
        checked = check(pipeline)
        if checked.problems:
            raise PipelineInvalid(checked.problems)
        self.pipeline = pipeline
        self.stages: dict[str, Stage] = checked.instances
        self.cache = StageCache(cache_dir)
        self.plan = make_plan(pipeline, checked.graph, self.stages)
        self.plan.announce()
        self.order = self.plan.order
        self.steps = plan_steps(pipeline, self.stages, self.plan)
        self._ready: set[str] = set()

    # ---- one batch ------------------------------------------------------------------------------------------
    def run_batch(self, sources: pa.Table) -> tuple[dict[str, pa.Table], bool]:
        """Run every needed stage on one batch; returns the output tables and whether all came from cache."""
        keys = {SOURCES: sources_key(sources)}
        tables: dict[str, pa.Table] = {SOURCES: sources}
        all_cached = True
        for step in self.steps:
            all_cached &= step(tables, keys, self.cache, lambda name=step.name: self._prepare(name))
        return {out: tables[out] for out in self.pipeline.outputs}, all_cached

    def _prepare(self, name: str) -> None:
        if name not in self._ready:
            setup_stage(name, self.stages[name])
            self._ready.add(name)

    # ---- whole run -------------------------------------------------------------------------------------------
    def run(
        self,
        inputs: Sequence[str | os.PathLike] | pa.Table,
        output: str | os.PathLike | None = None,
        *,
        batch_docs: int = 8,
        column: str | None = None,
        on_batch: Callable[[int, bool], None] | None = None,
    ) -> RunReport:
        """Run over ``inputs`` (paths, or a SOURCE table); write Parquet to ``output`` or keep tables in memory."""
        start = time.perf_counter()
        report = RunReport(skipped=dict(self.plan.skipped))
        batches: Iterable[pa.Table]
        if isinstance(inputs, pa.Table):
            batches = table_batches(inputs, batch_docs)
        else:
            batches = read_batches(inputs, batch_docs=batch_docs, column=column)
        sink = Sink(self.pipeline.outputs, {o: self.stages[o].output() for o in self.pipeline.outputs}, output)
        try:
            for batch in batches:
                outs, from_cache = self.run_batch(batch)
                report.batches += 1
                report.batches_from_cache += int(from_cache)
                report.documents += batch.num_rows
                for name, table in outs.items():
                    count_rows(report, table)
                    sink.write(name, table)
                if on_batch:
                    on_batch(batch.num_rows, from_cache)
            report.outputs, report.tables = sink.close()
        except BaseException:
            sink.abort()
            raise
        report.seconds = time.perf_counter() - start
        return report


def _common_schema(table: pa.Table, schema: pa.Schema) -> pa.Schema:
    """The fields of ``schema`` that ``table`` also has, so upstream errors keep doc_id, source, page."""
    return pa.schema([f for f in schema if f.name in table.column_names])


def _checked_output(name: str, table: pa.Table, schema: pa.Schema) -> pa.Table:
    if not isinstance(table, pa.Table):
        raise TypeError(f"stage '{name}' returned {type(table).__name__}, not a pyarrow.Table")
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise TypeError(f"stage '{name}' returned a table without its declared column(s) {missing}")
    return conform(table, schema)


class Sink:
    """Writers (one per output; Parquet, or CSV / JSON Lines by the file's suffix, :mod:`pipelines.writers`) writing
    to temporary names, renamed on success."""

    def __init__(self, names: list[str], schemas: dict[str, pa.Schema], output: str | os.PathLike | None) -> None:
        self.schemas = schemas
        self.paths: dict[str, Path] = {}
        self.memory: dict[str, list[pa.Table]] = {n: [] for n in names}
        self.writers: dict[str, TableWriter] = {}
        if output is not None:
            out = Path(output)
            if len(names) == 1:
                self.paths = {names[0]: out}
            else:
                self.paths = {n: out / f"{n}.parquet" for n in names}
            for name, path in self.paths.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                self.writers[name] = open_writer(str(path) + ".partial", schemas[name], output_format(path))

    def write(self, name: str, table: pa.Table) -> None:
        if name in self.writers:
            self.writers[name].write_table(table)
        else:
            self.memory[name].append(table)

    def close(self) -> tuple[dict[str, Path], dict[str, pa.Table]]:
        for name, writer in self.writers.items():
            writer.close()
            os.replace(str(self.paths[name]) + ".partial", self.paths[name])
        tables = {
            n: pa.concat_tables(parts) if parts else self.schemas[n].empty_table()
            for n, parts in self.memory.items() if n not in self.writers
        }
        return self.paths, tables

    def abort(self) -> None:
        for name, writer in self.writers.items():
            writer.close()
            Path(str(self.paths[name]) + ".partial").unlink(missing_ok=True)
