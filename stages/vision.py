"""vision.patches: a ViT's patch features for every rendered page, each patch with its box on the page.

Which ViT: a fusion checkpoint's metadata names it (stages/vision_spec.py); ``model``, ``model_args`` and
``image_size`` are for plain ViT weights, and with a fusion checkpoint must agree with it or be left out.

The page image is stretched to ``image_size`` so patch (r, c) covers an exact rectangle of the page; fusion then
places each patch with the same 2D coordinate embedding as the words. Weights come only from a local checkpoint
(see data/vision/README.md); nothing is ever downloaded.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, field_validator

from docfuse.fusion.encoder import patch_ink, patch_tokens
from docfuse.pipelines.registry import register
from docfuse.pipelines.stage import Stage, StageParams, error_value
from docfuse.stages import schemas
from docfuse.stages.vision_geometry import patch_boxes, patch_grid, tensor_column
from docfuse.stages.vision_image import BadImage, load_page
from docfuse.stages.vision_model import (HOW_TO_MAKE, as_args, create, geometry, init_checkpoint, load_weights,
                                 resolve_checkpoint, size_arg)
from docfuse.stages.vision_spec import PLAIN_DEFAULTS, resolve

__all__ = ["VisionPatches", "VisionPatchesParams", "init_checkpoint", "patches_schema"]

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def patches_schema(n_patches: int, dim: int) -> pa.Schema:
    """vision.patches' output for ``n_patches`` patches of ``dim`` features each."""
    return pa.schema(schemas.DOC + [
        pa.field("page", pa.int32()),
        pa.field("patch_features", pa.fixed_shape_tensor(pa.float32(), [n_patches, dim])),
        pa.field("patch_boxes", pa.fixed_shape_tensor(pa.float32(), [n_patches, 4])),
        pa.field("patch_grid", pa.fixed_shape_tensor(pa.int16(), [n_patches, 4])),
        pa.field("patch_ink", pa.fixed_shape_tensor(pa.float32(), [n_patches])),
        schemas.ERROR,
    ])


_FROM_CHECKPOINT = "a fusion checkpoint's metadata gives it (leave it out); for plain ViT weights, default "


class VisionPatchesParams(StageParams):
    model: str | None = Field(None, description="any timm ViT name (vit_*, or samvit_* for windowed attention); "
                                                "built without downloading. " + _FROM_CHECKPOINT
                                                + repr(PLAIN_DEFAULTS["model"]))
    model_args: dict[str, int | bool | list[int]] | None = Field(
        None, description="architecture overrides for timm (depth, embed_dim, num_heads, patch_size; samvit: "
                          "window_size, global_attn_indexes, use_rel_pos, neck_chans), as the checkpoint was made. "
                          + _FROM_CHECKPOINT + "{}")
    checkpoint: str = Field(description="a fusion checkpoint (its ViT and that ViT's shape are used), or local "
                                        "weights for `model` (safetensors or torch state dict); see "
                                        "data/vision/README.md")
    image_size: list[int] | None = Field(None, min_length=2, max_length=2,
                                         description="[H, W] the page is stretched to; multiples of the patch size, "
                                                     "and the size the checkpoint was made at. " + _FROM_CHECKPOINT
                                                     + "[224, 224]")
    batch_size: int = Field(16, ge=1, description="pages per forward pass")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="compute dtype; features are float32")
    device: str = Field("auto", description="torch device; auto = cuda when available, else cpu")

    @field_validator("image_size")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(v <= 0 for v in value):
            raise ValueError(f"image_size {value} must be two positive integers [H, W]")
        return value


