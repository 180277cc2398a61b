"""Does a layer-major prefill in longer calls close the engine's 128K TTFT gap to DynamicCache (issue 23)?

The engine prefills a 128K document layer by layer, 8,192 tokens a call (``layer_prefill.MAX_CHUNK``): the first call
is a square causal attention (cuDNN's kernel on an H100), the other 15 each attend over the keys before them with
flash attention's bottom-right diagonal. The ``kv: null`` anchor prefills in two 64K passes since ``prefill_chunk:
auto`` (twelfth session) and was 1.07x faster. This runs one 128K document through ``text_qa`` (the bench's
``batch1_128k`` document and settings): the engine at each ``--layer-chunks`` value, then ``kv: null``, ``--rounds``
times in alternating order, and reports each run's TTFT and peak device memory.

Run on the GPU machine:
    python bench/experiments/layer_chunk_128k.py --tokenizer $HOME/tok --out $OUT/layer_chunk_128k.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

from bench.bench_gpu_pipeline import KV, QUESTIONS, model_folder, run_pipeline, warm_up, write_documents  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("layer_chunk_128k.json"))
    parser.add_argument("--layer-chunks", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--prefill-chunk", default="auto", help="answer.prefill_chunk of every run (auto: 65,536 on "
                        "CUDA; it also caps a layer-major call)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path.home() / "docfuse-bench")
    args = parser.parse_args()
    from bench.bench_gpu_pipeline import PREFILL_CHUNK
    from docfuse.runtime import layer_prefill

    PREFILL_CHUNK[0] = args.prefill_chunk if args.prefill_chunk == "auto" else int(args.prefill_chunk)

    model_dir = args.work / "llama8b-random"
    _, tokenizer = model_folder(model_dir, args.tokenizer, False)
    kv = {**KV, "questions": "each"}
    warm_up(model_dir, tokenizer, args.work, kv, 64)
    paths = write_documents(args.work / "docs", 1, 131072 - 2048, tokenizer, seed=4)
    runs = []
    for round_ in range(args.rounds):
        order = [("engine", c) for c in args.layer_chunks] + [("kv_null", None)]
        for path, chunk in (order if round_ % 2 == 0 else order[::-1]):
            if chunk is not None:
                layer_prefill.MAX_CHUNK = chunk
            out = run_pipeline(model_dir, paths, QUESTIONS[:1], kv if path == "engine" else None, args.new_tokens,
                               "on" if path == "engine" else "off", 64, truncate="head")
            row = {"round": round_, "path": path, "layer_chunk": chunk, "ttft_s": out["ttft_median_s"],
                   "prompt_tokens": out["prompt_tokens_median"], "peak_device_gb": out["peak_device_gb"],
                   "decode_tok_s": out["per_stream_decode_tok_s_median"], "errors": out["errors"]}
            print(json.dumps(row), flush=True)
            runs.append(row)
    args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "kv": KV, "prefill_chunk": PREFILL_CHUNK[0],
                                    "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
