"""The small per-layer operations of a decode step, each one Triton kernel on CUDA and the same math in torch elsewhere.

At batch 1 the matrix-vector products of an 8B decoder read their weights near the memory bandwidth, but what sits
between them (RMSNorm's six elementwise kernels, RoPE's dozen, the cache write, SiLU times up, the split merge of
the attention kernel) is some forty tiny launches a layer, each costing a few microseconds even inside a CUDA graph:
milliseconds a token. Each function here does one of those groups in a single kernel.

Rounding follows transformers' Llama modules where it is visible: the residual sum is rounded to the model dtype
before it is normalised, RMSNorm rounds the normalised row before scaling it by its weight, SiLU's output is rounded
before the product. RoPE is computed in float32 and rounded once (transformers rounds each of its three bf16 ops),
a difference well inside bf16 tolerance.

Every function takes the torch path when its inputs are not on CUDA or Triton is missing, so CPU tests run the same
wiring; ``TRITON_INTERPRET=1`` runs the kernels themselves on CPU.
"""

from __future__ import annotations

import os

import torch

from docfuse.runtime import llama_block
from docfuse.runtime.gpu.triton_support import HAS_TRITON, tl, triton


def _use_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ---------------------------------------------------------------- residual add + RMSNorm

def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + delta`` (rounded to x's dtype; ``delta=None``: x itself) and its RMSNorm times ``weight``.

    Returns ``(normed, residual)``, both shaped like ``x`` ``[..., hidden]``.
    """
    if not _use_triton(x):
        return llama_block.add_rms_norm(x, delta, weight, eps)
    n = x.shape[-1]
    rows = x.numel() // n
    x2 = x.reshape(rows, n)
    out = torch.empty_like(x2)
    res = torch.empty_like(x2) if delta is not None else x2
    _rms_kernel[(rows,)](x2, delta.reshape(rows, n) if delta is not None else x2, weight, out, res, n, eps,
                         HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n), num_warps=8)
    return out.view(x.shape), res.view(x.shape)


# ---------------------------------------------------------------- RoPE on q and k, k and v written into the core

def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, D] rotated by ``cos``/``sin`` [B, D] in float32, rounded once to x's dtype (the kernel's math)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    return (x.float() * c + torch.cat([-x2, x1], dim=-1) * s).to(x.dtype)


def _rope_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 dest_k: torch.Tensor, dest_v: torch.Tensor, slot: torch.Tensor, s_b: int, s_h: int, s_t: int,
                 row_slots: bool) -> torch.Tensor:
    """The RoPE kernel: rotated q back, rotated k and v written at ``slot`` (one, or one per row) of ``dest_k``/``v``
    addressed by strides (batch, head, token)."""
    assert dest_k.stride() == dest_v.stride() and dest_k.stride(-1) == 1, "K and V must share one layout"
    b, hq, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    _rope_kernel[(b, hq + k.shape[1])](q, k, v, cos, sin, cos.stride(0), out, dest_k, dest_v, slot, s_b, s_h, s_t,
                                       hq, k.shape[1], HALF=d // 2, ROW_SLOTS=row_slots, num_warps=1)
    return out


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               core_k: torch.Tensor, core_v: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Rotate ``q`` [B, Hq, D] and ``k`` [B, Hkv, D] by ``cos``/``sin`` [B or 1, D] (transformers' rotate-half
    convention); write the rotated ``k`` and ``v`` at core index ``slot`` (device long [1]) of ``core_k``/``core_v``
    [B, Hkv, capacity, D]. Returns the rotated ``q``."""
    b, _, d = q.shape
    cos, sin = cos.expand(b, d), sin.expand(b, d)
    if not _use_triton(q):
        core_k.index_copy_(2, slot, _rotate(k, cos, sin).unsqueeze(2))
        core_v.index_copy_(2, slot, v.unsqueeze(2))
        return _rotate(q, cos, sin)
    return _rope_launch(q, k, v, cos, sin, core_k, core_v, slot, core_k.stride(0), core_k.stride(1),
                        core_k.stride(2), row_slots=False)


def rope_write_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`rope_write` for a paged pool (runtime.engine.pool): ``cos``/``sin`` [B, D] per batch row, and row ``b``'s
    rotated ``k`` and ``v`` go to pool row ``rows[b]`` (device long [B]) of ``pool_k``/``pool_v`` [rows, Hkv, D]."""
    b, _, d = q.shape
    cos, sin = cos.expand(b, d), sin.expand(b, d)
    if not _use_triton(q):
        pool_k.index_copy_(0, rows, _rotate(k, cos, sin).to(pool_k.dtype))
        pool_v.index_copy_(0, rows, v.to(pool_v.dtype))
        return _rotate(q, cos, sin)
    return _rope_launch(q, k, v, cos, sin, pool_k, pool_v, rows, 0, pool_k.stride(1), pool_k.stride(0),
                        row_slots=True)


# ---------------------------------------------------------------- SiLU(gate) * up

def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as a LlamaMLP computes it (SiLU rounded to the dtype first)."""
    if not _use_triton(gate):
        return llama_block.silu_mul(gate, up)
    n = gate.numel()
    out = torch.empty_like(gate)
    block = 2048
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate.contiguous(), up.contiguous(), out, n, BLOCK=block, num_warps=4)
    return out


