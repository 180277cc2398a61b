"""The Ray engine: the same pipeline compiled onto Ray Data, so a corpus can outgrow one machine.

Each needed stage becomes one ``map_batches(batch_format="pyarrow", batch_size=None)`` over Arrow blocks, in the
local engine's topological order. Stages that only compute (no ``setup()`` of their own) run as Ray tasks; model
stages (those that override ``setup()``) run as an actor pool whose actors build the stage and call ``setup()``
once, in their constructor, so a model loads once per actor. CPUs, GPUs and memory per task or actor come from
the stage class's ``resources``, overridden by the spec's ``resources:`` block, which may also size the pool
(``concurrency: n`` or ``[min, max]``).

How documents stay whole. The driver lists the documents and cuts them into batches of ``batch_docs`` whole
documents, one Ray block per batch; a first task reads the bytes, so no document's bytes pass through the driver.
Every block carries, besides the data, a ``__batch`` column (the batch's cache key), so a stage's wrapper
splits whatever block Ray hands it into the original batches and calls the stage once per batch, exactly as
the local engine does. Ray may merge the blocks of several batches (harmless: they are told apart again), but
it must never cut one, which it would do to an output block over ``DataContext.target_max_block_size``: the run
switches that cut off, so a block is as large as its batch (``batch_docs`` bounds it). A stage such as
decode.generate that groups pages by ``doc_id`` therefore sees every page of a document in one call.

How a DAG travels. A stage may read several upstream tables of other grains (pages, documents, questions), so
a block is a bundle: the tables still needed downstream, stacked in one Arrow table whose ``__table`` column
says which table a row belongs to and whose columns are namespaced per table (``<index>:<column>``), plus one
marker row per batch, so an empty batch still reaches the end. The per-stage work itself (cache, error routing,
per-document retry, conformance) is ``pipelines.executor.StageStep``, shared with the local engine, and the
stage cache keys are the local engine's: a batch cached by one engine is a hit for the other.

Outputs come back to the driver, which writes them through the local engine's Parquet sink, so the files are
the same up to row order (batches finish in any order).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from docfuse.pipelines.cache import StageCache
from docfuse.pipelines.executor import (
    RunReport, Sink, StageSetupError, StageStep, count_rows, plan_steps, setup_stage, sources_key,
)
from docfuse.pipelines.planning import make_plan
from docfuse.pipelines.sources import SOURCE_SCHEMA, SOURCES, Entry, expand, read_entry, table_batches
from docfuse.pipelines.stage import Stage, conform
from docfuse.pipelines.validate import PipelineInvalid, check

if TYPE_CHECKING:
    from docfuse.pipelines.spec import PipelineSpec

INSTALL_HINT = "pip install 'docfuse[ray]'"
SEQ, BATCH, CACHED, DOCS, TABLE = "__seq", "__batch", "__cached", "__docs", "__table"
MARKER = -1  # the __table value of a batch's marker row
#: One document to read, as the driver lists it: a path (absolute, for workers elsewhere) or bytes in hand.
ENTRY_SCHEMA = pa.schema([("source", pa.string()), ("path", pa.string()), ("data", pa.large_binary()),
                          ("error", pa.string()), (SEQ, pa.int64())])
Batch = tuple[int, str, bool, int, dict[str, pa.Table]]  # (number, cache key, all cached, documents, tables)


class RayUnavailable(RuntimeError):
    """Ray cannot be used: not installed, or the cluster cannot be joined. The message names the fix."""


def import_ray() -> Any:
    """The ``ray`` module with Ray Data, or RayUnavailable naming the install command."""
    try:
        import ray
        import ray.data  # noqa: F401 - the engine needs Ray Data, not only Ray core
    except ImportError as exc:
        raise RayUnavailable(f"the ray engine needs Ray Data, which is not installed ({exc}): {INSTALL_HINT}") from exc
    return ray


def ensure_ray(address: str | None = None) -> Any:
    """Join the Ray at ``address``, or keep the one this process already joined, or start a local one.

    A local Ray is sized to this machine (every core) and its workers get the driver's import path, so stage
    classes registered from the user's own modules import there too. On a cluster, every node needs docfuse
    installed (or join it yourself with ``ray.init(runtime_env=...)`` before running).
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    if address:
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailable(f"cannot join the Ray cluster at {address!r}: {exc}; check the address "
                                 "(`ray status` on the head node prints it) or leave --address out to run "
                                 "on a local Ray") from exc
    else:
        path = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p))
        ray.init(num_cpus=os.cpu_count() or 1, runtime_env={"env_vars": {"PYTHONPATH": path}}, **quiet)
    return ray


