"""Do answers cite the page their fact sits on? Measured through ``pdf_qa_text`` on the fidelity cases (issue 26).

The planted cases of ``bench/bench_fidelity.py make`` (../shared/corpus haystacks, facts planted at known depths,
written as multi-page PDFs) know each fact's text, so the page holding it is found in the PDF (PyMuPDF). For every
question whose answer states its fact, the row's ``cited_pages`` is checked: the fact's page cited first, cited at
all, and how many pages were cited. The anchor is chance: a page drawn at random from the document's pages.

Run:  python bench/bench_citations.py --cases DIR [--docs 30] [--half tune|check] [--out citations]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: an installed docfuse wins over the tree's folder

from bench.common import save  # noqa: E402
from bench.fidelity_cases import Fact  # noqa: E402


def fact_pages(pdf: Path, fact: Fact) -> list[int]:
    """0-based pages whose text holds every part of ``fact`` (compared as ``Fact.found_in`` compares answers)."""
    import fitz

    with fitz.open(pdf) as doc:
        return [i for i, page in enumerate(doc) if fact.found_in(page.get_text())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=Path, required=True)
    ap.add_argument("--docs", type=int, default=30)
    ap.add_argument("--half", choices=["tune", "check"], default=None)
    ap.add_argument("--out", default=None, help="name under bench/results/ (without .json)")
    a = ap.parse_args()
    from docfuse.pipelines import Pipeline

    cases = [c for c in json.loads((a.cases / "cases.json").read_text())
             if c["generator"].startswith("planted") and a.half in (None, c["half"])][: a.docs]
    rows = []
    for case in cases:
        pdf = a.cases / case["pdf"]
        pipeline = Pipeline.from_yaml("pdf_qa_text")
        pipeline.set("params.questions", case["questions"])
        pipeline.set("answer.max_new_tokens", 32)
        started = time.perf_counter()
        out = pipeline.run([str(pdf)], errors="raise").tables["answer"].to_pylist()
        seconds = time.perf_counter() - started
        import fitz

        with fitz.open(pdf) as doc:
            n_pages = doc.page_count
        for i, (row, fact) in enumerate(zip(out, case["facts"])):
            if not fact:
                continue
            fact = Fact(fact["kind"], fact["text"], "", tuple(fact["parts"]))
            where = fact_pages(pdf, fact)
            cited = row["cited_pages"] or []
            rows.append({"case": case["id"], "index": i, "pages": n_pages, "fact_pages": where, "cited": cited,
                         "answered": fact.found_in(row["answer"] or ""), "answer": row["answer"],
                         "first": bool(cited) and cited[0] in where, "any": bool(set(cited) & set(where)),
                         "seconds": seconds})
            r = rows[-1]
            print(f"{case['id']}#{i} answered={r['answered']} fact={where} cited={cited} {row['answer']!r:.60}",
                  flush=True)
    answered = [r for r in rows if r["answered"] and r["fact_pages"]]
    summary = {
        "documents": len(cases), "planted_questions": len(rows), "answered": len(answered),
        "fact_page_cited_first": sum(r["first"] for r in answered),
        "fact_page_cited": sum(r["any"] for r in answered),
        "share_cited_first": sum(r["first"] for r in answered) / max(1, len(answered)),
        "share_cited": sum(r["any"] for r in answered) / max(1, len(answered)),
        "chance": statistics.mean(len(r["fact_pages"]) / r["pages"] for r in answered) if answered else None,
        "cited_pages_mean": statistics.mean(len(r["cited"]) for r in answered) if answered else None,
        "unanswered_with_citation": sum(bool(r["cited"]) for r in rows if not r["answered"]),
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        save(a.out, {"cases": str(a.cases), "half": a.half, "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
