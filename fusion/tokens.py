"""Text tokens with the box of their word: the text half of the fused stream.

A page's text (as the text stage wrote it: reading order, tables as Markdown) is tokenised with character
offsets; each word of the text layer is found in that text, and a token takes the part of its word's box that its
characters cover (a word's box split in proportion to its characters). Tokens no word covers (newlines, Markdown
pipes, page markers) carry no box: ``NO_BOX`` (all -1), and fusion leaves them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

GRID = 1000.0
NO_BOX = (-1.0, -1.0, -1.0, -1.0)
_SEARCH_WINDOW = 400  # characters ahead of the cursor where the next word may start (skipped Markdown, headers)


@dataclass(frozen=True)
class Word:
    """One word of the text layer, its box in PDF points (origin top left)."""

    text: str
    x0: float
    y0: float
    x1: float
    y1: float


@dataclass
class PageTokens:
    """Token ids of one page's text and, per token, its box on the 0-1000 grid (``NO_BOX`` where none)."""

    ids: np.ndarray    # [T] int64
    boxes: np.ndarray  # [T, 4] float32

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def align_words(text: str, words: Sequence[Word]) -> list[tuple[int, int, int]]:
    """``(start, end, word_index)`` of each word found in ``text``, in order; words not found are left out."""
    spans, cursor = [], 0
    for index, word in enumerate(words):
        needle = word.text.strip()
        if not needle:
            continue
        at = text.find(needle, cursor, cursor + _SEARCH_WINDOW + len(needle))
        if at < 0:
            continue
        spans.append((at, at + len(needle), index))
        cursor = at + len(needle)
    return spans


def char_boxes(text: str, words: Sequence[Word], page_width: float, page_height: float) -> np.ndarray:
    """``[len(text), 4]`` grid box of every character: its slice of its word's box, ``NO_BOX`` outside words."""
    boxes = np.full((len(text), 4), -1.0, dtype=np.float32)
    sx, sy = GRID / float(page_width), GRID / float(page_height)
    for start, end, index in align_words(text, words):
        w = words[index]
        edges = np.linspace(w.x0, w.x1, end - start + 1, dtype=np.float64) * sx
        boxes[start:end, 0] = edges[:-1]
        boxes[start:end, 2] = edges[1:]
        boxes[start:end, 1] = w.y0 * sy
        boxes[start:end, 3] = w.y1 * sy
    return np.clip(boxes, -1.0, GRID)


def tokenize_page(tokenizer: Any, text: str, words: Sequence[Word], page_width: float,
                  page_height: float) -> PageTokens:
    """Token ids of ``text`` (no special tokens) and the box each token covers on its page."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc.input_ids, dtype=np.int64)
    return PageTokens(ids=ids, boxes=span_boxes(char_boxes(text, words, page_width, page_height),
                                                enc.offset_mapping))


def span_boxes(chars: np.ndarray, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """The union of the character boxes in each ``(start, end)`` span; ``NO_BOX`` when none has a box."""
    out = np.full((len(offsets), 4), -1.0, dtype=np.float32)
    for t, (start, end) in enumerate(offsets):
        part = chars[start:end]
        part = part[part[:, 2] >= 0]  # as coords.has_box: x0 may be clipped at a page edge
        if len(part):
            out[t] = (part[:, 0].min(), part[:, 1].min(), part[:, 2].max(), part[:, 3].max())
    return out

