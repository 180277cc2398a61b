"""Labels for the decision head: what skipping one block at one decode step costs, for every token of a window.

At a decode step the cache holds the dense history, and a skipped block changes only the current token's residual
stream. Replaying that step by step costs one forward per (token, block). Instead, one teacher-forced pass of a
window keeps every layer's dense K/V, and an *ablated stream* is run beside it: at each layer its queries attend to
the dense keys of earlier positions plus its own key at the current position. That is exactly the decode step with
a dense history, for all positions of the window at once, so one pass per block labels every token
(``tests/test_pruning.py`` checks it against real decode-step ablation).

Llama-family decoders only: each layer runs :class:`~runtime.llama_block.LlamaBlock` (the block the prefill and the
decode step run) with a two-stream attention hook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from docfuse.runtime.llama_block import LlamaBlock, rope, unwrap


def blocks_of(num_layers: int) -> list[tuple[str, int]]:
    """Every skippable block in model order: ``("attn", 0), ("mlp", 0), ("attn", 1), ...``; the head's output order."""
    return [(kind, i) for i in range(num_layers) for kind in ("attn", "mlp")]


@dataclass
class DenseTrace:
    """One window's dense pass: each layer's input residual, its residual after attention, and its K/V."""

    residual_in: list[torch.Tensor]  # [T, hidden] entering layer l; index L is the final residual
    after_attn: list[torch.Tensor]  # [T, hidden] after layer l's attention block
    keys: list[torch.Tensor]  # [KVH, T, D] after RoPE
    values: list[torch.Tensor]
    log_probs: torch.Tensor  # [T, vocab] float32
    cos: torch.Tensor
    sin: torch.Tensor


def _two_stream_attention(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor, k_hist: torch.Tensor,
                          v_hist: torch.Tensor, scaling: float) -> torch.Tensor:
    """Position t attends to the history's positions < t and to its own (k_self, v_self) at t. Returns [T, H*D]."""
    h, t, d = q.shape
    kvh = k_hist.shape[0]
    qg = q.view(kvh, h // kvh, t, d).float()
    hist = torch.einsum("kgtd,ksd->kgts", qg, k_hist.float()) * scaling
    earlier = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
    hist = hist.masked_fill(~earlier, float("-inf"))
    own = torch.einsum("kgtd,ktd->kgt", qg, k_self.float()).unsqueeze(-1) * scaling
    weights = torch.softmax(torch.cat([hist, own], dim=-1), dim=-1)
    out = torch.einsum("kgts,ksd->kgtd", weights[..., :t], v_hist.float())
    out = out + weights[..., t:] * v_self.float().unsqueeze(1)
    return out.to(q.dtype).reshape(h, t, d).transpose(0, 1).reshape(t, h * d)


class _TwoStream:
    """The ablated stream's attention hook (a :data:`~runtime.llama_block.Attention`) over one window [T] (batch 1).

    It rotates q and k at the window's positions, keeps the stream's own K/V (``keys``, ``values`` [KVH, T, D]) and
    attends with :func:`_two_stream_attention` over ``history`` (the dense pass's K/V of this layer) or, for the
    dense pass itself, over its own.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, scaling: float,
                 history: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.cos, self.sin = cos[None, None], sin[None, None]  # [T, D] -> [1, 1, T, D]
        self.scaling, self.history = scaling, history
        self.keys = self.values = torch.empty(0)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, d = q.shape[1], q.shape[3]
        q = rope(q.transpose(1, 2), self.cos, self.sin)[0]
        self.keys = rope(k.transpose(1, 2), self.cos, self.sin)[0]
        self.values = v.transpose(1, 2)[0]
        k_hist, v_hist = self.history or (self.keys, self.values)
        out = _two_stream_attention(q, self.keys, self.values, k_hist, v_hist, self.scaling)
        return out.view(1, t, -1, d)


def _finish(model: torch.nn.Module, residual: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model.lm_head(model.model.norm(residual)).float(), dim=-1)


@torch.no_grad()
def dense_trace(model: torch.nn.Module, ids: torch.Tensor) -> DenseTrace:
    """Run ``ids`` [T] through the decoder layer by layer, keeping what the ablated streams reuse."""
    inner = model.model
    positions = torch.arange(len(ids), device=ids.device).unsqueeze(0)
    h = inner.embed_tokens(ids.unsqueeze(0))
    cos, sin = (x[0] for x in inner.rotary_emb(h, positions))
    h = h[0]
    trace = DenseTrace([], [], [], [], torch.empty(0), cos, sin)
    for layer in inner.layers:
        block = LlamaBlock(layer)
        trace.residual_in.append(h)
        # the same arithmetic as the ablated streams, so a block whose skip changes nothing costs exactly 0
        attend = _TwoStream(cos, sin, block.scaling)
        after_attn, mlp_out = block.forward(h[None], None, attend)  # the stream is (after attention, MLP's output)
        trace.after_attn.append(after_attn[0])
        trace.keys.append(attend.keys)
        trace.values.append(attend.values)
        h = (after_attn + mlp_out)[0]
    trace.residual_in.append(h)
    trace.log_probs = _finish(model, h)
    return trace


@torch.no_grad()
def ablated_log_probs(model: torch.nn.Module, trace: DenseTrace, block: tuple[str, int] | None) -> torch.Tensor:
    """Next-token log-probs [T, vocab] when ``block`` is skipped at each position alone (history dense).

    ``block=None`` skips nothing: it reproduces the dense pass through the two-stream path (a self-check).
    """
    layers = model.model.layers
    kind, first = block if block is not None else ("none", 0)
    if kind == "attn":  # the block's output is zero; its K/V are the dense ones (same input)
        h = trace.residual_in[first]
        h = h + unwrap(layers[first].mlp)(layers[first].post_attention_layernorm(h))
    elif kind == "mlp":
        h = trace.after_attn[first]
    else:
        h = trace.residual_in[0]
        first = -1
    for i in range(first + 1, len(layers)):
        block = LlamaBlock(layers[i])
        attend = _TwoStream(trace.cos, trace.sin, block.scaling, (trace.keys[i], trace.values[i]))
        x, delta = block.forward(h[None], None, attend)
        h = (x + delta)[0]
    return _finish(model, h)


def kl_and_flip(dense: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(dense || other) in nats, and whether the top-1 token changed."""
    kl = (dense.exp() * (dense - other)).sum(-1).clamp_min(0)
    return kl, dense.argmax(-1) != other.argmax(-1)


@torch.no_grad()
def window_labels(model: torch.nn.Module, ids: torch.Tensor, read_layers: list[int]) -> dict[str, torch.Tensor]:
    """For one window: per (position, block) cost and top-1 flip, and the head's candidate input features.

    Returns ``kl`` [T, 2L] float32, ``flip`` [T, 2L] bool, and ``features_{r}`` [T, hidden] float32: the residual
    stream after layer r (what a head reading layer r sees), for each r in ``read_layers``.
    """
    trace = dense_trace(model, ids)
    blocks = blocks_of(len(model.model.layers))
    kl = torch.empty(len(ids), len(blocks))
    flip = torch.empty(len(ids), len(blocks), dtype=torch.bool)
    for j, block in enumerate(blocks):
        kl[:, j], flip[:, j] = kl_and_flip(trace.log_probs, ablated_log_probs(model, trace, block))
    out = {"kl": kl, "flip": flip}
    for r in read_layers:
        out[f"features_{r}"] = trace.residual_in[r + 1].float().cpu()
    return out
