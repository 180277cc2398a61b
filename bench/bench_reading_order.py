"""Reading order on the generated set (bench/reading_order_set.py): pdf_extract, PyMuPDF's sorted text and
pymupdf4llm, in one run, per layout family and overall (issue 28).

    .venv/bin/python bench/bench_reading_order.py [--out-dir DIR] [--families a,b] [--seed N]

The set is generated into ``--out-dir`` (default: a temporary folder). Scores, per system and family:

- similarity: ``difflib.SequenceMatcher(None, truth, output, autojunk=False).ratio()`` over lower-cased words
  (letters and digits; punctuation and Markdown syntax dropped), averaged over pages. It rewards words in the right
  order and punishes both lost and extra words (a running header left in costs as much as a word dropped).
- unbroken: share of the true body sentences whose words appear contiguous in the output, so a footnote, sidebar or
  line number read into the middle of a sentence counts against it even where the page's similarity stays high.
- false tables: share of pages without a table where the output holds a Markdown table (a ``|`` line followed by
  a ``|---`` separator line).
- table recall: share of true tables with at least 70% of their non-empty cells in the output's ``|`` rows (as in
  bench_extract.py). Plain sorted text has no tables: n/a.
- pages/s: pages over the seconds a system takes on that family's PDFs (each system warmed up on one PDF first).

``line_numbered`` is also scored against the truth that keeps each line's number at its start (all three systems;
the issue asks it of pdf_extract).
pymupdf4llm runs last, because importing it activates PyMuPDF's layout model for the whole process; pdf_extract
does not use that model (stages/pdf_tables.py asks find_tables for ``use_layout=False``). The full set's result
goes to bench/results/reading_order.json; a ``--families`` subset to reading_order_subset.json.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from statistics import mean

import pymupdf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save  # noqa: E402
from bench.reading_order_set import FAMILIES, make_set  # noqa: E402

SYSTEMS = ("docfuse", "get_text_sort", "pymupdf4llm")
Key = tuple[str, int]   # (pdf path, 0-based page)

_DROP = [re.compile(p, re.M) for p in (
    r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$",   # table separator rows
    r"==>.*?<==",                                           # pymupdf4llm's "picture ... intentionally omitted"
    r"!\[[^\]]*\]\([^)]*\)",                                # Markdown images
    r"<[^>]+>",                                             # HTML tags (<br>, <sup>)
)]


# --------------------------------------------------------------------------------------------------- scoring

def words(text: str) -> list[str]:
    """Lower-cased words of letters and digits, with Markdown syntax and punctuation gone."""
    for pattern in _DROP:
        text = pattern.sub(" ", text)
    return re.findall(r"[0-9a-z]+", text.lower())


def similarity(truth: str, output: str) -> float:
    return difflib.SequenceMatcher(None, words(truth), words(output), autojunk=False).ratio()


def unbroken(sentences: list[str], output: str) -> int:
    """How many of ``sentences`` appear with their words contiguous in ``output``."""
    flat = f" {' '.join(words(output))} "
    return sum(f" {' '.join(words(s))} " in flat for s in sentences if words(s))


def has_markdown_table(output: str) -> bool:
    return re.search(r"^\s*\|.*\n\s*\|\s*:?-{3,}", output, re.M) is not None


def _letters(text: str) -> str:
    return re.sub(r"[^0-9a-z]+", "", text.lower())


def tables_found(tables: list[list[list[str]]], output: str) -> int:
    """True tables with at least 70% of their non-empty cells in the output's Markdown table rows."""
    rows = _letters(" ".join(line for line in output.splitlines() if line.strip().startswith("|")))
    found = 0
    for table in tables:
        cells = [_letters(c) for row in table for c in row if _letters(c)]
        found += sum(c in rows for c in cells) >= 0.7 * len(cells)
    return found


