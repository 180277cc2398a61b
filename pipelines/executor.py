"""The local engine: stream batches of documents through the DAG, one stage after another.

Each batch holds whole documents (never half a document), so a stage that groups pages by document sees them
all. Per batch and stage: rows with an ``error`` skip the stage and are carried on in its output schema; the
good rows go to ``run``; if ``run`` raises, the batch is retried one document at a time and the documents that
still fail become error rows. Every stage output is cached (see cache.py), so a killed run resumes where it
stopped, and the output file is written under a temporary name and renamed at the end, so it holds every row
exactly once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.cache import StageCache, stable_hash
from pipelines.sources import read_batches
from pipelines.spec import Pipeline
from pipelines.stage import Stage, conform, error_value
from pipelines.validate import PipelineInvalid, check


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

    @property
    def exit_code(self) -> int:
        """0 when every row succeeded, 3 when some rows carry an error."""
        return 3 if self.error_rows else 0


class LocalExecutor:
    def __init__(self, pipeline: Pipeline, *, cache_dir: str | os.PathLike | None = None) -> None:
        checked = check(pipeline)
        if checked.problems:
            raise PipelineInvalid(checked.problems)
        self.pipeline = pipeline
        self.stages: dict[str, Stage] = checked.instances
        self.cache = StageCache(cache_dir)
        needed: set[str] = set()
        for out in pipeline.outputs:
            needed |= nx.ancestors(checked.graph, out) | {out}
        self.order = [n for n in nx.topological_sort(checked.graph) if n in needed]
        self._ready: set[str] = set()
        self._spec_keys = {
            name: stable_hash(stage.kind, stage.version, stage.params.model_dump(mode="json"), stage.context,
                              stage.cache_salt())
            for name, stage in self.stages.items()
        }

    # ---- one batch ------------------------------------------------------------------------------------------
    def run_batch(self, sources: pa.Table) -> tuple[dict[str, pa.Table], bool]:
        """Run every needed stage on one batch; returns the output tables and whether all came from cache."""
        key = {"__sources__": stable_hash(sources.column("doc_id").to_pylist(), sources.column("error").to_pylist())}
        tables: dict[str, pa.Table] = {}
        all_cached = True
        for name in self.order:
            spec = self.pipeline.stages[name]
            upstream = spec.inputs or ["__sources__"]
            key[name] = stable_hash(self._spec_keys[name], [key[u] for u in upstream])
            cached = self.cache.get(name, key[name])
            if cached is not None:
                tables[name] = cached
                continue
            all_cached = False
            inputs = [sources if u == "__sources__" else tables[u] for u in upstream]
            tables[name] = self._run_stage(name, inputs)
            self.cache.put(name, key[name], tables[name])
        return {out: tables[out] for out in self.pipeline.outputs}, all_cached

    def _run_stage(self, name: str, inputs: list[pa.Table]) -> pa.Table:
        stage = self.stages[name]
        schema = stage.output()
        good = [t.filter(pc.is_null(t.column("error"))) if "error" in t.column_names else t for t in inputs]
        bad = [t.filter(pc.is_valid(t.column("error"))) for t in inputs if "error" in t.column_names]
        parts: list[pa.Table] = []
        if any(t.num_rows for t in good):
            if name not in self._ready:
                try:
                    stage.setup()
                except Exception as exc:
                    raise StageSetupError(f"stage '{name}' ({stage.kind}) could not set up: {exc}") from exc
                self._ready.add(name)
            parts.append(self._run_isolated(name, stage, good, schema))
        errors = [t for t in bad if t.num_rows]
        if errors:
            merged = pa.concat_tables([conform(t, _common_schema(t, schema)) for t in errors], promote_options="default")
            parts.append(conform(stage.pass_errors(merged), schema))
        if not parts:
            return schema.empty_table()
        return pa.concat_tables(parts)

    def _run_isolated(self, name: str, stage: Stage, good: list[pa.Table], schema: pa.Schema) -> pa.Table:
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
        report = RunReport()
        batches: Iterable[pa.Table]
        if isinstance(inputs, pa.Table):
            batches = (inputs.slice(i, batch_docs) for i in range(0, inputs.num_rows, batch_docs))
        else:
            batches = read_batches(inputs, batch_docs=batch_docs, column=column)
        sink = _Sink(self.pipeline.outputs, {o: self.stages[o].output() for o in self.pipeline.outputs}, output)
        try:
            for batch in batches:
                outs, from_cache = self.run_batch(batch)
                report.batches += 1
                report.batches_from_cache += int(from_cache)
                report.documents += batch.num_rows
                for name, table in outs.items():
                    report.rows += table.num_rows
                    report.error_rows += table.num_rows - table.column("error").null_count
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


class _Sink:
    """Parquet writers (one per output) writing to temporary names, renamed on success."""

    def __init__(self, names: list[str], schemas: dict[str, pa.Schema], output: str | os.PathLike | None) -> None:
        self.schemas = schemas
        self.paths: dict[str, Path] = {}
        self.memory: dict[str, list[pa.Table]] = {n: [] for n in names}
        self.writers: dict[str, pq.ParquetWriter] = {}
        if output is not None:
            out = Path(output)
            if len(names) == 1:
                self.paths = {names[0]: out}
            else:
                self.paths = {n: out / f"{n}.parquet" for n in names}
            for name, path in self.paths.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                self.writers[name] = pq.ParquetWriter(str(path) + ".partial", schemas[name])

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
