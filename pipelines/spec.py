"""The pipeline spec: one object that YAML and Python both build, and nothing but data.

``Pipeline.from_yaml(text) == Pipeline.from_yaml(p.to_yaml())`` for every valid pipeline, and the Python API
(``Pipeline(...).add(...)``) produces the same object. Parsing is lenient and records problems instead of
raising, so that validation can report every problem at once.

This module imports nothing else of the engine: validation (validate.py) and execution (executor.py,
executor_ray.py) import it, never the reverse. ``pipelines.Pipeline`` (pipeline.py) is this spec plus
``validate()`` and ``run()``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

BUILTIN_DIR = Path(__file__).parent


#: What a stage's ``resources:`` may set, for a distributed engine: per instance (Ray task or actor) CPUs, GPUs
#: and memory in bytes, and for model stages the actor pool's size (``n`` or ``[min, max]``).
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "concurrency")


@dataclass
class StageSpec:
    """One node: a stage kind, the stages it reads from (in port order), its parameters, and the resources a
    distributed engine reserves for it (overriding the stage class's ``resources``; the local engine ignores them)."""

    stage: str
    inputs: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage}
        if self.inputs:
            out["from"] = self.inputs[0] if len(self.inputs) == 1 else list(self.inputs)
        if self.params:
            out["with"] = copy.deepcopy(self.params)
        if self.resources:
            out["resources"] = copy.deepcopy(self.resources)
        return out


def resource_problems(name: str, resources: Any) -> list[str]:
    """Why a stage's ``resources:`` block is unusable, each with its fix; empty when it is fine."""
    if not isinstance(resources, dict):
        return [f"stage '{name}': 'resources' must be a mapping, e.g. {{num_cpus: 1, num_gpus: 1}}"]
    problems = []
    for key, value in resources.items():
        if key not in RESOURCE_KEYS:
            problems.append(f"stage '{name}': unknown resource '{key}'; allowed are {', '.join(RESOURCE_KEYS)}")
        elif key == "concurrency":
            sizes = value if isinstance(value, list) else [value]
            if not (1 <= len(sizes) <= 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                 for v in sizes) and sizes[0] <= sizes[-1]):
                problems.append(f"stage '{name}': resources.concurrency must be a whole number of actors >= 1 or "
                                f"[min, max] with min <= max (got {value!r})")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            unit = "bytes" if key == "memory" else "a count, fractions allowed"
            problems.append(f"stage '{name}': resources.{key} must be a number >= 0 ({unit}); got {value!r}")
    return problems


