"""Groundwork for issue 4 (runtime pruning): what skipping each attention or MLP block costs the embedded model.

Teacher-forced over held-out natural text (the essays of ../shared/corpus/longctx, or data/sample.pdf's text when the
corpus is absent), each of the 60 blocks is skipped in turn (its output replaced by zero, so the residual passes
through; a skipped attention block still writes its K/V, as issue 4 asks) and compared against the dense model:
top-1 agreement and KL(dense || skipped) of the next-token distribution. Then the k blocks that cost least alone are
skipped together, for growing k. This is a static schedule; a per-token decision head can only do better by choosing
per token, and the per-token spread (share of token/block pairs whose skip costs under 0.01 nats) says how much room
that leaves.

Skipping for every position at once is harsher than decode-time skipping for attention (later tokens then also read
the skipped positions' changed K/V through deeper layers), so these figures are a lower bound for a decode-time head.

    .venv/bin/python bench/experiments/study_block_ablation.py [--windows 4 --tokens 512]

Writes bench/results/block_ablation.json. ``--oracle`` instead bounds what any per-token decision head can reach in
decode: at each greedy decode step (dense history in the cache), every block is skipped alone at that step only, then
the blocks are skipped together in the order of their cost at that step, for as many as keep the dense top-1 token
and stay under 0.05 nats (bisection). Writes bench/results/block_oracle.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import kv_cases  # noqa: E402
from bench.common import machine, save  # noqa: E402
from docfuse.runtime.loading import load_model  # noqa: E402
from docfuse.runtime.pruning.ablation import blocks_of as ablation_blocks  # noqa: E402

SAMPLE_PDF = Path(__file__).resolve().parents[2] / "data" / "sample.pdf"


def held_out_text() -> tuple[str, str]:
    if kv_cases.essays_available():
        return " ".join(kv_cases.essay_sentences()), "essays (../shared/corpus/longctx)"
    import fitz  # PyMuPDF

    with fitz.open(SAMPLE_PDF) as doc:
        return " ".join(page.get_text() for page in doc) * 20, "data/sample.pdf (repeated)"


def blocks_of(model) -> list[tuple[str, int]]:
    """Every skippable block, in model order (the decision head's order, ``runtime.pruning.ablation``)."""
    return ablation_blocks(model.config.num_hidden_layers)


class Skipper:
    """Forward hooks that zero the output of the chosen blocks: ``("attn", i)`` or ``("mlp", i)``."""

    def __init__(self, model) -> None:
        self.skip: set[tuple[str, int]] = set()
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_hook(self._hook("attn", i))
            layer.mlp.register_forward_hook(self._hook("mlp", i))

    def _hook(self, kind: str, i: int):
        def hook(_module, _inputs, output):
            if (kind, i) not in self.skip:
                return None
            if isinstance(output, tuple):
                return (torch.zeros_like(output[0]), *output[1:])
            return torch.zeros_like(output)
        return hook


@torch.no_grad()
def log_probs(model, windows: list[torch.Tensor]) -> torch.Tensor:
    """Next-token log-probabilities (float32) of every window, concatenated over positions."""
    out = [F.log_softmax(model(input_ids=w.unsqueeze(0)).logits[0].float(), dim=-1) for w in windows]
    return torch.cat(out)


def compare(dense: torch.Tensor, other: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """Top-1 agreement, mean KL(dense || other), and the per-position KL."""
    kl = (dense.exp() * (dense - other)).sum(-1)
    agree = (dense.argmax(-1) == other.argmax(-1)).float().mean().item()
    return agree, kl.mean().item(), kl


@torch.no_grad()
def step_log_probs(model, cache, token: torch.Tensor) -> torch.Tensor:
    """One decode step on ``cache``; the cache is cropped back afterwards so every trial sees the same history."""
    length = cache.get_seq_length()
    out = model(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1].float()
    cache.crop(-1)  # transformers 5.x: a negative count removes that many tokens from the end
    if cache.get_seq_length() != length:
        raise RuntimeError("the cache did not roll back; the trials would not share one history")
    return F.log_softmax(out, dim=-1)


def oracle(model, skipper: Skipper, prompts: list[torch.Tensor], steps: int, kl_limit: float = 0.05) -> dict:
    """Per decode step: how many blocks can be skipped at that step alone and keep top-1 and KL < ``kl_limit``."""
    from transformers import DynamicCache

    blocks = blocks_of(model)
    per_step = []
    for prompt in prompts:
        cache = DynamicCache()
        with torch.no_grad():
            logits = model(input_ids=prompt.unsqueeze(0), cache=cache, use_cache=True).logits[0, -1]
        token = logits.argmax()
        for _ in range(steps):
            skipper.skip = set()
            dense = step_log_probs(model, cache, token)
            costs = []
            for block in blocks:
                skipper.skip = {block}
                costs.append(compare(dense[None], step_log_probs(model, cache, token)[None])[1])
            order = sorted(range(len(blocks)), key=lambda j: costs[j])

            def ok(k: int) -> bool:
                skipper.skip = {blocks[j] for j in order[:k]}
                agree, kl, _ = compare(dense[None], step_log_probs(model, cache, token)[None])
                return agree == 1.0 and kl < kl_limit

            lo, hi = 0, len(blocks)  # largest k with ok(k), assuming monotone
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
            per_step.append({"skippable": lo, "below_0.01": sum(c < 0.01 for c in costs)})
            skipper.skip = set()
            with torch.no_grad():  # advance with the dense step
                token = model(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1].argmax()
            print(f"step {len(per_step)}: {lo} of {len(blocks)} blocks skippable", flush=True)
    share = [r["skippable"] / len(blocks) for r in per_step]
    return {"kl_limit": kl_limit, "steps": len(per_step), "mean_skippable_fraction": sum(share) / len(share),
            "median_skippable_fraction": sorted(share)[len(share) // 2],
            "steps_with_25pct_skippable": sum(x >= 0.25 for x in share) / len(share), "per_step": per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--oracle", action="store_true", help="per-token decode oracle instead (see the docstring)")
    parser.add_argument("--steps", type=int, default=16, help="--oracle: decode steps per window")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("default")
    text, source = held_out_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    stride = max(args.tokens, len(ids) // args.windows)
    windows = [ids[i * stride: i * stride + args.tokens] for i in range(args.windows)]
    windows = [w for w in windows if len(w) == args.tokens]
    started = time.perf_counter()
    skipper = Skipper(model)
    meta = {"command": " ".join([".venv/bin/python bench/experiments/study_block_ablation.py", *sys.argv[1:]]),
            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": str(model.dtype),
            "text": source, "windows": len(windows), "tokens_per_window": args.tokens}
    if args.oracle:
        result = oracle(model, skipper, windows, args.steps)
        print(f"oracle: mean skippable {result['mean_skippable_fraction']:.1%}, steps with >= 25% skippable "
              f"{result['steps_with_25pct_skippable']:.0%}")
        save("block_oracle", {**meta, "elapsed_s": round(time.perf_counter() - started), **result})
        return
    dense = log_probs(model, windows)
    blocks = blocks_of(model)
    single = []
    for block in blocks:
        skipper.skip = {block}
        agree, kl, per_pos = compare(dense, log_probs(model, windows))
        single.append({"block": f"{block[0]}{block[1]}", "top1_agreement": agree, "kl": kl,
                       "share_positions_kl_below_0.01": (per_pos < 0.01).float().mean().item()})
        print(f"{block[0]}{block[1]:>2}: top-1 {agree:.3f}  KL {kl:.4f}", flush=True)
    order = sorted(range(len(blocks)), key=lambda j: single[j]["kl"])
    cumulative = []
    for k in (3, 6, 9, 12, 15, 18, 24, 30):
        skipper.skip = {blocks[j] for j in order[:k]}
        agree, kl, _ = compare(dense, log_probs(model, windows))
        cumulative.append({"skipped_blocks": k, "skipped_fraction": k / len(blocks), "top1_agreement": agree,
                           "kl": kl, "blocks": [single[j]["block"] for j in order[:k]]})
        print(f"static skip of the {k} cheapest blocks ({k / len(blocks):.0%}): top-1 {agree:.3f}  KL {kl:.4f}",
              flush=True)
    skipper.skip = set()
    save("block_ablation", {
        **meta, "elapsed_s": round(time.perf_counter() - started), "single": single, "cumulative": cumulative,
    })


if __name__ == "__main__":
    main()
