"""Which ViT vision.patches builds: a fusion checkpoint's metadata names it; the stage's parameters only for a plain
ViT weights file.

Why one source: the ViT's shape (timm name, architecture overrides, input size) was written in the pipeline YAML as
well as in the checkpoint, and two copies drift. A fusion checkpoint records the ViT it was trained with, so the
stage reads it from there; a parameter that is set anyway must agree, else the pipeline is invalid and the error
names both values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What a plain ViT file (stages.vision.init_checkpoint, or weights of one's own) is built as when not told.
PLAIN_DEFAULTS: dict[str, Any] = {"model": "vit_tiny_patch16_224", "model_args": {}, "image_size": [224, 224]}


@dataclass(frozen=True)
class ViTSpec:
    """A timm ViT at an input size: what the stage builds and what its output schema follows."""

    model: str
    model_args: dict[str, Any]
    image_size: tuple[int, int]


def fusion_vision(path: Path) -> dict[str, Any] | None:
    """The ViT a fusion checkpoint was trained with, as the stage's parameters spell it; None for any other file."""
    if not path.is_file() or path.suffix != ".safetensors":
        return None
    from docfuse.fusion.checkpoint import read_meta, vision_spec  # torch: only when there is a file to read

    try:
        spec = vision_spec(read_meta(path))
    except ValueError:  # not a fusion checkpoint: plain ViT weights, whose shape the parameters give
        return None
    return {"model": spec.model, "model_args": spec.args, "image_size": list(spec.image_size)}


def resolve(given: dict[str, Any], path: Path, shown: str) -> ViTSpec:
    """The ViT for the parameters ``given`` (only those set, None meaning unset) and the checkpoint at ``path``
    (``shown`` as the user wrote it). Raises ValueError naming each disagreement with a fusion checkpoint."""
    recorded = fusion_vision(path)
    if recorded is not None:
        wrong = [(key, value, recorded[key]) for key, value in given.items()
                 if value is not None and _normal(value) != _normal(recorded[key])]
        if wrong:
            raise ValueError(
                "; ".join(f"{key} {value!r} disagrees with {want!r} in the fusion checkpoint {shown!r}"
                          for key, value, want in wrong)
                + ". The checkpoint's metadata names the ViT it was trained with: leave "
                + " and ".join(key for key, _, _ in wrong) + " out of this stage's `with:` (or --set them to null),"
                " or name a checkpoint trained with that ViT (`docfuse train-fusion`)")
        chosen = recorded
    else:
        chosen = {key: PLAIN_DEFAULTS[key] if given.get(key) is None else given[key] for key in PLAIN_DEFAULTS}
    size = chosen["image_size"]
    return ViTSpec(chosen["model"], dict(chosen["model_args"]), (int(size[0]), int(size[1])))


def _normal(value: Any) -> Any:
    """Lists and tuples alike (JSON has no tuples), so equal shapes compare equal however they were written."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in sorted(value.items())}
    return value