@dataclass
class PipelineSpec:
    """A named DAG of stages, pipeline-level ``params``, and the stages whose tables are the outputs."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, StageSpec] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    #: Problems found while parsing (duplicate names, malformed entries); validation reports them.
    parse_problems: list[str] = field(default_factory=list, compare=False, repr=False)

    # ---- Python API -------------------------------------------------------------------------------------
    def add(self, name: str, stage: str, *, from_: str | list[str] | None = None,
            resources_: dict[str, Any] | None = None, **params: Any) -> Self:
        """Add a stage; a second stage of the same name is recorded as a problem, as in YAML.

        ``resources_`` is YAML's ``resources:`` (the trailing underscore keeps it apart from stage parameters).
        """
        if name in self.stages:
            self.parse_problems.append(f"duplicate stage name '{name}': rename one of them")
        inputs = [] if from_ is None else ([from_] if isinstance(from_, str) else list(from_))
        resources = dict(resources_ or {})
        self.parse_problems.extend(resource_problems(name, resources))
        self.stages[name] = StageSpec(stage=stage, inputs=inputs, params=params, resources=resources)
        return self

    def set(self, dotted: str, value: Any) -> None:
        """Override one value: ``params.question``, ``pages.password``, ``answer.kv.core_tokens``.

        A value of ``None`` removes that key (and so a whole block such as ``answer.kv``).
        """
        head, _, rest = dotted.partition(".")
        if not rest:
            raise KeyError(f"--set {dotted}: expected STAGE.KEY=VALUE or params.KEY=VALUE")
        if head == "params":
            target = self.params
        elif head in self.stages:
            target = self.stages[head].params
        else:
            known = ", ".join(["params", *self.stages]) or "(none)"
            raise KeyError(f"--set {dotted}: no stage named '{head}' in pipeline '{self.name}'; stages: {known}")
        keys = rest.split(".")
        for key in keys[:-1]:
            nxt = target.get(key)
            if not isinstance(nxt, dict):
                nxt = {}
                target[key] = nxt
            target = nxt
        if value is None:
            target.pop(keys[-1], None)
        else:
            target[keys[-1]] = value

    def copy(self) -> Self:
        return copy.deepcopy(self)

    # ---- YAML ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.params:
            out["params"] = copy.deepcopy(self.params)
        out["stages"] = {name: spec.to_dict() for name, spec in self.stages.items()}
        if self.outputs:
            out["outputs"] = list(self.outputs)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def from_yaml(cls, source: str | Path) -> Self:
        """Parse YAML text, a path to a YAML file, or the name of a built-in pipeline (``pdf_qa``)."""
        text = _read_source(source)
        loader = _DuplicateKeyLoader(text)
        try:
            data = loader.get_single_data()
        except yaml.YAMLError as exc:
            raise ValueError(f"pipeline YAML does not parse: {exc}") from exc
        finally:
            loader.dispose()
        if not isinstance(data, dict):
            raise ValueError("pipeline YAML must be a mapping with keys name, params, stages, outputs")
        return cls.from_dict(data, problems=list(loader.duplicates))

    @classmethod
    def from_dict(cls, data: dict[str, Any], problems: list[str] | None = None) -> Self:
        problems = problems or []
        unknown = set(data) - {"name", "params", "stages", "outputs"}
        if unknown:
            problems.append(f"unknown top-level key(s) {sorted(unknown)}: allowed are name, params, stages, outputs")
        params = data.get("params") or {}
        if not isinstance(params, dict):
            problems.append("params must be a mapping of names to values")
            params = {}
        pipe = cls(name=str(data.get("name") or "pipeline"), params=params, parse_problems=problems)
        raw_stages = data.get("stages") or {}
        if not isinstance(raw_stages, dict):
            problems.append("stages must be a mapping of stage names to {stage, from, with}")
            raw_stages = {}
        for name, entry in raw_stages.items():
            pipe.stages[str(name)] = _stage_from_dict(str(name), entry, problems)
        outputs = data.get("outputs")
        if outputs is None:
            outputs = []
        pipe.outputs = [outputs] if isinstance(outputs, str) else [str(o) for o in outputs]
        return pipe


def _stage_from_dict(name: str, entry: Any, problems: list[str]) -> StageSpec:
    if not isinstance(entry, dict) or "stage" not in entry:
        problems.append(f"stage '{name}': expected a mapping with a 'stage' key, e.g. {{stage: pdf.open}}")
        return StageSpec(stage="")
    unknown = set(entry) - {"stage", "from", "with", "resources"}
    if unknown:
        problems.append(f"stage '{name}': unknown key(s) {sorted(unknown)}; a stage takes stage, from, with, "
                        "resources")
    src = entry.get("from")
    inputs = [] if src is None else ([src] if isinstance(src, str) else [str(s) for s in src])
    params = entry.get("with") or {}
    if not isinstance(params, dict):
        problems.append(f"stage '{name}': 'with' must be a mapping of parameters")
        params = {}
    resources = entry.get("resources") or {}
    problems.extend(resource_problems(name, resources))
    if not isinstance(resources, dict):
        resources = {}
    return StageSpec(stage=str(entry["stage"]), inputs=inputs, params=params, resources=resources)


def builtin_pipelines() -> dict[str, Path]:
    return {p.stem: p for p in sorted(BUILTIN_DIR.glob("*.yaml"))}


def _read_source(source: str | Path) -> str:
    if isinstance(source, Path):
        return source.read_text()
    if "\n" not in source and source in builtin_pipelines():
        return builtin_pipelines()[source].read_text()
    if "\n" not in source and source.endswith((".yaml", ".yml")):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"pipeline file '{source}' does not exist")
        return path.read_text()
    if "\n" not in source and ":" not in source:
        names = ", ".join(builtin_pipelines())
        raise FileNotFoundError(f"'{source}' is neither a YAML file nor a built-in pipeline ({names})")
    return source


class _DuplicateKeyLoader(yaml.SafeLoader):
    """A safe loader that records duplicate mapping keys instead of silently keeping the last one."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                self.duplicates.append(
                    f"duplicate name '{key}' (line {key_node.start_mark.line + 1}): each name must be unique"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
