"""One greedy decode step over a KernelTieredCache with static shapes, written out block by block.

This is what :class:`~runtime.gpu.decode_graph.GraphDecoder` captures. The core gets its final capacity up front,
the new token is written at a device-side index, the attention kernel reads the core length from the device, and
position, token, index and length advance on the device, so one captured step can be replayed for every token.
The host-side counters of the cache catch up in :meth:`StaticDecode.close`.

Each layer runs :class:`~runtime.llama_block.LlamaBlock` (the one explicit block, which the layer-major prefill runs
too) with fused kernels and the tier attention hook, so that a layer is about fourteen kernels: fused residual-add +
RMSNorm, the q/k/v products, one RoPE kernel that also writes K/V into the core, the tier kernel and its split
merge, o, fused add + RMSNorm, gate and up, SiLU times up, down (:mod:`runtime.gpu.fused_ops`). Going through transformers' modules instead costs some forty-five launches a layer;
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

from docfuse.runtime.gpu import fused_ops
from docfuse.runtime.gpu.attention_kernel import HAS_TRITON, kernel_supports, tiered_decode_attention
from docfuse.runtime.gpu.kernel_cache import GRAPH_ATTN_NAME, KernelTieredCache, KernelTieredLayer, register_attention
from docfuse.runtime.gpu.reference import tiered_decode_reference
from docfuse.runtime.llama_block import Kernels, LlamaBlock, norm_eps, unwrap


#: The decode step's elementwise kernels: one Triton kernel each on CUDA, the block's torch math elsewhere.
FUSED = Kernels(fused_ops.add_rms_norm, fused_ops.silu_mul)


def llama_decoder(model: Any) -> bool:
    """Whether ``model`` is a decoder of :class:`LlamaBlock`-shaped layers with embeddings, RoPE and a final norm:
    what a written-out decode step runs (the engine's, :mod:`runtime.engine.step`; q/k norms included)."""
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    return all(LlamaBlock.fits(block) for block in base.layers)


def explicit_supported(model: Any) -> bool:
    """Whether :func:`explicit_forward` knows this model's blocks (the Llama block without q/k norms, which the
    fused RoPE kernel does not apply)."""
    return llama_decoder(model) and not any(hasattr(unwrap(block.self_attn), "q_norm") for block in model.model.layers)


def kernel_covers(cache: KernelTieredCache) -> bool:
    """Whether the Triton kernel handles every layer's tiers (head size, bits); where it does not, decoding reads
    the core length on the host, so it runs eagerly instead of in a CUDA graph."""
    return all(kernel_supports(layer.assoc if layer.n_assoc else None, layer.keys.shape[-1])
               for layer in cache.layers)


class TierAttention:
    """The decode step's attention hook for one layer (a :data:`~runtime.llama_block.Attention`).

    One RoPE kernel rotates q and k and writes k and v into the layer's core at the device-side ``graph_slot``; the
    tier kernel then attends over the association tier and the core up to the device-side ``graph_count``. Off CUDA
    the same steps run in torch.
    """

    def __init__(self, layer: KernelTieredLayer, cos: torch.Tensor, sin: torch.Tensor, scale: float) -> None:
        self.layer, self.cos, self.sin, self.scale = layer, cos, sin, scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        q = fused_ops.rope_write(q[:, 0], k[:, 0], v[:, 0], self.cos, self.sin, layer.keys, layer.values,
                                 layer.graph_slot)
        return self._attend(q).unsqueeze(1)

    def _attend(self, q: torch.Tensor) -> torch.Tensor:
        """Decode attention of q [B, Hq, D] over the layer's tiers, the core length read from the device."""
        layer = self.layer
        assoc = layer.assoc if layer.n_assoc else None
        if HAS_TRITON and q.is_cuda and kernel_supports(assoc, q.shape[-1]):
            return tiered_decode_attention(q, layer.keys, layer.values, layer.keys.shape[2], assoc, self.scale,
                                           core_count=layer.graph_count)
        n_core = int(layer.graph_count.item())  # off the GPU nothing is captured: a host read is fine
        return tiered_decode_reference(q, layer.keys, layer.values, n_core, assoc, self.scale).to(q.dtype)


def explicit_forward(model: Any, cache: KernelTieredCache, tok: torch.Tensor, pos: torch.Tensor,
                     skip_mlp: frozenset[int] = frozenset()) -> torch.Tensor:
    """Logits ``[B, vocab]`` of one token ``tok`` [B, 1] at position ``pos`` [1, 1]; K/V go to each layer's core at
    ``graph_slot``. Same function as ``model(input_ids=tok, ...)`` over the same tiers, within bf16 rounding."""
    base = model.model
    x = base.embed_tokens(tok)  # [B, 1, hidden]
    cos, sin = base.rotary_emb(x, position_ids=pos)  # [1, 1, D]
    cos, sin = cos[:, 0], sin[:, 0]
    delta = None
    for i, (layer, tiers) in enumerate(zip(base.layers, cache.layers)):
        block = LlamaBlock(layer, FUSED)
        x, delta = block.forward(x, delta, TierAttention(tiers, cos, sin, block.scaling), skip_mlp=i in skip_mlp)
    h, _ = fused_ops.add_rms_norm(x, delta, base.norm.weight, norm_eps(base.norm))
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
        from docfuse.runtime.session import cache_kwarg

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