# ---------------------------------------------------------------- merge of flash-decoding splits

def combine_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge per-split partial softmax results: ``m``, ``l`` [B, Hq, S] (log2 domain), ``acc`` [B, Hq, S, D]
    -> [B, Hq, D] in ``dtype``. A split that saw no token has ``m = -inf`` and weighs nothing."""
    if not _use_triton(m):
        top = m.amax(dim=-1, keepdim=True)
        w = torch.exp2(m - top)
        return ((acc * w.unsqueeze(-1)).sum(dim=2) / (l * w).sum(dim=-1, keepdim=True)).to(dtype)
    b, hq, s, d = acc.shape
    out = torch.empty(b, hq, d, dtype=dtype, device=m.device)
    _combine_kernel[(b * hq,)](m, l, acc, out, s, D=d, BLOCK_S=triton.next_power_of_2(s), CHUNK=16, num_warps=4)
    return out


if HAS_TRITON:

    @triton.jit
    def _rms_kernel(X, DELTA, W, OUT, RES, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(X + row * n + offs, mask=ok, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(DELTA + row * n + offs, mask=ok, other=0.0).to(tl.float32)).to(
                X.dtype.element_ty)
            tl.store(RES + row * n + offs, x, mask=ok)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
        normed = (h * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + row * n + offs, (w * normed).to(X.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_kernel(Q, K, V, COS, SIN, s_cos, QOUT, CK, CV, SLOT, s_cb, s_ch, s_ct, hq, hkv,
                     HALF: tl.constexpr, ROW_SLOTS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        c1 = tl.load(COS + b * s_cos + i).to(tl.float32)
        c2 = tl.load(COS + b * s_cos + HALF + i).to(tl.float32)
        s1 = tl.load(SIN + b * s_cos + i).to(tl.float32)
        s2 = tl.load(SIN + b * s_cos + HALF + i).to(tl.float32)
        if h < hq:
            src = Q + (b * hq + h) * 2 * HALF
            x1 = tl.load(src + i).to(tl.float32)
            x2 = tl.load(src + HALF + i).to(tl.float32)
            dst = QOUT + (b * hq + h) * 2 * HALF
            tl.store(dst + i, (x1 * c1 - x2 * s1).to(QOUT.dtype.element_ty))
            tl.store(dst + HALF + i, (x2 * c2 + x1 * s2).to(QOUT.dtype.element_ty))
        else:
            hk = h - hq
            src = K + (b * hkv + hk) * 2 * HALF
            x1 = tl.load(src + i).to(tl.float32)
            x2 = tl.load(src + HALF + i).to(tl.float32)
            if ROW_SLOTS:  # a paged pool: each batch row writes its own row
                slot = tl.load(SLOT + b)
            else:
                slot = tl.load(SLOT)
            off = b * s_cb + hk * s_ch + slot * s_ct
            tl.store(CK + off + i, (x1 * c1 - x2 * s1).to(CK.dtype.element_ty))
            tl.store(CK + off + HALF + i, (x2 * c2 + x1 * s2).to(CK.dtype.element_ty))
            vsrc = V + (b * hkv + hk) * 2 * HALF
            tl.store(CV + off + i, tl.load(vsrc + i))
            tl.store(CV + off + HALF + i, tl.load(vsrc + HALF + i))

    @triton.jit
    def _silu_mul_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
        tl.store(OUT + offs, (act * u).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_kernel(M, L, ACC, OUT, s, D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, BLOCK_S)
        m = tl.load(M + row * s + j, mask=j < s, other=float("-inf"))
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(m - top)
        denom = tl.sum(tl.load(L + row * s + j, mask=j < s, other=0.0) * w, 0)
        d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        c = tl.arange(0, CHUNK)
        for start in tl.range(0, s, CHUNK):
            idx = start + c
            ok = idx < s
            wc = tl.exp2(tl.load(M + row * s + idx, mask=ok, other=float("-inf")) - top)
            part = tl.load(ACC + (row * s + idx)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            acc += tl.sum(part * wc[:, None], 0)
        tl.store(OUT + row * D + d, (acc / denom).to(OUT.dtype.element_ty))
