"""A wheel built from the checkout works outside it (issue 27): one package, ``docfuse``, with its shipped data.

The wheel is installed into a fresh environment that borrows the test venv's dependencies but not its editable
docfuse, and run from a directory that holds folders named ``pipelines`` and ``runtime``: a generic top-level name on
the import path would be shadowed by them, and a path relative to the source tree would not be found.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: Run inside the fresh environment: prove where docfuse came from, then do what the issue asks of a wheel.
CHECK = r"""
import json, sys
import docfuse
from docfuse import Pipeline
from docfuse.data import shipped
from docfuse.pipelines.cli import app
report = Pipeline.from_yaml("pdf_extract").run([str(shipped("sample.pdf"))])
table = next(iter(report.tables.values()))
print(json.dumps({"docfuse": docfuse.__file__, "rows": table.num_rows, "errors": table.column("error").null_count, "sample": str(shipped("sample.pdf")),
                  "head": str(shipped("pruning/smollm2-135m-instruct.safetensors")),
                  "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                                    {"pipelines", "stages", "runtime", "fusion", "data"})}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the fresh environment's python, its site-packages, a working directory with shadowing folders)."""
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp / "dist").glob("docfuse-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops <= {"docfuse", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    env_dir = tmp / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    target = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                          text=True).strip())
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    # the dependencies, as a plain path: a .pth line is not a site dir, so the test venv's editable docfuse (its own
    # .pth finder) stays out
    (target / "borrowed_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    work = tmp / "elsewhere"
    for name in ("pipelines", "runtime"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text("raise ImportError('a user folder, not docfuse')\n")
    return python, target, work


def run(python: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)


def test_the_wheel_is_one_package_that_finds_its_data_from_anywhere(installed) -> None:
    python, target, work = installed
    res = run(python, work, "-c", CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(got["docfuse"]).is_relative_to(target), f"docfuse came from {got['docfuse']}, not the wheel"
    assert Path(got["sample"]).is_file() and Path(got["sample"]).is_relative_to(target)
    assert Path(got["head"]).is_file() and Path(got["head"]).is_relative_to(target)
    assert got["modules"] == [], f"generic top-level modules were imported: {got['modules']}"
    assert got["rows"] >= 1 and got["errors"] == got["rows"], "pdf_extract failed on the shipped sample"


def test_the_installed_cli_answers_and_runs_the_fused_pipeline(installed, tmp_path) -> None:
    """``docfuse ask`` and ``pdf_qa`` with ``fused.apply=always``: the shipped fusion checkpoint and the embedded
    model, found from the installed package."""
    python, target, work = installed
    cli = "import sys; from docfuse.pipelines.cli import app; sys.argv[0] = 'docfuse'; app()"
    sample = str(target / "docfuse" / "data" / "sample.pdf")
    ask = run(python, work, "-c", cli, "ask", sample, "What is the monthly fee?", "--no-cache",
              "--set", "answer.max_new_tokens=24")
    assert ask.returncode == 0, ask.stderr[-3000:]
    assert "4,250" in ask.stdout
    out = tmp_path / "fused.parquet"
    fused = run(python, work, "-c", cli, "run", "pdf_qa", "-i", sample, "-o", str(out), "--no-cache",
                "--set", "fused.apply=always", "--set", "params.question=What is the monthly fee?",
                "--set", "answer.max_new_tokens=16")
    assert fused.returncode == 0, fused.stderr[-3000:]
    import pyarrow.parquet as pq

    (row,) = pq.read_table(out).to_pylist()
    assert row["error"] is None and row["answer"]
