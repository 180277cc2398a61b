"""The vision encoder: a timm ViT built without downloading anything, and the page image it expects.

The page is stretched to the model's input size (every patch an exact rectangle of the page), normalised with
ImageNet statistics; the share of inked pixels per patch is measured on the same image (visual tokens use it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GRID = 1000.0  # the page grid models see (fusion.tokens.GRID)
INK_LEVEL = 0.8  # a pixel darker than this (0 black .. 1 white) is ink


def build_vit(model: str, image_size: tuple[int, int], model_args: Mapping[str, Any] | None = None,
              device: str | None = None) -> Any:
    """A timm ViT with random weights and no classifier, sized for ``image_size`` (H, W); never downloads.

    ``model_args`` override the architecture (``depth``, ``embed_dim``, ``num_heads``, ``patch_size``).
    """
    import timm
    import torch

    if not timm.is_model(model):
        raise ValueError(f"unknown timm model {model!r}; pick a ViT from `timm.list_models('vit_*')`, "
                         "for example vit_tiny_patch16_224")
    try:
        with torch.device(device or "cpu"):
            net = timm.create_model(model, pretrained=False, num_classes=0, img_size=tuple(image_size),
                                    **dict(model_args or {}))
    except TypeError as exc:
        raise ValueError(f"timm model {model!r} does not take image_size or model_args {dict(model_args or {})} "
                         f"({exc}); pick a plain ViT from `timm.list_models('vit_*')`") from exc
    if not hasattr(net, "patch_embed") or not hasattr(net, "num_prefix_tokens") or not hasattr(net, "forward_features"):
        raise ValueError(f"timm model {model!r} is not a ViT (no patch embedding / prefix tokens); "
                         "pick one from `timm.list_models('vit_*')`")
    return net


def to_input(rgb: Image.Image, size: tuple[int, int], mean: tuple[float, ...] = IMAGENET_MEAN,
             std: tuple[float, ...] = IMAGENET_STD) -> np.ndarray:
    """``[3, H, W]`` float32 normalised pixels of an RGB page image stretched to ``size`` = (H, W)."""
    return normalise(stretch(rgb, size), mean, std)


def stretch(rgb: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """``[H, W, 3]`` uint8 of the image stretched to ``size`` = (H, W)."""
    height, width = size
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC, reducing_gap=3.0)
    return np.asarray(rgb.convert("RGB"), dtype=np.uint8)


def normalise(pixels: np.ndarray, mean: tuple[float, ...] = IMAGENET_MEAN,
              std: tuple[float, ...] = IMAGENET_STD) -> np.ndarray:
    """``[H, W, 3]`` uint8 to ``[3, H, W]`` float32 normalised."""
    x = pixels.astype(np.float32) / 255.0
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def patch_grid(rows: int, cols: int) -> np.ndarray:
    """``[rows*cols, 4]`` float32 patch boxes x0, y0, x1, y1 on the 0-1000 page grid, row-major (a ViT's order);
    edges rounded to whole grid units. The same for every page, and the same at training and at inference."""
    xs = np.rint(np.linspace(0.0, GRID, cols + 1))
    ys = np.rint(np.linspace(0.0, GRID, rows + 1))
    x0, y0 = np.meshgrid(xs[:-1], ys[:-1])
    x1, y1 = np.meshgrid(xs[1:], ys[1:])
    return np.stack([x0, y0, x1, y1], axis=-1).reshape(-1, 4).astype(np.float32)


def patch_ink(pixels: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``[rows*cols]`` float32 share of ink pixels in each patch of a ``[H, W, 3]`` uint8 image (row-major)."""
    gray = pixels.astype(np.float32).mean(-1) / 255.0
    h, w = gray.shape
    ink = (gray < INK_LEVEL).astype(np.float32)
    return ink.reshape(rows, h // rows, cols, w // cols).mean(axis=(1, 3)).reshape(-1)
