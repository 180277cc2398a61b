"""One-token decode attention that reads the association tier's packed codes as they are (the CPU fast path).

Dequantising the association tier every step (``AssociationStore.dequantize_into`` then SDPA) costs more on a CPU
than attending over the full bf16 cache does, because each code is expanded, scaled and shifted into a bf16 buffer
before attention reads it again. Here the scales and zeros are folded into the query (keys) and the attention
weights (values) instead, so the codes are only ever converted to float, never rescaled:

* keys are quantised per channel over groups of tokens: ``k[t, c] = s[g, c] * code[t, c] + z[g, c]``, so
  ``q . k[t] = sum_c (q[c] * s[g, c]) * code[t, c] + q . z[g]``: one small matmul per token group;
* values are quantised per token over groups of channels: ``sum_t p[t] * v[t, c] = sum_t (p[t] * s[t, cg]) *
  code[t, c] + sum_t p[t] * z[t, cg]``.

The packed bytes are not unpacked either. A byte ``b`` holds ``8 // bits`` codes ``c_k`` (``c_k`` at bit
``k * bits``); its shifted planes ``P_k = b >> (k * bits)`` satisfy ``c_k = P_k - 2**bits * P_{k+1}``, so a weighted
sum of codes is a weighted sum of planes with weights ``w_k - 2**bits * w_{k-1}``. Each plane is one shift and one
float conversion, no mask, no interleave.

The maths is float32 end to end; it equals the dequantise-then-attend reference to float32 rounding (tests: 1e-4,
1e-3 at 2 bits, where the unmasked planes reach 255 before the shifts cancel). The
differential encoding (per-page anchors) is not folded: those tiers take the dequantising path.

Eight-bit codes (the default) are the exception: a byte is one code, there are no planes to save, and the folded keys
cost one small matmul per group of 32 tokens (216 of them at 7K tokens) while dequantising into float32 is one
conversion and one multiply-add over the tier. On two AMD EPYC cores, one layer of the embedded model over 6,912
association tokens: keys 644 us folded against ~200 dequantised (plus one matmul), values 1,101 against ~180. So an
8-bit tier (keys or values, each on its own) is dequantised into float32 and attended with one matmul: exactly the
reference's arithmetic. (Dequantising into bf16 instead takes 8 ms there: bf16 elementwise maths is slow on CPUs.)
Where numba is installed (a dependency) an 8-bit tier skips even that copy: :mod:`runtime.kv.code_kernels` reads
the codes in place with the scales folded as above (keys ~130-190 us, values ~230 on the same layer), and its
``step`` takes the whole one-token attention (codes, exact core, softmax) in one launch (:func:`code_attention`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from docfuse.runtime.citations import record_forward
from docfuse.runtime.kv.association import AssociationStore
from docfuse.runtime.llama_block import causal_attention


def supports(assoc: AssociationStore | None) -> bool:
    """Whether :func:`code_attention` can read this tier directly (any bits, not differential, KIVI layout)."""
    if assoc is None or assoc.length == 0:
        return True
    return assoc.anchor_index is None and assoc.keys.per_channel and not assoc.values.per_channel


def _planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Float planes ``[..., per * bytes]`` (plane-major) of packed bytes ``[..., bytes]``: plane k is
    ``byte >> (k * bits)``, not masked (see the module docstring)."""
    per = 8 // bits
    if per == 1:
        return codes.float()
    return torch.cat([codes] + [codes >> (k * bits) for k in range(1, per)], dim=-1).float()


