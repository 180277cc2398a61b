"""Helpers shared by the benchmarks: where the corpus is, what machine this is, how to record a result."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("DOCFUSE_CORPUS", ROOT.parent / "shared" / "corpus"))
RESULTS = ROOT / "bench" / "results"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}{vector_units()}), {mem:.0f} GiB, Python {platform.python_version()}"


def vector_units() -> str:
    """``, AVX512-BF16`` / ``, AVX512`` / ``, AVX2`` / ``, AMX``: CPUs of one model name differ here, and bf16 speed
    (hence the ``auto`` dtype) turns on these flags, so every CPU figure says which it ran on."""
    try:
        flags = set(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return ""
    for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2")):
        if flag in flags:
            return f", {name}"
    return ""


def corpus_pdfs() -> list[Path]:
    if not CORPUS.is_dir():
        raise SystemExit(f"the corpus is not at {CORPUS}; this benchmark needs ../shared/corpus")
    skip = {"encrypted", "malformed"}
    return sorted(p for p in CORPUS.rglob("*.pdf") if not skip & set(p.parts))


def code_version() -> str:
    """HEAD's short hash, with ``+uncommitted`` when tracked code (results and notes aside) differs from it: a figure
    must not be credited to a commit that lacks the change that made it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
               if not line[3:].startswith("bench/results/") and not line[3:].endswith(".md")]
    return git("rev-parse", "--short", "HEAD") + ("+uncommitted" if changed else "")


def save(name: str, result: dict) -> Path:
    """Write ``result`` (with date, machine and code version) to ``bench/results/NAME.json``; a ``name`` ending in
    ``.json`` is taken as the file's path instead."""
    result = {"date": date.today().isoformat(), "machine": machine(), "commit": code_version(), **result}
    path = Path(name) if str(name).endswith(".json") else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def llama8b_config(max_positions: int = 131072):
    """A Llama-3.1-8B-shaped config on SDPA (the GPU benchmarks fill it with random bf16 weights)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def random_llama8b(max_positions: int = 131072):
    """An 8B-shaped Llama (``llama8b_config``) with random bf16 weights on the GPU, in eval mode (speed does not depend
    on the weights' values)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return LlamaForCausalLM(llama8b_config(max_positions)).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of ``reps``, after
    three warm-up copies)."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2]