# ---- blocks: bundles of whole batches ------------------------------------------------------------------------
@dataclass(frozen=True)
class Bundle:
    """The codec of a block: which tables it carries (by index into the run's table list) and their schemas."""

    tables: tuple[tuple[int, str, pa.Schema], ...]  # (index, name, schema), in index order

    @functools.cached_property
    def schema(self) -> pa.Schema:
        fields = [pa.field(SEQ, pa.int64()), pa.field(BATCH, pa.string()), pa.field(CACHED, pa.bool_()),
                  pa.field(DOCS, pa.int32()), pa.field(TABLE, pa.int16())]
        for index, _, schema in self.tables:
            fields += [pa.field(f"{index}:{f.name}", f.type) for f in schema]
        return pa.schema(fields)

    def encode(self, batches: list[Batch]) -> pa.Table:
        """One block from whole batches; a marker row leads each batch, so an empty batch still travels."""
        parts = []
        for seq, key, cached, docs, tables in batches:
            head = (seq, key, cached, docs)
            parts.append(self._part(head, MARKER, {}))
            for index, name, schema in self.tables:
                table = tables[name]
                if table.num_rows:
                    cols = {f"{index}:{f.name}": table.column(f.name) for f in schema}
                    parts.append(self._part(head, index, cols, table.num_rows))
        return pa.concat_tables(parts) if parts else self.schema.empty_table()

    def _part(self, head: tuple[int, str, bool, int], index: int, cols: dict[str, Any], n: int = 1) -> pa.Table:
        seq, key, cached, docs = head
        meta = {SEQ: pa.array([seq] * n, pa.int64()), BATCH: pa.array([key] * n, pa.string()),
                CACHED: pa.array([cached] * n, pa.bool_()), DOCS: pa.array([docs] * n, pa.int32()),
                TABLE: pa.array([index] * n, pa.int16())}
        return conform(pa.table({**meta, **cols}), self.schema)

    def decode(self, block: pa.Table) -> Iterator[Batch]:
        """The batches in a block, in order, each with its tables in their own schemas."""
        seqs = block.column(SEQ)
        distinct = list(dict.fromkeys(seqs.to_pylist()))
        for seq in distinct:
            rows = block if len(distinct) == 1 else block.filter(pc.equal(seqs, seq))
            marker = rows.filter(pc.equal(rows.column(TABLE), MARKER))
            if marker.num_rows != 1:  # the marker leads its batch: a piece without it was cut off by Ray
                raise RuntimeError(f"a block holds part of batch {seq} only; Ray cut it, so a stage would see "
                                   "half a document. Leave DataContext.target_max_block_size to the engine")
            key, cached, docs = (marker.column(c)[0].as_py() for c in (BATCH, CACHED, DOCS))
            tables = {}
            for index, name, schema in self.tables:
                part = rows.filter(pc.equal(rows.column(TABLE), index))
                cols = [part.column(f"{index}:{f.name}") for f in schema]
                tables[name] = conform(pa.Table.from_arrays(cols, names=schema.names), schema)
            yield seq, key, cached, docs, tables


