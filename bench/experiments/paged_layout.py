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
from pathlib import Path

import torch

POOL_TENSORS = ("core_k", "core_v", "key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")


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


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values [layers, rows, heads, x], stored heads before rows."""
    return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=132017)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("paged_layout.json"))
    args = parser.parse_args()
    from transformers import LlamaConfig

    from docfuse.runtime.engine.pool import PagePool, PoolShape, pages_for
    from docfuse.runtime.gpu import attention_kernel, paged_kernel
    from docfuse.runtime.kv import as_kv_config
    from docfuse.runtime.kv.association import AssociationStore

    config = LlamaConfig(num_hidden_layers=1, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    kv = as_kv_config({"core_tokens": 0.10, "association_tokens": 0.25, "association_bits": 4,
                       "association_key_bits": 4})
    shape = PoolShape.of(config, kv, torch.bfloat16)
    n_core, n_assoc = int(args.tokens * 0.10), int(args.tokens * 0.25) // shape.group * shape.group
    pc, pa = pages_for(n_core, shape.page), pages_for(n_assoc, shape.page)
    pool = PagePool(shape, pc, pa, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (pool.core_k, pool.core_v):
        t.normal_(generator=g)
    for t in (pool.key_codes, pool.value_codes):
        t.copy_(torch.randint(0, 256, t.shape, device="cuda", dtype=torch.uint8, generator=g))
    for t in (pool.key_scale, pool.value_scale):
        t.uniform_(0.01, 0.1, generator=g)
    for t in (pool.key_zero, pool.value_zero):
        t.uniform_(-0.5, 0.5, generator=g)
    rows_major = {name: getattr(pool, name) for name in POOL_TENSORS}
    heads_major = {name: head_major(t) for name, t in rows_major.items()}
    tables = {
        "shuffled": ((torch.randperm(pc, generator=torch.Generator().manual_seed(1)) + 1).int().cuda()[None],
                     (torch.randperm(pa, generator=torch.Generator().manual_seed(2)) + 1).int().cuda()[None]),
        "in_order": ((torch.arange(pc) + 1).int().cuda()[None], (torch.arange(pa) + 1).int().cuda()[None]),
    }
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
    k = torch.randn(1, 8, n_assoc, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 8, n_assoc, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    assoc = AssociationStore.build(k, v, 4, shape.group, key_bits=4)
    ck = torch.randn(1, 8, n_core, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cv = torch.randn(1, 8, n_core, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    result["harness_us"] = per_call_us(
        lambda: attention_kernel.tiered_decode_attention(q, ck, cv, n_core, assoc, scale), args.calls)
    print("harness", round(result["harness_us"], 1), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
