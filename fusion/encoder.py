"""The vision encoder: a timm ViT built without downloading anything, and the page image it expects.

The page is stretched to the model's input size (every patch an exact rectangle of the page), normalised with
ImageNet statistics; the share of inked pixels per patch is measured on the same image (visual tokens use it).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
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

    ``model_args`` override the architecture (``depth``, ``embed_dim``, ``num_heads``, ``patch_size``; for
    ``samvit_*``, ``window_size`` and ``global_attn_indexes``: attention within windows of patches, which on a page's
    3072 patches costs a fraction of global attention). Lists in ``model_args`` (JSON has no tuples) become tuples.
    """
    import timm
    import torch

    if not timm.is_model(model):
        raise ValueError(f"unknown timm model {model!r}; pick a ViT from `timm.list_models('vit_*')`, "
                         "for example vit_tiny_patch16_224")
    try:
        with torch.device(device or "cpu"):
            net = timm.create_model(model, pretrained=False, num_classes=0, img_size=tuple(image_size),
                                    **plain_args(model_args))
    except TypeError as exc:
        raise ValueError(f"timm model {model!r} does not take image_size or model_args {dict(model_args or {})} "
                         f"({exc}); pick a plain ViT from `timm.list_models('vit_*')`") from exc
    if not hasattr(net, "patch_embed") or not hasattr(net, "forward_features") \
            or not (hasattr(net, "num_prefix_tokens") or model.startswith("samvit")):
        raise ValueError(f"timm model {model!r} is not a ViT (no patch embedding / prefix tokens); "
                         "pick one from `timm.list_models('vit_*')` or `timm.list_models('samvit_*')`")
    return net


def plain_args(model_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """``model_args`` as timm takes them: JSON lists (``global_attn_indexes``) as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in (model_args or {}).items()}


def args_key(model_args: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """Hashable, order-free form of ``model_args`` (a cache key for the weightless copies that give a grid)."""
    return tuple(sorted(plain_args(model_args).items()))


def prefix_tokens(net: Any) -> int:
    """Class/register tokens before the patch tokens in ``forward_features`` (none for a feature-map model)."""
    return int(getattr(net, "num_prefix_tokens", 0))


def patch_tokens(net: Any, x: Any) -> Any:
    """``[B, P, D]`` patch features of a batch of normalised images, row-major like ``patch_grid``.

    A plain ViT returns tokens (prefix tokens dropped here); a windowed SAM ViT returns a ``[B, D, rows, cols]``
    feature map, flattened to the same layout."""
    out = net.forward_features(x)
    if out.ndim == 4:
        return out.flatten(2).transpose(1, 2)
    return out[:, prefix_tokens(net):]


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
    """``[H, W, 3]`` uint8 to ``[3, H, W]`` float32 normalised: ``(p / 255 - mean) / std`` in float32.

    A byte has 256 values, so each channel is one table lookup (the table built with that very float32
    arithmetic: the same numbers, bit for bit, for a fraction of the passes over the page)."""
    table = _normalise_table(tuple(float(m) for m in mean), tuple(float(s) for s in std))
    out = np.empty((3,) + pixels.shape[:2], dtype=np.float32)
    for c in range(3):
        np.take(table[c], pixels[..., c], out=out[c])
    return out


@lru_cache(maxsize=8)
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """``[3, 256]`` float32: what ``normalise`` gives each byte value in each channel."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (256, 3))
    x = values.astype(np.float32) / 255.0
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(x.T)


def patch_grid(rows: int, cols: int) -> np.ndarray:
    """``[rows*cols, 4]`` float32 patch boxes x0, y0, x1, y1 on the 0-1000 page grid, row-major (a ViT's order);
    edges rounded to whole grid units. The same for every page, and the same at training and at inference."""
    xs = np.rint(np.linspace(0.0, GRID, cols + 1))
    ys = np.rint(np.linspace(0.0, GRID, rows + 1))
    x0, y0 = np.meshgrid(xs[:-1], ys[:-1])
    x1, y1 = np.meshgrid(xs[1:], ys[1:])
    return np.stack([x0, y0, x1, y1], axis=-1).reshape(-1, 4).astype(np.float32)


def patch_ink(pixels: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``[rows*cols]`` float32 share of ink pixels in each patch of a ``[H, W, 3]`` uint8 image (row-major).

    A pixel is ink when its grey level ``mean(r, g, b) / 255`` is below ``INK_LEVEL``; that depends only on
    ``r + g + b``, so it is looked up in a table of the 766 sums (built with the same float32 arithmetic)."""
    total = pixels[..., 0].astype(np.uint16)
    total += pixels[..., 1]
    total += pixels[..., 2]
    ink = _ink_table()[total]
    h, w = ink.shape
    return ink.reshape(rows, h // rows, cols, w // cols).mean(axis=(1, 3)).reshape(-1)


@lru_cache(maxsize=1)
def _ink_table() -> np.ndarray:
    """``[766]`` float32 1.0 where a pixel whose channels sum to that value is ink."""
    sums = np.arange(766)
    rgb = np.stack([np.minimum(sums, 255), np.clip(sums - 255, 0, 255), np.clip(sums - 510, 0, 255)], -1)
    gray = rgb.astype(np.uint8).astype(np.float32).mean(-1) / 255.0
    return (gray < INK_LEVEL).astype(np.float32)
