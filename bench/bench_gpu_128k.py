"""GPU decode at 8K/32K/128K: DynamicCache vs docfuse's tiered cache (reference path, fused kernel, CUDA graph, pruning).

A Llama-3.1-8B-shaped model with random bf16 weights (speed does not depend on their values), batch 1, SDPA, prefill
in 8K chunks. Per context and cache: TTFT (prefill + tiering + first token; at the longest context the best of
``--ttft-repeats`` prefills, all recorded), decode ms/token over ``--decode`` tokens after ``--warmup`` tokens,
device KV bytes, peak device memory; and the bandwidth floor from a measured copy bandwidth.

The tiered cache is filled by the layer-major prefill (runtime.layer_prefill: one layer over the whole document at a
time, tiered as soon as it is full on a side stream while the next layer computes, its exact K/V archived to the host
by background threads), then decoded from the same state (rolled back in between): through the dequantising
reference path (``tiered``), the fused kernel (``tiered_kernel``), one CUDA graph per step of the explicit decode
forward with its fused ops (``tiered_graph``, runtime.gpu.decode_step), a graph of the model's own forward through the
same kernel (``tiered_graph_model_forward``: what the fused ops save), and the explicit graph with a static MLP skip
set (``tiered_graph_pruned``, see choose_skip_mlp). Each tiered prefill records its per-layer timeline (GPU compute,
host tiering, waits). At the
longest context ``batched`` decodes as many replicated documents as fit, in one graph.

Run on the GPU machine:  python3 bench/bench_gpu_128k.py --contexts 8192 32768 131072 --out $OUT/gpu_128k.json
(``--sweep`` first re-tunes the kernel launch config at the 128K layer shape and writes gpu_kernel_sweep.json.)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from docfuse.runtime.gpu.decode_graph import GraphDecoder  # noqa: E402
from docfuse.runtime.gpu import attention_kernel  # noqa: E402
from docfuse.runtime.gpu.attention_kernel import TUNED, kernel_flops_bytes, tiered_decode_attention  # noqa: E402
from docfuse.runtime.gpu.kernel_cache import KernelTieredCache, register_attention  # noqa: E402
from docfuse.runtime.gpu.reference import tiered_decode_reference  # noqa: E402
from docfuse.runtime.gpu.batch import stack_caches  # noqa: E402
from docfuse.runtime.kv.association import AssociationStore  # noqa: E402
from docfuse.runtime.kv.background import ArchiveWriter  # noqa: E402
from docfuse.runtime.layer_prefill import layer_major_prefill  # noqa: E402
from docfuse.runtime.session import cache_kwarg  # noqa: E402
from bench.common import copy_bandwidth, llama8b_config  # noqa: E402

KV = {"core_tokens": 0.10, "association_tokens": 0.25, "association_bits": 4, "association_key_bits": 4}
GB = 1e9


def build_model():
    from transformers import LlamaForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama8b_config()).eval()
    torch.set_default_dtype(torch.float32)
    return model


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    kwarg = cache_kwarg(model)
    out = None
    for s in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, s: s + chunk], logits_to_keep=1, use_cache=True, **{kwarg: cache})
    return out.logits[:, -1].argmax(-1, keepdim=True)


def decode(model, cache, tok: torch.Tensor, warmup: int, steps: int) -> float:
    """Greedy one-token steps; returns seconds per token over ``steps`` after ``warmup``."""
    kwarg = cache_kwarg(model)
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            t0 = sync_time()
        out = model(input_ids=tok, use_cache=True, **{kwarg: cache})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return (sync_time() - t0) / steps


def dynamic_kv_bytes(cache) -> int:
    return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
               for l in cache.layers)


def fresh() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def kernel_check(cache: KernelTieredCache, hq: int) -> dict:
    """Layer 0's tiers: kernel vs fp32 reference on fresh random queries, and the kernel's time and bandwidth."""
    import triton.testing

    layer = cache.layers[0]
    b, hkv, _, d = layer.keys.shape
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    ref = tiered_decode_reference(q, layer.keys, layer.values, layer.n_core, layer.assoc, d ** -0.5)
    out = tiered_decode_attention(q, layer.keys, layer.values, layer.n_core, layer.assoc, d ** -0.5)
    rel = float((out.float() - ref).norm() / ref.norm())
    fn = lambda: tiered_decode_attention(q, layer.keys, layer.values, layer.n_core, layer.assoc, d ** -0.5)  # noqa
    ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")  # graph replay: GPU time, not launch time
    _, nbytes = kernel_flops_bytes(b, hq, hkv, d, layer.n_core, layer.n_assoc)
    return {"rel_err_vs_fp32": rel, "kernel_us_per_layer": ms * 1e3, "kernel_bytes_per_layer": nbytes,
            "kernel_tb_s": nbytes / (ms / 1e3) / 1e12}


def run_context(model, length: int, args, bw: float, weights_read: int, writer: ArchiveWriter) -> dict:
    hq = model.config.num_attention_heads
    gen = torch.Generator(device="cuda").manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (1, length), device="cuda", generator=gen)
    weights_alloc = torch.cuda.memory_allocated()
    res: dict = {}

    # ---- DynamicCache baseline ----
    from transformers import DynamicCache

    fresh()
    model.config._attn_implementation = "sdpa"
    baseline_runs = []
    for _ in range(args.ttft_repeats if length == max(args.contexts) else 1):
        cache = None
        fresh()
        t0 = sync_time()
        cache = DynamicCache(config=model.config)
        tok = prefill(model, cache, ids, args.chunk)
        baseline_runs.append(sync_time() - t0)
    ttft = min(baseline_runs)
    first_token = tok.clone()
    kv = dynamic_kv_bytes(cache)
    step = decode(model, cache, tok, args.warmup, args.decode)
    peak = torch.cuda.max_memory_allocated()
    res["dynamic_cache"] = {"ttft_s": ttft, "ttft_runs_s": baseline_runs, "decode_ms_per_token": step * 1e3, "decode_tokens_per_s": 1 / step,
                            "kv_device_bytes": kv, "peak_device_gb": peak / GB,
                            "prefill_workspace_bytes": peak - weights_alloc - kv,
                            "floor_ms_per_token": (weights_read + kv) / bw * 1e3, "_first_token": first_token}
    del cache
    print(f"[{length}] dynamic: ttft {ttft:.2f}s decode {step * 1e3:.1f} ms/tok kv {kv / GB:.2f} GB "
          f"peak {peak / GB:.1f} GB", flush=True)

    # ---- tiered: one layer-major prefill (each layer tiered as soon as it is full), then three decode paths ----
    fresh()
    model.config._attn_implementation = register_attention()
    tiered_runs, timelines = [], []
    for _ in range(args.ttft_repeats if length == max(args.contexts) else 1):
        cache = None
        fresh()
        cache = KernelTieredCache(model.config, KV)
        timeline: list[dict] = []
        packed, waited = writer.pack_s, writer.wait_s
        t0 = sync_time()
        logits = layer_major_prefill(model, cache, ids, chunk=args.chunk, writer=writer, timeline=timeline)
        tok = logits.argmax(-1, keepdim=True)
        tiered_runs.append(sync_time() - t0)
        timelines.append(timeline_summary(timeline, tiered_runs[-1], writer.pack_s - packed, writer.wait_s - waited))
        print(f"[{length}] tiered prefill timeline: {timelines[-1]['totals']}", flush=True)
    ttft = min(tiered_runs)
    for layer in cache.layers:
        layer.archive.settle()
    settle = sync_time() - t0 - ttft
    prefill_peak = torch.cuda.max_memory_allocated()
    tiers = cache.tier_bytes()
    kvd = cache.device_bytes()
    read = tiers["core"] + tiers["association"]
    floor = (weights_read + read) / bw
    prefix = cache.get_seq_length()
    common = {"ttft_s": ttft, "ttft_runs_s": tiered_runs, "prefill_timelines": timelines, "archive_settled_after_first_token_s": settle, "kv_device_bytes": kvd,
              "tier_bytes": tiers, "tier_tokens": cache.tier_tokens(), "kv_peak_device_bytes": cache.peak_device,
              "floor_ms_per_token": floor * 1e3, "tier_bytes_read_per_token": read,
              "prefill_peak_device_gb": prefill_peak / GB,
              "prefill_workspace_bytes": prefill_peak - weights_alloc - kvd,
              "first_token_matches_dynamic_cache": bool(torch.equal(tok, res["dynamic_cache"].pop("_first_token")))}
    print(f"[{length}] tiered layer-major prefill: ttft {ttft:.2f}s (archive settled {settle:.2f}s later), "
          f"peak {prefill_peak / GB:.1f} GB, tiers {cache.tier_tokens()}", flush=True)
    check = kernel_check(cache, hq)
    for name, fused in (("tiered", False), ("tiered_kernel", True)):
        cache.rollback(prefix)
        cache.set_fused(fused)
        torch.cuda.reset_peak_memory_stats()
        step = decode(model, cache, tok, args.warmup, args.decode)
        peak = max(prefill_peak, torch.cuda.max_memory_allocated())
        res[name] = {**common, "decode_ms_per_token": step * 1e3, "decode_tokens_per_s": 1 / step,
                     "peak_device_gb": peak / GB, "decode_peak_device_gb": torch.cuda.max_memory_allocated() / GB,
                     "fraction_of_floor": floor / step}
        print(f"[{length}] {name}: decode {step * 1e3:.1f} ms/tok ({1 / step:.1f} tok/s) kv {kvd / GB:.2f} GB "
              f"peak {peak / GB:.1f} GB floor {floor * 1e3:.2f} ms", flush=True)
    res["tiered_kernel"]["kernel_check_layer0"] = check
    print(f"[{length}] kernel layer0: rel err {check['rel_err_vs_fp32']:.2e}, {check['kernel_us_per_layer']:.1f} us, "
          f"{check['kernel_tb_s']:.2f} TB/s", flush=True)
    # ---- the fused kernel inside one CUDA graph per decode step; then with a static MLP skip set ----
    skip = choose_skip_mlp(model, cache, tok, args.skip_mlp) if args.skip_mlp else []
    graphs = (("tiered_graph", [], True), ("tiered_graph_model_forward", [], False), ("tiered_graph_pruned", skip, True))
    for name, skip_mlp, explicit in graphs:
        if name == "tiered_graph_pruned" and not skip:
            continue
        try:
            cache.rollback(prefix)
            cache.set_fused(True)
            torch.cuda.reset_peak_memory_stats()
            t0 = sync_time()
            dec = GraphDecoder(model, cache, max_new=args.warmup + args.decode + 2, first_token=tok,
                               warmup=max(2, args.warmup), skip_mlp=skip_mlp, explicit=explicit)
            capture = sync_time() - t0
            t0 = sync_time()
            for _ in range(args.decode):
                dec.step()
            step = (sync_time() - t0) / args.decode
            dec.close()
            peak = max(prefill_peak, torch.cuda.max_memory_allocated())
            res[name] = {**common, "decode_ms_per_token": step * 1e3, "decode_tokens_per_s": 1 / step,
                         "peak_device_gb": peak / GB,
                         "decode_peak_device_gb": torch.cuda.max_memory_allocated() / GB,
                         "fraction_of_floor": floor / step, "graph_warmup_capture_s": capture}
            if skip_mlp:
                skipped_bytes = sum(p.numel() * p.element_size() for i in skip_mlp
                                    for p in model.model.layers[i].mlp.parameters())
                floor_p = (weights_read - skipped_bytes + read) / bw
                res[name].update({"skip_mlp_layers": skip_mlp, "skipped_blocks_fraction": len(skip_mlp) / (2 * len(
                    model.model.layers)), "floor_ms_per_token": floor_p * 1e3, "fraction_of_floor": floor_p / step})
            print(f"[{length}] {name}: decode {step * 1e3:.2f} ms/tok ({1 / step:.1f} tok/s) "
                  f"floor {floor * 1e3:.2f} ms ({floor / step:.0%} of floor), capture {capture:.2f}s", flush=True)
        except Exception as exc:  # record and go on: the eager figures still stand
            res[name] = {**common, "error": repr(exc)}
            print(f"[{length}] {name} failed: {exc!r}", flush=True)
    if args.batched and length == max(args.contexts):
        res["batched"] = batched_decode(model, cache, tok, prefix, args, weights_alloc)
    del cache
    fresh()
    base = res["dynamic_cache"]
    for name in ("tiered", "tiered_kernel", "tiered_graph", "tiered_graph_model_forward", "tiered_graph_pruned"):
        r = res.get(name)
        if r is None or "error" in r:
            continue
        r["speedup_vs_dynamic_cache"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["ttft_ratio_vs_dynamic_cache"] = r["ttft_s"] / base["ttft_s"]
        r["kv_device_ratio"] = r["kv_device_bytes"] / base["kv_device_bytes"]
    base["speedup_vs_dynamic_cache"] = base["ttft_ratio_vs_dynamic_cache"] = base["kv_device_ratio"] = 1.0
    return res


def timeline_summary(timeline: list[dict], wall: float, pack_s: float, archive_wait_s: float) -> dict:
    """Totals of a layer-major prefill's per-layer timeline (see runtime.layer_prefill), and the layers themselves.

    ``compute``: GPU time of the layers; ``tier``: host time tiering them (beside the next layer); ``wait``: the
    loop blocked on the previous layer's tiering; ``archive_pack_s``: LZ4 worker time (summed over threads)."""
    totals = {k: sum(r.get(k, 0.0) for r in timeline) for k in ("compute", "tier", "wait", "archive_wait")}
    totals.update({"wall": wall, "archive_pack_s": pack_s, "archive_wait_total": archive_wait_s})
    return {"totals": totals, "layers": timeline}


