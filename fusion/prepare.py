"""PageSamples to what the objective eats: token ids and boxes, pixels and ink as tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from docfuse.fusion.data import PageSample
from docfuse.fusion.objective import PageTensors
from docfuse.fusion.encoder import patch_grid
from docfuse.fusion.tokens import tokenize_page


@dataclass
class Prepared:
    tokens: PageTensors
    pixels: torch.Tensor  # [H, W, 3] uint8
    ink: torch.Tensor     # [P]
    source: str
    page: int


def prepare(sample: PageSample, tokenizer: Any, max_tokens: int) -> Prepared | None:
    """A page's tensors; its known text (caption) when it has no text layer; None when it has no text at all."""
    if sample.words:
        tok = tokenize_page(tokenizer, sample.text, sample.words, sample.width, sample.height)
        ids, boxes, caption = tok.ids, tok.boxes, False
    elif sample.truth:
        ids = np.asarray(tokenizer(sample.truth, add_special_tokens=False).input_ids, dtype=np.int64)
        boxes, caption = np.full((len(ids), 4), -1.0, dtype=np.float32), True
    else:
        return None
    if len(ids) < 8:
        return None
    ids, boxes = ids[:max_tokens], boxes[:max_tokens]
    return Prepared(PageTensors(torch.from_numpy(ids), torch.from_numpy(boxes), caption),
                    torch.from_numpy(sample.pixels.copy()), torch.from_numpy(sample.ink.copy()), sample.source, sample.page)


def patch_grid_boxes(rows: int, cols: int) -> torch.Tensor:
    """[rows*cols, 4] grid boxes of the patches, row-major (fusion.encoder.patch_grid, as vision.patches writes)."""
    return torch.from_numpy(patch_grid(rows, cols))
