"""Greedy decode over a KernelTieredCache as one replayed CUDA graph per token.

At batch 1 an 8B decoder step is hundreds of small launches, and the host cannot issue them as fast as the GPU runs
them. Capturing the step once and replaying it removes the host from the loop. That needs static shapes: the core
gets its final capacity up front, the new token is written at a device-side index, the kernel reads the core length
from the device, and position, token, index and length advance inside the graph. The host-side counters of the
cache catch up in :meth:`GraphDecoder.close`.

Tiers are fixed while a graph is live: re-tiering changes the tensors the graph points at, so it happens between
graphs: ``close()``, ``cache.retier()``, then a new ``GraphDecoder`` (documented fallback).

Pruning inside a graph (documented fallback): a per-step decision would need a host sync and a branch, which a
captured graph cannot take. Instead the skip set is fixed for the life of a graph (``skip_mlp``: the MLP blocks of
those layers are left out of the capture), decided before capture, and revised by capturing a new graph. Only MLP
blocks are skipped this way: a skipped attention block must still write its K/V, which would need a second graph
path for the core; MLPs hold 80% of an 8B layer's weights anyway.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from runtime.gpu.kernel_cache import GRAPH_ATTN_NAME, KernelTieredCache, register_attention


class GraphDecoder:
    """Captures one greedy decode step of ``model`` over ``cache`` and replays it.

    Args:
        model: a Llama-family causal LM on CUDA.
        cache: a prefilled (and usually re-tiered) :class:`KernelTieredCache`.
        max_new: most tokens this decoder may add (the core's capacity grows by this much once).
        first_token: ``[B, 1]`` token the first step consumes (e.g. the prefill's argmax).
        warmup: eager steps before capture (they decode real tokens too).
        skip_mlp: decoder layers whose MLP block this graph leaves out (the residual passes through).
    """

    def __init__(self, model: Any, cache: KernelTieredCache, max_new: int, first_token: torch.Tensor,
                 warmup: int = 2, skip_mlp: Sequence[int] = ()) -> None:
        from runtime.session import cache_kwarg

        self.model, self.cache = model, cache
        bad = [i for i in skip_mlp if not 0 <= i < len(model.model.layers)]
        if bad:
            raise ValueError(f"skip_mlp names layers {bad}; the model has layers 0..{len(model.model.layers) - 1}")
        self.kwarg = cache_kwarg(model)
        self.has_cache_position = "cache_position" in inspect.signature(type(model.model).forward).parameters
        register_attention()
        self.saved_impl = model.config._attn_implementation
        device = first_token.device
        layers = cache.layers
        self.start_core, self.start_length = layers[0].n_core, layers[0].length
        if any(l.n_core != self.start_core for l in layers):
            raise ValueError("every layer must hold the same number of core tokens (prefill and re-tier first)")
        self.max_new = max_new
        for layer in layers:
            if layer.keys.shape[2] < layer.n_core + max_new:
                layer.keys = layer._grow(layer.keys, layer.n_core + max_new)
                layer.values = layer._grow(layer.values, layer.n_core + max_new)
        # write index of the next token, the core length once it is written, its position, the token itself
        self.slot = torch.full((1,), self.start_core - 1, dtype=torch.long, device=device)
        self.count = torch.full((1,), self.start_core, dtype=torch.int32, device=device)
        self.pos = torch.full((1, 1), self.start_length - 1, dtype=torch.long, device=device)
        self.tok = first_token.clone()
        self.logits: torch.Tensor | None = None
        self.steps = 0
        for layer in layers:
            layer.graph_slot, layer.graph_count = self.slot, self.count
        model.config._attn_implementation = GRAPH_ATTN_NAME
        self.skipped = _skip_mlps(model, skip_mlp)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(warmup):
                    self._step()
                    self.steps += 1
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.no_grad():
                self._step()
        except BaseException:
            self.close()  # the model gets its MLPs and attention back; the cache counts the warm-up steps
            raise

    def _step(self) -> None:
        self.slot += 1
        self.count += 1
        self.pos += 1
        extra = {"cache_position": self.pos[0]} if self.has_cache_position else {}
        out = self.model(input_ids=self.tok, position_ids=self.pos, use_cache=True, **extra,
                         **{self.kwarg: self.cache})
        self.logits = out.logits[:, -1]
        self.tok.copy_(self.logits.argmax(-1, keepdim=True))

    def step(self) -> torch.Tensor:
        """Decode one token (replay); returns the ``[B, 1]`` token tensor (overwritten by the next step)."""
        if self.steps >= self.max_new:
            raise RuntimeError(f"this decoder was sized for {self.max_new} tokens; close() and start another")
        self.graph.replay()
        self.steps += 1
        return self.tok

    def close(self) -> None:
        """Bring the cache's host-side counters up to date and leave graph mode (the cache is usable eagerly)."""
        n = self.steps
        for layer in self.cache.layers:
            layer.graph_slot = layer.graph_count = None
            b, h = layer.core_pos.shape[:2]
            pos = torch.empty(b, h, layer.keys.shape[2], dtype=torch.long)
            pos[:, :, : self.start_core] = layer.core_pos[:, :, : self.start_core]
            pos[:, :, self.start_core: self.start_core + n] = torch.arange(self.start_length, self.start_length + n)
            layer.core_pos = pos
            layer.n_core = self.start_core + n
            layer.length = self.start_length + n
        self.model.config._attn_implementation = self.saved_impl
        for block, mlp in self.skipped:
            block.mlp = mlp
        self.skipped = []
        self.graph = None


class _Skipped(torch.nn.Module):
    """Stands in for a skipped MLP block: adds nothing to the residual stream."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


def _skip_mlps(model: Any, layers: Sequence[int]) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    blocks = model.model.layers
    saved = []
    for i in sorted(set(layers)):
        saved.append((blocks[i], blocks[i].mlp))
        blocks[i].mlp = _Skipped()
    return saved
