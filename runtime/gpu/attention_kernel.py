"""Triton decode attention that reads the core tier in model precision and the 4-bit association tier packed.

One program per (batch row, KV head, split of the tokens): it loads the GQA group's query rows once, walks its share
of the association tier (packed bytes -> two nibbles -> fp16 scale/zero affine, in registers) and of the core tier
(bf16), with an online softmax, and writes a partial (max, sum, weighted values). ``combine_splits`` merges the splits
(flash-decoding, :func:`runtime.gpu.fused_ops.combine_splits`). No dequantised copy of the association tier ever exists in device memory.

Layouts are those of :mod:`runtime.kv.quant`: key codes ``[B, H, T_pad, D/2]`` with per-channel scale/zero per block
of ``group`` tokens ``[B, H, T_pad/group, 1, D]``; value codes ``[B, H, T, D/2]`` with per-token scale/zero per
group of 32 channels ``[B, H, T, D/32, 1]``; byte ``j`` holds channel ``2j`` in its low nibble and ``2j+1`` in its high.
"""

from __future__ import annotations

import math
import os

import torch

from docfuse.runtime.kv.association import AssociationStore

from docfuse.runtime.gpu.fused_ops import combine_splits
from docfuse.runtime.gpu.triton_support import HAS_TRITON, tl, triton

LOG2E = 1.4426950408889634

#: Launch configuration (tokens per tile, warps, pipeline stages, compact scale loads); chosen by measurement on an
#: H200 at the 128K tier shapes (see bench/RESULTS.md).
TUNED = {"block_n": 128, "num_warps": 8, "num_stages": 2, "compact": True}
#: Programs per multiprocessor, in units of four (token splits grow with it).
SPLIT_SCALE = 1.0


def _dot_dtype():
    """bf16 operands for the tensor cores; float32 under TRITON_INTERPRET (numpy has no bf16), for CPU debugging."""
    return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


def kernel_supports(assoc: AssociationStore | None, head_dim: int) -> bool:
    """Whether the kernel handles this association tier (4-bit, not differential) and head size."""
    if head_dim & (head_dim - 1) or head_dim < 32:
        return False
    if assoc is None or assoc.length == 0:
        return True
    return (assoc.hidden is None and assoc.keys.bits == 4 and assoc.values.bits == 4 and assoc.anchor_index is None and assoc.values.group == 32
            and assoc.keys.per_channel)


