"""Does the page pool's memory layout explain the paged kernel's gap to the harness kernel at 128K (issue 23)?

The pool stores each layer as ``[rows, KV heads, D]``: a tile (one page of one head) is 128 rows of 256 bytes at a
stride of 2 KB (8 heads of 128 bf16), and a 4-bit code row is 64 bytes at a stride of 512. The harness kernel reads
``[heads, tokens, D]``: a head's tile is one contiguous range. The kernel takes its strides as arguments, so the
same kernel runs over a head-major pool (storage ``[heads, rows, D]`` seen as ``[rows, heads, D]``) unchanged.

One 8B layer (32 query heads, 8 KV heads, head dim 128, bf16), the bench's budgets at ``--tokens`` (core 10%,
association 25% at 4/4 bits); for each layout and page order (shuffled, as a busy pool hands pages out, or in
order): microseconds per call (kernel plus split combine, CUDA events over ``--calls`` calls), and the harness
kernel over the same counts in contiguous tiers, in the same run.

Run on the GPU machine:  python bench/experiments/paged_layout.py --out $OUT/paged_layout.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.experiments.sweep_paged_kernel import (  # noqa: E402
    harness_us, in_order_tables, per_call_us, random_pool, shuffled_tables)

POOL_TENSORS = ("core_k", "core_v", "key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values [layers, rows, heads, x], stored heads before rows."""
    return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=132017)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("paged_layout.json"))
    args = parser.parse_args()
    from docfuse.runtime.gpu import paged_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    pool, n_core, n_assoc = random_pool(args.tokens, g)
    pc, pa = pool.core_total, pool.assoc_total
    rows_major = {name: getattr(pool, name) for name in POOL_TENSORS}
    heads_major = {name: head_major(t) for name, t in rows_major.items()}
    tables = {"shuffled": shuffled_tables(pc, pa), "in_order": in_order_tables(pc, pa)}
    nc = torch.tensor([n_core], dtype=torch.int32, device="cuda")
    na = torch.tensor([n_assoc], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 128 ** -0.5
    rows = paged_kernel.identity_rows(1, q.device)
    splits = paged_kernel.paged_splits(8, max(pc, pa))
    result: dict = {"card": torch.cuda.get_device_name(0), "tokens": args.tokens, "n_core": n_core,
                    "n_assoc": n_assoc, "splits": splits, "tuned": dict(paged_kernel.TUNED), "rows": []}
    reference = None
    for layout, tensors in (("rows_major", rows_major), ("heads_major", heads_major)):
        for name, t in tensors.items():
            setattr(pool, name, t)
        for order, (ct, at) in tables.items():
            call = lambda: paged_kernel.paged_decode_attention(q, pool, 0, ct, nc, at, na, scale,  # noqa: E731
                                                               splits, rows=rows)
            out = call().float()
            reference = out if reference is None else reference
            row = {"layout": layout, "order": order, "us": per_call_us(call, args.calls),
                   "max_diff": (out - reference).abs().max().item()}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    result["harness_us"] = harness_us(q, n_core, n_assoc, pool.shape.group, g, args.calls)
    print("harness", round(result["harness_us"], 1), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
