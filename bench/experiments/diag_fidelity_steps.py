"""Where a tiered cache's greedy answer leaves the full cache's: teacher-forced logits, step by step (issue 29).

For a few cases of bench_fidelity's tuning half, the full cache answers greedily; every config then decodes the
same tokens (teacher forcing) and we record, per step, the largest logit difference to the full cache, whether the
argmax differs, and the full cache's top-1/top-2 margin there. A config whose differences sit at the dtype's noise
level flips only where the full cache itself was nearly tied; one far above it flips on its own.

    python bench/experiments/diag_fidelity_steps.py --cases .fid/cases --docs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import bench.bench_fidelity as bf
from docfuse.runtime.kv.queries import read_question
from docfuse.runtime.loading import load_model
from docfuse.runtime.session import Session


def document_text(pdf: Path) -> str:
    import pymupdf

    with pymupdf.open(pdf) as doc:
        return "\n".join(page.get_text() for page in doc)


@torch.inference_mode()
def forced(session: Session, question: str, tokens: list[int]) -> list[torch.Tensor]:
    """Logits at every answer step when the answer is ``tokens`` (the first entry: after the question)."""
    suffix = session.prompt.suffix(question)
    kv = getattr(session.cache, "kv", None)
    out = []
    if kv is not None and kv.question == "exact":
        out.append(read_question(session.model, session.cache, torch.tensor([suffix])).float())
    else:
        out.append(session._forward(suffix).float())
    if kv is not None:
        session.cache.start_decode()
    for t in tokens[:-1]:
        out.append(session._forward([t]).float())
        if kv is not None:
            session.cache.maybe_retier()
    from docfuse.runtime.session import crop_cache
    crop_cache(session.cache, session.prefix_length)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=Path, required=True)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--configs", default="full-chunk256,default,k8v4,assoc-all-8bit")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--case", action="append", help="these case ids (any half) instead of --docs tuning cases")
    ap.add_argument("--steps", action="store_true", help="print every step's difference and margin")
    a = ap.parse_args()
    model, tokenizer = load_model("default")
    every = json.loads((a.cases / "cases.json").read_text())
    cases = [c for c in every if c["half"] == "tune"]
    cases = [c for c in cases if c["generator"] == "real:leval"][: a.docs // 2] + \
        [c for c in cases if c["generator"] != "real:leval"][: a.docs - a.docs // 2]
    if a.case:
        cases = [c for c in every if c["id"] in a.case]
    stats: dict[str, list[tuple[float, bool, float]]] = {n: [] for n in a.configs.split(",")}
    for case in cases:
        text = document_text(a.cases / case["pdf"])
        full = Session(model, tokenizer)
        prefix = full.fit_document(text, questions=case["questions"], max_new_tokens=a.tokens)
        full.prefill(prefix)
        for q in case["questions"]:
            answer = full.ask(q, max_new_tokens=a.tokens)
            tokens = tokenizer.encode(answer.text, add_special_tokens=False)[: a.tokens] or [0]
            ref = forced(full, q, tokens)
            for name in stats:
                kv = bf.CONFIGS[name]
                s = Session(model, tokenizer, kv=kv)
                s.prefill(prefix, chunk_size=bf.EXTRA.get(name, {}).get("prefill_chunk", 512))
                got = forced(s, q, tokens)
                for step, (r, g) in enumerate(zip(ref, got)):
                    top = r.topk(2).values
                    stats[name].append((float((r - g).abs().max()), bool(r.argmax() != g.argmax()),
                                        float(top[0] - top[1])))
                    if a.steps:
                        print(f"{case['id']} q{case['questions'].index(q)} {name} step {step} "
                              f"token {tokenizer.decode(tokens[step:step + 1])!r} max|d| {stats[name][-1][0]:.3f} "
                              f"flip {stats[name][-1][1]} margin {stats[name][-1][2]:.3f}", flush=True)
        print(case["id"], flush=True)
    for name, rows in stats.items():
        diffs = [d for d, _, _ in rows]
        flips = [m for _, f, m in rows if f]
        print(f"{name:16s} steps {len(rows)} median max|dlogit| {statistics.median(diffs):.3f} "
              f"p90 {sorted(diffs)[int(0.9 * len(diffs))]:.3f} flips {len(flips)} "
              f"full margins at flips {[round(m, 2) for m in flips]}")


if __name__ == "__main__":
    main()
