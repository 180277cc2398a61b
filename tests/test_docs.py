"""docs/ARCHITECTURE.md against the code: what the map names exists, and what it tabulates matches. No model loads.

When one of these fails, the code moved away from the map: fix the map (or the code), not the test.
"""

from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

import pytest

from docfuse.pipelines import Pipeline
from docfuse.pipelines.registry import all_stages
from docfuse.pipelines.sources import SOURCE_SCHEMA
from docfuse.pipelines.spec import builtin_pipelines
from docfuse.stages.schemas import PAGE_LAYOUT_FIELDS
from tests.test_engine_layers import runtime_imports

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("pipelines", "stages", "fusion", "runtime")
#: What a path in backticks may start with to count as a path in this repository.
TOP = {*PACKAGES, "bench", "tests", "data", "docs", "README.md", "pyproject.toml", "Makefile"}
DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.\w+)+(?::\w+)?$")


@pytest.fixture(scope="module")
def text() -> str:
    return MAP.read_text()


def shipped_stages() -> dict:
    """The registered stage kinds that docfuse ships (tests register toy stages of their own)."""
    return {kind: cls for kind, cls in all_stages().items() if cls.__module__.removeprefix("docfuse.").split(".")[0] in PACKAGES}


def spans(markdown: str) -> list[str]:
    """Everything in single backticks."""
    return re.findall(r"`([^`\n]+)`", markdown)


def sections(markdown: str) -> dict[str, str]:
    """Level-3 heading -> the text under it, up to the next heading of level 1 to 3."""
    out, heading, lines = {}, None, []
    for line in markdown.splitlines():
        if re.match(r"#{1,3} ", line):
            if heading is not None:
                out[heading] = "\n".join(lines)
            heading, lines = (line if line.startswith("### ") else None), []
        else:
            lines.append(line)
    if heading is not None:
        out[heading] = "\n".join(lines)
    return out


def rows(section: str) -> list[list[str]]:
    """The cells of each table row that starts with a backticked name (header and rule rows left out)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]


def names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_built_in_pipeline_and_stage_kind_is_on_the_map(text: str) -> None:
    named = set(spans(text))
    missing = [n for n in [*builtin_pipelines(), *shipped_stages()] if n not in named]
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}; add them where the map lists their peers"


def test_every_repository_path_the_map_cites_exists(text: str) -> None:
    cited = {s.rstrip("/") for s in spans(text) if "/" in s and " " not in s and s.split("/")[0] in TOP}
    assert len(cited) > 50, "the map cites few paths; did the backtick convention change?"
    missing = sorted(p for p in cited if not (glob.glob(str(ROOT / p)) if "*" in p else (ROOT / p).exists()))
    assert not missing, f"docs/ARCHITECTURE.md cites paths that do not exist: {missing}"


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines: functions, classes, assignments, imports."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return out


def resolves(dotted: str) -> bool:
    """``package.module.name[.member]`` names a module, then a name defined in it, then a member of that class."""
    parts = dotted.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path is not None:
            break
    else:
        return False
    rest, body = parts[cut:], ast.parse(path.read_text()).body
    for name in rest:
        node = _defined(body).get(name)
        if node is None:
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def test_every_dotted_name_the_map_cites_is_defined(text: str) -> None:
    kinds = set(all_stages())
    cited = {s for s in spans(text) if DOTTED.match(s) and s not in kinds}
    assert len(cited) > 10, "the map cites few dotted names; did the backtick convention change?"
    missing = sorted(s for s in cited if not resolves(s))
    assert not missing, f"docs/ARCHITECTURE.md cites names the code does not define: {missing}"


def test_the_column_tables_match_the_stage_schemas(text: str) -> None:
    outputs = {h: s for h, s in sections(text).items() if " output" in h}
    layout = {f.name for f in PAGE_LAYOUT_FIELDS}  # pdf.text adds them with layout: true
    for kind, cls in shipped_stages().items():
        found = [s for h, s in outputs.items() if f"`{kind}`" in h]
        assert len(found) == 1, f"docs/ARCHITECTURE.md needs one '### `{kind}` output' section with its columns"
        columns = [r[0].strip("`") for r in rows(found[0])]
        assert set(cls.output_schema.names) <= set(columns) <= set(cls.output_schema.names) | layout, (
            f"the map's `{kind}` columns {columns} are not the stage's {cls.output_schema.names}")
    source = [s for h, s in sections(text).items() if "`SOURCE`" in h]
    assert len(source) == 1 and [r[0].strip("`") for r in rows(source[0])] == SOURCE_SCHEMA.names


def test_the_pipeline_tables_match_the_built_in_yaml(text: str) -> None:
    by_heading = sections(text)
    for name in builtin_pipelines():
        found = [s for h, s in by_heading.items() if h.startswith(f"### `{name}`")]
        assert len(found) == 1, f"docs/ARCHITECTURE.md needs one '### `{name}`' section with its stages"
        pipe = Pipeline.from_yaml(name)
        mapped = {r[0].strip("`"): (r[1].strip("`"), names(r[2])) for r in rows(found[0])}
        actual = {stage: (spec.stage, spec.inputs) for stage, spec in pipe.stages.items()}
        assert mapped == actual, f"the map's {name} stages (name: (kind, reads)) are {mapped}; the YAML has {actual}"


def _package_imports(package: str) -> dict[str, set[str]]:
    """File (relative to the root) -> the other packages it imports, lazily or not, type-only too."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        found = {m.split(".")[0] for m in runtime_imports(path, type_only_too=True)} & (set(PACKAGES) - {package})
        if found:
            out[str(path.relative_to(ROOT))] = found
    return out


def test_the_import_table_matches_the_imports(text: str) -> None:
    table = {r[0].strip("`/"): r for r in rows(text) if len(r) == 3 and r[0] in {f"`{p}/`" for p in PACKAGES}}
    assert set(table) == set(PACKAGES), "the map's import table needs one row per package"
    for package, (_, imports, where) in table.items():
        files = _package_imports(package)
        actual = set().union(*files.values()) if files else set()
        assert set(names(imports)) == actual, f"{package}/ imports {sorted(actual)}; the map says {imports}"
        if where.startswith("only"):
            assert set(files) <= set(names(where)), f"{package}/: {sorted(files)} import the others; map: {where}"


def test_the_gpu_engine_reaches_the_product_through_the_decode_stage() -> None:
    """The map and README say decode.generate uses runtime.engine on CUDA; the batch-1 GPU pieces stay bench-only."""
    users = sorted(str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                   if not p.is_relative_to(ROOT / "runtime" / "gpu")
                   and any(m.startswith("runtime.engine") for m in runtime_imports(p, type_only_too=True)))
    assert "stages/decode.py" in users, "decode.generate no longer reaches the engine: update the map and README"
    batch1 = ("runtime.gpu.decode_graph", "runtime.gpu.batch", "runtime.gpu.kernel_cache")
    product = sorted(str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                     if not p.is_relative_to(ROOT / "runtime" / "gpu")
                     and any(m.startswith(batch1) for m in runtime_imports(p, type_only_too=True)))
    assert not product, f"{product} import the batch-1 GPU pieces the map calls bench only; update the map"