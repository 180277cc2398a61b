"""Check a pipeline before anything runs, and report every problem at once, each with its fix."""

from __future__ import annotations

import difflib

from dataclasses import dataclass
from typing import TYPE_CHECKING

import networkx as nx
import pyarrow as pa
from pydantic import ValidationError

from docfuse.pipelines.registry import find_stage, suggest
from docfuse.pipelines.sources import SOURCE_SCHEMA, SOURCES
from docfuse.pipelines.stage import Stage

if TYPE_CHECKING:
    from docfuse.pipelines.spec import PipelineSpec


class PipelineInvalid(Exception):
    """Raised by the engine when validation finds problems; ``problems`` lists them all."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("pipeline is invalid:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Checked:
    """What validation learnt on the way: the graph and one configured (not yet set up) instance per stage."""

    graph: nx.DiGraph
    instances: dict[str, Stage]
    problems: list[str]


def build_graph(pipeline: PipelineSpec) -> nx.DiGraph:
    """Nodes are stage names; an edge u -> v means v reads u's table, with ``port`` the input position."""
    graph = nx.DiGraph()
    for name in pipeline.stages:
        graph.add_node(name)
    for name, spec in pipeline.stages.items():
        for port, src in enumerate(spec.inputs):
            if src in pipeline.stages:
                graph.add_edge(src, name, port=port)
    return graph


def check(pipeline: PipelineSpec) -> Checked:
    problems = list(pipeline.parse_problems)
    graph = build_graph(pipeline)
    instances: dict[str, Stage] = {}

    if not pipeline.stages:
        problems.append("the pipeline has no stages: add at least one under 'stages'")
    for name, spec in pipeline.stages.items():
        if name == SOURCES:
            problems.append(f"stage name '{SOURCES}' is reserved for the documents given with --input; rename it")
        if not spec.stage:
            continue  # already reported by the parser
        cls = find_stage(spec.stage)
        if cls is None:
            problems.append(f"stage '{name}': unknown stage kind '{spec.stage}'; {suggest(spec.stage)}")
        for src in spec.inputs:
            if src not in pipeline.stages:
                close = [s for s in pipeline.stages if s != name]
                problems.append(
                    f"stage '{name}': input '{src}' names no stage in this pipeline; "
                    f"'from' must be one of: {', '.join(close) or '(none)'}"
                )
        if cls is not None:
            stage = _instantiate(name, cls, spec.params, pipeline.params, problems)
            if stage is not None:
                instances[name] = stage

    problems.extend(_unread_params(pipeline, instances))
    for cycle in nx.simple_cycles(graph):
        members = " -> ".join([*cycle, cycle[0]])
        problems.append(f"cycle between stages {members}: a stage cannot depend on its own output; remove one 'from'")

    for name, spec in pipeline.stages.items():
        stage = instances.get(name)
        if stage is None:
            continue
        ports = list(stage.inputs)
        given = spec.inputs or [SOURCES]
        if len(given) != len(ports):
            problems.append(
                f"stage '{name}' ({spec.stage}) takes {len(ports)} input(s) {ports} but 'from' gives {len(given)}: "
                f"set from: {ports[0] if len(ports) == 1 else ports}"
            )
            continue
        for port, src in zip(ports, given):
            wanted = stage.inputs[port]
            if src == SOURCES:
                produced, producer = SOURCE_SCHEMA, "--input"
            elif src in instances:
                produced, producer = instances[src].output(), f"stage '{src}'"
            else:
                continue
            for msg in schema_misfits(produced, wanted):
                problems.append(f"stage '{name}' input '{port}' from {producer}: {msg}")

    for out in pipeline.outputs:
        if out not in pipeline.stages:
            problems.append(f"output '{out}' names no stage; outputs must be among: {', '.join(pipeline.stages)}")
    if pipeline.stages and not pipeline.outputs:
        problems.append("no outputs: list the stage(s) whose tables to write, e.g. outputs: [answer]")
    return Checked(graph=graph, instances=instances, problems=problems)


def _unread_params(pipeline: PipelineSpec, instances: dict[str, Stage]) -> list[str]:
    """Pipeline ``params`` that no stage reads: a typo (``qestion``) would otherwise pass and the default be used.

    Checked once every stage is known and some stage reads params (a pipeline whose stages read none may carry any).
    """
    if len(instances) != len(pipeline.stages):
        return []
    read = sorted({key for stage in instances.values() for key in stage.reads_params})
    if not read:
        return []
    out = []
    for key in pipeline.params:
        if key not in read:
            close = difflib.get_close_matches(key, read, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            out.append(f"params.{key}: no stage of this pipeline reads it; {hint}the stages read: {', '.join(read)}")
    return out


def validate(pipeline: PipelineSpec) -> list[str]:
    """Every problem in the pipeline, each naming its fix; empty when it can run."""
    return check(pipeline).problems


def schema_misfits(produced: pa.Schema, wanted: pa.Schema) -> list[str]:
    """Why a producer's schema cannot feed a consumer that reads ``wanted`` (extra columns are fine)."""
    out = []
    for fld in wanted:
        if fld.name not in produced.names:
            out.append(f"needs column '{fld.name}' ({fld.type}) which the producer does not make; "
                       f"producer columns: {', '.join(produced.names)}")
        elif not _compatible(produced.field(fld.name).type, fld.type):
            out.append(f"column '{fld.name}' is {produced.field(fld.name).type} but {fld.type} is needed")
    return out


def _compatible(have: pa.DataType, want: pa.DataType) -> bool:
    if have == want:
        return True
    widen = {(pa.binary(), pa.large_binary()), (pa.string(), pa.large_string())}
    return (have, want) in widen


def _instantiate(name: str, cls: type[Stage], params: dict, context: dict, problems: list[str]) -> Stage | None:
    try:
        return cls(context=context, **params)
    except ValidationError as exc:
        accepted = ", ".join(cls.Params.model_fields) or "(none)"
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(parameters)"
            if err["type"] == "extra_forbidden":
                problems.append(f"stage '{name}' ({cls.kind}): unknown parameter '{where}'; accepted: {accepted}")
            elif err["type"] == "missing":
                problems.append(f"stage '{name}' ({cls.kind}): missing required parameter '{where}'; "
                                f"set it under 'with' or --set {name}.{where}=...")
            else:
                problems.append(f"stage '{name}' ({cls.kind}): parameter '{where}' {err['msg'].lower()} "
                                f"(got {err.get('input')!r})")
        return None
    except (TypeError, ValueError) as exc:
        problems.append(f"stage '{name}' ({cls.kind}): {exc}")
        return None