def choose_skip_mlp(model, cache, tok: torch.Tensor, count: int) -> list[int]:
    """Stand-in skip set for a model without a calibrated decision head (random weights): the ``count`` layers whose
    MLP changes the residual stream least, relative to its input, on one eager step from the prompt's last token.
    The step's token is rolled back afterwards."""
    prefix = cache.get_seq_length()
    ratios: dict[int, float] = {}
    hooks = []
    for i, block in enumerate(model.model.layers):
        def hook(_m, inputs, output, i=i):
            ratios[i] = float(output[:, -1].float().norm() / inputs[0][:, -1].float().norm().clamp(min=1e-6))
        hooks.append(block.mlp.register_forward_hook(hook))
    try:
        model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache})
    finally:
        for h in hooks:
            h.remove()
        cache.rollback(prefix)
    return sorted(sorted(ratios, key=ratios.get)[:count])


def batched_decode(model, cache, tok: torch.Tensor, prefix: int, args, weights_alloc: int) -> dict:
    """Decode many documents at once: the tiers of the prefilled document, replicated ``n`` times along the batch
    (every row a full copy on the device; the speed does not depend on the values, as with the random weights).
    Finds the largest ``n`` that fits, then reports aggregate tokens/s and peak memory at a few batch sizes."""
    cache.rollback(prefix)
    cache.set_fused(True)
    per_doc = cache.device_bytes()
    fresh()
    free = torch.cuda.mem_get_info()[0]
    reserve = 3 * GB  # graph capture, logits, the growth of the core by max_new tokens
    n_fit = max(1, int((free - reserve) // per_doc))
    out: dict = {"per_document_device_bytes": per_doc, "free_before_gb": free / GB, "estimated_fit": n_fit,
                 "sizes": {}}

    def run(n: int) -> bool:
        stacked = dec = None
        try:
            fresh()
            stacked = stack_caches([cache] * n, release=False)
            toks = tok.expand(n, 1).contiguous()
            t0 = sync_time()
            dec = GraphDecoder(model, stacked, max_new=args.warmup + args.decode + 2, first_token=toks,
                               warmup=max(2, args.warmup))
            capture = sync_time() - t0
            t0 = sync_time()
            for _ in range(args.decode):
                dec.step()
            step = (sync_time() - t0) / args.decode
            rows_agree = bool((dec.tok == dec.tok[:1]).all())
            out["sizes"][n] = {"documents": n, "decode_ms_per_step": step * 1e3,
                               "aggregate_tokens_per_s": n / step, "per_document_tokens_per_s": 1 / step,
                               "peak_device_gb": torch.cuda.max_memory_allocated() / GB,
                               "graph_warmup_capture_s": capture, "rows_agree": rows_agree}
            print(f"[batched] {n} documents: {step * 1e3:.1f} ms/step, {n / step:.0f} tok/s aggregate, "
                  f"peak {torch.cuda.max_memory_allocated() / GB:.1f} GB, rows agree {rows_agree}", flush=True)
            return True
        except torch.cuda.OutOfMemoryError as exc:
            print(f"[batched] {n} documents: out of memory ({str(exc)[:80]})", flush=True)
            out.setdefault("out_of_memory_at", []).append(n)
            return False
        finally:
            if dec is not None and dec.graph is not None:
                dec.close()
            del stacked, dec
            fresh()

    largest, n = None, n_fit
    while n >= 1 and largest is None:
        largest = n if run(n) else None
        n -= 1
    if largest and largest > 8:
        run(8)
    out["max_documents_decoded_at_once"] = largest
    return out


def sweep_kernel(out_dir: Path) -> dict:
    """Time the kernel's launch configurations at the 128K layer shape (core 13147, association 32768 tokens, 8 KV
    heads, 32 query heads); adopt the fastest within 1e-2 of the fp32 reference for the rest of the run."""
    import itertools

    import triton.testing

    torch.manual_seed(0)
    b, hkv, hq, d, nc, na = 1, 8, 32, 128, 13147, 32768
    ck = torch.randn(b, hkv, nc + 40, d, device="cuda", dtype=torch.bfloat16)
    cv = torch.randn_like(ck)
    assoc = AssociationStore.build(torch.randn(b, hkv, na, d, device="cuda", dtype=torch.bfloat16) * 2,
                                   torch.randn(b, hkv, na, d, device="cuda", dtype=torch.bfloat16), 4, 32)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    ref = tiered_decode_reference(q, ck, cv, nc, assoc, d ** -0.5)
    _, nbytes = kernel_flops_bytes(b, hq, hkv, d, nc, na)
    rows = []
    for compact, bn, nw, sm in itertools.product([False, True], [32, 64, 128], [4, 8], [1, 2]):
        attention_kernel.SPLIT_SCALE = sm
        kw = dict(splits=attention_kernel.default_splits(b * hkv, nc + na, bn), block_n=bn, num_warps=nw,
                  num_stages=2, compact=compact)
        attention_kernel.SPLIT_SCALE = 1.0
        fn = lambda: tiered_decode_attention(q, ck, cv, nc, assoc, d ** -0.5, **kw)  # noqa: E731
        rel = float((fn().float() - ref).norm() / ref.norm())
        us = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
        rows.append({"us": us, "tb_s": nbytes / us / 1e6, "rel": rel, "split_scale": sm, **kw})
        print(f"sweep {us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s rel {rel:.1e} {kw}", flush=True)
    best = min((r for r in rows if r["rel"] <= 1e-2), key=lambda r: r["us"])
    TUNED.update({k: best[k] for k in ("block_n", "num_warps", "num_stages", "compact")})
    attention_kernel.SPLIT_SCALE = float(best["split_scale"])
    (out_dir / "gpu_kernel_sweep.json").write_text(json.dumps(rows, indent=1))
    print(f"sweep best: {best}", flush=True)
    return best


def concurrent_documents(r: dict, free_after_weights: int) -> dict:
    """Documents of this length that fit at once: each keeps its device KV; one prefill at a time needs its
    workspace (activations, and for the tiered cache the full-precision cache it holds until its re-tier)."""
    kv, work = r["kv_device_bytes"], max(0, r["prefill_workspace_bytes"])
    return {"with_prefill_workspace": int((free_after_weights - work) // kv),
            "kv_only": int(free_after_weights // kv)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_128k.json")
    parser.add_argument("--sweep", action="store_true", help="re-tune the kernel's launch config first")
    parser.add_argument("--skip-mlp", type=int, default=8, help="MLP blocks the pruned graph leaves out (0: no row)")
    parser.add_argument("--batched", action=argparse.BooleanOptionalAction, default=True,
                        help="at the longest context, decode as many replicated documents as fit")
    parser.add_argument("--workers", type=int, default=None, help="archive compression threads")
    parser.add_argument("--ttft-repeats", type=int, default=2,
                        help="prefills per cache at the longest context (TTFT = the best; all are recorded)")
    args = parser.parse_args(argv)
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = True
    if args.sweep:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        sweep_kernel(args.out.parent)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    model = build_model()
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights_read = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    fresh()
    free_after_weights = torch.cuda.mem_get_info()[0]
    print(f"model built in {time.perf_counter() - t0:.1f}s: {weights / GB:.2f} GB weights, "
          f"{free_after_weights / GB:.1f} GB free", flush=True)
    writer = ArchiveWriter(workers=args.workers)
    with torch.no_grad():
        warm = argparse.Namespace(chunk=args.chunk, warmup=1, decode=2, skip_mlp=args.skip_mlp, batched=False,
                                  contexts=[2048], ttft_repeats=1)
        run_context(model, 2048, warm, bw, weights_read, writer)  # kernels, Triton compile, allocator: out of the numbers
        result = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "model": "Llama-3.1-8B shape, random bf16 weights, SDPA, batch 1", "kv": KV,
                  "prefill_chunk": args.chunk, "decode_tokens": args.decode, "warmup_tokens": args.warmup,
                  "kernel_config": {**TUNED, "split_scale": attention_kernel.SPLIT_SCALE},
                  "archive_workers": writer.workers, "skip_mlp": args.skip_mlp,
                  "copy_bandwidth_tb_s": bw / 1e12, "weights_gb": weights / GB,
                  "weights_read_per_token_gb": weights_read / GB, "free_after_weights_gb": free_after_weights / GB,
                  "contexts": {}}
        for length in args.contexts:
            result["contexts"][str(length)] = run_context(model, length, args, bw, weights_read, writer)
            top = result["contexts"][str(length)]
            modes = [m for m in top if m != "batched" and "error" not in top[m]]
            for key in ("decode_tokens_per_s", "speedup_vs_dynamic_cache", "ttft_s", "ttft_ratio_vs_dynamic_cache",
                        "peak_device_gb", "kv_device_ratio", "floor_ms_per_token"):
                result[key] = {m: top[m][key] for m in modes}
            result["fraction_of_floor"] = {m: top[m]["floor_ms_per_token"] / top[m]["decode_ms_per_token"]
                                           for m in modes}
            result[f"concurrent_{length // 1024}k_documents"] = {m: concurrent_documents(top[m], free_after_weights)
                                                                 for m in modes}
            if "batched" in top:
                result[f"concurrent_{length // 1024}k_documents"]["measured_decode_batch"] = \
                    top["batched"]["max_documents_decoded_at_once"]
            result["summary_context"] = length
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
    if "concurrent_128k_documents" not in result:
        print("note: 128K not run; concurrent_128k_documents is missing", flush=True)
    print(f"\n{'ctx':>7} {'cache':>14} {'ttft s':>8} {'ms/tok':>8} {'tok/s':>7} {'floor ms':>8} {'KV GB':>7} "
          f"{'peak GB':>8}")
    for length, top in result["contexts"].items():
        for m, r in top.items():
            if m == "batched" or "error" in r:
                continue
            print(f"{length:>7} {m:>14} {r['ttft_s']:8.2f} {r['decode_ms_per_token']:8.1f} "
                  f"{r['decode_tokens_per_s']:7.1f} {r['floor_ms_per_token']:8.2f} {r['kv_device_bytes'] / GB:7.2f} "
                  f"{r['peak_device_gb']:8.1f}")
    print(json.dumps({k: v for k, v in result.items() if k.startswith("concurrent")}))


if __name__ == "__main__":
    main()
