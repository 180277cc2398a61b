"""Runtime pruning: a calibrated decision head skips low-value attention and MLP blocks in decode.

``Pruner(model, head, threshold)`` installs gates (``gates.py``); the head (``head.py``) is trained by
``calibrate.py`` on labels from ablating each block at each token (``ablation.py``). Sessions take a
``pruning:`` block (``config.PruningConfig``); safe mode or threshold 0 is exactly the dense model.
"""

from runtime.pruning.config import PruningConfig, find_head
from runtime.pruning.gates import Pruner
from runtime.pruning.head import DecisionHead

__all__ = ["DecisionHead", "Pruner", "PruningConfig", "find_head"]
