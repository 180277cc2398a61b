"""pdf_extract on the local engine against the Ray engine, on this machine: what Ray costs, and what it gives.

The same corpus PDFs, the same pipeline, no cache, in one process: the local engine (one core), then Ray Data on a
local Ray started once, sized to the machine (``ray.init(num_cpus=<cores>)``). Ray's start-up is timed apart, and
its first run (workers still starting) is reported apart from the warm ones. Alternating repeats, best of each;
the Ray rows are checked equal to the local ones. Batches of 8 documents are the CLI's default; batches of 2 give
Ray more blocks to spread over the cores.

    .venv/bin/python bench/bench_ray.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import corpus_pdfs, save  # noqa: E402
from docfuse.pipelines import Pipeline  # noqa: E402
from docfuse.pipelines.executor_ray import ensure_ray  # noqa: E402

REPEATS = 3
CONFIGS = (("local", 8), ("ray", 8), ("ray", 2))


def run(paths: list[str], engine: str, batch_docs: int):
    start = time.perf_counter()
    report = Pipeline.from_yaml("pdf_extract").run(paths, batch_docs=batch_docs, engine=engine)
    return time.perf_counter() - start, report.tables["text"]


def main() -> None:
    paths = [str(p) for p in corpus_pdfs()]
    t = time.perf_counter()
    ensure_ray()
    ray_start_s = time.perf_counter() - t
    seconds: dict[str, list[float]] = {f"{e}/{b}": [] for e, b in CONFIGS}
    reference = None
    pages = 0
    for _ in range(REPEATS):
        for engine, batch_docs in CONFIGS:
            s, table = run(paths, engine, batch_docs)
            seconds[f"{engine}/{batch_docs}"].append(round(s, 3))
            rows = table.sort_by([("doc_id", "ascending"), ("page", "ascending")])
            if reference is None:
                reference, pages = rows, table.column("error").null_count  # pages without an error
            elif not rows.equals(reference):
                raise SystemExit(f"{engine} with batches of {batch_docs} gave other rows than the local engine")
    best = {k: min(v) for k, v in seconds.items()}
    result = {
        "documents": len(paths), "pages": pages, "cores": os.cpu_count(), "ray_start_s": round(ray_start_s, 2),
        "seconds": seconds,
        "pages_per_s": {k: round(pages / v, 2) for k, v in best.items()},
        "ray_first_run_s": seconds["ray/8"][0],
        "ray_overhead_vs_local": round(best["ray/8"] / best["local/8"] - 1, 3),
        "note": "pdf_extract, no cache; key = engine/batch_docs; pages_per_s from the best of the repeats; "
                "rows checked equal across engines; ray_start_s (ray.init) is not in any run",
        "command": ".venv/bin/python bench/bench_ray.py",
    }
    out = save("ray", result)
    print(f"{len(paths)} documents, {pages} pages; Ray start {ray_start_s:.1f} s (not counted)")
    for key, value in result["pages_per_s"].items():
        print(f"  {key:8s} best {best[key]:6.2f} s  {value:6.2f} pages/s   runs {seconds[key]}")
    print(f"ray/8 against local/8: {result['ray_overhead_vs_local'] * 100:+.1f}% time -> {out}")


if __name__ == "__main__":
    main()
