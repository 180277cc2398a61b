"""Triton, where the machine has it: CPU-only machines (CI) still import every GPU module; HAS_TRITON says whether
the kernels can run."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "triton", "tl"]
