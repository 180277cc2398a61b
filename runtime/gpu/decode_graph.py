"""Greedy decode over a KernelTieredCache as one replayed CUDA graph per token.

At batch 1 an 8B decoder step is hundreds of small launches, and the host cannot issue them as fast as the GPU runs
them. :class:`~runtime.gpu.decode_step.StaticDecode` makes every shape of the step static; this captures that step
once and replays it, which removes the host from the loop.

Tiers are fixed while a graph is live: re-tiering changes the tensors the graph points at, so it happens between
graphs: ``close()``, ``cache.retier()``, then a new ``GraphDecoder`` (documented fallback). Pruning inside a graph
is a skip set fixed per graph (``skip_mlp``, see :mod:`runtime.gpu.decode_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from docfuse.runtime.gpu.decode_step import StaticDecode, kernel_covers
from docfuse.runtime.gpu.kernel_cache import KernelTieredCache


class GraphDecoder(StaticDecode):
    """Captures one greedy decode step of ``model`` over ``cache`` and replays it (CUDA only).

    Arguments as :class:`~runtime.gpu.decode_step.StaticDecode`, plus ``warmup``: eager steps before capture
    (they decode real tokens too).
    """

    def __init__(self, model: Any, cache: KernelTieredCache, max_new: int, first_token: torch.Tensor,
                 warmup: int = 2, skip_mlp: Sequence[int] = (), explicit: bool | None = None) -> None:
        if not first_token.is_cuda:
            raise ValueError("CUDA graphs need the model and cache on a CUDA device; use StaticDecode off the GPU")
        super().__init__(model, cache, max_new, first_token, skip_mlp=skip_mlp, explicit=explicit)
        self.graph: torch.cuda.CUDAGraph | None = None
        if not kernel_covers(cache):  # e.g. a head size the kernel lacks: the reference path, eagerly
            for _ in range(warmup):
                self.step()
            return
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    self.step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._advance()
            self.graph = graph
        except BaseException:
            self.close()  # the model gets its MLPs and attention back; the cache counts the warm-up steps
            raise

    def step(self) -> torch.Tensor:
        """Decode one token (replay once captured); returns the ``[B, 1]`` token tensor (overwritten next step)."""
        if self.graph is None:
            return super().step()
        self._check_room()
        self.graph.replay()
        self.steps += 1
        return self.tok

    def close(self) -> None:
        super().close()
        self.graph = None
