"""Where a question's start goes on a GPU: the exact read and the re-tier of ``read_question``, function by function.

An 8B-shaped Llama with random bf16 weights, one document of ``--tokens`` random ids in a TieredCache with the
engine's DeviceArchive, prefilled token-major; then ``--questions`` questions of 12 tokens, each read with
``read_question`` and rolled back. Each named function is wrapped with a CUDA synchronisation before and after, and
its inclusive time is summed (nested functions count in their callers too).

Run on the GPU machine:  python bench/experiments/profile_question_start.py --out $OUT/question_start.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            TIMES[label] += time.perf_counter() - t0
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("question_start.json"))
    args = parser.parse_args()
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from docfuse.runtime.kv import TieredCache, read_question, tiered
    from docfuse.runtime.kv import layer as layer_mod
    from docfuse.runtime.kv import association, queries, summaries, votes
    from docfuse.runtime.kv.background import DeviceArchive
    from docfuse.runtime.session import fill_cache

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, 49152, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = {"core_tokens": 0.10, "association_tokens": 0.25, "association_bits": 4, "association_key_bits": 4}
    result: dict = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "layers": args.layers, "kv": kv}

    def prefill(cache) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fill_cache(model, cache, ids, 8192)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    prefill(DynamicCache(config=config))  # warm
    result["prefill_dynamic_s"] = prefill(DynamicCache(config=config))
    cache = TieredCache(config, kv)
    for layer in cache.layers:
        layer.archive = DeviceArchive()
    result["prefill_tiered_s"] = prefill(cache)
    prefix = cache.get_seq_length()
    for owner, name in ((layer_mod.TieredLayer, "_materialize"), (layer_mod.TieredLayer, "vote_priority"),
                        (layer_mod.TieredLayer, "rebuild"), (layer_mod.TieredLayer, "refresh_summaries"),
                        (layer_mod.TieredLayer, "_archive_all"), (layer_mod.TieredLayer, "_exact_update"),
                        (layer_mod.TieredLayer, "membership"), (layer_mod.TieredLayer, "truncate"),
                        (tiered.TieredCache, "retier_layer"), (association.AssociationStore, "build")):
        timed(owner, name, f"{owner.__name__}.{name}")
    for module, name in ((layer_mod, "token_votes"), (layer_mod, "page_minmax"), (layer_mod, "nominate"),
                         (layer_mod, "page_scores")):
        timed(module, name, name)
    del votes, summaries, queries
    runs = []
    for q in range(args.questions):
        question = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(q + 1)).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            read_question(model, cache, question)
        torch.cuda.synchronize()
        read = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.inference_mode():
            cache.rollback(prefix)
        torch.cuda.synchronize()
        runs.append({"read_question_s": read, "rollback_s": time.perf_counter() - t0})
        print(runs[-1], flush=True)
    result["questions"] = runs
    result["functions_s"] = {k: round(v, 4) for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1])}
    result["calls"] = dict(CALLS)
    print(json.dumps(result, indent=1), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