def score_page(record: dict, output: str) -> dict:
    """One page's raw counts, summed or averaged per family by ``summarise``."""
    # line-numbered pages: every system keeps the margin numbers (pdf.text's default line_numbers: keep), so the
    # truth that keeps them is the one scored; the truth without them is kept beside it
    truth = record.get("truth_numbered", record["truth"])
    score = {"similarity": similarity(truth, output),
             "sentences": len(record["sentences"]), "unbroken": unbroken(record["sentences"], output),
             "tables": len(record["tables"]), "tables_found": tables_found(record["tables"], output),
             "no_table_page": not record["has_table"],
             "false_table": not record["has_table"] and has_markdown_table(output)}
    if "truth_numbered" in record:
        score["similarity_without_numbers"] = similarity(record["truth"], output)  # against the truth without numbers
    return score


# --------------------------------------------------------------------------------------------------- systems

def run_docfuse(paths: list[Path]) -> tuple[dict[Key, str], float]:
    """pdf_extract as bench_extract.py runs it; the page's Markdown is the ``text`` column."""
    from docfuse.pipelines import Pipeline

    pipe = Pipeline.from_yaml("pdf_extract")
    start = time.perf_counter()
    report = pipe.run([str(p) for p in paths], batch_docs=4)
    seconds = time.perf_counter() - start
    pages = {(r["source"], r["page"]): r["text"] or "" for r in report.tables["text"].to_pylist()
             if r["page"] is not None}
    return pages, seconds


def run_get_text(paths: list[Path]) -> tuple[dict[Key, str], float]:
    pages = {}
    start = time.perf_counter()
    for path in paths:
        with pymupdf.open(path) as doc:
            for page in doc:
                pages[(str(path), page.number)] = page.get_text(sort=True)
    return pages, time.perf_counter() - start


def run_pymupdf4llm(paths: list[Path]) -> tuple[dict[Key, str], float]:
    import pymupdf4llm

    pages = {}
    start = time.perf_counter()
    for path in paths:
        for i, chunk in enumerate(pymupdf4llm.to_markdown(str(path), page_chunks=True, show_progress=False)):
            number = chunk.get("metadata", {}).get("page", i + 1)
            pages[(str(path), int(number) - 1)] = chunk.get("text", "")
    return pages, time.perf_counter() - start


RUNNERS: dict[str, Callable[[list[Path]], tuple[dict[Key, str], float]]] = {
    "docfuse": run_docfuse, "get_text_sort": run_get_text, "pymupdf4llm": run_pymupdf4llm}


def run_system(name: str, records: list[dict]) -> tuple[dict[Key, str], dict[str, float]]:
    """Every page's output and the seconds per family, after one warm-up PDF (imports, model loading)."""
    runner = RUNNERS[name]
    by_family: dict[str, list[Path]] = defaultdict(list)
    for r in records:
        if Path(r["pdf"]) not in by_family[r["family"]]:
            by_family[r["family"]].append(Path(r["pdf"]))
    runner([next(iter(by_family.values()))[0]])
    outputs: dict[Key, str] = {}
    seconds: dict[str, float] = {}
    for family, paths in by_family.items():
        pages, seconds[family] = runner(paths)
        outputs.update(pages)
    return outputs, seconds


# --------------------------------------------------------------------------------------------------- report

