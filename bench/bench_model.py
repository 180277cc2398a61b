"""Measure model load time, prefill and decode speed per dtype, and a pass-key sanity check.

    .venv/bin/python bench/bench_model.py --dtypes float32 bfloat16 --tokens 1024 --new-tokens 32 [--convert]

``--convert`` first converts the GGUF into a temporary DOCFUSE_HOME to time the one-off conversion. Prints one JSON
line per measurement; the CPU figures decide ``resolve_dtype``'s CPU default (speed and a correct pass key).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docfuse.runtime import loading  # noqa: E402
from docfuse.runtime.session import Session  # noqa: E402

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "The pass key is 71432. Remember it. 71432 is the pass key. "


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def time_conversion() -> None:
    """The first load: GGUF parse, dequantise, verify, save (into a throwaway DOCFUSE_HOME)."""
    old = os.environ.get("DOCFUSE_HOME")
    with tempfile.TemporaryDirectory() as home:
        os.environ["DOCFUSE_HOME"] = home
        try:
            started = time.perf_counter()
            loading.load_model("default")
            _emit(what="load_first_with_conversion", seconds=round(time.perf_counter() - started, 2))
        finally:
            if old is None:
                os.environ.pop("DOCFUSE_HOME")
            else:
                os.environ["DOCFUSE_HOME"] = old


def bench_dtype(dtype: str, tokens: int, new_tokens: int, repeats: int) -> None:
    started = time.perf_counter()
    model, tokenizer = loading.load_model("default", dtype=dtype, device="cpu")
    _emit(what="load_cached", dtype=dtype, seconds=round(time.perf_counter() - started, 2))
    session = Session(model, tokenizer)
    words = FILLER * max(1, tokens // 23)
    prefix = session.prompt.prefix(words)
    ids = list(prefix.ids[:tokens])
    for _ in range(repeats):
        seconds = session.prefill(ids, chunk_size=512)
        answer = session.ask("Summarise the document in one long paragraph.", max_new_tokens=new_tokens)
        _emit(what="speed", dtype=dtype, prefill_tokens=len(ids), prefill_tokens_per_s=round(len(ids) / seconds, 1),
              decode_tokens=answer.new_tokens, decode_tokens_per_s=round(answer.decode_tokens_per_s, 2),
              threads=torch.get_num_threads())
    pass_doc = FILLER * 8 + KEY + FILLER * 8
    session.prefill(session.fit_document(pass_doc, max_new_tokens=16))
    answer = session.ask("What is the pass key?", max_new_tokens=16)
    _emit(what="passkey", dtype=dtype, prompt_tokens=answer.prompt_tokens, answer=answer.text,
          correct="71432" in answer.text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=1024, help="prefill length")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--convert", action="store_true", help="also time the one-off GGUF conversion")
    args = parser.parse_args()
    _emit(what="machine", cpu=platform.processor() or platform.machine(), cores=len(os.sched_getaffinity(0)),
          torch=torch.__version__, load_average=os.getloadavg()[0])
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401

    _emit(what="import_transformers_llama", seconds=round(time.perf_counter() - started, 2))
    if args.convert:
        time_conversion()
    for dtype in args.dtypes:
        bench_dtype(dtype, args.tokens, args.new_tokens, args.repeats)


if __name__ == "__main__":
    main()
