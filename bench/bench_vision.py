"""vision.patches pages/s on CPU: US-letter text pages rendered at 96 dpi, vit_tiny at 224x224.

    .venv/bin/python bench/bench_vision.py [pages] [float32|bfloat16]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pymupdf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save  # noqa: E402
from docfuse.stages import schemas  # noqa: E402
from docfuse.stages.vision import VisionPatches, init_checkpoint  # noqa: E402


def pages_table(n: int) -> pa.Table:
    doc = pymupdf.open()
    for i in range(n):
        doc.new_page(width=612, height=792).insert_textbox(
            pymupdf.Rect(54, 54, 558, 738), f"Page {i}. " + "Quarterly revenue rose by four percent. " * 60, fontsize=10)
    rows = []
    for i, page in enumerate(doc):
        pix = page.get_pixmap(dpi=96)
        rows.append(schemas.empty_row(schemas.PAGE_IMAGE, doc_id="b", source="b.pdf", page=i, page_width=612.0,
                                      page_height=792.0, dpi=96.0, width_px=pix.width, height_px=pix.height,
                                      image=pix.tobytes("png")))
    return pa.Table.from_pylist(rows, schema=schemas.PAGE_IMAGE)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    table = pages_table(n)
    with tempfile.TemporaryDirectory() as tmp:
        stage = VisionPatches(checkpoint=str(init_checkpoint(Path(tmp) / "v.safetensors")), device="cpu", dtype=dtype)
        stage.setup()
        stage.run(table.slice(0, 8))
        start, cpu = time.perf_counter(), time.process_time()
        out = stage.run(table)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert out.column("error").null_count == n
    out_path = save(f"vision_{dtype}", {"pages": n, "pages_per_s": round(n / wall, 2),
                                        "cpu_ms_per_page": round(cpu / n * 1e3, 1), "threads": torch.get_num_threads(),
                                        "command": f".venv/bin/python bench/bench_vision.py {n} {dtype}"})
    print(f"vision.patches: {n / wall:.1f} pages/s, {cpu / n * 1e3:.0f} CPU-ms/page -> {out_path}")


if __name__ == "__main__":
    main()
