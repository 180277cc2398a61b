"""What a new attention shape costs the first time on a GPU, per SDPA path (issue 23, twelfth session).

The engine's first masked prefill chunk of a shape took ~0.6 s more than the next one of that shape: cuDNN's
attention builds a plan per shape. Documents come in every length, so a path that pays per shape pays per document.
For each ``--shapes`` (queries, keys) pair, new to the process, this times the first call and the mean of the next
three, for an 8B-shaped layer (32 query heads, 8 KV heads, head dim 128, bf16):

* ``default_causal``: ``is_causal=True`` on a square shape (what a one-pass prefill runs; PyTorch picks the backend);
* ``flash_causal``: the same with only flash attention allowed;
* ``lower_right``: ``causal_lower_right`` (flash's bottom-right diagonal; a chunk or a question over a cache);
* ``masked``: a boolean ``T x S`` mask (transformers' path for a chunk over a cache), heads repeated as it does.

Run on the GPU machine:  python bench/experiments/sdpa_first_shape.py --out $OUT/sdpa_first_shape.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


def timed(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return first, (time.perf_counter() - t0) / 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("sdpa_first_shape.json"))
    parser.add_argument("--square", type=int, nargs="+", default=[4096, 8192, 8200, 12345, 35442, 35443])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8192, 2048, 23],
                        help="query lengths over a cache (each against keys of 16384 and 30001)")
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    result: dict = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}

    def qkv(t: int, s: int):
        g = torch.Generator(device=dev).manual_seed(t * 7 + s)
        return (torch.randn(1, 32, t, 128, device=dev, dtype=dt, generator=g),
                torch.randn(1, 8, s, 128, device=dev, dtype=dt, generator=g),
                torch.randn(1, 8, s, 128, device=dev, dtype=dt, generator=g))

    q, k, v = qkv(256, 256)
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # the library's own start
    for n in args.square:
        q, k, v = qkv(n, n)
        for name, fn in (("default_causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                    enable_gqa=True)),):
            first, then = timed(fn)
            result["rows"].append({"path": name, "t": n, "s": n, "first_s": first, "then_s": then})
        q, k, v = qkv(n + 1, n + 1)  # a shape new to flash too
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            first, then = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        result["rows"].append({"path": "flash_causal", "t": n + 1, "s": n + 1, "first_s": first, "then_s": then})
    for t in args.chunks:
        for s in (16384 + t, 30001 + t):
            q, k, v = qkv(t, s)
            first, then = timed(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(t, s), enable_gqa=True))
            result["rows"].append({"path": "lower_right", "t": t, "s": s, "first_s": first, "then_s": then})
            q, k, v = qkv(t, s + 1)
            mask = torch.ones(t, s + 1, dtype=torch.bool, device=dev).tril(diagonal=s + 1 - t)[None, None]
            kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
            first, then = timed(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask))
            result["rows"].append({"path": "masked", "t": t, "s": s + 1, "first_s": first, "then_s": then})
    for row in result["rows"]:
        print(json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
