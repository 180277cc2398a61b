"""Which branch of the shipped fusion costs what on held-out pages: each gate zeroed in turn (a diagnosis only;
the checkpoint ships as trained).

    .venv/bin/python bench/experiments/diag_fusion_gates.py PDF_OR_DIR...
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import save  # noqa: E402
from docfuse.fusion import checkpoint  # noqa: E402
from docfuse.fusion.evaluate import masked_recovery  # noqa: E402
from docfuse.fusion.run import pdf_files, prepared, read_many  # noqa: E402
from docfuse.runtime.loading import load_model  # noqa: E402
from docfuse.stages.fuse import DEFAULT_CHECKPOINT  # noqa: E402

VARIANTS = {"trained": (), "no_mlp": ("mlp",), "no_visual_tokens": ("visual",), "attention_only": ("mlp", "visual"),
            "no_attention": ("attention",)}


def main() -> None:
    model, tok = load_model("default", dtype="float32", device="cpu")
    vit, fusion, vision, _ = checkpoint.load(Path(__file__).resolve().parents[2] / DEFAULT_CHECKPOINT)
    pages = prepared(read_many(pdf_files(sys.argv[1:]), vision), tok)
    out = {}
    for name, off in VARIANTS.items():
        f = copy.deepcopy(fusion)
        with torch.no_grad():
            for gate, param in (("attention", f.cross.attn_gate), ("mlp", f.cross.mlp_gate), ("visual", f.visual_gate)):
                if gate in off:
                    param.zero_()
        r = masked_recovery(model, vit, f, pages)
        out[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items() if k != "gates"}
        print(name, out[name], flush=True)
    print("->", save("fusion_gate_diagnosis", {"variants": out, "pdfs": [str(p) for p in pdf_files(sys.argv[1:])],
                                               "command": "python bench/experiments/diag_fusion_gates.py " + " ".join(sys.argv[1:])}))


if __name__ == "__main__":
    main()
