"""Why the engine's token-major prefill of a 35K document takes ~3.1 s when ``fill_cache`` into a TieredCache takes
~2.1 s on the same card (bench/RESULTS.md, issue 23, eleventh session).

An 8B-shaped Llama with random bf16 weights, one document of ``--tokens`` random ids, the GPU bench's ``kv`` block.
Each variant prefills the document token-major in ``--chunk`` chunks; every chunk's forward is timed with the card
synchronised (``forward_tokens`` wrapped), so the slow chunk and the time outside the forwards both show:

* ``direct``: ``fill_cache`` into ``TieredCache(config, kv)`` (what ``profile_batch1_step.py`` timed);
* ``engine``: ``Engine._open`` after ``Engine._make_pool`` (what ``Engine.run`` does first);
* ``engine_host_archive``: the same with ``archive="host"`` (no DeviceArchive);
* ``dynamic``: ``fill_cache`` into a DynamicCache;
* with ``--pipeline``: the bench's ``batch1_32k`` run itself (``run_pipeline``: ``text_qa``, the engine, then
  ``kv: null``), twice, its chunks timed the same way.

Run on the GPU machine:  python bench/experiments/prefill_engine_vs_direct.py --out $OUT/prefill_engine.json
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=35442)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("prefill_engine.json"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--tokenizer", type=Path, default=None)
    args = parser.parse_args()
    from transformers import DynamicCache

    from docfuse.runtime import session as session_module
    from docfuse.runtime.engine.engine import Document, Engine, StreamOutput
    from docfuse.runtime.kv import TieredCache

    model = random_llama8b(args.tokens + 4096)
    ids = _random_ids(model, args.tokens)[0].tolist()
    chunks: list[float] = []
    forward = session_module.forward_tokens

    def timed_forward(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward(*a, **k)
        torch.cuda.synchronize()
        chunks.append(time.perf_counter() - t0)
        return out

    session_module.forward_tokens = timed_forward
    doc = Document(ids, [ids[:12]], max_new_tokens=4)

    def direct() -> None:
        session_module.fill_cache(model, TieredCache(model.config, KV), ids, args.chunk)

    def dynamic() -> None:
        session_module.fill_cache(model, DynamicCache(config=model.config), ids, args.chunk)

    def engine(archive: str):
        def run() -> None:
            eng = Engine(model, KV, stop_ids=set(), max_streams=1, prefill_chunk=args.chunk, archive=archive)
            eng.pool = eng._make_pool([doc])
            opened = eng._open(0, doc, [StreamOutput()])
            assert opened is not None
            eng.extra = {"prefill_s": opened.prefill_s}
        return run

    result: dict = {"card": torch.cuda.get_device_name(0), "tokens": args.tokens, "chunk": args.chunk}
    variants = {"dynamic": dynamic, "direct": direct, "engine": engine("auto"),
                "engine_host_archive": engine("host")}
    with torch.inference_mode():
        for rnd in range(args.rounds):
            for name, fn in variants.items():
                chunks.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                total = time.perf_counter() - t0
                row = {"total_s": total, "chunks_s": list(chunks), "outside_forwards_s": total - sum(chunks),
                       "peak_gb": torch.cuda.max_memory_allocated() / 1e9}
                result[f"{name}_{rnd}"] = row
                print(name, rnd, json.dumps({k: (round(v, 3) if isinstance(v, float) else
                                                 [round(x, 3) for x in v] if isinstance(v, list) else v)
                                             for k, v in row.items()}), flush=True)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    if args.pipeline:
        from bench.bench_gpu_pipeline import QUESTIONS, model_folder, run_pipeline, write_documents

        del model
        torch.cuda.empty_cache()
        work = Path.home() / "docfuse-bench"
        _, tokenizer = model_folder(work / "llama8b-random", args.tokenizer, False)
        paths = write_documents(work / "docs", 1, 32768, tokenizer, seed=2)
        warm = write_documents(work / "docs", 2, 2048, tokenizer, seed=0)
        run_pipeline(work / "llama8b-random", warm, QUESTIONS[:2], KV, 4, "on", 64)
        for rnd in range(2):
            for name, kv, engine_mode, streams in (("pipeline_engine", KV, "on", 64), ("pipeline_kv_null", None, "off", 1)):
                chunks.clear()
                out = run_pipeline(work / "llama8b-random", paths, QUESTIONS[:1], kv, 4, engine_mode, streams)
                row = {"ttft_s": out["ttft_median_s"], "chunks_s": list(chunks), "wall_s": out["wall_s"]}
                result[f"{name}_{rnd}"] = row
                print(name, rnd, json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