# ---- what runs on the workers --------------------------------------------------------------------------------
@dataclass
class _Op:
    """One stage's work on a block: decode, run the shared StageStep per batch, encode what is still needed."""

    step: StageStep
    chain: list[StageStep]  # the steps before this one, to rebuild the batch's cache keys
    before: Bundle
    after: Bundle
    cache_dir: str | None

    def apply(self, block: pa.Table, prepare: Callable[[], None]) -> pa.Table:
        cache = StageCache(self.cache_dir)
        out = []
        for seq, key, cached, docs, tables in self.before.decode(block):
            keys = {SOURCES: key}
            for step in self.chain:
                keys[step.name] = step.batch_key(keys)
            cached &= self.step(tables, keys, cache, prepare)
            out.append((seq, key, cached, docs, tables))
        return self.after.encode(out)


def _run_task(block: pa.Table, op: _Op) -> pa.Table:
    """A stateless stage as a Ray task: nothing heavy to set up, so each task builds nothing more."""
    return op.apply(block, lambda: setup_stage(op.step.name, op.step.stage))


class _StageActor:
    """A model stage as a Ray actor: ``setup()`` once here, in the constructor, then one call per block.

    A setup failure is kept and raised by the first call that has good rows, as the local engine does, so a
    run whose rows all failed upstream does not stop on a model it never needed.
    """

    def __init__(self, op: _Op) -> None:
        self.op = op
        self.failure: str | None = None
        try:
            setup_stage(op.step.name, op.step.stage)
        except StageSetupError as exc:
            self.failure = str(exc)

    def _prepare(self) -> None:
        if self.failure is not None:
            raise StageSetupError(self.failure)

    def __call__(self, block: pa.Table) -> pa.Table:
        return self.op.apply(block, self._prepare)


def _read_sources(block: pa.Table) -> pa.Table:
    """Entries (one batch of documents) to the SOURCE bundle: the bytes are read here, on a worker."""
    rows = [read_entry(Entry(source=r["source"], path=r["path"], data=r["data"], error=r["error"]))
            for r in block.to_pylist()]
    return _source_bundle(block, pa.Table.from_pylist(rows, schema=SOURCE_SCHEMA))


def _wrap_sources(block: pa.Table) -> pa.Table:
    """A slice of a SOURCE table given in memory to the SOURCE bundle."""
    return _source_bundle(block, conform(block, SOURCE_SCHEMA))


def _source_bundle(block: pa.Table, sources: pa.Table) -> pa.Table:
    seq = block.column(SEQ)[0].as_py()
    return _SOURCES_BUNDLE.encode([(seq, sources_key(sources), True, sources.num_rows, {SOURCES: sources})])


_SOURCES_BUNDLE = Bundle(((0, SOURCES, SOURCE_SCHEMA),))


def _named(fn: Callable[[pa.Table], pa.Table], label: str) -> Callable[[pa.Table], pa.Table]:
    """``fn`` under the name Ray Data shows for its operator."""
    def call(block: pa.Table) -> pa.Table:
        return fn(block)

    call.__name__ = call.__qualname__ = label
    return call


