"""One greedy decode step over a KernelTieredCache with static shapes, written out block by block.

This is what :class:`~runtime.gpu.decode_graph.GraphDecoder` captures. The core gets its final capacity up front,
the new token is written at a device-side index, the attention kernel reads the core length from the device, and
position, token, index and length advance on the device, so one captured step can be replayed for every token.
The host-side counters of the cache catch up in :meth:`StaticDecode.close`.

The forward of a Llama-family decoder is spelled out here (as in :mod:`runtime.layer_prefill`) so that each layer is
about fourteen kernels: fused residual-add + RMSNorm, the q/k/v products, one RoPE kernel that also writes K/V into
the core, the tier kernel and its split merge, o, fused add + RMSNorm, gate and up, SiLU times up, down
(:mod:`runtime.gpu.fused_ops`). Going through transformers' modules instead costs some forty-five launches a layer;
that path (``explicit=False``) stays for models whose blocks this forward does not know.

Pruning (documented fallback): a per-step decision would need a host sync and a branch, which a captured graph
cannot take. The skip set is fixed for the life of the decoder (``skip_mlp``: those layers' MLP blocks are left out;
the residual passes through), decided before capture, and revised by building a new decoder. Only MLP blocks are
skipped this way: a skipped attention block must still write its K/V, which would need a second path for the core;
MLPs hold 80% of an 8B layer's weights anyway.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from runtime.gpu import fused_ops
from runtime.gpu.attention_kernel import HAS_TRITON, tiered_decode_attention
from runtime.gpu.kernel_cache import GRAPH_ATTN_NAME, KernelTieredCache, KernelTieredLayer, register_attention
from runtime.gpu.reference import tiered_decode_reference


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    """The block inside a pruning gate (runtime.pruning.gates wraps attention and MLP modules)."""
    return getattr(module, "inner", module)


def explicit_supported(model: Any) -> bool:
    """Whether :func:`explicit_forward` knows this model's blocks (Llama-style attention, gated SiLU MLP)."""
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    for block in base.layers:
        attn, mlp = _inner(block.self_attn), _inner(block.mlp)
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return False
        if hasattr(attn, "q_norm") or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        if getattr(getattr(mlp, "config", None), "hidden_act", "silu") != "silu":
            return False
    return True


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _attend(layer: KernelTieredLayer, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention over the layer's tiers with the core length read from the device."""
    assoc = layer.assoc if layer.n_assoc else None
    if HAS_TRITON and q.is_cuda:
        return tiered_decode_attention(q, layer.keys, layer.values, layer.keys.shape[2], assoc, scale,
                                       core_count=layer.graph_count)
    n_core = int(layer.graph_count.item())  # off the GPU nothing is captured: a host read is fine
    return tiered_decode_reference(q, layer.keys, layer.values, n_core, assoc, scale).to(q.dtype)


def explicit_forward(model: Any, cache: KernelTieredCache, tok: torch.Tensor, pos: torch.Tensor,
                     skip_mlp: frozenset[int] = frozenset()) -> torch.Tensor:
    """Logits ``[B, vocab]`` of one token ``tok`` [B, 1] at position ``pos`` [1, 1]; K/V go to each layer's core at
    ``graph_slot``. Same function as ``model(input_ids=tok, ...)`` over the same tiers, within bf16 rounding."""
    base = model.model
    x = base.embed_tokens(tok)  # [B, 1, hidden]
    b = x.shape[0]
    cos, sin = base.rotary_emb(x, position_ids=pos)  # [1, 1, D]
    cos, sin = cos[:, 0], sin[:, 0]
    delta = None
    for i, (block, layer) in enumerate(zip(base.layers, cache.layers)):
        attn, mlp = _inner(block.self_attn), _inner(block.mlp)
        h, x = fused_ops.add_rms_norm(x, delta, block.input_layernorm.weight, _eps(block.input_layernorm))
        d = attn.head_dim
        q = attn.q_proj(h).view(b, -1, d)
        k = attn.k_proj(h).view(b, -1, d)
        v = attn.v_proj(h).view(b, -1, d)
        q = fused_ops.rope_write(q, k, v, cos, sin, layer.keys, layer.values, layer.graph_slot)
        out = _attend(layer, q, attn.scaling)
        delta = attn.o_proj(out.reshape(b, 1, -1))
        if i in skip_mlp:
            continue
        h, x = fused_ops.add_rms_norm(x, delta, block.post_attention_layernorm.weight,
                                      _eps(block.post_attention_layernorm))
        delta = mlp.down_proj(fused_ops.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
    h, _ = fused_ops.add_rms_norm(x, delta, base.norm.weight, _eps(base.norm))
    return model.lm_head(h)[:, -1]


class StaticDecode:
    """Greedy decoding of ``model`` over ``cache`` with every shape fixed, one :meth:`step` per token.

    Args:
        model: a Llama-family causal LM.
        cache: a prefilled (and usually re-tiered) :class:`KernelTieredCache`.
        max_new: most tokens this decoder may add (the core's capacity grows by this much once).
        first_token: ``[B, 1]`` token the first step consumes (e.g. the prefill's argmax).
        skip_mlp: decoder layers whose MLP block is left out (the residual passes through).
        explicit: use :func:`explicit_forward` (default: wherever :func:`explicit_supported`), else the model's own
            forward through the registered tier attention.
    """

    def __init__(self, model: Any, cache: KernelTieredCache, max_new: int, first_token: torch.Tensor,
                 skip_mlp: Sequence[int] = (), explicit: bool | None = None) -> None:
        from runtime.session import cache_kwarg

        self.model, self.cache = model, cache
        n_layers = len(model.model.layers)
        bad = [i for i in skip_mlp if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"skip_mlp names layers {bad}; the model has layers 0..{n_layers - 1}")
        self.explicit = explicit_supported(model) if explicit is None else explicit
        if self.explicit and not explicit_supported(model):
            raise ValueError(f"{type(model).__name__}'s blocks are not the Llama shape the explicit decode step "
                             "writes out; pass explicit=False to decode through the model's own forward")
        self.skip = frozenset(skip_mlp)
        self.kwarg = cache_kwarg(model)
        self.has_cache_position = "cache_position" in inspect.signature(type(model.model).forward).parameters
        layers = cache.layers
        self.start_core, self.start_length = layers[0].n_core, layers[0].length
        if any(l.n_core != self.start_core for l in layers):
            raise ValueError("every layer must hold the same number of core tokens (prefill and re-tier first)")
        self.max_new = max_new
        for layer in layers:
            if layer.keys.shape[2] < layer.n_core + max_new:
                layer.keys = layer._grow(layer.keys, layer.n_core + max_new)
                layer.values = layer._grow(layer.values, layer.n_core + max_new)
        device = first_token.device
        # write index of the next token, the core length once it is written, its position, the token itself
        self.slot = torch.full((1,), self.start_core - 1, dtype=torch.long, device=device)
        self.count = torch.full((1,), self.start_core, dtype=torch.int32, device=device)
        self.pos = torch.full((1, 1), self.start_length - 1, dtype=torch.long, device=device)
        self.tok = first_token.clone()
        self.logits: torch.Tensor | None = None
        self.steps = 0
        for layer in layers:
            layer.graph_slot, layer.graph_count = self.slot, self.count
        self.saved_impl = model.config._attn_implementation
        self.skipped: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        if not self.explicit:
            register_attention()
            model.config._attn_implementation = GRAPH_ATTN_NAME
            self.skipped = _skip_mlps(model, self.skip)
        self.closed = False

    @torch.no_grad()
    def _advance(self) -> None:
        """One step on the device: counters forward, the forward pass, the argmax into ``tok``."""
        self.slot += 1
        self.count += 1
        self.pos += 1
        if self.explicit:
            self.logits = explicit_forward(self.model, self.cache, self.tok, self.pos, self.skip)
        else:
            extra = {"cache_position": self.pos[0]} if self.has_cache_position else {}
            out = self.model(input_ids=self.tok, position_ids=self.pos, use_cache=True, **extra,
                             **{self.kwarg: self.cache})
            self.logits = out.logits[:, -1]
        self.tok.copy_(self.logits.argmax(-1, keepdim=True))

    def _check_room(self) -> None:
        if self.closed:
            raise RuntimeError("this decoder is closed; start another")
        if self.steps >= self.max_new:
            raise RuntimeError(f"this decoder was sized for {self.max_new} tokens; close() and start another")

    def step(self) -> torch.Tensor:
        """Decode one token; returns the ``[B, 1]`` token tensor (overwritten by the next step)."""
        self._check_room()
        self._advance()
        self.steps += 1
        return self.tok

    def close(self) -> None:
        """Bring the cache's host-side counters up to date and leave static mode (the cache is usable eagerly)."""
        if self.closed:
            return
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
        self.closed = True


class _Skipped(torch.nn.Module):
    """Stands in for a skipped MLP block on the model-forward path: adds nothing to the residual stream."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


def _skip_mlps(model: Any, layers: Sequence[int]) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    blocks = model.model.layers
    saved = []
    for i in sorted(set(layers)):
        saved.append((blocks[i], blocks[i].mlp))
        blocks[i].mlp = _Skipped()
    return saved
