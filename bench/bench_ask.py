"""`docfuse ask` end to end on a 10-page PDF that the project generates: wall time and peak memory.

Runs the real CLI in a fresh process (model load, PDF extraction, prefill, decoding), with no stage cache, and
reads the child's peak RSS from the kernel.

    .venv/bin/python bench/bench_ask.py [--tty]

``--tty`` runs it as a user at a terminal sees it (stdout and stderr on pseudo-terminals): seconds from the start to
the first progress on stderr, to the first answer text streamed on stdout, and to the end, against the time to first
token the run reports (issue 26: progress within 1 s, the answer's first token as soon as it exists).
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


def on_terminals(argv: list[str]) -> dict:
    """Run ``argv`` with stdout and stderr on two pseudo-terminals; when each first wrote, and everything written."""
    import pty
    import select

    out_master, out_slave = pty.openpty()
    err_master, err_slave = pty.openpty()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=out_slave, stderr=err_slave, stdin=subprocess.DEVNULL, close_fds=True)
    os.close(out_slave)
    os.close(err_slave)
    first: dict[int, float] = {}
    data: dict[int, bytes] = {out_master: b"", err_master: b""}
    open_fds = {out_master, err_master}
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [], 0.05)
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed its end
                chunk = b""
            if not chunk:
                open_fds.discard(fd)
                continue
            first.setdefault(fd, time.perf_counter() - start)
            data[fd] += chunk
    proc.wait()
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - start,
            "first_stdout_s": first.get(out_master), "first_stderr_s": first.get(err_master),
            "stdout": data[out_master].decode(errors="replace"), "stderr": data[err_master].decode(errors="replace")}


def tty_runs(pdf: Path, docfuse: str) -> None:
    import re

    runs = []
    for _ in range(2):
        r = on_terminals([docfuse, "ask", str(pdf), QUESTION, "--no-cache"])
        if r["returncode"]:
            raise SystemExit(r["stderr"][-2000:])
        ttft = re.search(r"time to first token ([0-9.]+) s", r["stderr"])
        runs.append({k: r[k] for k in ("wall_s", "first_stdout_s", "first_stderr_s")} |
                    {"reported_ttft_s": float(ttft.group(1)) if ttft else None,
                     "answer": re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", r["stdout"]).strip()[:200]})
        print(runs[-1])
    out = save("ask_tty", {"pages": 10, "runs": runs, "command": ".venv/bin/python bench/bench_ask.py --tty"})
    print(f"first progress {min(r['first_stderr_s'] for r in runs):.2f} s, first answer text "
          f"{min(r['first_stdout_s'] for r in runs):.1f} s, wall {min(r['wall_s'] for r in runs):.1f} s -> {out}")


def main() -> None:
    tty = "--tty" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        pdf = Path(tmp) / "ten_pages.pdf"
        subprocess.run([sys.executable, str(ROOT / "data" / "make_sample_pdf.py"), "--pages", "10", "--out", str(pdf)],
                       check=True)
        docfuse = str(Path(sys.executable).parent / "docfuse")
        if tty:
            return tty_runs(pdf, docfuse)
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
