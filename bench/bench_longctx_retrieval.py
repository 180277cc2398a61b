"""Long texts past the context (issue 26): does ``truncate: retrieve`` read the part that answers the question?

The corpus's LEval sets with free-text answers (``../shared/corpus/longctx/leval``: ``multidoc_qa``, ``scientific_qa``)
hold documents of 2.5K-7K tokens, each with several questions and reference answers: every one fits the embedded
model's 8,192 positions. So each question's own document is set among other documents of the same set (seeded
order, its own at a random place) until the text holds ``--tokens`` tokens (default 24K, three contexts): a long
document whose answering part is known, with distractors of the same kind around it. ``text_qa``'s own stages build
the prompt (``text.pages`` splits each document into pages, ``decode.generate`` plans the read with the embedded
model's tokenizer and context) under each ``truncate`` mode, and the prompt is compared with what answers:

* **own document read**: the share of questions for which the prompt holds at least one page of their document;
* **own pages**: the share of the document's pages the prompt holds;
* **answer words**: the share of the reference answer's content words (3+ letters, not a stop word) that the
  prompt's text holds (the question's own document alone is the ceiling: answers are written, not copied).

Pages drawn at random up to the retrieve prompt's token budget (seeded, one draw per question) are the floor. No
token is decoded, so it runs in about a minute; nothing here was tuned on these questions.

``--answer N`` also answers N of the questions (spread evenly over the list) with the embedded model in its default
dtype, from the ``head`` prompt and from the ``retrieve`` prompt (``decode.generate``'s session: chat prompt, stop
rules, 48 new tokens), and scores each answer against the reference: word F1 (SQuAD style) and whether it holds
half of the reference's content words. About 30 s an answer on 2 cores.

Run:  python bench/bench_longctx_retrieval.py --out bench/results/longctx_retrieval.json [--answer 16]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.bench_fidelity's word F1
LEVAL = ROOT.parent / "shared" / "corpus" / "longctx" / "leval"
SETS = ("multidoc_qa", "scientific_qa")
MODES = ("head", "head_tail", "retrieve")
_WORD = re.compile(r"[a-z0-9]+")
#: Words an answer shares with any text: they say nothing about whether the prompt holds it.
STOP = frozenset("""the and for are but not you all any can had her was one our out has him his how its may new now
old see two who did get let put say she too use that with have this will your from they been were what when which
their there about would these other into more some than them then also only such most very just over each many
because should could where while does those both after before being through between under""".split())


def content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) >= 3 and w not in STOP}


def coverage(answer: set[str], text: str) -> float | None:
    return len(answer & content_words(text)) / len(answer) if answer else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leval", type=Path, default=LEVAL)
    parser.add_argument("--tokens", type=int, default=24576, help="length of each long text (own document + others)")
    parser.add_argument("--per-doc", type=int, default=4, help="questions asked of each document (its first ones)")
    parser.add_argument("--answer", type=int, default=0, help="also answer this many questions from head and retrieve")
    parser.add_argument("--page-chars", type=int, default=3000, help="text.pages' page size (its default)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "longctx_retrieval.json")
    args = parser.parse_args(argv)
    if not args.leval.exists():
        raise SystemExit(f"{args.leval} is missing: this benchmark needs ../shared/corpus")
    from docfuse.runtime.page_select import PageIndex
    from docfuse.runtime.prompt import document_text
    from docfuse.stages.decode import DecodeGenerate
    from docfuse.stages.text_split import split_pages

    stages = {mode: DecodeGenerate(context={"question": "?"}, truncate=mode, dtype="float32", device="cpu")
              for mode in MODES}
    for stage in stages.values():
        stage.setup()
    tokenizer = stages["retrieve"].session.tokenizer
    limit = stages["retrieve"].session.limit
    rng = random.Random(0)
    rows: list[dict] = []
    prompts: dict[tuple[int, str], tuple[list[int], str]] = {}  # (row, mode) -> document prefix ids, question prompt
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    for name in SETS:
        records = [json.loads(line) for line in (args.leval / f"{name}.jsonl").open()]
        split = [split_pages(r["input"], args.page_chars) for r in records]
        sizes = [count(r["input"]) for r in records]
        for d, record in enumerate(records):
            others = [o for o in rng.sample(range(len(records)), len(records)) if o != d]
            members, total = [d], sizes[d]
            for o in others:
                if total >= args.tokens:
                    break
                members.insert(rng.randint(0, len(members)), o)
                total += sizes[o]
            pages, own = [], []
            for m in members:
                for text in split[m]:
                    if m == d:
                        own.append(len(pages))
                    pages.append((len(pages), text))
            index = PageIndex(pages, count)  # the pages' token costs, for the random floor's budget
            for question, reference in list(zip(record["instructions"], record["outputs"]))[: args.per_doc]:
                answer = content_words(str(reference))
                if not answer:
                    continue
                row = {"set": name, "doc": d, "question": question, "reference": str(reference),
                       "answer_words": len(answer),
                       "pages": len(pages), "own_pages": own, "text_tokens": total,
                       "own_position": members.index(d) / max(1, len(members) - 1),
                       "ceiling_answer_words": coverage(answer, record["input"])}
                for mode, stage in stages.items():
                    prompt = stage.params.prompt.format(question=question)
                    (read,) = stage._reads(pages, [question], [prompt], None)
                    text = tokenizer.decode(read.ids, skip_special_tokens=True)
                    used = set(read.pages_used or [])
                    if mode != "retrieve":  # head and head_tail cut the text: which pages it still holds, whole or not
                        used = {p for p, t in pages if t.strip()[:80] in text or t.strip()[-80:] in text}
                    row[mode] = {"answer_words": coverage(answer, text), "own_read": bool(used & set(own)),
                                 "own_pages": len(used & set(own)) / len(own), "pages_read": sorted(used),
                                 "prompt_tokens": len(read.ids)}
                    prompts[(len(rows), mode)] = (list(read.ids), prompt)
                # the floor: random pages up to the retrieve prompt's document budget, in page order
                budget = sum(index.cost[p] for p in row["retrieve"]["pages_read"])
                chosen, spent = [], 0
                for p in rng.sample(range(len(pages)), len(pages)):
                    if p in index.cost and spent + index.cost[p] <= budget:
                        chosen.append(p)
                        spent += index.cost[p]
                row["random"] = {"answer_words": coverage(answer, document_text([pages[p] for p in sorted(chosen)])),
                                 "own_read": bool(set(chosen) & set(own)),
                                 "own_pages": len(set(chosen) & set(own)) / len(own), "pages_read": sorted(chosen)}
                rows.append(row)
    summary = {}
    for name in (*SETS, "all"):
        mine = [r for r in rows if name in ("all", r["set"])]
        if not mine:
            continue
        summary[name] = {"questions": len(mine), "documents": len({(r["set"], r["doc"]) for r in mine}),
                         "text_tokens_median": statistics.median(r["text_tokens"] for r in mine),
                         "ceiling_answer_words": statistics.mean(r["ceiling_answer_words"] for r in mine),
                         **{way: {k: statistics.mean(float(r[way][k]) for r in mine)
                                  for k in ("own_read", "own_pages", "answer_words")}
                            for way in ("random", *MODES)}}
    if args.answer:
        summary["answers"] = answer_some(rows, prompts, args.answer)
    result = {"date": datetime.now(timezone.utc).isoformat(), "context": limit, "page_chars": args.page_chars,
              "tokens": args.tokens, "per_doc": args.per_doc,
              "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


def answer_some(rows: list[dict], prompts: dict[tuple[int, str], tuple[list[int], str]], n: int) -> dict:
    """Answer ``n`` rows (spread over the list) from the head and the retrieve prompts; scores into each row."""
    import time

    from bench.bench_fidelity import token_f1
    from docfuse.stages.decode import DecodeGenerate

    stage = DecodeGenerate(context={"question": "?"}, device="cpu")
    stage.setup()
    session = stage.session
    picked = sorted({round(i * len(rows) / n) for i in range(n)} - {len(rows)})
    for i in picked:
        row = rows[i]
        for mode in ("head", "retrieve"):
            ids, prompt = prompts[(i, mode)]
            t0 = time.perf_counter()
            session.prefill(ids)
            text = session.ask(prompt, max_new_tokens=48).text
            reference = str(row.get("reference", ""))
            row[mode].update(answer=text, f1=token_f1(text, reference), seconds=time.perf_counter() - t0,
                             holds_half=(coverage(content_words(reference), text) or 0) >= 0.5)
            print(f"{i:4d} {mode:8s} f1={row[mode]['f1']:.2f} {time.perf_counter() - t0:5.1f}s {text[:70]!r}",
                  flush=True)
    done = [rows[i] for i in picked]
    return {"questions": len(done), "dtype": str(session.model.dtype),
            **{mode: {"f1_mean": statistics.mean(r[mode]["f1"] for r in done),
                      "holds_half": sum(r[mode]["holds_half"] for r in done) / len(done),
                      "seconds_median": statistics.median(r[mode]["seconds"] for r in done)}
               for mode in ("head", "retrieve")}}


if __name__ == "__main__":
    main()
