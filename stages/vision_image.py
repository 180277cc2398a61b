"""PNG bytes to a ViT input: decode, flatten transparency onto white paper, stretch to the model size, normalise.

Stretching (not cropping or padding) is deliberate: it keeps every patch an exact rectangle of the page.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from docfuse.fusion.encoder import normalise, stretch


class BadImage(ValueError):
    """The bytes are not a decodable image; the message says why."""


def load_page(png: bytes | None, size: tuple[int, int], mean: tuple[float, ...],
              std: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``[3, H, W]`` float32 normalised pixels of ``png`` stretched to ``size`` = (H, W), and the ``[H, W, 3]``
    uint8 image they came from (for the ink measure)."""
    if not png:
        raise BadImage("the image is empty")
    try:
        with Image.open(io.BytesIO(png)) as img:
            img.load()
            rgb = _on_white(img)
    except UnidentifiedImageError as exc:
        raise BadImage("its bytes are not a PNG or any other image format PIL reads") from exc
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadImage(f"it does not decode as an image ({exc})") from exc
    stretched = stretch(rgb, size)
    return normalise(stretched, mean, std), stretched


def _on_white(img: Image.Image) -> Image.Image:
    """RGB with any alpha composited onto white, the colour of a page (plain convert() would turn it black)."""
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        paper = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(paper, rgba).convert("RGB")
    return img.convert("RGB")
