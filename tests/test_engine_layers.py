"""The engine's modules import in one direction: the spec is data, validation and execution sit above it."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

from docfuse.pipelines import Pipeline, executor, executor_ray, sources, validate
from docfuse.pipelines.engines import choose_executor
from docfuse.pipelines.executor import LocalExecutor
from tests.test_engine import TOY_YAML

ENGINE = Path(__file__).resolve().parents[1] / "pipelines"


def runtime_imports(path: Path, type_only_too: bool = False) -> set[str]:
    """Modules ``path`` imports when it runs (lazily inside functions too); those under ``if TYPE_CHECKING`` only
    with ``type_only_too``. Named by folder, as the repository lays them out: ``docfuse.runtime.kv`` is
    ``runtime.kv``."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_only_too else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m.removeprefix("docfuse.") for m in found}


def engine_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for path in ENGINE.glob("*.py"):
        name = f"pipelines.{path.stem}"
        graph.add_node(name)
        graph.add_edges_from((name, m) for m in runtime_imports(path) if m.startswith("pipelines.") and m != name)
    return graph


def test_the_engine_modules_import_each_other_without_a_circle() -> None:
    graph = engine_graph()
    assert nx.is_directed_acyclic_graph(graph), list(nx.simple_cycles(graph))
    assert not set(graph.successors("pipelines.spec")), "spec.py is pure data: it imports no engine module"
    for below in ("pipelines.validate", "pipelines.executor", "pipelines.executor_ray"):
        assert "pipelines.pipeline" not in nx.descendants(graph, below), f"{below} must not import the public API"


def test_the_engine_imports_no_stage_library_model_or_trainer() -> None:
    libraries = {"stages", "fusion", "runtime"}
    found = {f"{path.name}: {m}" for path in ENGINE.glob("*.py") for m in runtime_imports(path, type_only_too=True)
             if m.split(".")[0] in libraries}
    assert not found, f"pipelines/ must reach them only through entry points (registry.py, commands.py): {found}"


def test_sources_is_one_name_shared_by_validation_and_both_executors() -> None:
    assert validate.SOURCES is sources.SOURCES is executor.SOURCES is executor_ray.SOURCES


def test_a_stage_cannot_take_the_name_of_the_input_documents() -> None:
    pipe = Pipeline.from_yaml(TOY_YAML)
    pipe.stages[sources.SOURCES] = pipe.stages.pop(next(iter(pipe.stages)))
    assert any(f"'{sources.SOURCES}' is reserved" in p for p in pipe.validate())


def test_one_function_chooses_the_executor_and_names_both_spellings_of_the_fix() -> None:
    pipe = Pipeline.from_yaml(TOY_YAML)
    assert isinstance(choose_executor(pipe, "local"), LocalExecutor)
    with pytest.raises(ValueError, match="engine='local' or engine='ray'.*--engine local or --engine ray"):
        choose_executor(pipe, "spark")
    with pytest.raises(ValueError, match="only --engine ray uses \\(engine='ray' in Python\\)"):
        choose_executor(pipe, "local", address="auto")
