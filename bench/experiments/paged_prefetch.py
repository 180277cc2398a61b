"""Does loading the next page index a tile ahead close the paged kernel's gap to the harness kernel at 128K (issue 23)?

``paged_layout.py`` ruled out the pool's layout: in-order pages took 127.6 us a layer against the harness kernel's
107.3, so the gap is in the walk itself. Each tile's K/V load depends on a load of its page index, and nothing else
hides that latency. ``TUNED["prefetch_pages"]`` makes the kernel load tile i+1's index while tile i computes.

One 8B layer at ``--tokens`` (the bench's budgets, random contents: ``sweep_paged_kernel.random_pool``): microseconds
per call (kernel plus split combine) for prefetch off/on x ``num_stages`` 2/3 x shuffled/in-order pages, with the
harness kernel over the same counts in contiguous tiers in the same run.

Run on the GPU machine:  python bench/experiments/paged_prefetch.py --out $OUT/paged_prefetch.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.experiments.sweep_paged_kernel import (  # noqa: E402
    harness_us, in_order_tables, per_call_us, random_pool, shuffled_tables)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=132017)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("paged_prefetch.json"))
    args = parser.parse_args()
    from docfuse.runtime.gpu import paged_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    pool, n_core, n_assoc = random_pool(args.tokens, g)
    pc, pa = pool.core_total, pool.assoc_total
    tables = {"shuffled": shuffled_tables(pc, pa), "in_order": in_order_tables(pc, pa)}
    nc = torch.tensor([n_core], dtype=torch.int32, device="cuda")
    na = torch.tensor([n_assoc], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = paged_kernel.identity_rows(1, q.device)
    splits = paged_kernel.paged_splits(8, max(pc, pa))
    default = dict(paged_kernel.TUNED)
    result: dict = {"card": torch.cuda.get_device_name(0), "tokens": args.tokens, "n_core": n_core,
                    "n_assoc": n_assoc, "splits": splits, "tuned": default, "rows": []}
    reference = None
    for prefetch, stages, order in itertools.product((0, 1), (2, 3), tables):
        paged_kernel.TUNED.update(prefetch_pages=prefetch, num_stages=stages)
        ct, at = tables[order]
        call = lambda: paged_kernel.paged_decode_attention(q, pool, 0, ct, nc, at, na, 128 ** -0.5,  # noqa: E731
                                                           splits, rows=rows)
        out = call().float()
        reference = out if reference is None else reference
        row = {"prefetch": prefetch, "num_stages": stages, "order": order, "us": per_call_us(call, args.calls),
               "max_diff": (out - reference).abs().max().item()}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    paged_kernel.TUNED.clear()
    paged_kernel.TUNED.update(default)
    result["harness_us"] = harness_us(q, n_core, n_assoc, pool.shape.group, g, args.calls)
    print("harness", round(result["harness_us"], 1), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