def _plane_weights(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Weights per code ``[..., bytes, per]`` -> weights per plane ``[..., per, bytes]``: ``w_k - 2**bits w_{k-1}``."""
    out = w.transpose(-1, -2).contiguous()
    if out.shape[-2] > 1:
        out[..., 1:, :] -= float(1 << bits) * w.transpose(-1, -2)[..., :-1, :]
    return out


def _codes_from_planes(a: torch.Tensor, bits: int) -> torch.Tensor:
    """Sums over planes ``[..., per, bytes]`` -> sums over codes ``[..., bytes, per]``: ``A_k - 2**bits A_{k+1}``."""
    if a.shape[-2] > 1:
        a = a.clone()
        a[..., :-1, :] -= float(1 << bits) * a[..., 1:, :]
    return a.transpose(-1, -2)


def _code_kernels():
    """:mod:`runtime.kv.code_kernels`, imported at the first 8-bit step on a CPU: numba takes 0.1-0.5 s to import,
    which a run without a tiered cache (``kv: null``, the default) should not pay at start-up."""
    from docfuse.runtime.kv import code_kernels

    return code_kernels


def association_scores(qg: torch.Tensor, assoc: AssociationStore) -> torch.Tensor:
    """Scaled scores ``[B, H, r, n]`` of grouped queries ``qg`` [B, H, r, D] over the association keys (8-bit keys:
    read in place by :mod:`runtime.kv.code_kernels` on a CPU, else dequantised in float32 for one matmul; see the
    module docstring)."""
    keys = assoc.keys
    if keys.bits == 8:
        if qg.device.type == "cpu" and _code_kernels().available():
            return _code_kernels().scores(qg, keys)
        return torch.matmul(qg, keys.dequantize(torch.float32).transpose(-1, -2))
    b, h, r, d = qg.shape
    per, g = 8 // keys.bits, keys.group
    groups = keys.codes.shape[2] // g
    planes = _planes(keys.codes, keys.bits).view(b, h, groups, g, d)  # [B, H, G, g, per * bytes]
    w = qg.unsqueeze(2) * keys.scale.float()  # [B, H, G, r, D]: the query with each group's channel scales
    w = _plane_weights(w.view(b, h, groups, r, d // per, per), keys.bits).view(b, h, groups, r, d)
    scores = torch.matmul(w, planes.transpose(-1, -2))  # [B, H, G, r, g]
    scores += torch.matmul(qg, keys.zero.float().squeeze(3).transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
    return scores.transpose(2, 3).reshape(b, h, r, groups * g)[..., : keys.length]


def association_values(p: torch.Tensor, assoc: AssociationStore) -> torch.Tensor:
    """``sum_t p[t] * v[t]`` [B, H, r, D] for attention weights ``p`` [B, H, r, n] over the association values
    (8-bit values: as the keys of :func:`association_scores`)."""
    values = assoc.values
    if values.bits == 8:
        if p.device.type == "cpu" and _code_kernels().available():
            return _code_kernels().values(p, values)
        return torch.matmul(p, values.dequantize(torch.float32))
    b, h, r, n = p.shape
    per, vg = 8 // values.bits, values.group
    d = values.codes.shape[-1] * per
    cg, vb = d // vg, vg // per  # channel groups; bytes per group
    scale, zero = values.scale.float()[..., 0], values.zero.float()[..., 0]  # [B, H, n, CG]
    weighted = (p.unsqueeze(-1) * scale.unsqueeze(2)).permute(0, 1, 4, 2, 3)  # [B, H, CG, r, n], fp32
    grouped = values.codes.view(b, h, n, cg, vb).transpose(2, 3)  # [B, H, CG, n, bytes of the group]
    planes = _planes(grouped, values.bits).view(b, h, cg, n, vg)  # [B, H, CG, n, per * bytes]
    sums = torch.matmul(weighted, planes).view(b, h, cg, r, per, vb)  # over planes
    sums = _codes_from_planes(sums, values.bits).reshape(b, h, cg, r, vg)  # over codes, channel order
    sums += torch.matmul(p, zero).transpose(2, 3).unsqueeze(-1)  # the zero points, [B, H, CG, r, 1]
    return sums.permute(0, 1, 3, 2, 4).reshape(b, h, r, d)


def code_attention(q: torch.Tensor, core_k: torch.Tensor, core_v: torch.Tensor, n_core: int,
                   assoc: AssociationStore | None, scale: float) -> torch.Tensor:
    """Attention of one query token per head over ``[association codes, core[:n_core]]``, float32.

    Args:
        q: ``[B, Hq, D]`` queries (post-RoPE); ``Hq`` a multiple of the KV heads (GQA).
        core_k, core_v: ``[B, Hkv, >=n_core, D]`` exact core tier.
        assoc: the packed association tier (``supports(assoc)`` must hold), or ``None``; its ``hidden`` positions
            (fixed codes) are left out.
    Returns: ``[B, Hq, D]`` float32, what ``runtime.gpu.reference.tiered_decode_reference`` computes.
    """
    b, hq, d = q.shape
    h = core_k.shape[1]
    r = hq // h
    qg = q.float().view(b, h, r, d) * scale
    n_assoc = assoc.length if assoc is not None else 0
    if n_assoc and q.device.type == "cpu" and _code_kernels().fuses(core_k, assoc):
        return _code_kernels().step(qg, core_k, core_v, n_core, assoc).view(b, hq, d)
    scores = torch.matmul(qg, core_k[:, :, :n_core].float().transpose(-1, -2))  # [B, H, r, n_core]
    if n_assoc:
        codes = association_scores(qg, assoc)
        if assoc.hidden is not None:  # fixed codes: positions the core holds exactly take no weight here
            codes.masked_fill_(assoc.hidden.unsqueeze(2), float("-inf"))
        scores = torch.cat([codes, scores], dim=-1)
    p = scores.softmax(dim=-1)
    out = torch.matmul(p[..., n_assoc:], core_v[:, :, :n_core].float())
    if n_assoc:
        out += association_values(p[..., :n_assoc], assoc)
    return out.view(b, hq, d)


# ---- wiring into transformers' attention ----------------------------------------------------------------------------
#: Name under which :func:`attention_forward` is registered with transformers (``register``).
ATTN_NAME = "docfuse_codes"

_handover = threading.local()  # layer_idx -> the layer whose one-token update awaits its attention call
_unpadded = threading.local()  # .on: this thread's passes are one unpadded sequence over its cache (unpadded_causal)

#: Whether :func:`grouped_sdpa` (``causal=True``) takes the mask-free path on an accelerator; the GPU benches turn it
#: off to measure the masked anchor in the same run.
MASK_FREE_ON_ACCELERATORS = True


def hand_over(layer: Any) -> None:
    """Called by ``TieredLayer.update``: the next attention call of this layer reads its tiers directly."""
    if not hasattr(_handover, "layers"):
        _handover.layers = {}
    _handover.layers[layer.layer_idx] = layer


def take(layer_idx: int) -> Any:
    """The layer handed over for ``layer_idx`` (once), or ``None``."""
    return getattr(_handover, "layers", {}).pop(layer_idx, None)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs: Any
                      ) -> tuple[torch.Tensor, None]:
    """transformers attention function: the handed-over layer's own ``decode_attention`` for a one-token step
    (``TieredLayer``: :func:`code_attention`; ``runtime.gpu.KernelTieredLayer``: the Triton kernel), else SDPA
    (which also feeds ``runtime.citations`` while it records an answer's attention).

    The handed-over path applies no mask: it serves unpadded decoding (``Session``), where a one-token step may
    see every cached token.
    """
    layer = take(getattr(module, "layer_idx", -1))
    if layer is not None and query.shape[2] == 1:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return layer.decode_attention(query, scale), None
    record_forward(module, query, key)
    return sdpa_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs: Any
                 ) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except where a plain call (no dropout, soft-capping or position bias) has a
    faster way:

    * inside :func:`unpadded_causal` (no mask was built): the bottom-right causal diagonal, applied by the kernel;
    * one bf16 token on the CPU: :func:`one_token_attention`;
    * a masked pass of several tokens on the CPU: grouped-query K/V heads read in place (``enable_gqa``) instead of
      each KV head copied for every query head it serves. transformers copies them whenever a mask is given (a
      question read over a document, a prefill chunk), because CUDA's fused kernels do not take a mask with grouped
      heads; PyTorch's CPU kernel does, and gives the same numbers bit for bit (tests/test_code_attention.py),
      1.3-1.7x faster for a question's 20-64 tokens over 7K."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = not kwargs.get("dropout") and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    tokens, on_cpu = query.shape[2], query.device.type == "cpu"
    if plain and attention_mask is None and tokens > 1 and getattr(_unpadded, "on", False):
        # inside unpadded_causal the mask builder made no mask: every cached token is visible, the new ones causal
        return causal_attention(query, key, value, scaling).transpose(1, 2).contiguous(), None
    if plain and attention_mask is None and tokens == 1 and on_cpu and query.dtype == torch.bfloat16:
        return one_token_attention(query, key, value, scaling), None
    if (plain and attention_mask is not None and tokens > 1 and on_cpu and attention_mask.dtype == torch.bool
            and getattr(module, "num_key_value_groups", 1) > 1):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def one_token_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
                        ) -> torch.Tensor:
    """One query token per head [B, Hq, 1, D] over every key [B, Hkv, S, D] (grouped heads read in place), in two
    bf16 matmuls and a float32 softmax; -> [B, 1, Hq, D] as transformers' attention returns it.

    Why: on a CPU whose bf16 support is AVX512-BF16 without AMX, PyTorch's SDPA kernel decodes one bf16 token over
    7.3K keys in 4.4 ms a layer where these matmuls (oneDNN) take 0.36-0.42 ms (fp32 SDPA: 0.95 ms); the embedded
    model decodes 3x faster at 7K (bench/RESULTS.md, issue 29). The scores are rounded to bf16 once before the
    softmax, as the values' weights are after it: about one bf16 step in the output."""
    b, hq, _, d = query.shape
    h = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    scores = torch.matmul(query.view(b, h, hq // h, d), key.transpose(-1, -2)).float() * scale
    out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)  # [B, Hkv, r, D]
    return out.view(b, 1, hq, d)


def register() -> str:
    """Register :func:`attention_forward` (with SDPA's mask builder) as :data:`ATTN_NAME`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        # inside unpadded_causal no mask is built: the attention applies the bottom-right causal diagonal itself
        return None if getattr(_unpadded, "on", False) else sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, mask)
    return ATTN_NAME


_swaps: dict[int, list] = {}  # id(model config) -> [sessions inside reading_codes, the implementation to restore]
_swaps_lock = threading.Lock()


@contextlib.contextmanager
def swapped_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Inside: the model's attention is :func:`attention_forward` (for a model on SDPA; yields whether it is on).

    The swap is counted per model config, so decodes in threads may overlap: the model's own attention comes back
    when the last one inside ends."""
    config = model.config
    with _swaps_lock:
        swap = _swaps.get(id(config))
        on = swap is not None or config._attn_implementation == "sdpa"
        if on:
            if swap is None:
                swap = _swaps[id(config)] = [0, config._attn_implementation]
                config._attn_implementation = register()
            swap[0] += 1
    try:
        yield on
    finally:
        if on:
            with _swaps_lock:
                swap[0] -= 1
                if swap[0] == 0:
                    config._attn_implementation = swap[1]
                    del _swaps[id(config)]


@contextlib.contextmanager
def unpadded_causal(model: torch.nn.Module) -> Iterator[bool]:
    """Inside, in this thread: the model's passes are one unpadded sequence over its cache (batch 1, no attention
    mask given), so every cached token is visible and the new tokens are causal among themselves. No ``T x S`` mask
    is built; attention applies that bottom-right causal diagonal itself (``llama_block.causal_attention``: flash
    attention on a GPU). Yields whether it is on (a model on SDPA).

    Why: with a mask, a prefill chunk over a cache or a question over a document takes CUDA's masked kernels
    (cuDNN, which builds a plan for every new shape, ~0.6 s the first time: bench/RESULTS.md, issue 23) over every
    key, where flash attention skips the blocks above the diagonal. Not for a pass that brings its own mask
    (``read_questions``) or a padded batch."""
    with swapped_attention(model) as on:
        previous = getattr(_unpadded, "on", False)
        _unpadded.on = on
        try:
            yield on
        finally:
            _unpadded.on = previous


def _mask_free(param: torch.Tensor) -> bool:
    """Whether unpadded passes on this parameter's device build no mask: on an accelerator (the CPU keeps its masked
    read of grouped heads in place, whose numbers tests hold bit for bit to transformers')."""
    return param.device.type != "cpu" and MASK_FREE_ON_ACCELERATORS


@contextlib.contextmanager
def grouped_sdpa(model: torch.nn.Module, causal: bool = False) -> Iterator[None]:
    """Inside: a model on the CPU reads grouped-query K/V heads in place in masked passes (:func:`sdpa_forward`,
    the same numbers as transformers' SDPA). ``causal``: the caller's passes are one unpadded sequence over its
    cache, and on an accelerator they build no mask (:func:`unpadded_causal`); otherwise nothing changes there."""
    param = next(model.parameters(), None)
    if param is not None and causal and _mask_free(param):
        with unpadded_causal(model):
            yield
    elif param is not None and param.device.type == "cpu":
        with swapped_attention(model):
            yield
    else:
        yield


@contextlib.contextmanager
def reading_codes(model: torch.nn.Module, cache: Any) -> Iterator[bool]:
    """Inside: one-token steps of ``cache`` (a TieredCache) attend to the packed codes directly.

    Only for a model on SDPA (its attention is swapped for :func:`attention_forward`, which falls back to SDPA for
    everything else) and unpadded batches; yields whether it is on.
    """
    if not hasattr(cache, "layers"):
        yield False
        return
    with swapped_attention(model) as on:
        if on:
            for layer in cache.layers:
                layer.read_codes = True
        try:
            yield on
        finally:
            if on:
                for layer in cache.layers:
                    layer.read_codes = False
                getattr(_handover, "layers", {}).clear()