def summarise(scores: list[dict], seconds: float, with_tables: bool) -> dict:
    """Per-page scores of one system on one family (or all) into the reported figures."""
    no_table = [s for s in scores if s["no_table_page"]]
    tables = sum(s["tables"] for s in scores)
    sentences = sum(s["sentences"] for s in scores)
    out = {"pages": len(scores), "similarity": round(mean(s["similarity"] for s in scores), 4),
           "unbroken": round(sum(s["unbroken"] for s in scores) / sentences, 4) if sentences else None,
           "false_tables": round(sum(s["false_table"] for s in no_table) / len(no_table), 4) if no_table else None,
           "table_recall": (round(sum(s["tables_found"] for s in scores) / tables, 4)
                            if tables and with_tables else None),
           "seconds": round(seconds, 3), "pages_per_s": round(len(scores) / seconds, 2) if seconds else None}
    numbered = [s["similarity_without_numbers"] for s in scores if "similarity_without_numbers" in s]
    if numbered:
        out["similarity_without_numbers"] = round(mean(numbered), 4)
    return out


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(results: dict[str, dict[str, dict]]) -> None:
    head = f"{'family':<16} {'system':<14} {'pages':>5} {'similarity':>10} {'unbroken':>9} {'false tbl':>9} " \
           f"{'tbl recall':>10} {'pages/s':>8}"
    print(head)
    print("-" * len(head))
    for family, systems in results.items():
        for name, m in systems.items():
            print(f"{family:<16} {name:<14} {m['pages']:>5} {fmt(m['similarity']):>10} {fmt(m['unbroken']):>9} "
                  f"{fmt(m['false_tables']):>9} {fmt(m['table_recall']):>10} {fmt(m['pages_per_s'], 1):>8}")
    numbered = {name: m["similarity_without_numbers"] for name, m in results.get("line_numbered", {}).items()}
    if numbered:
        print("line_numbered against the truth without the line numbers (what line_numbers: drop aims at): "
              + ", ".join(f"{name} {value:.3f}" for name, value in numbered.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, help="where the set's PDFs go (default: a temporary folder)")
    parser.add_argument("--families", help=f"comma-separated subset of: {','.join(FAMILIES)}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    families = tuple(args.families.split(",")) if args.families else FAMILIES
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out_dir or Path(tmp)
        start = time.perf_counter()
        records = make_set(out_dir, seed=args.seed, families=families)
        generation = time.perf_counter() - start
        print(f"generated {len(records)} pages in {generation:.2f} s into {out_dir}", flush=True)
        bench_start = time.perf_counter()
        results, per_page = evaluate(records, families)
        bench_seconds = time.perf_counter() - bench_start
    print_table(results)
    name = "reading_order" if set(families) == set(FAMILIES) else "reading_order_subset"
    path = save(name, {"seed": args.seed, "pages": len(records), "generation_s": round(generation, 2),
                       "bench_s": round(bench_seconds, 1), "families": results, "per_page": per_page,
                       "command": shlex.join([".venv/bin/python", "bench/bench_reading_order.py", *sys.argv[1:]])})
    print(f"generation {generation:.1f} s, systems and scoring {bench_seconds:.1f} s -> {path}")


def evaluate(records: list[dict], families: tuple[str, ...]) -> tuple[dict[str, dict[str, dict]], list[dict]]:
    """Run every system over the records' PDFs and score them per family, then overall; also each page's
    similarity per system (to find the pages a change moves)."""
    results: dict[str, dict[str, dict]] = {f: {} for f in families}
    results["overall"] = {}
    per_page = [{"pdf": Path(r["pdf"]).name, "page": r["page"], "family": r["family"]} for r in records]
    for name in SYSTEMS:
        outputs, seconds = run_system(name, records)
        scores: dict[str, list[dict]] = defaultdict(list)
        for r, row in zip(records, per_page, strict=True):
            scores[r["family"]].append(score_page(r, outputs.get((r["pdf"], r["page"]), "")))
            row[name] = round(scores[r["family"]][-1]["similarity"], 4)
        missing = sum((r["pdf"], r["page"]) not in outputs for r in records)
        if missing:
            print(f"warning: {name} gave no output for {missing} pages (scored as empty)", flush=True)
        for family in families:
            results[family][name] = summarise(scores[family], seconds[family], name != "get_text_sort")
        results["overall"][name] = summarise([s for f in families for s in scores[f]], sum(seconds.values()),
                                             name != "get_text_sort")
        print(f"{name}: {results['overall'][name]}", flush=True)
    return results, per_page


if __name__ == "__main__":
    main()
