"""Default model load time after the first conversion, in fresh processes.

``imports_s``: ``import torch, transformers``; ``load_s``: the first ``load_model`` in the process, which also pays
transformers' lazy imports (with torchvision installed they pull in torch._dynamo, ~2 s); ``second_load_s``: a
second ``load_model`` in the same process, the weights and tokenizer alone.

    .venv/bin/python bench/bench_load.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ROOT, save  # noqa: E402

CHILD = """
import time, json
t0 = time.perf_counter()
import torch, transformers
from docfuse.runtime.loading import load_model
t1 = time.perf_counter()
model, tok = load_model("default")
t2 = time.perf_counter()
model, tok = load_model("default")
t3 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1, "second_load_s": t3 - t2}))
"""


def main() -> None:
    subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, check=True, capture_output=True)  # converts if needed
    runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]) for _ in range(3)]
    best = min(r["load_s"] for r in runs)
    second = min(r["second_load_s"] for r in runs)
    out = save("load", {"runs": runs, "best_load_s": round(best, 3), "best_second_load_s": round(second, 3),
                        "command": ".venv/bin/python bench/bench_load.py"})
    print(f"load_model('default') after conversion: best {best:.2f} s of {[round(r['load_s'], 2) for r in runs]}, "
          f"second load in the process {second:.2f} s -> {out}")


if __name__ == "__main__":
    main()
