"""The paged decode kernel's launch settings at batch 1 and 128K (issue 23: the engine's 128K decode is 0.88x the
``tiered_graph`` harness, whose kernel was tuned by a sweep; the paged kernel never was).

One 8B layer shape (32 query heads, 8 KV heads, head dim 128, bf16), the bench's budgets at ``--tokens``: a core of
10% and an association tier of 25% at 4/4 bits, in pages of a :class:`PagePool` (random contents: the time does not
depend on them). For each setting: microseconds per call (CUDA events over ``--calls`` calls after a warm-up), the
kernel plus its split combine, as the decode step runs them. The harness kernel (``attention_kernel``) over the same
token counts in contiguous tiers is timed in the same run as the anchor.

Run on the GPU machine:  python bench/experiments/sweep_paged_kernel.py --out $OUT/sweep_paged.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def random_pool(tokens: int, g: torch.Generator):
    """A one-layer 8B-shaped :class:`PagePool` (32 query heads, 8 KV heads, head dim 128, bf16) holding the bench's
    budgets at ``tokens`` (a core of 10%, an association tier of 25% at 4/4 bits) in random contents (the time does
    not depend on them): ``(pool, n_core, n_assoc)``."""
    from transformers import LlamaConfig

    from docfuse.runtime.engine.pool import PagePool, PoolShape, pages_for
    from docfuse.runtime.kv import as_kv_config

    config = LlamaConfig(num_hidden_layers=1, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    kv = as_kv_config({"core_tokens": 0.10, "association_tokens": 0.25, "association_bits": 4,
                       "association_key_bits": 4})
    shape = PoolShape.of(config, kv, torch.bfloat16)
    n_core, n_assoc = int(tokens * 0.10), int(tokens * 0.25) // shape.group * shape.group
    pool = PagePool(shape, pages_for(n_core, shape.page), pages_for(n_assoc, shape.page), "cuda")
    for t in (pool.core_k, pool.core_v):
        t.normal_(generator=g)
    for t in (pool.key_codes, pool.value_codes):
        t.copy_(torch.randint(0, 256, t.shape, device="cuda", dtype=torch.uint8, generator=g))
    for t in (pool.key_scale, pool.value_scale):
        t.uniform_(0.01, 0.1, generator=g)
    for t in (pool.key_zero, pool.value_zero):
        t.uniform_(-0.5, 0.5, generator=g)
    return pool, n_core, n_assoc


def shuffled_tables(core_pages: int, assoc_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream's core and association page tables [1, W] over pages 1.. in a fixed shuffled order, as a pool
    that has served others hands them out."""
    core = torch.randperm(core_pages, generator=torch.Generator().manual_seed(1)) + 1
    assoc = torch.randperm(assoc_pages, generator=torch.Generator().manual_seed(2)) + 1
    return core.int().cuda()[None], assoc.int().cuda()[None]


def in_order_tables(core_pages: int, assoc_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tables with pages 1.. in order, as a fresh pool hands them out."""
    return (torch.arange(core_pages) + 1).int().cuda()[None], (torch.arange(assoc_pages) + 1).int().cuda()[None]


def harness_us(q: torch.Tensor, n_core: int, n_assoc: int, group: int, g: torch.Generator, calls: int) -> float:
    """The harness kernel (``attention_kernel``) over the same token counts in contiguous tiers: us per call."""
    from docfuse.runtime.gpu import attention_kernel
    from docfuse.runtime.kv.association import AssociationStore

    k = torch.randn(1, 8, n_assoc, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 8, n_assoc, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    assoc = AssociationStore.build(k, v, 4, group, key_bits=4)
    ck = torch.randn(1, 8, n_core, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cv = torch.randn(1, 8, n_core, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    return per_call_us(lambda: attention_kernel.tiered_decode_attention(q, ck, cv, n_core, assoc, 128 ** -0.5),
                       calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=132017)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("sweep_paged.json"))
    args = parser.parse_args()
    from docfuse.runtime.gpu import paged_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    pool, n_core, n_assoc = random_pool(args.tokens, g)
    pc, pa = pool.core_total, pool.assoc_total
    core_table, assoc_table = shuffled_tables(pc, pa)
    nc, na = torch.tensor([n_core], dtype=torch.int32, device="cuda"), torch.tensor([n_assoc], dtype=torch.int32,
                                                                                      device="cuda")
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 128 ** -0.5
    rows = paged_kernel.identity_rows(1, q.device)
    result: dict = {"card": torch.cuda.get_device_name(0), "tokens": args.tokens, "n_core": n_core,
                    "n_assoc": n_assoc, "rows": []}
    default = dict(paged_kernel.TUNED)
    reference = None
    for warps, stages, per_sm in itertools.product((4, 8), (1, 2, 3, 4), (2, 4, 8, 16)):
        paged_kernel.TUNED.update(num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
        splits = paged_kernel.paged_splits(8, max(pc, pa))
        call = lambda: paged_kernel.paged_decode_attention(q, pool, 0, core_table, nc, assoc_table, na, scale,  # noqa: E731
                                                           splits, rows=rows)
        try:
            out = call()
            us = per_call_us(call, args.calls)
        except Exception as exc:  # a setting Triton cannot compile (shared memory): noted, skipped
            result["rows"].append({"num_warps": warps, "num_stages": stages, "programs_per_sm": per_sm,
                                   "error": str(exc).splitlines()[0][:200]})
            continue
        if reference is None:
            reference = out.float()
        diff = (out.float() - reference).abs().max().item()
        result["rows"].append({"num_warps": warps, "num_stages": stages, "programs_per_sm": per_sm,
                               "splits": splits, "us": us, "max_diff": diff})
        print(json.dumps(result["rows"][-1]), flush=True)
    paged_kernel.TUNED.clear()
    paged_kernel.TUNED.update(default)
    default_row = next(r for r in result["rows"] if r.get("num_warps") == 8 and r.get("num_stages") == 2
                       and r.get("programs_per_sm") == 4)
    harness = harness_us(q, n_core, n_assoc, pool.shape.group, g, args.calls)
    best = min((r for r in result["rows"] if "us" in r), key=lambda r: r["us"])
    result.update({"harness_us": harness, "default": default_row, "best": best})
    print("harness", round(harness, 1), "default", round(default_row["us"], 1), "best", json.dumps(best), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
