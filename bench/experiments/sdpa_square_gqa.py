"""Square causal attention of one 8B layer at long lengths on a GPU: grouped K/V heads passed as they are
(``enable_gqa``) against K/V repeated per query head, per SDPA backend (issue 23: a layer-major call over a whole 128K
document took 28 s against 17 s in 64K calls).

Run on the GPU machine:  python bench/experiments/sdpa_square_gqa.py --out $OUT/sdpa_square_gqa.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps: int = 2) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--out", type=Path, default=Path("sdpa_square_gqa.json"))
    args = parser.parse_args()
    rows = []
    for n in args.lengths:
        q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        variants = {
            "gqa_default": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "repeat_default": lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True),
        }
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            for kind in ("gqa", "repeat"):
                def call(backend=backend, kind=kind):
                    with sdpa_kernel([backend]):
                        if kind == "gqa":
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                                              v.repeat_interleave(4, 1), is_causal=True)
                variants[f"{kind}_{name}"] = call
        for name, fn in variants.items():
            try:
                ms = timed(fn)
            except RuntimeError as exc:
                ms = None
                print(n, name, "not supported:", str(exc).splitlines()[0][:100])
            rows.append({"tokens": n, "variant": name, "ms": ms})
            print(n, name, ms, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                                   indent=2))


if __name__ == "__main__":
    main()
