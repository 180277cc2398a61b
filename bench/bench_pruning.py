"""Issue 4: runtime pruning against the dense model on held-out text, needles, and decode speed.

    .venv/bin/python bench/bench_pruning.py [--head data/pruning/smollm2-135m-instruct.safetensors]

1. Teacher-forced threshold sweep over held-out windows (the essays of ../shared/corpus/longctx when present, else
   data/sample.pdf's text): top-1 agreement, KL, skip rate, and the per-layer skip rate at the default threshold.
2. Greedy continuations, dense vs pruned, from held-out prompts: tokens agreeing before the first divergence.
3. Needle cases at 1K-4K (bench/kv_cases): each document is prefilled once and asked twice, dense (safe mode,
   per request) and pruned, so both answers share the prefill; decode tokens/s of each answer are compared in the
   same run (the head's cost is inside the pruned figure). The 4K cases are repeated with the tiered KV cache.

Writes bench/results/pruning.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kv_cases  # noqa: E402
from bench.common import machine, save  # noqa: E402
from bench.experiments.study_block_ablation import held_out_text  # noqa: E402
from docfuse.runtime.loading import load_model  # noqa: E402
from docfuse.runtime.pruning import DecisionHead, Pruner, find_head  # noqa: E402
from docfuse.runtime.pruning.ablation import blocks_of  # noqa: E402
from docfuse.runtime.pruning.calibrate import fidelity  # noqa: E402
from docfuse.runtime.session import Session  # noqa: E402


@torch.no_grad()
def greedy(model, pruner: Pruner, prompt: torch.Tensor, steps: int, prune: bool) -> list[int]:
    cache = DynamicCache(config=model.config)
    pruner.mode = "off"
    token = model(input_ids=prompt[None], cache=cache, use_cache=True).logits[0, -1].argmax()
    out = [int(token)]
    pruner.mode = "decode" if prune else "off"
    for _ in range(steps - 1):
        token = model(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1].argmax()
        out.append(int(token))
    pruner.mode = "off"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=None, help="head file; default: the one shipped for the model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--threshold", type=float, default=0.15)
    parser.add_argument("--needles", default="1024:4,2048:4,4096:2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer = load_model("default")
    head = DecisionHead.load(Path(args.head)) if args.head else find_head(model)
    if head is None:
        sys.exit("no pruning head for the model; run docfuse calibrate-pruning first")
    pruner = Pruner.for_model(model, head, args.threshold)
    text, source = held_out_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    stride = max(512, len(ids) // args.windows)
    windows = [w for w in (ids[i * stride: i * stride + 512] for i in range(args.windows)) if len(w) == 512]

    sweep = [fidelity(model, pruner, windows, t) for t in (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)]
    for row in sweep:
        print(f"threshold {row['threshold']}: top-1 {row['top1_agreement']:.3f}, KL {row['kl']:.4f}, "
              f"skipped {row['skipped_fraction']:.1%}", flush=True)
    default = next(r for r in sweep if r["threshold"] == args.threshold)
    names = [f"{k}{i}" for k, i in blocks_of(model.config.num_hidden_layers)]
    per_layer = {n: round(v, 3) for n, v in zip(names, default["skipped_per_block"]) if v > 0}

    pruner.threshold = args.threshold
    continuations = []
    for w in windows:
        dense, pruned = greedy(model, pruner, w[:256], 32, False), greedy(model, pruner, w[:256], 32, True)
        first = next((i for i, (a, b) in enumerate(zip(dense, pruned)) if a != b), len(dense))
        continuations.append({"first_divergence": first, "tokens": len(dense)})
    print("greedy first divergence:", [c["first_divergence"] for c in continuations], flush=True)

    plan = {int(k): int(v) for k, v in (item.split(":") for item in args.needles.split(","))}
    cases = kv_cases.single_cases(plan, kv_cases.essays_available())
    needle_rows = []
    for kv in (None, {"core_tokens": 0.1, "association_tokens": 0.25, "association_bits": 4}):
        session = Session(model, tokenizer, kv=kv, pruning={"threshold": args.threshold, "head": args.head})
        session.pruner = pruner if session.pruner is None else session.pruner
        for case in cases:
            if kv is not None and case.target < 4096:
                continue
            kv_cases.build_document(case, session.prompt, tokenizer,
                                    kv_cases.prefix_budget(case.target, session.limit, 96))
            session.prefill(list(case.prefix_ids))
            question = kv_cases.questions(case)[0]
            value = case.needles[0][0].value.lower()
            dense = session.ask(question, max_new_tokens=24, safe_mode=True)
            pruned = session.ask(question, max_new_tokens=24)
            row = {"case": case.id, "kv": "tiered" if kv else "full", "dense_right": value in dense.text.lower(),
                   "pruned_right": value in pruned.text.lower(), "dense_tps": dense.decode_tokens_per_s,
                   "pruned_tps": pruned.decode_tokens_per_s, "skipped_fraction": pruned.skipped_fraction,
                   "dense": dense.text, "pruned": pruned.text}
            needle_rows.append(row)
            print(row, flush=True)
    lost = [r["case"] for r in needle_rows if r["dense_right"] and not r["pruned_right"]]

    def ratio(kind: str) -> float | None:
        rows = [r for r in needle_rows if r["kv"] == kind and r["dense_tps"] and r["pruned_tps"]]
        return statistics.median(r["pruned_tps"] / r["dense_tps"] for r in rows) if rows else None

    result = {
        "command": " ".join([".venv/bin/python bench/bench_pruning.py", *sys.argv[1:]]), "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": str(model.dtype), "text": source,
        "head": head.meta, "head_parameters": head.parameter_count(),
        "head_share_of_model": head.parameter_count() / sum(p.numel() for p in model.parameters()),
        "sweep": [{k: v for k, v in r.items() if k != "skipped_per_block"} for r in sweep],
        "skip_rate_per_block_at_default": per_layer, "greedy": continuations,
        "needles": needle_rows, "needles_lost": lost,
        "decode_speed_ratio_full": ratio("full"), "decode_speed_ratio_tiered": ratio("tiered"),
        "elapsed_s": round(time.perf_counter() - started),
    }
    print(f"lost {lost}; decode pruned/dense: full {result['decode_speed_ratio_full']}, "
          f"tiered {result['decode_speed_ratio_tiered']}")
    save("pruning", result)


if __name__ == "__main__":
    main()
