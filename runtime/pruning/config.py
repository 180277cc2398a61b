"""The decode stage's ``pruning:`` block, and where a model's calibrated head is found."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from docfuse.data import shipped
from docfuse.runtime.pruning.head import DecisionHead, model_fingerprint

log = logging.getLogger("docfuse.pruning")
#: Heads the project ships, one safetensors file per model (see data/pruning/README.md for the commands).
SHIPPED_HEADS = shipped("pruning")
_warned: set[str] = set()


class PruningConfig(BaseModel):
    """``pruning: {threshold: 0.15, safe_mode: false}``; ``safe_mode`` or ``threshold: 0`` is the dense model."""

    model_config = ConfigDict(extra="forbid")
    threshold: float = Field(0.15, ge=0.0, le=1.0, description="skip a block when the head's probability that it "
                                                               "matters is under this")
    safe_mode: bool = Field(False, description="true = never skip (output identical to the dense model)")
    head: str | None = Field(None, description="a head file from docfuse calibrate-pruning; null = the one "
                                               "shipped for this model, if any")

    @property
    def dense(self) -> bool:
        return self.safe_mode or self.threshold == 0.0


def _matches(head: DecisionHead, model: Any) -> bool:
    return head.meta.get("fingerprint") == model_fingerprint(model.config)


def find_head(model: Any, path: str | None = None) -> DecisionHead | None:
    """The head at ``path``, else a shipped head whose fingerprint matches the model; None (warned once) if none."""
    if path is not None:
        head = DecisionHead.load(Path(path))
        if not _matches(head, model):
            raise ValueError(f"pruning head {path} was calibrated for {head.meta.get('fingerprint')}, not this "
                             f"model ({model_fingerprint(model.config)}); run docfuse calibrate-pruning for it")
        return head
    for file in sorted(SHIPPED_HEADS.glob("*.safetensors")):
        head = DecisionHead.load(file)
        if _matches(head, model):
            return head
    name = str(getattr(model.config, "name_or_path", "") or model.config.model_type)
    if name not in _warned:
        _warned.add(name)
        log.warning("no calibrated pruning head for %s: decoding dense. Make one with "
                    "docfuse calibrate-pruning --model MODEL --corpus TEXT --out head.safetensors "
                    "and pass it as pruning.head", name)
    return None

