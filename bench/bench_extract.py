"""pdf_extract against pymupdf4llm.to_markdown over the corpus PDFs: pages/s and table recall, in one run.

Table recall: the reference tables are what PyMuPDF's table finder returns when run on every page (the slow,
exhaustive setting). A system recalls a table when at least 70% of its non-empty cells appear in Markdown table
rows of that system's output for the page. The same reference scores both systems, and also our own
``tables: always`` setting, which measures what the ``auto`` gate gives up for its speed.

    .venv/bin/python bench/bench_extract.py
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import pymupdf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import corpus_pdfs, save  # noqa: E402
from docfuse.pipelines import Pipeline  # noqa: E402


def norm(text: str) -> str:
    """Letters and digits only: table finders differ in spacing, thousands separators and line breaks."""
    return re.sub(r"[^0-9a-z]+", "", (text or "").lower())


def reference_tables(paths: list[Path]) -> dict[tuple[str, int], list[list[str]]]:
    ref: dict[tuple[str, int], list[list[str]]] = defaultdict(list)
    for path in paths:
        with pymupdf.open(path) as doc:
            for page in doc:
                for table in page.find_tables().tables:
                    cells = [norm(c) for row in table.extract() for c in row if c and norm(c)]
                    if len(cells) >= 4:
                        ref[(str(path), page.number)].append(cells)
    return ref


def table_rows(markdown: str) -> str:
    return norm(" ".join(line for line in markdown.splitlines() if line.strip().startswith("|")))


def recall(ref, pages: dict[tuple[str, int], str]) -> tuple[int, int]:
    found = total = 0
    for key, tables in ref.items():
        rows = table_rows(pages.get(key, ""))
        for cells in tables:
            total += 1
            hit = sum(1 for c in cells if c in rows)
            found += hit >= 0.7 * len(cells)
    return found, total


def run_docfuse(paths: list[Path], tables: str) -> tuple[dict, float, int]:
    pipe = Pipeline.from_yaml("pdf_extract")
    pipe.set("text.tables", tables)
    start = time.perf_counter()
    report = pipe.run([str(p) for p in paths], batch_docs=4)
    seconds = time.perf_counter() - start
    table = report.tables["text"]
    pages = {(r["source"], r["page"]): r["text"] or "" for r in table.to_pylist() if r["page"] is not None}
    return pages, seconds, len(pages)


def run_pymupdf4llm(paths: list[Path]) -> tuple[dict, float, int]:
    import pymupdf4llm

    pages = {}
    start = time.perf_counter()
    for path in paths:
        chunks = pymupdf4llm.to_markdown(str(path), page_chunks=True, show_progress=False)
        for i, chunk in enumerate(chunks):
            number = chunk.get("metadata", {}).get("page", i + 1)
            pages[(str(path), int(number) - 1)] = chunk.get("text", "")
    return pages, time.perf_counter() - start, len(pages)


def main() -> None:
    paths = corpus_pdfs()
    ref = reference_tables(paths)
    results = {}
    for name, fn in [("pymupdf4llm", lambda: run_pymupdf4llm(paths)),
                     ("docfuse_auto", lambda: run_docfuse(paths, "auto")),
                     ("docfuse_always", lambda: run_docfuse(paths, "always"))]:
        pages, seconds, n = fn()
        found, total = recall(ref, pages)
        results[name] = {"pages": n, "seconds": round(seconds, 2), "pages_per_s": round(n / seconds, 2),
                         "tables_found": found, "tables_reference": total,
                         "table_recall": round(found / total, 3) if total else None}
        print(name, results[name], flush=True)
    speedup = results["docfuse_auto"]["pages_per_s"] / results["pymupdf4llm"]["pages_per_s"]
    out = save("extract", {"documents": len(paths), "systems": results,
                           "speedup_vs_pymupdf4llm": round(speedup, 2),
                           "command": ".venv/bin/python bench/bench_extract.py"})
    print(f"pdf_extract (auto) is {speedup:.2f}x pymupdf4llm's pages/s -> {out}")


if __name__ == "__main__":
    main()