# ---- the driver ----------------------------------------------------------------------------------------------
class RayExecutor:
    """Runs a pipeline on Ray Data with the local engine's results, report and exit codes."""

    def __init__(self, pipeline: PipelineSpec, *, cache_dir: str | os.PathLike | None = None,
                 address: str | None = None) -> None:
        import_ray()
        checked = check(pipeline)
        if checked.problems:
            raise PipelineInvalid(checked.problems)
        self.pipeline = pipeline
        self.address = address
        self.stages: dict[str, Stage] = checked.instances
        self.plan = make_plan(pipeline, checked.graph, self.stages)
        self.plan.announce()
        self.order = self.plan.order
        self.steps = plan_steps(pipeline, self.stages, self.plan)
        self.cache_dir = str(Path(cache_dir).resolve()) if cache_dir else None

    # ---- the plan --------------------------------------------------------------------------------------------
    def bundles(self) -> list[Bundle]:
        """The codec of the block entering each stage, then of the block the driver reads."""
        names = [SOURCES, *self.order]
        schemas = {SOURCES: SOURCE_SCHEMA, **{n: self.stages[n].output() for n in self.order}}
        out = []
        for i in range(len(self.steps) + 1):
            later = self.steps[i:]
            live = [(idx, n, schemas[n]) for idx, n in enumerate(names[:i + 1])
                    if n in self.pipeline.outputs or any(n in s.upstream for s in later)]
            out.append(Bundle(tuple(live)))
        return out

    def stateful(self, name: str) -> bool:
        """A stage with a ``setup()`` of its own holds a model: it runs as an actor pool, not as tasks."""
        return type(self.stages[name]).setup is not Stage.setup

    def ray_args(self, name: str) -> dict[str, Any]:
        """``map_batches`` keywords for one stage: resources per task or actor and, for actors, the pool."""
        import ray.data

        wanted = {**self.stages[name].resources, **self.pipeline.stages[name].resources}
        concurrency = wanted.pop("concurrency", None)
        args: dict[str, Any] = {k: wanted.pop(k) for k in ("num_cpus", "num_gpus", "memory") if k in wanted}
        if wanted:
            args["resources"] = wanted  # custom resources a stage class asks for
        if self.stateful(name):
            lo, hi = (concurrency, concurrency) if isinstance(concurrency, int) else (concurrency or [1, None])
            args["compute"] = ray.data.ActorPoolStrategy(min_size=lo, max_size=hi or self._fit(args))
        elif concurrency is not None:
            size = concurrency if isinstance(concurrency, int) else concurrency[-1]
            args["compute"] = ray.data.TaskPoolStrategy(size=size)
        return args

    def _fit(self, args: dict[str, Any]) -> int:
        """How many actors of this size the cluster holds now (at least one): the default pool's upper bound."""
        import ray

        have = ray.cluster_resources()
        fits = [have.get(res, 0) / args[key] for key, res in (("num_cpus", "CPU"), ("num_gpus", "GPU"))
                if args.get(key)]
        return max(1, math.floor(min(fits))) if fits else max(1, int(have.get("CPU", 1)))

    def dataset(self, entries: list[pa.Table], from_entries: bool) -> Any:
        """The pipeline as a lazy Ray Dataset: one block per batch of documents, one map_batches per stage."""
        import ray.data

        ds = ray.data.from_arrow(entries)
        ds = ds.map_batches(_named(_read_sources if from_entries else _wrap_sources, "read"),
                            batch_format="pyarrow", batch_size=None, zero_copy_batch=True)
        bundles = self.bundles()
        for i, step in enumerate(self.steps):
            op = _Op(step=step, chain=self.steps[:i], before=bundles[i], after=bundles[i + 1],
                     cache_dir=self.cache_dir)
            common = {"batch_format": "pyarrow", "batch_size": None, "zero_copy_batch": True,
                      **self.ray_args(step.name)}
            label = f"{step.name}:{step.stage.kind}"  # what Ray's progress bars and logs call the operator
            if self.stateful(step.name):
                actor = type(label, (_StageActor,), {"__module__": __name__})
                ds = ds.map_batches(actor, fn_constructor_kwargs={"op": op}, **common)
            else:
                ds = ds.map_batches(_named(functools.partial(_run_task, op=op), label), **common)
        return ds

    # ---- whole run -------------------------------------------------------------------------------------------
    def run(
        self,
        inputs: Sequence[str | os.PathLike] | pa.Table,
        output: str | os.PathLike | None = None,
        *,
        batch_docs: int = 8,
        column: str | None = None,
        on_batch: Callable[[int, bool], None] | None = None,
        progress: bool | None = None,
    ) -> RunReport:
        """As ``LocalExecutor.run``; ``progress`` shows Ray Data's progress bars (default: on a terminal)."""
        start = time.perf_counter()
        if batch_docs < 1:
            raise ValueError("batch_docs must be at least 1")
        entries, from_entries = _batches(inputs, batch_docs, column)
        ray = ensure_ray(self.address)
        report = RunReport(batches=len(entries), documents=sum(t.num_rows for t in entries),
                           skipped=dict(self.plan.skipped))
        sink = Sink(self.pipeline.outputs, {o: self.stages[o].output() for o in self.pipeline.outputs}, output)
        last = self.bundles()[-1]
        show = sys.stderr.isatty() if progress is None else progress
        try:
            with _data_context(ray, show) if entries else contextlib.nullcontext():
                blocks = self.dataset(entries, from_entries).iter_batches(
                    batch_size=None, batch_format="pyarrow", prefetch_batches=1) if entries else iter(())
                for block in _reraise_setup_errors(blocks):
                    for _seq, _key, cached, docs, tables in last.decode(block):
                        report.batches_from_cache += int(cached)
                        for name in self.pipeline.outputs:
                            count_rows(report, tables[name])
                            sink.write(name, tables[name])
                        if on_batch:
                            on_batch(docs, cached)
            report.outputs, report.tables = sink.close()
        except BaseException:
            sink.abort()
            raise
        report.seconds = time.perf_counter() - start
        return report


