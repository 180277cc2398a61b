"""Why the engine's batch-1 decode step is slower than ``bench_gpu_128k.py``'s ``tiered_graph`` harness.

An 8B-shaped Llama with random bf16 weights, one document of ``--tokens`` random ids and one question. The engine
answers it (``Engine.run``, the bench's budgets); then its bucket-1 ``BatchStep`` graph is replayed three ways:
back to back with one synchronisation at the end (device time), with a synchronisation and ``.tolist()`` after each
replay (as ``Engine.run`` does), and under ``torch.profiler`` (the kernels of one step, by device time). The
harness's graph step (``GraphDecoder`` over a ``KernelTieredCache``) is measured and profiled the same ways.

Run on the GPU machine:  python bench/experiments/profile_batch1_step.py --out $OUT/batch1_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

from bench.bench_gpu_pipeline import KV, _random_ids  # noqa: E402
from bench.common import random_llama8b  # noqa: E402


def timings(replay, sync_each, reset, steps: int = 40) -> dict:
    """Mean ms a step: back to back (device time) and synchronised after each step (what a serving loop sees);
    ``reset`` puts the counts back before each run of steps (the stream has room for 64 tokens)."""
    reset()
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        replay()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - t0) / steps
    reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        sync_each()
    each = (time.perf_counter() - t0) / steps
    return {"back_to_back_ms": back_to_back * 1e3, "synced_each_ms": each * 1e3}


def kernels(replay, reset, steps: int = 5, top: int = 25) -> list[dict]:
    """The kernels of ``steps`` replays by total device time (per step)."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev <= 0 or e.key.startswith("cuda") or "replay" in e.key.lower():
            continue
        rows.append({"kernel": e.key[:90], "ms_per_step": dev / 1e3 / steps, "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    return [{"kernel": "TOTAL", "ms_per_step": total, "calls_per_step": sum(r["calls_per_step"] for r in rows)}] + rows[:top]


def prefill_times(model, ids: list[int], kv: dict) -> dict:
    """Seconds of a token-major prefill into a DynamicCache and a TieredCache, in 8K chunks and in one pass (the
    first chunk has no mask: SDPA runs causal, grouped heads in place)."""
    from transformers import DynamicCache

    from docfuse.runtime.kv import TieredCache
    from docfuse.runtime.session import fill_cache

    out = {}
    for name, make in (("dynamic", lambda: DynamicCache(config=model.config)),
                       ("tiered", lambda: TieredCache(model.config, kv))):
        for chunk in (512, 8192, len(ids)):
            times = []
            for _ in range(2):
                cache = make()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    fill_cache(model, cache, ids, chunk)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                del cache
                torch.cuda.empty_cache()
            out[f"{name}_chunk_{chunk}"] = min(times)
    out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=Path("batch1_step.json"))
    args = parser.parse_args()
    from docfuse.runtime.engine.engine import Document, Engine
    from docfuse.runtime.gpu.decode_graph import GraphDecoder
    from docfuse.runtime.gpu.kernel_cache import KernelTieredCache, register_attention
    from docfuse.runtime.kv.background import ArchiveWriter
    from docfuse.runtime.layer_prefill import layer_major_prefill

    model = random_llama8b(args.tokens + 4096)
    ids = _random_ids(model, args.tokens)[0].tolist()
    result: dict = {"card": torch.cuda.get_device_name(0), "tokens": args.tokens}

    kv = {k: v for k, v in KV.items() if k != "prefill"}
    result["prefill_s"] = prefill_times(model, ids, kv)
    print(json.dumps(result, indent=1), flush=True)
    engine = Engine(model, kv, stop_ids=set(), max_streams=1)
    with torch.inference_mode():
        out = engine.run([Document(ids, [ids[:12]], max_new_tokens=64)])[0][0]
        result["engine_run"] = {"decode_tok_s": out.decode_tokens_per_s, "ttft_s": out.ttft_s,
                                "step_ms": engine.stats["step_s"] / max(1, engine.stats["steps"]) * 1e3,
                                "steps": engine.stats["steps"]}
        step = engine.steps[1]
        start = [t.clone() - engine.stats["steps"] for t in (step.n_core, step.pos)]

        def reset() -> None:
            step.n_core.copy_(start[0])
            step.pos.copy_(start[1])

        result["engine_step"] = timings(step.graph.replay, lambda: step.run()[:1, 0].tolist(), reset)
        result["engine_kernels"] = kernels(step.graph.replay, reset)
    print(json.dumps(result, indent=1), flush=True)
    del engine, step

    before = model.config._attn_implementation
    model.config._attn_implementation = register_attention()
    with torch.inference_mode():
        cache = KernelTieredCache(model.config, kv)
        logits = layer_major_prefill(model, cache, torch.tensor([ids], device="cuda"), chunk=8192,
                                     writer=ArchiveWriter())
        token = logits.argmax(-1, keepdim=True)
        for layer in cache.layers:
            layer.archive.settle()
        cache.set_fused(True)
        dec = GraphDecoder(model, cache, max_new=400, first_token=token, warmup=2)
        result["harness_step"] = timings(dec.graph.replay, lambda: dec.step()[:1, 0].tolist(), lambda: None)
        result["harness_kernels"] = kernels(dec.graph.replay, lambda: None)
    model.config._attn_implementation = before
    print(json.dumps({k: result[k] for k in ("harness_step", "harness_kernels")}, indent=1), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
