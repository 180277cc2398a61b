"""What a run executes, decided before its first batch: the stages the outputs need, less those that feed only
input ports their consumers will not read (``Stage.unread_inputs``).

Why before: a stage found useless after it ran saves nothing (pdf_qa rendered every page and ran the ViT, then
its fusion stayed text-only). Both engines plan here, so they skip the same stages and warn the same way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import networkx as nx

from docfuse.pipelines.stage import Stage, Unread

if TYPE_CHECKING:
    from docfuse.pipelines.spec import PipelineSpec

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """The stages to run in topological order, the ports left unread, and what does not run and why."""

    order: list[str]
    unread: dict[str, dict[int, Unread]]  # stage -> {port index: why it is not read}
    skipped: dict[str, str]  # stage that does not run -> why
    warnings: list[str]

    def announce(self) -> None:
        """Log the warnings, once per run, before its first batch (the engines call this; validate prints them)."""
        for text in self.warnings:
            log.warning("%s", text)


def make_plan(pipeline: PipelineSpec, graph: nx.DiGraph, stages: dict[str, Stage]) -> Plan:
    """Ask every stage which ports it will not read, then keep only the stages the outputs still need."""
    unread = {name: ports for name, stage in stages.items() if (ports := unread_ports(name, stage, pipeline))}
    everything = needed(pipeline, {})
    kept = needed(pipeline, unread)
    topo = [n for n in nx.topological_sort(graph) if n in kept]
    skipped: dict[str, str] = {}
    warnings = []
    for name in topo:
        for port, reason in unread.get(name, {}).items():
            src = pipeline.stages[name].inputs[port]
            cut = [n for n in nx.topological_sort(graph) if n in ({src} | nx.ancestors(graph, src)) - kept]
            for n in cut:
                skipped.setdefault(n, f"only stage '{name}' input '{port_name(stages[name], port)}' needs it, "
                                      f"and that input is not read: {reason.why}")
            if reason.enable:
                warnings.append(warning(name, stages[name], port, reason, cut))
    return Plan(order=topo, unread=unread, skipped=skipped, warnings=warnings)


def unread_ports(name: str, stage: Stage, pipeline: PipelineSpec) -> dict[int, Unread]:
    """``stage.unread_inputs()`` by port index, for the ports this pipeline wires."""
    ports = list(stage.inputs)
    found = stage.unread_inputs()
    wrong = sorted(set(found) - set(ports))
    if wrong:
        raise ValueError(f"stage '{name}' ({stage.kind}) says it will not read input(s) {wrong}, which it does not "
                         f"have; its inputs are {ports}: fix its unread_inputs()")
    wired = pipeline.stages[name].inputs
    return {ports.index(p): why for p, why in found.items() if ports.index(p) < len(wired)}


def needed(pipeline: PipelineSpec, unread: dict[str, dict[int, Unread]]) -> set[str]:
    """The stages the outputs reach through the ports that are read."""
    seen: set[str] = set()
    todo = list(pipeline.outputs)
    while todo:
        name = todo.pop()
        if name in seen or name not in pipeline.stages:
            continue
        seen.add(name)
        todo += [src for port, src in enumerate(pipeline.stages[name].inputs) if port not in unread.get(name, {})]
    return seen


def port_name(stage: Stage, port: int) -> str:
    return list(stage.inputs)[port]


def warning(name: str, stage: Stage, port: int, reason: Unread, cut: list[str]) -> str:
    """What the user reads: which input is ignored and why, what does not run, what to set and what it costs."""
    skipping = f" Stage(s) {', '.join(cut)} do not run." if cut else ""
    sets = " ".join(f"--set {name}.{key}={_yaml(value)}" for key, value in reason.enable.items())
    cost = f": {reason.cost}" if reason.cost else ""
    return (f"stage '{name}' ({stage.kind}) will not read its input '{port_name(stage, port)}': {reason.why}."
            f"{skipping} To read it anyway, {sets}{cost}.")


def _yaml(value: Any) -> str:
    """A --set value as the command line takes it."""
    return value if isinstance(value, str) else json.dumps(value)
