"""Runtime pruning: a calibrated decision head skips low-value attention and MLP blocks in decode.

``Pruner(model, head, threshold)`` installs gates (``gates.py``); the head (``head.py``) is trained by
``calibrate.py`` on labels from ablating each block at each token (``ablation.py``). Sessions take a
``pruning:`` block (``config.PruningConfig``); safe mode or threshold 0 is exactly the dense model.

The names below are imported on first use: ``docfuse`` imports this package's ``cli`` module to list its
commands, and listing commands must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from docfuse.runtime.pruning.config import PruningConfig, find_head
    from docfuse.runtime.pruning.gates import Pruner
    from docfuse.runtime.pruning.head import DecisionHead

_WHERE = {"PruningConfig": "config", "find_head": "config", "Pruner": "gates", "DecisionHead": "head"}
__all__ = ["DecisionHead", "Pruner", "PruningConfig", "find_head"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'docfuse.runtime.pruning' has no attribute {name!r}")
    return getattr(importlib.import_module(f"docfuse.runtime.pruning.{_WHERE[name]}"), name)
