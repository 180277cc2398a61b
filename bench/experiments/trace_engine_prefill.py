"""Where the engine's 35K prefill loses ~0.6 s inside the GPU bench's own runs (issue 23, eleventh session).

``prefill_engine_vs_direct.py`` timed every prefill chunk with the card synchronised, and then the engine prefilled
as fast as ``kv: null`` did; in the bench's own runs (no synchronisation) the engine logs ~3.0 s against ~2.4 s.
This runs the bench's exact sequence (copy bandwidth, the two warm-up documents, then ``batch1_32k`` through
``run_pipeline``: engine, then ``kv: null``, ``--rounds`` times) and watches without synchronising:

* every ``forward_tokens`` call: CUDA events before and after (the chunk's time on the card, read at the end), and
  the host's clock when the call is made and when it returns (how far the host runs ahead);
* every ``Engine._open`` and the ``kv: null`` prefill: the caching allocator's counters before and after
  (``num_alloc_retries``, device mallocs and frees, ``num_sync_all_streams``): a retry frees every cached block and
  synchronises, the suspected cost;
* with ``--profile``: a torch profiler over the engine's ``_open`` of the last round; its tables by device and host
  time are written to ``$OUT``.

Found (twelfth session): the engine's first masked chunk of that shape ran on cuDNN's attention, which built a plan
for it (~0.6 s once); whichever path met the shape first paid. Prefill chunks and questions now build no mask on a
GPU (``code_attention.unpadded_causal``); ``--masked`` runs the path before, the anchor.

Run on the GPU machine:
    python bench/experiments/trace_engine_prefill.py --tokenizer $HOME/tok --out $OUT/trace_prefill.json --profile
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

from bench.bench_gpu_pipeline import (KV, PREFILL_CHUNK, QUESTIONS, model_folder, run_pipeline,  # noqa: E402
                                      warm_up, write_documents)
from bench.common import copy_bandwidth  # noqa: E402

COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
            "allocation.all.allocated", "segment.all.allocated", "reserved_bytes.all.peak", "allocated_bytes.all.peak")


def counters() -> dict:
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("trace_prefill.json"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--work", type=Path, default=Path.home() / "docfuse-bench")
    parser.add_argument("--masked", action="store_true", help="prefill chunks and questions with transformers' "
                        "masks (the path before code_attention.unpadded_causal), the anchor")
    parser.add_argument("--prefill-chunk", default="8192", help="answer.prefill_chunk: auto or tokens (8192: the "
                        "bench's chunk when this ran first)")
    args = parser.parse_args()
    PREFILL_CHUNK[0] = args.prefill_chunk if args.prefill_chunk == "auto" else int(args.prefill_chunk)
    from docfuse.runtime.kv import code_attention

    code_attention.MASK_FREE_ON_ACCELERATORS = not args.masked
    from docfuse.runtime import session as session_module
    from docfuse.runtime.engine import engine as engine_module

    calls: list[dict] = []
    phase = ["setup"]
    forward = session_module.forward_tokens

    def watched_forward(model, cache, ids, *a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        row = {"phase": phase[0], "tokens": len(ids), "past": cache.get_seq_length(), "cache": type(cache).__name__,
               "host_in": time.perf_counter()}
        start.record()
        out = forward(model, cache, ids, *a, **k)
        end.record()
        row["host_out"] = time.perf_counter()
        row["events"] = (start, end)
        calls.append(row)
        return out

    session_module.forward_tokens = watched_forward
    opens: list[dict] = []
    original_open = engine_module.Engine._open
    profile_round = [-1]

    def watched_open(self, index, doc, outputs):
        before = counters()
        t0 = time.perf_counter()
        if profile_round[0] >= 0 and phase[0] == f"engine_{profile_round[0]}":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                opened = original_open(self, index, doc, outputs)
                torch.cuda.synchronize()
            for key, name in (("self_cuda_time_total", "by_device"), ("self_cpu_time_total", "by_host")):
                table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
                (args.out.parent / f"trace_prefill_{name}.txt").write_text(table)
            prof.export_chrome_trace(str(args.out.parent / "trace_prefill_chrome.json"))
        else:
            opened = original_open(self, index, doc, outputs)
        after = counters()
        opens.append({"phase": phase[0], "host_s": time.perf_counter() - t0,
                      "prefill_s": getattr(opened, "prefill_s", None),
                      "counters": {k: after[k] - before[k] if "peak" not in k else after[k] for k in COUNTERS}})
        return opened

    engine_module.Engine._open = watched_open

    result: dict = {"card": torch.cuda.get_device_name(0), "masked": args.masked, "prefill_chunk": args.prefill_chunk}
    result["copy_bandwidth_tb_s"] = copy_bandwidth(2 << 30, 10) / 1e12
    model_dir = args.work / "llama8b-random"
    model, tokenizer = model_folder(model_dir, args.tokenizer, False)
    kv = {**KV, "questions": "each"}
    warm_up(model_dir, tokenizer, args.work, kv, 64)
    paths = write_documents(args.work / "docs", 1, 32768, tokenizer, seed=2)
    runs = []
    for rnd in range(args.rounds):
        if args.profile and rnd == args.rounds - 1:
            profile_round[0] = rnd
        for name, kv_block, mode, streams in (("engine", kv, "on", 64), ("kv_null", None, "off", 1)):
            phase[0] = f"{name}_{rnd}"
            before = counters()
            out = run_pipeline(model_dir, paths, QUESTIONS[:1], kv_block, 64, mode, streams)
            after = counters()
            runs.append({"phase": phase[0], "ttft_s": out["ttft_median_s"], "wall_s": out["wall_s"],
                         "decode_tok_s": out["per_stream_decode_tok_s_median"],
                         "counters": {k: after[k] - before[k] if "peak" not in k else after[k] for k in COUNTERS}})
            print(json.dumps(runs[-1]), flush=True)
    torch.cuda.synchronize()
    rows = []
    for row in calls:
        start, end = row.pop("events")
        row["device_s"] = start.elapsed_time(end) / 1e3
        row["host_s"] = row["host_out"] - row["host_in"]
        rows.append(row)
    # per phase: the chunks' device time, the host's time in the calls, and the gap between consecutive calls
    for ph in sorted({r["phase"] for r in rows}):
        mine = [r for r in rows if r["phase"] == ph and r["tokens"] > 64]
        if not mine:
            continue
        gaps = [b["host_in"] - a["host_out"] for a, b in zip(mine, mine[1:])]
        print(ph, json.dumps({"chunks_device_s": [round(r["device_s"], 3) for r in mine],
                              "chunks_host_s": [round(r["host_s"], 3) for r in mine],
                              "host_gaps_s": [round(g, 3) for g in gaps],
                              "cache": mine[0]["cache"]}), flush=True)
    for o in opens:
        print("open", json.dumps(o), flush=True)
    result.update({"runs": runs, "opens": opens,
                   "calls": [{k: v for k, v in r.items() if k not in ("host_in", "host_out")} for r in rows
                             if r["tokens"] > 64]})
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
