"""Pages for training and evaluating the fusion, read straight from PDFs with PyMuPDF.

Each page gives its text (words in the text layer's order, a line per line), the words with their boxes, and the
page image rendered at ``dpi`` and stretched to the ViT's input size, as uint8 (normalised on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from docfuse.fusion.encoder import patch_ink, stretch
from docfuse.fusion.tokens import Word


@dataclass
class PageSample:
    source: str
    page: int
    width: float
    height: float
    text: str
    words: list[Word]
    pixels: np.ndarray           # [H, W, 3] uint8 at the ViT's input size
    ink: np.ndarray              # [P] share of ink per patch
    truth: str | None = None     # for pages without a text layer: what the image says, when known
    meta: dict = field(default_factory=dict)


def page_text(raw_words: list[tuple]) -> tuple[str, list[Word]]:
    """Text and words from PyMuPDF ``get_text("words")`` tuples: words of a line joined by spaces, lines by newlines."""
    lines: list[str] = []
    words: list[Word] = []
    current, key = [], None
    for x0, y0, x1, y1, text, block, line, _ in raw_words:
        if key is not None and (block, line) != key:
            lines.append(" ".join(current))
            current = []
        key = (block, line)
        current.append(text)
        words.append(Word(text, x0, y0, x1, y1))
    if current:
        lines.append(" ".join(current))
    return "\n".join(lines), words


def read_pdf(path: str | Path, image_size: tuple[int, int], grid: tuple[int, int], dpi: float = 96,
             pages: list[int] | None = None, truths: list[str | None] | None = None) -> list[PageSample]:
    """Every page (or the listed ones) of a PDF as PageSamples; an unreadable page is skipped, not fatal."""
    import pymupdf

    out = []
    with pymupdf.open(str(path)) as doc:
        if doc.needs_pass and not doc.authenticate(""):
            return []
        for number in pages if pages is not None else range(doc.page_count):
            try:
                page = doc[number]
                text, words = page_text(page.get_text("words", sort=False))
                zoom = dpi / 72.0
                pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), alpha=False, colorspace=pymupdf.csRGB)
            except Exception:  # noqa: BLE001 - a broken page of a real PDF is left out of the data
                continue
            rgb = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
            pixels = stretch(rgb, image_size)
            out.append(PageSample(source=str(path), page=number, width=page.rect.width, height=page.rect.height,
                                  text=text, words=words, pixels=pixels, ink=patch_ink(pixels, *grid),
                                  truth=truths[number] if truths else None))
    return out
