"""Why the first tiered prefill of a process is slower than the next ones (GPU machine).

Three layer-major prefills of one 128K document in a row, in one process: ``first``; ``reused`` after the first
cache (and its host archive) was freed, so the archive's bytes land in host pages the process already touched; and
``grown`` while the second cache is still alive, so the archive must take fresh pages again. Each records its wall
time, its timeline totals and the minor page faults the process took meanwhile. If ``grown`` is as slow as ``first``
and ``reused`` is fast, the cost is the host faulting in fresh pages for the archive, not a warm-up.

Run on the GPU machine:  python3 bench/experiments/diag_first_prefill.py --out $OUT/first_prefill.json
(set GLIBC_TUNABLES or MALLOC_* in the environment to compare allocator settings: the JSON records them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.bench_gpu_128k import GB, build_model  # noqa: E402
from bench.experiments.diag_layer_prefill import tiered_prefill  # noqa: E402
from docfuse.runtime.gpu.kernel_cache import KernelTieredCache, register_attention  # noqa: E402
from docfuse.runtime.kv.background import ArchiveWriter  # noqa: E402


def one(model, ids: torch.Tensor, chunk: int, writer: ArchiveWriter) -> tuple[KernelTieredCache, dict]:
    """One overlapped layer-major prefill (diag_layer_prefill.tiered_prefill) and the minor page faults it took."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cache, out = tiered_prefill(model, ids, chunk, writer, overlap=True)
    out.update(minor_page_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
               host_archive_gb=cache.host_bytes() / GB)
    return cache, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "first_prefill.json")
    args = parser.parse_args()
    model = build_model()
    model.config._attn_implementation = register_attention()
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    res: dict = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
                 "length": args.length, "env": {k: v for k, v in os.environ.items()
                                                if k.startswith(("GLIBC_TUNABLES", "MALLOC_"))}}
    with torch.no_grad(), ArchiveWriter() as writer:
        one(model, ids[:, :4096], args.chunk, writer)  # kernels and allocators warm on a short document
        cache, res["first"] = one(model, ids, args.chunk, writer)
        del cache
        kept, res["reused"] = one(model, ids, args.chunk, writer)
        _, res["grown"] = one(model, ids, args.chunk, writer)
        del kept
    print(json.dumps(res, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
