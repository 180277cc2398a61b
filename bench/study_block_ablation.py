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

    .venv/bin/python bench/study_block_ablation.py [--windows 4 --tokens 512]

Writes bench/results/block_ablation.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kv_cases  # noqa: E402
from bench.common import machine, save  # noqa: E402
from runtime.loading import load_model  # noqa: E402

SAMPLE_PDF = Path(__file__).resolve().parents[1] / "data" / "sample.pdf"


def held_out_text() -> tuple[str, str]:
    if kv_cases.essays_available():
        return " ".join(kv_cases.essay_sentences()), "essays (../shared/corpus/longctx)"
    import fitz  # PyMuPDF

    with fitz.open(SAMPLE_PDF) as doc:
        return " ".join(page.get_text() for page in doc) * 20, "data/sample.pdf (repeated)"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
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
    dense = log_probs(model, windows)
    blocks = [(kind, i) for i in range(model.config.num_hidden_layers) for kind in ("attn", "mlp")]
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
        "command": " ".join([".venv/bin/python bench/study_block_ablation.py", *sys.argv[1:]]),
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": str(model.dtype),
        "text": source, "windows": len(windows), "tokens_per_window": args.tokens,
        "elapsed_s": round(time.perf_counter() - started), "single": single, "cumulative": cumulative,
    })


if __name__ == "__main__":
    main()