def _batches(inputs: Sequence[str | os.PathLike] | pa.Table, batch_docs: int,
             column: str | None) -> tuple[list[pa.Table], bool]:
    """The documents cut into batches on the driver: entries to read on workers, or slices of a SOURCE table."""
    if isinstance(inputs, pa.Table):
        return [t.append_column(SEQ, pa.array([n] * t.num_rows, pa.int64()))
                for n, t in enumerate(table_batches(inputs, batch_docs))], False
    rows = [{"source": e.source, "path": os.path.abspath(e.path) if e.path else None, "data": e.data,
             "error": e.error} for e in expand(inputs, column)]
    return [pa.Table.from_pylist([{**r, SEQ: n // batch_docs} for r in rows[n:n + batch_docs]], schema=ENTRY_SCHEMA)
            for n in range(0, len(rows), batch_docs)], True


class _data_context:
    """Ray Data settings for one run, restored afterwards: whole blocks, progress only when wanted."""

    def __init__(self, ray: Any, progress: bool) -> None:
        self.ctx = ray.data.DataContext.get_current()
        self.settings = {
            "target_max_block_size": None,  # never cut a block: it would cut a batch of whole documents
            "raise_original_map_exception": True,  # a StageSetupError reaches the driver as itself
            "enable_progress_bars": progress,
            "print_on_execution_start": progress,
        }
        if progress:  # Ray Data's rich per-operator bars (tqdm's stay blank here)
            self.settings.update(enable_rich_progress_bars=True, use_ray_tqdm=False)
        self.progress = progress
        self.logger = logging.getLogger("ray.data")

    def __enter__(self) -> None:
        self.saved = {key: getattr(self.ctx, key) for key in self.settings}
        self.level = self.logger.level
        for key, value in self.settings.items():
            setattr(self.ctx, key, value)
        if not self.progress:
            self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for key, value in self.saved.items():
            setattr(self.ctx, key, value)
        self.logger.setLevel(self.level)


def _reraise_setup_errors(blocks: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Ray wraps what a worker raised; a stage that could not set up stops the run as StageSetupError."""
    try:
        yield from blocks
    except Exception as exc:
        found = _find_setup_error(exc)
        if found is None:
            raise
        raise StageSetupError(found) from exc


def _find_setup_error(exc: BaseException) -> str | None:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)  # RayTaskError keeps the worker's exception here
        if isinstance(cause, StageSetupError):
            return str(cause.args[0]) if cause.args else str(cause)
        if isinstance(e, StageSetupError) and type(e) is StageSetupError:
            return str(e)
        todo += [e.__cause__, e.__context__, cause if isinstance(cause, BaseException) else None]
    return None