if HAS_TRITON:

    @triton.jit
    def _tiered_decode_kernel(
        Q, s_qb, s_qh,
        KC, VC, s_cb, s_ch, s_ct, n_core, NCORE_PTR,
        AKC, s_akb, s_akh, s_akt,
        AKS, AKZ, s_ksb, s_ksh, s_ksg,
        AVC, s_avb, s_avh, s_avt,
        AVS, AVZ, s_vsb, s_vsh, s_vst,
        n_assoc,
        M_OUT, L_OUT, ACC_OUT, n_split, hkv, per_a, per_c,
        qk_scale,
        GQ: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        KGROUP: tl.constexpr, VGROUP: tl.constexpr, DOT: tl.constexpr, DYN_CORE: tl.constexpr,
        COMPACT: tl.constexpr,
    ):
        if DYN_CORE:  # CUDA-graph decode: the core length lives on the device (``per_c`` covers the capacity)
            n_core = tl.load(NCORE_PTR)
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // hkv
        h = pid_bh % hkv
        HALF: tl.constexpr = D // 2
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        j = tl.arange(0, HALF)
        n = tl.arange(0, BLOCK_N)
        g_ok = g < GQ
        q_ptr = Q + b * s_qb + (h * GQ + g)[:, None] * s_qh + d[None, :]
        q = tl.load(q_ptr, mask=g_ok[:, None], other=0.0).to(DOT)  # [BLOCK_G, D]

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)

        # ---- association tier: packed 4-bit codes, dequantised in registers ----
        a_lo = pid_s * per_a
        for start in tl.range(0, per_a, BLOCK_N):
            t = a_lo + start + n
            t_ok = t < n_assoc
            kb = tl.load(AKC + b * s_akb + h * s_akh + t[:, None] * s_akt + j[None, :], mask=t_ok[:, None], other=0)
            kq = tl.reshape(tl.join(kb & 15, kb >> 4), (BLOCK_N, D)).to(tl.float32)
            if COMPACT:  # one scale/zero row per group of KGROUP tokens, broadcast in registers
                gi = (a_lo + start) // KGROUP + tl.arange(0, BLOCK_N // KGROUP)
                g_ok2 = gi < tl.cdiv(n_assoc, KGROUP)
                ks_off = b * s_ksb + h * s_ksh + gi[:, None] * s_ksg + d[None, :]
                k_s = tl.load(AKS + ks_off, mask=g_ok2[:, None], other=0.0).to(tl.float32)
                k_z = tl.load(AKZ + ks_off, mask=g_ok2[:, None], other=0.0).to(tl.float32)
                k3 = tl.reshape(kq, (BLOCK_N // KGROUP, KGROUP, D)) * k_s[:, None, :] + k_z[:, None, :]
                k = tl.reshape(k3, (BLOCK_N, D)).to(DOT)
            else:
                ks_off = b * s_ksb + h * s_ksh + (t // KGROUP)[:, None] * s_ksg + d[None, :]
                k_s = tl.load(AKS + ks_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
                k_z = tl.load(AKZ + ks_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
                k = (kq * k_s + k_z).to(DOT)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N], log2 domain
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no valid token: no NaN
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(AVC + b * s_avb + h * s_avh + t[:, None] * s_avt + j[None, :], mask=t_ok[:, None], other=0)
            vq = tl.reshape(tl.join(vb & 15, vb >> 4), (BLOCK_N, D)).to(tl.float32)
            if COMPACT:  # D // VGROUP scale/zero pairs per token, broadcast over their channels in registers
                vs_off = b * s_vsb + h * s_vsh + t[:, None] * s_vst + tl.arange(0, D // VGROUP)[None, :]
                v_s = tl.load(AVS + vs_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
                v_z = tl.load(AVZ + vs_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
                v3 = tl.reshape(vq, (BLOCK_N, D // VGROUP, VGROUP)) * v_s[:, :, None] + v_z[:, :, None]
                v = tl.reshape(v3, (BLOCK_N, D)).to(DOT)
            else:
                vs_off = b * s_vsb + h * s_vsh + t[:, None] * s_vst + (d // VGROUP)[None, :]
                v_s = tl.load(AVS + vs_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
                v_z = tl.load(AVZ + vs_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
                v = (vq * v_s + v_z).to(DOT)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
            m_i = m_new

        # ---- core tier: exact, model precision ----
        c_lo = pid_s * per_c
        for start in tl.range(0, per_c, BLOCK_N):
            t = c_lo + start + n
            t_ok = t < n_core
            off = b * s_cb + h * s_ch + t[:, None] * s_ct + d[None, :]
            k = tl.load(KC + off, mask=t_ok[:, None], other=0.0).to(DOT)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no valid token: no NaN
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + off, mask=t_ok[:, None], other=0.0).to(DOT)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
            m_i = m_new

        row = (b * hkv * GQ + h * GQ + g) * n_split + pid_s  # [BLOCK_G] index into [B, Hq, S]
        tl.store(M_OUT + row, m_i, mask=g_ok)
        tl.store(L_OUT + row, l_i, mask=g_ok)
        tl.store(ACC_OUT + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None])


def _per_split(tokens: int, splits: int, block_n: int) -> int:
    """Tokens each split walks (a whole number of tiles); the last split masks what lies past the end."""
    return -(-(-(-tokens // splits)) // block_n) * block_n


def default_splits(batch_heads: int, tokens: int, block_n: int, sms: int = 132) -> int:
    """Token splits per (row, KV head): about four programs per multiprocessor, never an empty-only split."""
    want = max(1, int(4 * sms * SPLIT_SCALE) // max(1, batch_heads))
    return max(1, min(want, -(-tokens // (2 * block_n))))


def tiered_decode_attention(q: torch.Tensor, core_k: torch.Tensor, core_v: torch.Tensor, n_core: int,
                            assoc: AssociationStore | None, scale: float, splits: int | None = None,
                            block_n: int | None = None, core_count: torch.Tensor | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            compact: bool | None = None) -> torch.Tensor:
    """Decode attention of ``q`` [B, Hq, D] over ``[association, core[:n_core]]``; returns [B, Hq, D] in q.dtype.

    Same function as :func:`runtime.gpu.reference.tiered_decode_reference`, reading the association codes directly.
    ``core_count`` (int32 device tensor [1]): the core length read on the device, for CUDA graphs; ``n_core`` is
    then the capacity the launch is sized for (splits and tiles stay fixed while the core grows).
    """
    if not HAS_TRITON:
        raise RuntimeError("tiered_decode_attention needs Triton and a CUDA device; use tiered_decode_reference")
    b, hq, dim = q.shape
    hkv = core_k.shape[1]
    block_n = block_n or TUNED["block_n"]
    num_warps = num_warps or TUNED["num_warps"]
    num_stages = num_stages or TUNED["num_stages"]
    compact = TUNED["compact"] if compact is None else compact
    if hq % hkv or not kernel_supports(assoc, dim):
        raise ValueError(f"unsupported shape or tier: Hq={hq}, Hkv={hkv}, D={dim}; use tiered_decode_reference")
    gq = hq // hkv
    n_assoc = assoc.length if assoc is not None else 0
    if n_assoc + n_core == 0:
        raise ValueError("attention over an empty cache")
    for t in (core_k, core_v):
        assert t.stride(-1) == 1, "core tier must be contiguous in the head dimension"
    if n_assoc:
        kc, ks, kz = assoc.keys.codes, assoc.keys.scale, assoc.keys.zero
        vc, vs, vz = assoc.values.codes, assoc.values.scale, assoc.values.zero
        kgroup = assoc.keys.group
        compact = compact and block_n % kgroup == 0
    else:  # dummies, never read (the loop over the association tier is empty)
        kc = vc = torch.empty(1, 1, 1, 1, dtype=torch.uint8, device=q.device)
        ks = kz = torch.empty(1, 1, 1, 1, 1, dtype=torch.float16, device=q.device)
        vs = vz = ks
        kgroup = 32
    kc, vc = kc.contiguous(), vc.contiguous()
    s = splits or default_splits(b * hkv, n_assoc + n_core, block_n)
    m = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(b, hq, s, dim, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    _tiered_decode_kernel[(b * hkv, s)](
        q, q.stride(0), q.stride(1),
        core_k, core_v, core_k.stride(0), core_k.stride(1), core_k.stride(2), n_core,
        core_count if core_count is not None else m,
        kc, kc.stride(0), kc.stride(1), kc.stride(2),
        ks, kz, ks.stride(0), ks.stride(1), ks.stride(2),
        vc, vc.stride(0), vc.stride(1), vc.stride(2),
        vs, vz, vs.stride(0), vs.stride(1), vs.stride(2),
        n_assoc,
        m, l, acc, s, hkv, _per_split(n_assoc, s, block_n), _per_split(n_core, s, block_n),
        scale * LOG2E,
        GQ=gq, BLOCK_G=max(16, triton.next_power_of_2(gq)), BLOCK_N=block_n, D=dim,
        KGROUP=kgroup, VGROUP=32, DOT=_dot_dtype(), DYN_CORE=core_count is not None, COMPACT=compact,
        num_warps=num_warps, num_stages=num_stages,
    )
    return combine_splits(m, l, acc, q.dtype)


def kernel_flops_bytes(b: int, hq: int, hkv: int, d: int, n_core: int, n_assoc: int, elem: int = 2) -> tuple[int, int]:
    """FLOPs and the fewest device bytes one call must read (queries, core, packed codes with scales/zeros)."""
    flops = 4 * b * hq * d * (n_core + n_assoc)
    core = 2 * b * hkv * n_core * d * elem
    assoc = 2 * b * hkv * n_assoc * (d // 2) + b * hkv * n_assoc * 2 * 2 * (d // 32) \
        + b * hkv * math.ceil(n_assoc / 32) * 2 * 2 * d
    return flops, core + assoc + b * hq * d * elem
