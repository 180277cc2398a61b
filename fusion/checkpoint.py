"""A fusion checkpoint: the ViT's weights and the fusion's in one safetensors file, with what made them.

Metadata: the fusion's sizes, the ViT (timm name, architecture overrides, input size), the render dpi, the decoder
it was trained against (a fingerprint: a fusion fits only the embedding space it learned), and the command.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from docfuse.fusion.encoder import args_key, build_vit
from docfuse.fusion.model import Fusion, FusionConfig


@dataclass
class VisionSpec:
    """Which ViT a fusion reads, at which input size (H, W) and render dpi."""

    model: str
    args: dict
    image_size: tuple[int, int]
    dpi: float = 96.0

    def build(self, device: str | None = None) -> Any:
        return build_vit(self.model, self.image_size, self.args, device)

    @property
    def grid(self) -> tuple[int, int]:
        """The ViT's patch grid (rows, cols) at this input size, from a weightless copy."""
        return _grid(self.model, tuple(self.image_size), args_key(self.args))


@functools.lru_cache(maxsize=8)
def _grid(model: str, image_size: tuple[int, int], args: tuple) -> tuple[int, int]:
    rows, cols = build_vit(model, image_size, dict(args), "meta").patch_embed.grid_size
    return int(rows), int(cols)


def decoder_fingerprint(config: Any) -> str:
    """What a fusion depends on in the decoder: its kind and the shape of its embedding space."""
    return (f"{getattr(config, 'model_type', '?')}:hidden={config.hidden_size}:vocab={config.vocab_size}"
            f":layers={config.num_hidden_layers}")


def save(path: str | Path, vit: Any, fusion: Fusion, vision: VisionSpec, decoder: str,
         dtype: torch.dtype = torch.float16, reader: Any = None, **extra: str) -> Path:
    """Write ``vision.*`` and ``fusion.*`` tensors (``dtype``: fp16 keeps it small), and ``reader.*`` when a
    word reader (fusion.reader) is given, with the metadata that rebuilds them; loading casts back to float32."""
    from safetensors.torch import save_file

    tensors = {f"vision.{k}": v.detach().to(dtype).cpu().contiguous() for k, v in vit.state_dict().items()}
    tensors |= {f"fusion.{k}": v.detach().to(dtype).cpu().contiguous() for k, v in fusion.state_dict().items()}
    if reader is not None:
        tensors |= {f"reader.{k}": v.detach().to(dtype).cpu().contiguous() for k, v in reader.state_dict().items()}
        extra["reader_config"] = json.dumps(reader.config.to_dict())
    meta = {"format": "docfuse-fusion-1", "fusion_config": json.dumps(fusion.config.to_dict()),
            "vision_model": vision.model, "vision_args": json.dumps(vision.args),
            "image_size": f"{vision.image_size[0]}x{vision.image_size[1]}", "dpi": str(vision.dpi),
            "decoder": decoder, **{k: str(v) for k, v in extra.items()}}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return out


#: metadata keys save() writes itself; the rest (command, config, held_out, ...) is the caller's
OWN_KEYS = ("format", "fusion_config", "vision_model", "vision_args", "image_size", "dpi", "decoder", "reader_config")


def carried_meta(meta: dict[str, str]) -> dict[str, str]:
    """A checkpoint's metadata less what save() writes itself: what a re-save carries over."""
    return {k: v for k, v in meta.items() if k not in OWN_KEYS}


def read_meta(path: str | Path) -> dict[str, str]:
    """The checkpoint's metadata, without loading its tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            meta = dict(fh.metadata() or {})
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"fusion checkpoint {str(path)!r} is not a safetensors file ({exc}); "
                         "make one with `docfuse train-fusion`") from exc
    if meta.get("format") != "docfuse-fusion-1":
        raise ValueError(f"{str(path)!r} is not a docfuse fusion checkpoint (format {meta.get('format')!r}); "
                         "make one with `docfuse train-fusion`")
    return meta


def vision_spec(meta: dict[str, str]) -> VisionSpec:
    h, w = (int(v) for v in meta["image_size"].split("x"))
    return VisionSpec(meta["vision_model"], json.loads(meta["vision_args"]), (h, w), float(meta.get("dpi", 96)))


def load(path: str | Path, decoder: str | None = None, device: str = "cpu") -> tuple[Any, Fusion, VisionSpec, dict]:
    """The ViT (eval mode), the fusion (eval mode), the vision spec and the metadata of a checkpoint.

    ``decoder``: the fingerprint of the decoder it will feed; a checkpoint made for another is refused.
    """
    from safetensors.torch import load_file

    meta = read_meta(path)
    if decoder is not None and meta.get("decoder") != decoder:
        raise ValueError(f"fusion checkpoint {str(path)!r} was trained for decoder {meta.get('decoder')!r}, "
                         f"not {decoder!r}; train one for this model with `docfuse train-fusion --model ...`")
    spec = vision_spec(meta)
    tensors = {k: v.float() for k, v in load_file(str(path), device=device).items()}
    vit = spec.build(device)
    vit.load_state_dict({k[7:]: v for k, v in tensors.items() if k.startswith("vision.")}, strict=True)
    fusion = Fusion(FusionConfig(**json.loads(meta["fusion_config"]))).to(device)
    fusion.load_state_dict({k[7:]: v for k, v in tensors.items() if k.startswith("fusion.")}, strict=True)
    return vit.eval(), fusion.eval(), spec, meta


def load_reader(path: str | Path, device: str = "cpu") -> Any:
    """The checkpoint's word reader (fusion.reader.WordReader, eval mode), or None when it has none."""
    from safetensors import safe_open

    from docfuse.fusion.reader import ReaderConfig, WordReader

    meta = read_meta(path)
    if "reader_config" not in meta:
        return None
    reader = WordReader(ReaderConfig(**json.loads(meta["reader_config"])))
    with safe_open(str(path), framework="pt", device=device) as fh:
        state = {k[7:]: fh.get_tensor(k).float() for k in fh.keys() if k.startswith("reader.")}
    reader.load_state_dict(state, strict=True)
    return reader.to(device).eval()


def untrained(vision: VisionSpec, hidden: int, seed: int = 0, **sizes: int) -> tuple[Any, Fusion]:
    """A fresh (seeded) ViT and fusion for ``vision`` and a decoder of ``hidden`` size: gates at 0, text-only.

    ``sizes`` override FusionConfig fields (``mlp_hidden=0``: no MLP branch)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vit = vision.build("cpu")
        rows, cols = vit.patch_embed.grid_size
        fusion = Fusion(FusionConfig(hidden=hidden, vision_dim=int(vit.num_features), grid_rows=rows, grid_cols=cols,
                                     **sizes))
    return vit, fusion
