"""Separate ranking error from quantisation error in the tiered cache, on three cases the full cache answers.

Same cases as bench_kv.py (same seeds); configurations that keep the byte budget but change the bits, or move
everything to the core, or widen the association tier.

    .venv/bin/python bench/experiments/diag_kv_ranking.py
"""
import sys, time; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from bench import bench_kv as B, kv_cases as K
from docfuse.runtime.loading import load_model
from docfuse.runtime.prompt import ChatPrompt, DEFAULT_SYSTEM
from docfuse.runtime import session as S
torch.set_num_threads(1)
model, tok = load_model("default")
prompt = ChatPrompt(tok, DEFAULT_SYSTEM)
cases = [c for c in K.single_cases({1024: 8, 2048: 8, 4096: 12, 8192: 12}, K.essays_available()) if c.id in ("s1k-01", "s1k-03", "s4k-00")]
limit = S.context_limit(model)
reserve = max(len(prompt.suffix(q)) for c in cases for q in K.questions(c)) + B.MAX_NEW_TOKENS
configs = {"full": None,
           "t10/25 4b": {"core_tokens": 0.1, "association_tokens": 0.25, "association_bits": 4},
           "t10/25 8b": {"core_tokens": 0.1, "association_tokens": 0.25, "association_bits": 8},
           "t35/0 core only": {"core_tokens": 0.35, "association_tokens": 0},
           "t10/90 8b": {"core_tokens": 0.1, "association_tokens": 0.9, "association_bits": 8}}
for c in cases:
    K.build_document(c, prompt, tok, K.prefix_budget(c.target, limit, reserve))
    row = B.run_case(model, tok, c, configs, False)
    print(c.id, {k: (v[0]["right"], v[0]["answer"][:40]) for k, v in row["configs"].items()}, flush=True)
