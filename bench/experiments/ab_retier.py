"""A/B of a question's re-tier on the CPU: this tree's ``TieredLayer.rebuild``/``vote_priority`` against an earlier
commit's, or fixed codes against re-quantising at every question (``layer.FIXED_CODES``), in one process on one
prefilled document (the machine's noise hits both alike).

    git show 26e2a9e:runtime/kv/layer.py > /tmp/old_layer.py
    python bench/experiments/ab_retier.py --cases DIR --old /tmp/old_layer.py
    python bench/experiments/ab_retier.py --cases DIR --fixed-codes

Takes the check half's longest document of ``DIR`` (bench_fidelity.py make), prefills it once in float32 at the
default ``kv:``, asks its first question, then asks every question ``--reps`` times a side, alternating which side
goes first, one answer token each. Prints the median re-tier time (the sum of ``retier_layer`` over the layers),
the median time to first token, and the re-tier's mean share of it, per side.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=Path, required=True)
    parser.add_argument("--old", type=Path, help="an earlier runtime/kv/layer.py (its rebuild takes no codes_upto)")
    parser.add_argument("--fixed-codes", action="store_true",
                        help="compare FIXED_CODES on (new) and off (old) in this tree instead")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    import pymupdf

    from docfuse.runtime.kv import layer as new_layer
    from docfuse.runtime.kv import tiered
    from docfuse.runtime.loading import load_model
    from docfuse.runtime.session import Session

    if args.fixed_codes == (args.old is not None):
        parser.error("give --old FILE or --fixed-codes")
    if args.old is not None:
        spec = importlib.util.spec_from_file_location("old_layer", args.old)
        old_layer = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old_layer)
    cases = json.loads((args.cases / "cases.json").read_text())
    case = max((c for c in cases if c["half"] == "check"), key=lambda c: c["tokens"])
    text = "\n".join(p.get_text() for p in pymupdf.open(args.cases / case["pdf"]))
    model, tokenizer = load_model("default", device="cpu", dtype=torch.float32)
    session = Session(model, tokenizer, kv={})
    session.prefill(session.fit_document(text, questions=case["questions"], max_new_tokens=8))
    session.ask(case["questions"][0], 1)
    spent = [0.0]
    original = tiered.TieredCache.retier_layer

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0

    tiered.TieredCache.retier_layer = timed
    if args.old is not None:
        sides = {name: {n: getattr(module.TieredLayer, n) for n in ("rebuild", "vote_priority")}
                 for name, module in (("old", old_layer), ("new", new_layer))}
    got: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for rep in range(args.reps):
        for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            if args.old is not None:
                for n, fn in sides[name].items():
                    setattr(new_layer.TieredLayer, n, fn)
            else:
                new_layer.FIXED_CODES = name == "new"
                session.ask(case["questions"][-1], 1)  # untimed: a side's first question makes its codes
            for question in case["questions"]:
                spent[0] = 0.0
                answer = session.ask(question, 1)
                got[name].append((spent[0], answer.ttft_s))
    print(f"document {case['id']} ({case['tokens']} tokens), {len(case['questions'])} questions x {args.reps} a side")
    for name, rows in got.items():
        print(f"{name}: re-tier median {statistics.median(r for r, _ in rows):.3f} s, TTFT median "
              f"{statistics.median(t for _, t in rows):.3f} s, re-tier share {statistics.mean(r / t for r, t in rows):.3f}")


if __name__ == "__main__":
    main()
