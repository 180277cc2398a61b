"""One 2D coordinate embedding for words and patches alike: a box on the 0-1000 grid to a vector.

The box's centre, width and height go through sine/cosine features at geometric frequencies and one linear
layer; words and patches share the module, so a word and the patch under it land near each other.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class CoordinateEmbedding(nn.Module):
    """``[..., 4]`` boxes (x0, y0, x1, y1 on the 0-1000 grid) to ``[..., dim]``."""

    def __init__(self, dim: int, frequencies: int = 16) -> None:
        super().__init__()
        scales = torch.exp(torch.linspace(0.0, math.log(1000.0), frequencies))  # periods 1 .. 1000 grid units
        self.register_buffer("omega", 2 * math.pi / scales, persistent=False)
        self.proj = nn.Linear(4 * 2 * frequencies, dim)

    def forward(self, boxes: torch.Tensor) -> torch.Tensor:
        x0, y0, x1, y1 = boxes.float().unbind(-1)
        geo = torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)  # [..., 4]
        angles = geo.unsqueeze(-1) * self.omega  # [..., 4, F]
        feats = torch.cat([angles.sin(), angles.cos()], dim=-1).flatten(-2)
        return self.proj(feats.to(self.proj.weight.dtype))


def centres(boxes: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` box centres."""
    return torch.stack([(boxes[..., 0] + boxes[..., 2]) / 2, (boxes[..., 1] + boxes[..., 3]) / 2], dim=-1)


def has_box(boxes: torch.Tensor) -> torch.Tensor:
    """True where a box is given (``NO_BOX`` is all -1)."""
    return boxes[..., 2] >= 0
