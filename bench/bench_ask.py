"""`docfuse ask` end to end on a 10-page PDF that the project generates: wall time and peak memory.

Runs the real CLI in a fresh process (model load, PDF extraction, prefill, decoding), with no stage cache, and
reads the child's peak RSS from the kernel.

    .venv/bin/python bench/bench_ask.py
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ROOT, save  # noqa: E402

QUESTION = "What is the monthly fee, and when is it due?"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pdf = Path(tmp) / "ten_pages.pdf"
        subprocess.run([sys.executable, str(ROOT / "data" / "make_sample_pdf.py"), "--pages", "10", "--out", str(pdf)],
                       check=True)
        docfuse = str(Path(sys.executable).parent / "docfuse")
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            res = subprocess.run([docfuse, "ask", str(pdf), QUESTION, "--no-cache"], capture_output=True, text=True)
            runs.append(time.perf_counter() - start)
            if res.returncode != 0:
                raise SystemExit(res.stderr)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    out = save("ask", {"pages": 10, "seconds": [round(r, 2) for r in runs], "peak_rss_bytes": peak,
                       "answer": res.stdout.strip(), "stats": res.stderr.strip().splitlines()[-1:],
                       "threads": os.cpu_count(), "command": ".venv/bin/python bench/bench_ask.py"})
    print(f"docfuse ask, 10 pages: {min(runs):.1f} s (runs {runs}), peak RSS {peak / 2**20:.0f} MiB -> {out}")


if __name__ == "__main__":
    main()
