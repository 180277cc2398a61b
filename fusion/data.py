"""A page for training and evaluating the fusion.

Each page gives its text and its words with their boxes as ``pdf.text`` reads them for the pipeline (reading order,
Markdown), and the page image as ``pdf.render`` draws it, stretched to the ViT's input size as uint8 (normalised on
the device). Pages are read by the pipeline's own stages (stages/training_pages.py), so that training and serving see
the same tokens in the same order (issue 27).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
