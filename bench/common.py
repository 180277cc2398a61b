"""Helpers shared by the benchmarks: where the corpus is, what machine this is, how to record a result."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("DOCFUSE_CORPUS", ROOT.parent / "shared" / "corpus"))
RESULTS = ROOT / "bench" / "results"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def corpus_pdfs() -> list[Path]:
    if not CORPUS.is_dir():
        raise SystemExit(f"the corpus is not at {CORPUS}; this benchmark needs ../shared/corpus")
    skip = {"encrypted", "malformed"}
    return sorted(p for p in CORPUS.rglob("*.pdf") if not skip & set(p.parts))


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"date": date.today().isoformat(), "machine": machine(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(), **result}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    return path
