"""Decoder models shared by the stages of one process: decode.generate and fusion.gate load each model once."""

from __future__ import annotations

from typing import Any

_MODELS: dict[tuple[str, str, str], tuple[Any, Any]] = {}


def shared_model(name: str, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) of ``name`` (runtime.loading names), loaded on first use and kept for the process."""
    from docfuse.runtime.loading import load_model, resolve_device

    key = (name, dtype, resolve_device(device))
    if key not in _MODELS:
        _MODELS[key] = load_model(name, dtype=dtype, device=key[2])
    return _MODELS[key]