@register
class VisionPatches(Stage):
    """ViT patch features per page image, with each patch's box in PDF points and on the 0-1000 grid."""

    kind = "vision.patches"
    version = "2"
    Params = VisionPatchesParams
    inputs: ClassVar[dict[str, pa.Schema]] = {
        "images": pa.schema([f for f in schemas.PAGE_IMAGE
                             if f.name in ("doc_id", "source", "page", "page_width", "page_height", "image")]),
    }
    #: The defaults' schema (vit_tiny_patch16_224 at 224x224: 14x14 patches of 192 features); see output().
    output_schema = patches_schema(196, 192)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._net: Any = None
        p = self.params
        #: the ViT to build: a fusion checkpoint's (a disagreeing parameter is a ValueError, i.e. invalid), else
        #: the parameters' (or their defaults)
        self.vit = resolve({"model": p.model, "model_args": p.model_args, "image_size": p.image_size},
                           resolve_checkpoint(p.checkpoint), p.checkpoint)

    @property
    def _size(self) -> tuple[int, int]:
        return self.vit.image_size

    def output(self) -> pa.Schema:
        geo = geometry(self.vit.model, self._size, as_args(self.vit.model_args))
        return patches_schema(geo.n_patches, geo.dim)

    def cache_salt(self) -> str:
        """The checkpoint file's identity, so retrained weights at the same path invalidate cached features."""
        path = resolve_checkpoint(self.params.checkpoint)
        st = path.stat() if path.is_file() else None
        return f"{path}:{st.st_size}:{st.st_mtime_ns}" if st else str(path)

    def setup(self) -> None:
        import torch

        p, vit = self.params, self.vit
        path = resolve_checkpoint(p.checkpoint)
        if not path.is_file():
            given = "" if str(path) == p.checkpoint else f" (given as {p.checkpoint!r})"
            raise ValueError(f"vision.patches: checkpoint {str(path)!r}{given} not found; "
                             + HOW_TO_MAKE.format(path=p.checkpoint, model=vit.model, size=size_arg(self._size)))
        self._geo = geometry(vit.model, self._size, as_args(vit.model_args))
        net = create(vit.model, self._size, device="cpu", args=as_args(vit.model_args))
        load_weights(net, path, vit.model, self._size)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if p.device == "auto" else p.device
        self._device = torch.device(device)
        self._dtype = getattr(torch, p.dtype)
        self._net = net.to(self._device, self._dtype).eval()
        cfg = getattr(net, "pretrained_cfg", None) or {}
        self._mean = tuple(cfg.get("mean") or _IMAGENET_MEAN)
        self._std = tuple(cfg.get("std") or _IMAGENET_STD)
        self._grid = patch_grid(self._geo.rows, self._geo.cols)

    def run(self, images: pa.Table) -> pa.Table:
        import torch

        if self._net is None:
            self.setup()
        # PNG decode, resize and normalisation are single-threaded PIL/numpy work that releases the GIL: a batch's
        # pages are prepared side by side, one per core torch may use (a quarter of the stage's time otherwise)
        with ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="docfuse-pages") as prep:
            return self._run(images, prep)

    def _run(self, images: pa.Table, prep: ThreadPoolExecutor) -> pa.Table:
        geo = self._geo
        n = images.num_rows
        cols = {name: images.column(name).to_pylist()
                for name in ("doc_id", "source", "page", "page_width", "page_height")}
        features = np.zeros((n, geo.n_patches, geo.dim), dtype=np.float32)
        boxes = np.zeros((n, geo.n_patches, 4), dtype=np.float32)
        ink = np.zeros((n, geo.n_patches), dtype=np.float32)
        errors: list[str | None] = [None] * n
        pngs = images.column("image")
        for start in range(0, n, self.params.batch_size):  # decode one batch at a time: memory stays bounded
            batch = list(enumerate(pngs.slice(start, self.params.batch_size).to_pylist(), start))
            prepared = list(prep.map(lambda item: self._check(item[0], item[1], cols, ink), batch))
            pixels: dict[int, np.ndarray] = {}
            for (i, _), (error, page) in zip(batch, prepared):
                errors[i] = error
                if error is None:
                    pixels[i] = page
                    boxes[i] = patch_boxes(cols["page_width"][i], cols["page_height"][i], geo.rows, geo.cols)
            if pixels:
                features[list(pixels)] = self._encode(np.stack(list(pixels.values())))
        valid = np.array([e is None for e in errors], dtype=bool)
        grid = np.broadcast_to(self._grid, (n, geo.n_patches, 4))
        schema = patches_schema(geo.n_patches, geo.dim)
        return pa.table({
            "doc_id": pa.array(cols["doc_id"], pa.string()),
            "source": pa.array(cols["source"], pa.string()),
            "page": pa.array(cols["page"], pa.int32()),
            "patch_features": tensor_column(features, valid, pa.float32()),
            "patch_boxes": tensor_column(boxes, valid, pa.float32()),
            "patch_grid": tensor_column(np.ascontiguousarray(grid), valid, pa.int16()),
            "patch_ink": tensor_column(ink, valid, pa.float32()),
            "error": pa.array(errors, pa.string()),
        }, schema=schema)

    def _check(self, i: int, png: bytes | None, cols: dict[str, list],
               ink: np.ndarray) -> tuple[str | None, np.ndarray | None]:
        """Row ``i``'s normalised pixels (its ink share goes to ``ink[i]``), or the error value when its page size
        or image is unusable. Runs in the page-preparation threads: it writes only row ``i``."""
        where = f"page {cols['page'][i]} of {cols['source'][i] or cols['doc_id'][i]!r}"
        width, height = cols["page_width"][i], cols["page_height"][i]
        if not _positive(width) or not _positive(height):
            return error_value("bad_page_size", f"{where} has page size {width} x {height} points; "
                                                "pdf.render must report the page's width and height"), None
        try:
            pixels, stretched = load_page(png, self._size, self._mean, self._std)
            ink[i] = patch_ink(stretched, self._geo.rows, self._geo.cols)
        except BadImage as exc:
            return error_value("bad_image", f"{where}: {exc}; re-render the page with pdf.render "
                                            "(its PNG is corrupt or truncated) or repair the source PDF"), None
        return None, pixels

    def _encode(self, batch: np.ndarray) -> np.ndarray:
        """Patch tokens of a batch, prefix (class/register) tokens dropped, as float32 ``[B, N, D]``."""
        import torch

        with torch.inference_mode():
            x = torch.from_numpy(batch).to(self._device, self._dtype)
            tokens = patch_tokens(self._net, x)
            if tuple(tokens.shape[1:]) != (self._geo.n_patches, self._geo.dim):
                raise RuntimeError(f"{self.vit.model} returned tokens of shape {tuple(tokens.shape)}; "
                                   f"expected [B, {self._geo.n_patches}, {self._geo.dim}] after "
                                   f"{self._geo.prefix_tokens} prefix tokens")
            return tokens.float().cpu().numpy()


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0
