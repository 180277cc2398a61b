"""Layer-major against token-major prefill on CPU with the embedded model: peak memory, prefill time, answers.

    .venv/bin/python bench/bench_layer_prefill_cpu.py            # 4 needle cases at 8K -> bench/results/layer_prefill_cpu.json

Each mode runs in its own process (a clean memory high-water mark): the embedded model through ``Session`` with the
tiered cache's target budgets (10% core, 25% 4-bit association), ``kv.prefill`` = ``tokens`` (the usual chunked
prefill: the whole cache in full precision until the question's re-tier) or ``layers`` (runtime.layer_prefill: one
layer at a time, each tiered as soon as it is full). A sampling thread reads the process's resident memory every
5 ms during the prefill; the figure is its peak above the resident memory just before. Then each case's question is
asked and checked.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KV = {"core_tokens": 0.10, "association_tokens": 0.25, "association_bits": 4}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRSS:
    """Samples resident memory in a thread while the block runs."""

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = rss_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())


def run_mode(mode: str, cases: int, target: int) -> dict:
    from bench import kv_cases
    from docfuse.runtime.loading import load_model
    from docfuse.runtime.session import Session

    model, tokenizer = load_model("default")
    session = Session(model, tokenizer, kv={**KV, "prefill": mode})
    out = []
    for case in kv_cases.single_cases({target: cases}, with_essays=False):
        question = kv_cases.questions(case)[0]
        reserve = len(session.prompt.suffix(question)) + 16
        kv_cases.build_document(case, session.prompt, tokenizer,
                                kv_cases.prefix_budget(case.target, session.limit, reserve))
        with PeakRSS() as mem:
            seconds = session.prefill(list(case.prefix_ids))
        answer = session.ask(question, max_new_tokens=16)
        out.append({"case": case.id, "prefix_tokens": len(case.prefix_ids), "prefill_s": seconds,
                    "prefill_peak_rss_above_start_bytes": mem.peak - mem.base,
                    "kv_full_bytes": answer.kv_full_bytes, "kv_peak_device_bytes": session.cache.peak_device,
                    "ttft_s": answer.ttft_s, "answer": answer.text, "right": case.needles[0][0].found_in(answer.text)})
        print(mode, out[-1], flush=True)
    return {"mode": mode, "dtype": str(model.dtype), "cases": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=4)
    parser.add_argument("--target", type=int, default=8192)
    parser.add_argument("--mode", choices=["tokens", "layers"], help="(internal) run one mode and print JSON")
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args.mode, args.cases, args.target)))
        return
    from bench.common import save

    modes = {}
    for mode in ("tokens", "layers"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--cases", str(args.cases),
                               "--target", str(args.target)], capture_output=True, text=True, cwd=ROOT)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        modes[mode] = json.loads(line[7:])
    pairs = list(zip(modes["tokens"]["cases"], modes["layers"]["cases"]))
    summary = {
        "peak_rss_ratio_layers_over_tokens": [b["prefill_peak_rss_above_start_bytes"] /
                                              max(1, a["prefill_peak_rss_above_start_bytes"]) for a, b in pairs],
        "prefill_time_ratio_layers_over_tokens": [b["prefill_s"] / a["prefill_s"] for a, b in pairs],
        "same_answers": [a["answer"] == b["answer"] for a, b in pairs],
        "right": {m: sum(c["right"] for c in r["cases"]) for m, r in modes.items()},
    }
    print(json.dumps(summary, indent=1))
    print(save("layer_prefill_cpu", {"command": "bench/bench_layer_prefill_cpu.py", "kv": KV, "modes": modes,
                                     "summary": summary}))


if __name__ == "__main__":
    main()
