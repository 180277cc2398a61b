"""One Llama decoder block, written out once, for every place that runs the decoder layer by layer.

The layer-major prefill (:mod:`runtime.layer_prefill`) and the explicit decode step (:mod:`runtime.gpu.decode_step`)
cannot go through transformers' ``LlamaDecoderLayer.forward``: the prefill attends over a whole document of one layer
at a time, and the decode step reads tiers with fused kernels inside a CUDA graph. Both run :class:`LlamaBlock`,
which takes a transformers layer's weights (not a copy) and spells out its forward::

    x -> RMSNorm -> q, k, v projections (GQA) -> [attention hook: RoPE, cache write, attend] -> o -> + x
      -> RMSNorm -> down(silu(gate) * up) -> + residual

What differs between the callers is only:

* where K/V live and what the queries attend over: the ``attention`` hook (see :data:`Attention`);
* whether the elementwise groups are fused kernels: :class:`Kernels` (:data:`TORCH` here; the decode step passes
  :mod:`runtime.gpu.fused_ops`, which falls back to these same torch functions off CUDA).

The residual stream is carried as ``(x, delta)``, whose sum is the hidden state, so that each addition can be fused
into the RMSNorm that follows it (the decode step's ``add_rms_norm``); ``x + delta`` is the block's output.
Rounding follows transformers' modules, so in float32 the block equals ``LlamaDecoderLayer`` to the last bits
(tests/test_llama_block.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: The cache hook: ``q`` [B, T, Hq, D], ``k`` and ``v`` [B, T, Hkv, D] as projected (after q/k norms where the model
#: has them, before RoPE) -> attention output [B, T, Hq, D]. It rotates q and k, stores k and v wherever its caller
#: keeps the layer's cache, and attends over what that cache holds.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The block inside a pruning gate (runtime.pruning.gates wraps attention and MLP modules)."""
    return getattr(module, "inner", module)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal SDPA of a chunk's queries [B, Hq, T, D] over keys [B, Hkv, S, D] whose last ``T`` are the chunk's own.

    The causal diagonal is aligned to the bottom right (query ``i`` sees keys ``<= S - T + i``) without building an
    ``T x S`` mask where the GPU kernels can avoid it: flash attention applies that diagonal itself (the layer-major
    prefill, and a prefill chunk or a question over a cache through ``runtime.kv.code_attention.unpadded_causal``).
    """
    t, s = q.shape[2], k.shape[2]
    if t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, s), scale=scale,
                                              enable_gqa=True)
    except RuntimeError:  # a backend without bottom-right causal + GQA: an explicit mask (T x S booleans)
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon, whichever name the model gives it."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` of the two halves of the last axis: RoPE's rotation by 90 degrees in transformers' layout."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, T, D] rotated by ``cos``/``sin`` [B or 1, 1, T, D] in x's dtype (transformers' rotate-half)."""
    return x * cos + rotate_half(x) * sin


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + delta) * weight, x + delta)``; ``delta=None`` adds nothing.

    The sum is rounded to x's dtype before it is normalised and the normalised row before the weight, as
    transformers' LlamaRMSNorm rounds.
    """
    res = x if delta is None else x + delta
    h = res.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), res


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating, ``silu(gate) * up``, as LlamaMLP computes it."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class Kernels:
    """The elementwise groups of a block that a caller may fuse: residual add + RMSNorm, and SwiGLU's gating."""

    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


#: Plain torch, transformers' rounding: what the prefill runs, and the fused kernels' fallback.
TORCH = Kernels(add_rms_norm, silu_mul)


class LlamaBlock:
    """One transformers Llama-family decoder layer (seen through pruning gates), run by the forward written here.

    Args:
        layer: a ``LlamaDecoderLayer`` or one of the same shape (``self_attn.{q,k,v,o}_proj``, optional
            ``q_norm``/``k_norm``, ``input_layernorm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``).
        kernels: the residual-add + RMSNorm and SwiGLU implementations (default: plain torch).
    """

    @staticmethod
    def fits(layer: torch.nn.Module) -> bool:
        """Whether ``layer`` has this block's shape: Llama attention and a SwiGLU MLP with SiLU."""
        attn, mlp = unwrap(layer.self_attn), unwrap(layer.mlp)
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm")):
            return False
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return False
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        return getattr(getattr(mlp, "config", None), "hidden_act", "silu") == "silu"

    def __init__(self, layer: torch.nn.Module, kernels: Kernels = TORCH) -> None:
        self.attn, self.mlp = unwrap(layer.self_attn), unwrap(layer.mlp)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.kernels = kernels
        self.head_dim: int = self.attn.head_dim
        self.scaling: float = self.attn.scaling
        self.kv_heads: int = self.attn.k_proj.out_features // self.head_dim

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, Hq, D], k and v [B, T, Hkv, D] of normed hidden states ``h`` [B, T, hidden], before RoPE."""
        b, t, _ = h.shape
        d = self.head_dim
        q = self.attn.q_proj(h).view(b, t, -1, d)
        k = self.attn.k_proj(h).view(b, t, -1, d)
        v = self.attn.v_proj(h).view(b, t, -1, d)
        if hasattr(self.attn, "q_norm"):  # Qwen3-style per-head norms, before RoPE
            q, k = self.attn.q_norm(q), self.attn.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, attention: Attention, skip_mlp: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on the residual stream ``x + delta`` [B, T, hidden]; returns the stream after it as
        ``(x, delta)``. ``skip_mlp`` leaves the MLP out (the residual passes through)."""
        add_norm = self.kernels.add_rms_norm
        h, x = add_norm(x, delta, self.input_norm.weight, norm_eps(self.input_norm))
        out = attention(*self.project(h))
        delta = self.attn.o_proj(out.flatten(2))
        if skip_mlp:
            return x, delta
        h, x = add_norm(x, delta, self.post_norm.weight, norm_eps(self.post_norm))
        mlp = self.mlp
        return x, mlp.down_proj(self.kernels.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))

    def __call__(self, x: torch.Tensor, attention: Attention) -> torch.Tensor:
        """The layer's output hidden states for input ``x`` [B, T, hidden]."""
        x, delta = self.forward(x, None, attention)
        return x + delta
