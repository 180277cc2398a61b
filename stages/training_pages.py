"""Pages for fusion training, read by the pipeline's own stages: one reading of a PDF (issue 27).

The fusion is served pages that ``pdf.text`` put in reading order (Markdown tables, headings, word boxes in layout
mode) and that ``pdf.render`` drew; training read them before with a reader of its own (raw text-layer order, its own
rendering), so the model learnt one view of a page and was served another. Here the ``pages``, ``text`` and
``render`` stages of the built-in ``pdf_qa`` pipeline, with its parameters, run through the engine, and each page row
becomes a ``PageSample`` for training and evaluation. A document or page the stages turn into an error row is left
out of the data, as a corrupt PDF always was.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from docfuse.fusion.data import PageSample
from docfuse.fusion.encoder import patch_ink, stretch
from docfuse.fusion.tokens import Word
from docfuse.pipelines import Pipeline

#: The stages of ``pdf_qa`` that read a page, and the pipeline whose parameters they take.
SERVED_BY = "pdf_qa"
READING_STAGES = ("pages", "text", "render")


def reading_pipeline(dpi: float | None = None) -> Pipeline:
    """``pdf_qa``'s reading stages alone (render at ``dpi`` when given), with both page tables as outputs."""
    qa = Pipeline.from_yaml(SERVED_BY)
    reading = Pipeline("fusion-training-pages")
    for name in READING_STAGES:
        reading.stages[name] = qa.stages[name]
    if dpi is not None:
        reading.set("render.dpi", dpi)
    reading.outputs = ["text", "render"]
    return reading


def read_pages(paths: Sequence[str | Path], image_size: tuple[int, int], grid: tuple[int, int],
               dpi: float | None = None, truths: dict[str, list[str | None]] | None = None) -> list[PageSample]:
    """Every page of the PDFs, as ``pdf_qa`` reads it, in path and page order. ``truths``: per path, per page, what
    the image says where the page has no text layer (synthetic scans)."""
    if not paths:
        return []
    report = reading_pipeline(dpi).run([str(p) for p in paths])
    given = {os.path.abspath(str(k)): v for k, v in (truths or {}).items()}
    text = report.tables["text"].to_pylist()
    images = {(r["doc_id"], r["page"]): r for r in report.tables["render"].to_pylist()
              if r["error"] is None and r["image"] is not None}
    out = []
    for row in text:
        image = images.get((row["doc_id"], row["page"]))
        if row["error"] is not None or image is None:
            continue
        rgb = Image.open(io.BytesIO(image["image"])).convert("RGB")
        pixels = stretch(rgb, image_size)
        truth = given.get(os.path.abspath(row["source"]))
        out.append(PageSample(
            source=row["source"], page=row["page"], width=row["page_width"], height=row["page_height"],
            text=row["text"] or "", words=[Word(w["text"], w["x0"], w["y0"], w["x1"], w["y1"])
                                           for w in row["words"] or []],
            pixels=np.asarray(pixels), ink=patch_ink(pixels, *grid),
            truth=truth[row["page"]] if truth and row["page"] < len(truth) else None))
    return out
