"""Issue 5 figures: fusion gates, patches + fusion pages/s on CPU at 96 dpi, QA over image-only pages.

    .venv/bin/python bench/bench_fusion.py [--pages 32] [--qa 10]
    .venv/bin/python bench/bench_fusion.py --against REV   # speed of this tree against commit REV, interleaved

- speed: synthetic pages (fusion.synth) rendered at 96 dpi; vision.patches with the shipped ViT (1024x768) and
  fusion.gate (apply: always, so the fusion really runs) timed per page, after a warm-up; anchor: pdf.text
  (layout) on the same pages in the same run.
- qa: image-only pages (a fact drawn as an image, no text layer) through pdf_qa, text-only vs fusion forced on.
- gates: tanh of each gate of the shipped checkpoint.
- against: the speed part (float32 ViT) for a worktree of commit REV and for this tree, alternating, each run in a
  fresh process, ``--repeats`` times: on a shared machine only a side-by-side ratio means anything.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pymupdf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save  # noqa: E402
from docfuse.fusion import checkpoint  # noqa: E402
from docfuse.fusion.synth import make_corpus  # noqa: E402
from docfuse.stages.fuse import DEFAULT_CHECKPOINT, FusionGate  # noqa: E402
from docfuse.stages.pdf import PdfOpen, PdfRender, PdfText  # noqa: E402
from docfuse.stages.vision import VisionPatches  # noqa: E402

CKPT = os.environ.get("DOCFUSE_FUSION_CKPT") or str(Path(__file__).resolve().parents[1] / DEFAULT_CHECKPOINT)


def sources(paths: list[Path]) -> pa.Table:
    return pa.table({"doc_id": [p.stem for p in paths], "source": [str(p) for p in paths],
                     "data": [p.read_bytes() for p in paths], "error": pa.array([None] * len(paths), pa.string())})


def patches_stage(dtype: str = "float32") -> VisionPatches:
    spec = checkpoint.vision_spec(checkpoint.read_meta(CKPT))
    return VisionPatches(checkpoint=CKPT, model=spec.model, model_args=spec.args, image_size=list(spec.image_size),
                         device="cpu", batch_size=4, dtype=dtype)  # batch as pdf_qa.yaml


def speed(n_pages: int, tmp: Path, vit_dtype: str = "float32") -> dict:
    made = make_corpus(tmp / "speed", (n_pages + 3) // 4, seed=7)
    opened = PdfOpen().run(sources([Path(m["path"]) for m in made]))
    text_stage, render = PdfText(layout=True), PdfRender(dpi=96)
    t0 = time.perf_counter()
    text = text_stage.run(opened)
    text_s = time.perf_counter() - t0
    images = render.run(opened)
    patches, gate = patches_stage(vit_dtype), FusionGate(checkpoint=CKPT, apply="always")
    patches.setup(), gate.setup()
    gate.run(text.slice(0, 4), patches.run(images.slice(0, 4)))  # warm-up
    t0 = time.perf_counter()
    feats = patches.run(images)
    t1 = time.perf_counter()
    fused = gate.run(text, feats)
    t2 = time.perf_counter()
    pages = images.num_rows
    assert fused.column("error").null_count == fused.num_rows
    return {"pages": pages, "vit_dtype": vit_dtype, "patches_pages_per_s": round(pages / (t1 - t0), 2),
            "fusion_pages_per_s": round(pages / (t2 - t1), 2),
            "patches_and_fusion_pages_per_s": round(pages / (t2 - t0), 2),
            "anchor_pdf_text_pages_per_s": round(pages / text_s, 2),
            "ratio_vs_pdf_text": round((t2 - t0) / text_s, 2),
            "visual_tokens_per_page": round(sum(fused.column("visual_tokens").to_pylist()) / pages, 1)}


def image_only_pdf(path: Path, fact: str) -> None:
    """One page whose only content is a picture of ``fact`` and some filler: no text layer."""
    src = pymupdf.open()
    page = src.new_page(width=612, height=792)
    page.insert_textbox(pymupdf.Rect(72, 72, 540, 720), "Service report\n\n" + fact + "\n\n"
                        + "The review covered the usual items and found nothing else of note. " * 6, fontsize=12)
    png = page.get_pixmap(dpi=150).tobytes("png")
    doc = pymupdf.open()
    doc.new_page(width=612, height=792).insert_image(pymupdf.Rect(0, 0, 612, 792), stream=io.BytesIO(png).getvalue())
    doc.save(path)


def qa(n: int, tmp: Path) -> dict:
    from docfuse.pipelines import Pipeline

    rng = random.Random(3)
    cases = []
    for i in range(n):
        number = rng.randint(10000, 99999)
        path = tmp / f"scan-{i}.pdf"
        image_only_pdf(path, f"The account number is {number}.")
        cases.append((path, str(number)))
    out = {}
    for name, apply in (("text_only", "never"), ("fusion", "always")):
        qa_pipe = Pipeline.from_yaml("pdf_qa")
        qa_pipe.set("params.question", "What is the account number?")
        qa_pipe.set("fused.apply", apply)
        qa_pipe.set("answer.max_new_tokens", 24)
        report = qa_pipe.run([str(p) for p, _ in cases])
        rows = report.tables["answer"].to_pylist()
        by_source = {r["source"]: r for r in rows}
        right = sum(1 for p, number in cases if number in (by_source[str(p)]["answer"] or ""))
        errors = sum(1 for r in rows if r["error"])
        out[name] = {"right": right, "of": n, "error_rows": errors,
                     "examples": [(by_source[str(p)]["answer"] or by_source[str(p)]["error"])[:80] for p, _ in cases[:3]]}
    return out


_ONE_SPEED_RUN = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/bench")
from bench_fusion import speed
with tempfile.TemporaryDirectory() as tmp:
    print(json.dumps(speed(int(sys.argv[2]), Path(tmp), "float32")))
"""


