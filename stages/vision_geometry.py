"""Where each ViT patch lies on its page, and Arrow fixed-shape tensor columns to carry per-patch arrays.

A page image is stretched to the model's input size, so patch (r, c) of a ``rows x cols`` grid covers exactly
x in [c*W/cols, (c+1)*W/cols] and y in [r*H/rows, (r+1)*H/rows] of the page (PDF points, origin top left).
Patches are listed row-major, the order a ViT's patch embedding flattens them in.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from docfuse.fusion.encoder import patch_grid as fusion_patch_grid



def patch_boxes(page_width: float, page_height: float, rows: int, cols: int) -> np.ndarray:
    """``[rows*cols, 4]`` float32 boxes x0, y0, x1, y1 in points; neighbours share edges bit for bit."""
    xs = np.linspace(0.0, float(page_width), cols + 1).astype(np.float32)
    ys = np.linspace(0.0, float(page_height), rows + 1).astype(np.float32)
    return _tile(xs, ys)


def patch_grid(rows: int, cols: int) -> np.ndarray:
    """``[rows*cols, 4]`` int16 boxes on the 0-1000 page grid models see (the same for every page): the grid
    the fusion was trained on, fusion.encoder.patch_grid."""
    return fusion_patch_grid(rows, cols).astype(np.int16)


def _tile(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    x0, y0 = np.meshgrid(xs[:-1], ys[:-1])  # [rows, cols], row-major
    x1, y1 = np.meshgrid(xs[1:], ys[1:])
    return np.stack([x0, y0, x1, y1], axis=-1).reshape(-1, 4)


def tensor_column(values: np.ndarray, valid: np.ndarray, value_type: pa.DataType) -> pa.ExtensionArray:
    """A fixed-shape tensor column from ``[rows, *shape]`` values; rows where ``valid`` is false are null."""
    shape = list(values.shape[1:])
    tensor_type = pa.fixed_shape_tensor(value_type, shape)
    flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=value_type)
    storage = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(shape)), mask=pa.array(~valid, type=pa.bool_()))
    return pa.ExtensionArray.from_storage(tensor_type, storage)
