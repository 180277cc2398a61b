"""The ViT behind vision.patches: build it from timm without downloading anything, load local weights strictly.

Weights come only from a local file (safetensors or a torch state dict). The model is built at the stage's
``image_size`` (timm sizes the position embedding for it), so a checkpoint must have been made at that size:
resampling position embeddings silently would hand a trained fusion features it never saw.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from docfuse.data import shipped

if TYPE_CHECKING:  # torch and timm are imported lazily: listing stages must not pay for them
    import torch

Args = tuple[tuple[str, Any], ...]

HOW_TO_MAKE = (
    "train one with `docfuse train-fusion` (issue #5), or write an untrained one with "
    "`python -c \"from stages.vision import init_checkpoint; init_checkpoint('{path}', model='{model}'{size})\"` "
    "(see data/vision/README.md)"
)


@dataclass(frozen=True)
class Geometry:
    """What the output schema needs: the patch grid and the feature width, known without loading weights."""

    patch_size: tuple[int, int]
    rows: int
    cols: int
    dim: int
    prefix_tokens: int

    @property
    def n_patches(self) -> int:
        return self.rows * self.cols


def create(model: str, image_size: tuple[int, int], device: str | None = None, args: Args = ()) -> Any:
    """A timm ViT with random weights, without its classifier, sized for ``image_size``; never downloads.

    ``args``: architecture overrides as sorted ``(name, value)`` pairs (``depth``, ``embed_dim``, ...).
    """
    from docfuse.fusion.encoder import build_vit

    return build_vit(model, image_size, dict(args), device)


def as_args(model_args: dict[str, Any] | None) -> Args:
    """Hashable, order-free form of ``model_args`` (the cache key of ``geometry``)."""
    from docfuse.fusion.encoder import args_key

    return args_key(model_args)


@functools.lru_cache(maxsize=32)
def geometry(model: str, image_size: tuple[int, int], args: Args = ()) -> Geometry:
    """Patch grid and width of ``model`` at ``image_size``, from a weightless (meta-device) copy, remembered on
    disk (``GEOMETRY_MEMO`` under docfuse's home) per timm version: importing timm and torchvision costs ~2.5 s
    of every run on two cores, and a pipeline's schema needs the geometry even when its vision stages do not run."""
    key = _memo_key(model, image_size, args)
    known = _read_memo().get(key)
    if known is not None:
        try:
            return Geometry(patch_size=tuple(known["patch_size"]), rows=int(known["rows"]), cols=int(known["cols"]),
                            dim=int(known["dim"]), prefix_tokens=int(known["prefix_tokens"]))
        except (KeyError, TypeError, ValueError):
            pass  # a damaged record: measured again below and rewritten
    geo = _measure(model, image_size, args)
    _remember(key, geo)
    return geo


GEOMETRY_MEMO = "vit_geometry.json"


def _memo_path() -> Path:
    from docfuse.runtime.loading import docfuse_home

    return docfuse_home() / GEOMETRY_MEMO


def _memo_key(model: str, image_size: tuple[int, int], args: Args) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        timm_version = version("timm")
    except PackageNotFoundError:
        timm_version = "none"
    return json.dumps([timm_version, model, [int(v) for v in image_size], [[k, repr(v)] for k, v in args]])


def _read_memo() -> dict[str, Any]:
    try:
        memo = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _remember(key: str, geo: Geometry) -> None:
    """Adds ``geo`` to the memo (a temporary file renamed over it: readers never see half a file); a home that
    cannot be written only costs the next run the measurement."""
    path = _memo_path()
    memo = _read_memo()
    memo[key] = {"patch_size": list(geo.patch_size), "rows": geo.rows, "cols": geo.cols, "dim": geo.dim,
                 "prefix_tokens": geo.prefix_tokens}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def _measure(model: str, image_size: tuple[int, int], args: Args) -> Geometry:
    patch = _patch_size(model, args)
    height, width = image_size
    if height % patch[0] or width % patch[1] or height <= 0 or width <= 0:
        nearest = [max(1, round(height / patch[0])) * patch[0], max(1, round(width / patch[1])) * patch[1]]
        raise ValueError(f"image_size {list(image_size)} must be positive multiples of {model}'s patch size "
                         f"{list(patch)}, so that every patch is an exact rectangle of the page; for example {nearest}")
    net = create(model, image_size, device="meta", args=args)
    rows, cols = net.patch_embed.grid_size
    if (rows, cols) != (height // patch[0], width // patch[1]):
        raise ValueError(f"timm built {model} with a {rows}x{cols} patch grid for image_size {list(image_size)}; "
                         "pick a plain ViT (no patch-grid pooling)")
    from docfuse.fusion.encoder import prefix_tokens

    return Geometry(patch_size=patch, rows=rows, cols=cols, dim=int(net.num_features),
                    prefix_tokens=prefix_tokens(net))


@functools.lru_cache(maxsize=32)
def _patch_size(model: str, args: Args = ()) -> tuple[int, int]:
    net = create(model, _default_size(model), device="meta", args=args)
    size = net.patch_embed.patch_size
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _default_size(model: str) -> tuple[int, int]:
    import timm

    if not timm.is_model(model):
        create(model, (224, 224))  # raises the unknown-model error
    cfg = timm.models.get_pretrained_cfg(model)
    input_size = (cfg.input_size if cfg is not None else None) or (3, 224, 224)
    return int(input_size[1]), int(input_size[2])


def resolve_checkpoint(path: str) -> Path:
    """The checkpoint as given (``~`` expanded), else, for ``data/...``, the shipped package data (docfuse.data), so
    shipped YAML works from any directory and from an installed wheel."""
    given = Path(path).expanduser()
    if given.is_file() or given.is_absolute():
        return given
    if given.parts and given.parts[0] == "data":
        packaged = shipped("/".join(given.parts[1:]))
        if packaged.is_file():
            return packaged
    return given


def read_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file or a ``torch.save`` state dict (plain or under state_dict/model)."""
    import torch
    from safetensors import safe_open

    with path.open("rb") as fh:
        head = fh.read(9)
    is_safetensors = path.suffix == ".safetensors" or (
        len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000
    )
    try:
        if is_safetensors:
            with safe_open(str(path), framework="pt", device="cpu") as fh:
                return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"checkpoint {str(path)!r} is neither a safetensors file nor a torch state dict ({exc}); "
                         "write one with stages.vision.init_checkpoint or `docfuse train-fusion`") from exc
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint {str(path)!r} does not hold a state dict (name -> tensor); "
                         "save one with torch.save(model.state_dict(), path) or stages.vision.init_checkpoint")
    return state, {}


def load_weights(net: Any, path: Path, model: str, image_size: tuple[int, int]) -> None:
    """Copy the checkpoint into ``net``; every key and shape must match, nothing is skipped or resampled.

    A fusion checkpoint (``docfuse train-fusion``) holds its ViT under ``vision.``; that part is used.
    """
    state, metadata = read_state_dict(path)
    if metadata.get("format") == "docfuse-fusion-1":
        state = {k[len("vision."):]: v for k, v in state.items() if k.startswith("vision.")}
        metadata = {**metadata, "model": metadata.get("vision_model", "")}
    expected = net.state_dict()
    made_for = f" (it was made for {metadata['model']})" if metadata.get("model") and metadata["model"] != model else ""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(path)!r} does not fit {model}{made_for}: "
                         f"{len(missing)} missing keys {missing[:5]}, {len(unexpected)} unexpected keys {unexpected[:5]}; "
                         "use the model name the checkpoint was made for, or make a checkpoint for this model: "
                         + HOW_TO_MAKE.format(path=path, model=model, size=size_arg(image_size)))
    wrong = [(k, list(state[k].shape), list(v.shape)) for k, v in expected.items() if state[k].shape != v.shape]
    if wrong:
        hint = ""
        if any(k == "pos_embed" for k, _, _ in wrong):
            hint = (f" The position embedding has {state['pos_embed'].shape[1]} tokens where image_size "
                    f"{list(image_size)} needs {expected['pos_embed'].shape[1]}: the checkpoint was made at another image "
                    f"size{_square_size_hint(state['pos_embed'].shape[1], net)}; set image_size to it, or make a checkpoint "
                    "at this size.")
        raise ValueError(f"checkpoint {str(path)!r} does not fit {model}{made_for}: shapes differ for "
                         + ", ".join(f"{k} {a} (checkpoint) vs {b} (model)" for k, a, b in wrong[:5])
                         + f".{hint} To make a matching one: "
                         + HOW_TO_MAKE.format(path=path, model=model, size=size_arg(image_size)))
    net.load_state_dict(state, strict=True)


def _square_size_hint(tokens: int, net: Any) -> str:
    """The square image size a position embedding of ``tokens`` entries was made for, when it is square."""
    from docfuse.fusion.encoder import prefix_tokens

    patches = tokens - (0 if getattr(net, "no_embed_class", False) else prefix_tokens(net))
    side = math.isqrt(max(patches, 0))
    patch = net.patch_embed.patch_size
    patch = patch if isinstance(patch, int) else patch[0]
    return f" (probably [{side * patch}, {side * patch}])" if side * side == patches else ""


def size_arg(image_size: tuple[int, int]) -> str:
    return "" if tuple(image_size) == (224, 224) else f", image_size={list(image_size)}"


def init_checkpoint(path: str | Path, model: str = "vit_tiny_patch16_224", seed: int = 0,
                    image_size: tuple[int, int] | list[int] = (224, 224),
                    model_args: dict[str, Any] | None = None) -> Path:
    """Write a freshly initialised (untrained) ViT as safetensors: what tests use until issue #5 trains one.

    Deterministic for a given ``seed``; the global torch RNG is left as it was. ``image_size`` must be the
    vision.patches stage's ``image_size`` (both default to [224, 224], whatever the model's own input size).
    """
    import torch
    from safetensors.torch import save_file

    size = (int(image_size[0]), int(image_size[1]))
    geometry(model, size, as_args(model_args))  # validates the model name and the size before anything is written
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = create(model, size, device="cpu", args=as_args(model_args))
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={
        "model": model, "image_size": f"{size[0]}x{size[1]}", "seed": str(seed), "trained": "false",
        "made_by": "stages.vision.init_checkpoint",
    })
    return out
