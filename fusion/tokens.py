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
    """``[len(text), 4]`` grid box of every character: its slice of its word's box, ``NO_BOX`` outside words.

    A word of ``n`` characters is cut at ``np.linspace(x0, x1, n + 1)``; the cuts are computed for every word at
    once, with linspace's own arithmetic (``j * step + x0``, the last cut exactly ``x1``), so the boxes are the
    ones a per-word linspace gives, bit for bit (a test keeps it so)."""
    boxes = np.full((len(text), 4), -1.0, dtype=np.float32)
    spans = align_words(text, words)
    if not spans:
        return boxes
    sx, sy = GRID / float(page_width), GRID / float(page_height)
    start, end, index = (np.array(col, dtype=np.int64) for col in zip(*spans))
    coords = np.array([(words[i].x0, words[i].y0, words[i].x1, words[i].y1) for i in index], dtype=np.float64)
    count = end - start
    word = np.repeat(np.arange(len(spans)), count)                 # the span of every covered character
    j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)  # its place in its word
    x0, x1 = coords[word, 0], coords[word, 2]
    step = (x1 - x0) / count[word]
    left = (j * step + x0) * sx
    right = np.where(j + 1 == count[word], x1, (j + 1) * step + x0) * sx
    chars = np.repeat(start, count) + j
    boxes[chars, 0] = left
    boxes[chars, 2] = right
    boxes[chars, 1] = coords[word, 1] * sy
    boxes[chars, 3] = coords[word, 3] * sy
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
    if len(offsets) == 0 or len(chars) == 0:
        return out
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2).clip(0, len(chars))
    boxed = chars[:, 2] >= 0  # as coords.has_box: x0 may be clipped at a page edge
    # min of x0/y0 and max of x1/y1 over each span, characters without a box left out (+-inf), one sentinel row so
    # a span may end at the text's end; reduceat reduces [start, end) at even places (odd places are discarded)
    lo = np.where(boxed[:, None], chars[:, :2], np.inf)
    hi = np.where(boxed[:, None], chars[:, 2:], -np.inf)
    lo = np.vstack([lo, np.full((1, 2), np.inf)])
    hi = np.vstack([hi, np.full((1, 2), -np.inf)])
    cuts = spans.reshape(-1)
    mins = np.minimum.reduceat(lo, cuts, axis=0)[0::2]
    maxs = np.maximum.reduceat(hi, cuts, axis=0)[0::2]
    found = (spans[:, 1] > spans[:, 0]) & np.isfinite(mins[:, 0])
    out[found] = np.concatenate([mins, maxs], axis=1)[found]
    return out
