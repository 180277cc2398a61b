"""Where the layer-major prefill's time and memory go, next to the usual chunked prefill (GPU machine).

Same model as bench_gpu_128k.py (Llama-3.1-8B shape, random bf16 weights). Three prefills of one document:
``token_major`` (DynamicCache, the model's own forward in chunks: the baseline's TTFT), ``layer_major_dense``
(the layer-major loop with tiering switched off: its compute alone), and ``layer_major_tiered`` (tiering in line,
its steps timed one by one by CUDA-synchronised wrappers, with the peak memory each reached), and
``layer_major_tiered_overlapped`` (each layer tiered on a side stream while the next computes, as the bench runs it).

Run on the GPU machine:  python3 bench/experiments/diag_layer_prefill.py --length 131072 --out $OUT/layer_prefill_diag.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.bench_gpu_128k import KV, GB, build_model, fresh, prefill, sync_time, timeline_summary  # noqa: E402
from docfuse.runtime.gpu.kernel_cache import KernelTieredCache, register_attention  # noqa: E402
from docfuse.runtime.kv import layer as layer_module  # noqa: E402
from docfuse.runtime.kv import tiered as tiered_module  # noqa: E402
from docfuse.runtime.kv.association import AssociationStore  # noqa: E402
from docfuse.runtime.kv.background import ArchiveWriter  # noqa: E402
from docfuse.runtime import layer_prefill  # noqa: E402


def timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = sync_time()
        out = fn(*args, **kwargs)
        table[name]["s"] += sync_time() - t0
        table[name]["calls"] += 1
        table[name]["peak_gb"] = max(table[name]["peak_gb"], torch.cuda.max_memory_allocated() / GB)
        return out
    return wrapper


def tiered_prefill(model, ids: torch.Tensor, chunk: int, writer: ArchiveWriter | None, overlap: bool,
                   kv: dict | None = None, handoff_s: float | None = layer_prefill.HANDOFF_S):
    """One layer-major prefill into a fresh cache: (cache, {s to the logits, s more until the archive is written,
    peak GB, the timeline's totals})."""
    fresh()
    timeline: list[dict] = []
    packed, waited = (writer.pack_s, writer.wait_s) if writer is not None else (0.0, 0.0)
    t0 = sync_time()
    cache = KernelTieredCache(model.config, kv or KV)
    layer_prefill.layer_major_prefill(model, cache, ids, chunk=chunk, writer=writer, overlap=overlap,
                                      timeline=timeline, handoff_s=handoff_s)
    total = sync_time() - t0
    for layer in cache.layers:
        layer.archive.settle()
    packed, waited = (writer.pack_s - packed, writer.wait_s - waited) if writer is not None else (0.0, 0.0)
    return cache, {"s": total, "settle_s": sync_time() - t0 - total, "peak_gb": torch.cuda.max_memory_allocated() / GB,
                   "timeline": timeline_summary(timeline, total, packed, waited)["totals"]}


def variants(model, ids: torch.Tensor, chunk: int) -> dict:
    """Overlapped layer-major prefills with one part of the host work switched off at a time: which part slows the
    GPU's own compute down (each row's ``timeline.compute`` against ``dense``'s). All but the last row keep Python's
    own GIL switch interval, as the prefill did before its hand-off existed; the last one hands off every 0.1 ms."""
    out = {}
    saved = tiered_module.TieredCache.retier_layer
    try:
        tiered_module.TieredCache.retier_layer = lambda self, i, q: None
        _, out["dense"] = tiered_prefill(model, ids, chunk, None, overlap=True, handoff_s=None)
        with ArchiveWriter() as writer:
            _, out["archive_only"] = tiered_prefill(model, ids, chunk, writer, overlap=True, handoff_s=None)
    finally:
        tiered_module.TieredCache.retier_layer = saved
    with ArchiveWriter() as writer:
        _, out["tier_and_archive_no_lz4"] = tiered_prefill(model, ids, chunk, writer, overlap=True,
                                                           kv={**KV, "background": None}, handoff_s=None)
    for workers in (8, 2):
        with ArchiveWriter(workers=workers) as writer:
            _, out[f"full_{workers}_workers"] = tiered_prefill(model, ids, chunk, writer, overlap=True,
                                                               handoff_s=None)
    with ArchiveWriter() as writer:
        _, out["full_switch_interval_0.1ms"] = tiered_prefill(model, ids, chunk, writer, overlap=True, handoff_s=1e-4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--variants", action="store_true",
                        help="only the overlapped prefill with parts of the host work switched off (see variants)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "layer_prefill_diag.json")
    args = parser.parse_args()
    model = build_model()
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    res: dict = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
                 "length": args.length, "chunk": args.chunk, "kv": KV}
    with torch.no_grad():
        from transformers import DynamicCache

        for warm in (True, False):  # the first pass compiles and warms the allocator
            n = 4096 if warm else args.length
            fresh()
            t0 = sync_time()
            prefill(model, DynamicCache(config=model.config), ids[:, :n], args.chunk)
            if not warm:
                res["token_major"] = {"s": sync_time() - t0, "peak_gb": torch.cuda.max_memory_allocated() / GB}
        model.config._attn_implementation = register_attention()
        if args.variants:
            res["variants"] = variants(model, ids, args.chunk)
            print(json.dumps(res, indent=1))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))
            return

        # compute alone: tiering and archiving switched off (every layer keeps its full K/V)
        saved = tiered_module.TieredCache.retier_layer
        tiered_module.TieredCache.retier_layer = lambda self, i, q: None
        fresh()
        t0 = sync_time()
        layer_prefill.layer_major_prefill(model, KernelTieredCache(model.config, KV), ids, chunk=args.chunk)
        res["layer_major_dense"] = {"s": sync_time() - t0, "peak_gb": torch.cuda.max_memory_allocated() / GB}
        tiered_module.TieredCache.retier_layer = saved

        table: dict = defaultdict(lambda: {"s": 0.0, "calls": 0, "peak_gb": 0.0})
        patches = [(layer_prefill, "causal_attention"), (layer_module.TieredLayer, "refresh_summaries"),
                   (layer_module.TieredLayer, "vote_priority"), (layer_module.TieredLayer, "rebuild"),
                   (layer_module.TieredLayer, "_materialize"), (layer_prefill, "_adopt")]
        originals = [(obj, name, getattr(obj, name)) for obj, name in patches]
        for obj, name, fn in originals:
            setattr(obj, name, timed(table, name, fn))
        build = AssociationStore.build
        AssociationStore.build = classmethod(timed(table, "association_build", build.__func__))
        writer = ArchiveWriter()
        cache, res["layer_major_tiered"] = tiered_prefill(model, ids, args.chunk, writer, overlap=False)
        res["layer_major_tiered"].update({"steps": dict(table), "archive_workers": writer.workers,
                                          "archive_ratio": cache.host_bytes() / max(1, cache.full_bytes())})
        for obj, name, fn in originals:
            setattr(obj, name, fn)
        AssociationStore.build = build
        del cache
        # the real thing: each layer tiered on a side stream while the next one computes (no timers in the way)
        _, res["layer_major_tiered_overlapped"] = tiered_prefill(model, ids, args.chunk, writer, overlap=True)
    print(json.dumps(res, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
