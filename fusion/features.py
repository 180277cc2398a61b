"""Patch features of a batch of page images: normalise uint8 pixels on the device, run the ViT, drop prefix tokens."""

from __future__ import annotations

from typing import Any

import torch

from docfuse.fusion.encoder import IMAGENET_MEAN, IMAGENET_STD, patch_tokens


def encode(vit: Any, pixels: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``pixels`` [B, H, W, 3] uint8 to [B, P, D] patch features (float32)."""
    device = next(vit.parameters()).device
    x = pixels.to(device).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    x = ((x - mean) / std).to(dtype or next(vit.parameters()).dtype)
    return patch_tokens(vit, x).float()
