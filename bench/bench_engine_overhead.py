"""The engine's overhead: pdf_extract through the local executor against the same stage calls made directly.

Both sides get the same documents in the same batches and do the same work; the executor adds batching, error
routing, schema conformance and (here disabled) caching. Alternating repeats, best of each, on a warm page cache.

    .venv/bin/python bench/bench_engine_overhead.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import corpus_pdfs, save  # noqa: E402
from docfuse.pipelines import Pipeline  # noqa: E402
from docfuse.pipelines.sources import read_batches  # noqa: E402
from docfuse.stages.pdf import PdfOpen, PdfText  # noqa: E402

REPEATS = 3


def direct(paths) -> int:
    opener, text = PdfOpen(), PdfText(tables="auto")
    rows = 0
    for batch in read_batches([str(p) for p in paths], batch_docs=8):
        docs = opener.run(batch)
        rows += text.run(docs.filter(docs.column("error").is_null())).num_rows
    return rows


def engine(paths) -> int:
    report = Pipeline.from_yaml("pdf_extract").run([str(p) for p in paths], batch_docs=8)
    return report.rows


def main() -> None:
    paths = [p for p in corpus_pdfs()]
    direct_s, engine_s = [], []
    for _ in range(REPEATS):
        t = time.perf_counter(); direct(paths); direct_s.append(time.perf_counter() - t)
        t = time.perf_counter(); engine(paths); engine_s.append(time.perf_counter() - t)
    best_d, best_e = min(direct_s), min(engine_s)
    overhead = best_e / best_d - 1
    out = save("engine_overhead", {"direct_s": [round(x, 3) for x in direct_s],
                                   "engine_s": [round(x, 3) for x in engine_s],
                                   "overhead": round(overhead, 4),
                                   "note": "both read the files and run pdf.open + pdf.text (tables: auto) in batches of 8",
                                   "command": ".venv/bin/python bench/bench_engine_overhead.py"})
    print(f"direct best {best_d:.2f} s, engine best {best_e:.2f} s: overhead {overhead * 100:.1f}% -> {out}")


if __name__ == "__main__":
    main()
