"""Pooled visual tokens for the parts of a page that have no text: figures, charts, scanned pages.

The patch grid is cut into ``pool x pool`` windows; a window whose patches mostly overlap no word's box and that
holds ink becomes one token: the mean of its word-free projected patches, plus its box's coordinate embedding.
Tokens are placed in reading order among the text tokens (before the first word whose centre lies below theirs).
A page with more such windows than ``max_tokens`` is pooled coarser (the window side doubles) until it fits: a
documented downscale, never an unbounded stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from docfuse.fusion.coords import centres, has_box
from docfuse.fusion.tokens import GRID


@dataclass
class Windows:
    """The chosen windows: their mean word-free patch (``pooled`` [V, H]) and grid box (``boxes`` [V, 4])."""

    pooled: torch.Tensor
    boxes: torch.Tensor
    pool: int  # the window side in patches actually used


def uncovered(patch_boxes: torch.Tensor, word_boxes: torch.Tensor) -> torch.Tensor:
    """[P] True where a patch overlaps no word's box."""
    words = word_boxes[has_box(word_boxes)]
    if words.shape[0] == 0:
        return torch.ones(patch_boxes.shape[0], dtype=torch.bool, device=patch_boxes.device)
    p = patch_boxes.float()
    overlap = ((p[:, None, 0] < words[None, :, 2]) & (p[:, None, 2] > words[None, :, 0])
               & (p[:, None, 1] < words[None, :, 3]) & (p[:, None, 3] > words[None, :, 1]))
    return ~overlap.any(dim=1)


def _blocks(grid: torch.Tensor, pool: int) -> torch.Tensor:
    """[rows, cols, C] to [R, Cb, pool*pool, C] windows (zero-padded at the bottom and right edges)."""
    rows, cols, c = grid.shape
    pr, pc = -rows % pool, -cols % pool
    grid = F.pad(grid, (0, 0, 0, pc, 0, pr))
    r, cb = grid.shape[0] // pool, grid.shape[1] // pool
    return grid.view(r, pool, cb, pool, c).permute(0, 2, 1, 3, 4).reshape(r, cb, pool * pool, c)


def windows(rows: int, cols: int, patches: torch.Tensor, free: torch.Tensor, ink: torch.Tensor, pool: int,
            max_tokens: int, min_ink: float = 0.01) -> Windows:
    """Windows of ``pool x pool`` patches, mostly word-free and holding ink, at most ``max_tokens`` of them."""
    while True:
        stats = _blocks(torch.stack([free.float(), ink.float(), torch.ones_like(ink, dtype=torch.float)], -1)
                        .view(rows, cols, 3), pool)                          # [R, Cb, pool², 3]
        n_free, n_ink, n_real = stats.sum(2).unbind(-1)                       # [R, Cb]
        n_real = n_real.clamp(min=1)
        chosen = (n_free / n_real >= 0.5) & (n_ink / n_real >= min_ink)
        if int(chosen.sum()) <= max_tokens or pool >= max(rows, cols):
            break
        pool *= 2
    weights = _blocks(free.float().view(rows, cols, 1), pool)                 # [R, Cb, pool², 1]
    feats = _blocks(patches.view(rows, cols, -1), pool)                       # [R, Cb, pool², H]
    pooled = (feats * weights.to(feats.dtype)).sum(2) / weights.sum(2).clamp(min=1).to(feats.dtype)
    r_idx, c_idx = chosen.nonzero(as_tuple=True)
    sx, sy = GRID / cols, GRID / rows
    boxes = torch.stack([c_idx * pool * sx, r_idx * pool * sy, ((c_idx + 1) * pool).clamp(max=cols) * sx,
                         ((r_idx + 1) * pool).clamp(max=rows) * sy], -1).float()
    return Windows(pooled=pooled[r_idx, c_idx], boxes=boxes, pool=pool)


def insertion_points(text_boxes: torch.Tensor, visual_boxes: torch.Tensor) -> torch.Tensor:
    """[V] index in the text stream before which each visual token goes (reading order: top to bottom)."""
    if visual_boxes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=visual_boxes.device)
    t = len(text_boxes)
    ty = torch.where(has_box(text_boxes), centres(text_boxes.float())[:, 1],
                     torch.full((t,), -1.0, device=text_boxes.device))
    ty = torch.cummax(ty, dim=0).values if t else ty  # a token without a box sits where the last boxed one did
    vy = centres(visual_boxes.float())[:, 1]
    return torch.searchsorted(ty.contiguous(), vy.contiguous(), right=True)