def against(rev: str, pages: int, repeats: int) -> dict:
    """Speed of a worktree of ``rev`` and of this tree, interleaved, each run in a fresh process."""
    root = Path(__file__).resolve().parents[1]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), rev], cwd=root, check=True)
        try:
            for _ in range(repeats):
                for side, tree in (("before", old), ("after", root)):
                    out = subprocess.run([sys.executable, "-c", _ONE_SPEED_RUN, str(tree), str(pages)], check=True,
                                         capture_output=True, text=True, env=os.environ.copy())
                    runs.append({"side": side, **json.loads(out.stdout.strip().splitlines()[-1])})
                    print(runs[-1], flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=root, check=False)
    key = "patches_and_fusion_pages_per_s"
    ratios = [a[key] / b[key] for b, a in zip(runs[0::2], runs[1::2])]
    return {"before": rev, "runs": runs, "after_over_before": [round(r, 3) for r in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--qa", type=int, default=10, help="0: speed only (both ViT dtypes), saved as fusion_speed")
    ap.add_argument("--against", metavar="REV", help="speed only, this tree against a worktree of commit REV, "
                                                     "interleaved; saved as fusion_speed_against")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs for --against")
    args = ap.parse_args()
    if args.against:
        result = against(args.against, args.pages, args.repeats)
        result["command"] = (f".venv/bin/python bench/bench_fusion.py --against {args.against} --pages {args.pages} "
                             f"--repeats {args.repeats}")
        print("->", save("fusion_speed_against", result))
        return
    if args.qa == 0:
        with tempfile.TemporaryDirectory() as tmp:
            runs = [speed(args.pages, Path(tmp) / d, d) for d in ("float32", "bfloat16", "float32", "bfloat16")]
        for r in runs:
            print(r)
        print("->", save("fusion_speed", {"runs": runs, "command": f".venv/bin/python bench/bench_fusion.py "
                                                                  f"--pages {args.pages} --qa 0"}))
        return
    _, fusion, _, meta = checkpoint.load(CKPT)
    result = {"checkpoint": DEFAULT_CHECKPOINT, "gates": fusion.gates(), "held_out": meta.get("held_out")}
    with tempfile.TemporaryDirectory() as tmp:
        result["speed"] = speed(args.pages, Path(tmp))
        print(result["speed"], flush=True)
        result["qa_image_only"] = qa(args.qa, Path(tmp))
    result["command"] = f".venv/bin/python bench/bench_fusion.py --pages {args.pages} --qa {args.qa}"
    print(result)
    print("->", save("fusion", result))


if __name__ == "__main__":
    main()
