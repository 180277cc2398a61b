"""Triton decode attention over paged tiers, ragged: every batch row has its own page tables and token counts.

The engine (:mod:`runtime.engine`) keeps many streams' tiers in one pool of pages (:mod:`runtime.engine.pool`). One
program per (batch row, KV head, split) reads its row's counts from the device, walks its share of the row's
association pages (packed 4- or 8-bit codes, dequantised in registers, as :mod:`runtime.gpu.attention_kernel` does)
and core pages (model precision), with an online softmax, and writes a partial result; ``combine_splits`` merges
the splits. A tile is one page, so a tile's tokens are contiguous rows of the pool. Counts live on the device, so a
captured CUDA graph serves any mix of lengths up to the tables' width; a row's work is its own length, not the
longest row's.
"""

from __future__ import annotations

import os

import torch

from docfuse.runtime.gpu.fused_ops import combine_splits
from docfuse.runtime.gpu.triton_support import HAS_TRITON, tl, triton

LOG2E = 1.4426950408889634


def paged_kernel_supports(head_dim: int, key_bits: int, value_bits: int, page: int, group: int, vgroup: int) -> bool:
    """Whether the kernel handles this layout: a power-of-two head of 32 channels or more, 4- or 8-bit codes."""
    return (head_dim >= 32 and not head_dim & (head_dim - 1) and key_bits in (4, 8) and value_bits in (4, 8)
            and page % group == 0 and vgroup == 32 and page in (32, 64, 128))


def _dot_dtype():
    return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


if HAS_TRITON:

    @triton.jit
    def _codes(ptr, rows, s_t, h, s_h, ok, BITS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr):
        """A page's codes ``[PAGE, D]`` as float32: two 4-bit codes a byte (low nibble first), or one 8-bit code."""
        if BITS == 4:
            j = tl.arange(0, D // 2)
            packed = tl.load(ptr + rows[:, None] * s_t + h * s_h + j[None, :], mask=ok[:, None], other=0)
            return tl.reshape(tl.join(packed & 15, packed >> 4), (PAGE, D)).to(tl.float32)
        d = tl.arange(0, D)
        return tl.load(ptr + rows[:, None] * s_t + h * s_h + d[None, :], mask=ok[:, None], other=0).to(tl.float32)

    @triton.jit
    def _attend_tile(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT: tl.constexpr, PRECISE: tl.constexpr):
        """One tile of the online softmax: keys ``k`` and values ``v`` [PAGE, D] (``ok``: the tile's real tokens)
        folded into the running max ``m_i``, sum ``l_i`` and weighted values ``acc`` of the query rows ``q``."""
        if PRECISE:  # a float32 model: float32 products, as the CPU path computes them
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no valid token: no NaN
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if PRECISE:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
        return m_new, l_i, acc

    @triton.jit
    def _paged_kernel(
        Q, s_qb, s_qh,
        KC, VC, s_ct, s_ch, CT, s_ctb, NC,
        AKC, s_akt, s_akh, AKS, AKZ, s_kst, s_ksh,
        AVC, s_avt, s_avh, AVS, AVZ, s_vst, s_vsh,
        AT, s_atb, NA, MT,
        M_OUT, L_OUT, ACC_OUT, n_split, split_at, splits_out, hkv, qk_scale,
        GQ: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
        KGROUP: tl.constexpr, VGROUP: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, DOT: tl.constexpr,
        PRECISE: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        # program: (table row b, KV head h, split); its query rows are the GQ heads of h of each of the MEMBERS batch
        # rows MT[b] lists (-1: none), so the pages of a table row shared by several streams are read once for all
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // hkv
        h = pid_bh % hkv
        j = tl.arange(0, BLOCK_G)
        member = j // GQ
        g = j % GQ
        d = tl.arange(0, D)
        n = tl.arange(0, PAGE)
        mrow = tl.load(MT + b * MEMBERS + member, mask=member < MEMBERS, other=-1)
        g_ok = (member < MEMBERS) & (mrow >= 0)
        q = tl.load(Q + mrow[:, None] * s_qb + (h * GQ + g)[:, None] * s_qh + d[None, :], mask=g_ok[:, None],
                    other=0.0).to(DOT)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)

        # ---- association pages: packed codes ----
        n_a = tl.load(NA + b)
        pages_a = tl.cdiv(n_a, PAGE)
        per_a = tl.cdiv(pages_a, n_split)
        if PREFETCH:
            nxt = tl.load(AT + b * s_atb + pid_s * per_a, mask=pid_s * per_a < pages_a, other=0)
        for i in tl.range(0, per_a):
            pi = pid_s * per_a + i
            if PREFETCH:  # the next tile's page index loads while this tile computes
                page = nxt
                nxt = tl.load(AT + b * s_atb + pi + 1, mask=pi + 1 < pages_a, other=0)
            else:
                page = tl.load(AT + b * s_atb + pi, mask=pi < pages_a, other=0)
            t = pi * PAGE + n
            t_ok = (t < n_a) & (pi < pages_a)
            rows = page * PAGE + n
            kq = _codes(AKC, rows, s_akt, h, s_akh, t_ok, KBITS, PAGE, D)
            grows = page * (PAGE // KGROUP) + tl.arange(0, PAGE // KGROUP)
            ks_off = grows[:, None] * s_kst + h * s_ksh + d[None, :]
            k_s = tl.load(AKS + ks_off).to(tl.float32)
            k_z = tl.load(AKZ + ks_off).to(tl.float32)
            k3 = tl.reshape(kq, (PAGE // KGROUP, KGROUP, D)) * k_s[:, None, :] + k_z[:, None, :]
            k = tl.reshape(k3, (PAGE, D)).to(DOT)
            vq = _codes(AVC, rows, s_avt, h, s_avh, t_ok, VBITS, PAGE, D)
            vs_off = rows[:, None] * s_vst + h * s_vsh + tl.arange(0, D // VGROUP)[None, :]
            v_s = tl.load(AVS + vs_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
            v_z = tl.load(AVZ + vs_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
            v3 = tl.reshape(vq, (PAGE, D // VGROUP, VGROUP)) * v_s[:, :, None] + v_z[:, :, None]
            v = tl.reshape(v3, (PAGE, D)).to(DOT)
            m_i, l_i, acc = _attend_tile(q, k, v, t_ok, m_i, l_i, acc, qk_scale, DOT, PRECISE)

        # ---- core pages: exact ----
        n_c = tl.load(NC + b)
        pages_c = tl.cdiv(n_c, PAGE)
        per_c = tl.cdiv(pages_c, n_split)
        if PREFETCH:
            nxt = tl.load(CT + b * s_ctb + pid_s * per_c, mask=pid_s * per_c < pages_c, other=0)
        for i in tl.range(0, per_c):
            pi = pid_s * per_c + i
            if PREFETCH:
                page = nxt
                nxt = tl.load(CT + b * s_ctb + pi + 1, mask=pi + 1 < pages_c, other=0)
            else:
                page = tl.load(CT + b * s_ctb + pi, mask=pi < pages_c, other=0)
            t = pi * PAGE + n
            t_ok = (t < n_c) & (pi < pages_c)
            off = (page * PAGE + n)[:, None] * s_ct + h * s_ch + d[None, :]
            k = tl.load(KC + off, mask=t_ok[:, None], other=0.0).to(DOT)
            v = tl.load(VC + off, mask=t_ok[:, None], other=0.0).to(DOT)
            m_i, l_i, acc = _attend_tile(q, k, v, t_ok, m_i, l_i, acc, qk_scale, DOT, PRECISE)

        row = (mrow * hkv * GQ + h * GQ + g) * splits_out + split_at + pid_s
        tl.store(M_OUT + row, m_i, mask=g_ok)
        tl.store(L_OUT + row, l_i, mask=g_ok)
        tl.store(ACC_OUT + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None])


#: Launch settings: ``num_warps`` (None: 8 for pages of 128 tokens or more, else 4), ``num_stages`` (a plain paged
#: launch in 16-bit; a cascade launch, whose query block grows with its members, and a float32 one keep
#: ``SAFE_STAGES``), and ``programs_per_sm``, the programs per multiprocessor the splits aim at. Swept at batch 1 and
#: 132K on an H100 (``bench/experiments/sweep_paged_kernel.py``): 4 stages took 166.7 us a layer alone against 183.3
#: with 2, but the engine's 128K decode did not move (99.6 tok/s against 101.0), so 2 stays.
TUNED: dict[str, int | None] = {"num_warps": None, "num_stages": 2, "programs_per_sm": 4, "prefetch_pages": 0}
SAFE_STAGES = 2


def paged_splits(batch_heads: int, max_pages: int, sms: int | None = None) -> int:
    """Splits per (row, KV head): about ``TUNED["programs_per_sm"]`` programs per multiprocessor, at most one per
    page of the widest row."""
    if sms is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    per_sm = int(TUNED["programs_per_sm"] or 4)
    return max(1, min(max(1, per_sm * sms // max(1, batch_heads)), max_pages))


def paged_decode_attention(q: torch.Tensor, pool, layer: int, core_table: torch.Tensor, n_core: torch.Tensor,
                           assoc_table: torch.Tensor, n_assoc: torch.Tensor, scale: float,
                           splits: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` [B, Hq, D] over each row's association and core pages of ``pool`` (a
    :class:`~runtime.engine.pool.PagePool`) at ``layer``; tables [B, W] int32, counts [B] int32; -> [B, Hq, D].
    ``rows``: :func:`identity_rows` of B, when the caller keeps one (a captured step: no kernel to make it).

    Every row must have at least one token (idle rows point at the scratch page with a count of one or more)."""
    b, hq, dim = q.shape
    m, l, acc = _partials(q, splits)
    q = q.contiguous()
    rows = identity_rows(b, q.device) if rows is None else rows
    _launch(q, pool, layer, core_table, n_core, assoc_table, n_assoc, rows, (m, l, acc), 0, splits, scale)
    return combine_splits(m, l, acc, q.dtype)


def cascade_decode_attention(q: torch.Tensor, pool, layer: int, shared: tuple[torch.Tensor, ...],
                             members: torch.Tensor, own: tuple[torch.Tensor, ...], scale: float,
                             splits: int, own_splits: int = 1, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention where batch rows share pages: the streams of one document's questions
    (``kv.questions: together``) read the same association pages and the same whole core pages.

    ``shared`` = (core table, core counts, association table, association counts) [G, W] / [G] of G table rows,
    ``members`` [G, M] int32 the batch rows that read each table row (-1: none; every batch row in exactly one table
    row), ``own`` = the same four of each batch row's pages past the shared ones [B, W'] / [B] (counts may be 0).
    One program per (table row, KV head, split) reads a shared page once for all its members' query heads (the
    cascade of shared-prefix decoding), a second pass reads each row's own pages, and the splits of both merge per
    row. Equals :func:`paged_decode_attention` over each row's concatenated pages to float rounding. ``rows``: as
    in :func:`paged_decode_attention`."""
    b = q.shape[0]
    m, l, acc = _partials(q, splits + own_splits)
    q = q.contiguous()
    rows = identity_rows(b, q.device) if rows is None else rows
    _launch(q, pool, layer, *shared, members, (m, l, acc), 0, splits, scale)
    _launch(q, pool, layer, *own, rows, (m, l, acc), splits, own_splits, scale)
    return combine_splits(m, l, acc, q.dtype)


def identity_rows(batch: int, device: torch.device) -> torch.Tensor:
    """The member table [B, 1] int32 in which table row ``b`` serves batch row ``b`` alone."""
    return torch.arange(batch, dtype=torch.int32, device=device).unsqueeze(1)


def _partials(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, dim = q.shape
    m = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    return m, torch.empty_like(m), torch.empty(b, hq, splits, dim, dtype=torch.float32, device=q.device)


def _launch(q: torch.Tensor, pool, layer: int, core_table: torch.Tensor, n_core: torch.Tensor,
            assoc_table: torch.Tensor, n_assoc: torch.Tensor, members: torch.Tensor,
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], split_at: int, splits: int, scale: float) -> None:
    """One kernel launch over the table rows of ``core_table``/``assoc_table``, writing splits ``split_at ..
    split_at + splits`` of each member row's partials in ``out``."""
    if not HAS_TRITON:
        raise RuntimeError("paged_decode_attention needs Triton; use runtime.engine.attention's reference path")
    s = pool.shape
    hq, dim = q.shape[1], q.shape[2]
    hkv = s.kv_heads
    gq = hq // hkv
    kc, vc = pool.core_k[layer], pool.core_v[layer]
    akc, aks, akz = pool.key_codes[layer], pool.key_scale[layer], pool.key_zero[layer]
    avc, avs, avz = pool.value_codes[layer], pool.value_scale[layer], pool.value_zero[layer]
    m, l, acc = out
    precise = q.dtype == torch.float32 and os.environ.get("TRITON_INTERPRET") != "1"
    groups, per = members.shape
    _paged_kernel[(groups * hkv, splits)](
        q, q.stride(0), q.stride(1),
        kc, vc, kc.stride(0), kc.stride(1), core_table, core_table.stride(0), n_core,
        akc, akc.stride(0), akc.stride(1), aks, akz, aks.stride(0), aks.stride(1),
        avc, avc.stride(0), avc.stride(1), avs, avz, avs.stride(0), avs.stride(1),
        assoc_table, assoc_table.stride(0), n_assoc, members.contiguous(),
        m, l, acc, splits, split_at, m.shape[2], hkv, scale * LOG2E,
        GQ=gq, MEMBERS=per, BLOCK_G=max(16, triton.next_power_of_2(gq * per)), PAGE=s.page, D=dim,
        KGROUP=s.group, VGROUP=s.vgroup, KBITS=s.key_bits, VBITS=s.value_bits,
        DOT=tl.float32 if precise else _dot_dtype(), PRECISE=precise, PREFETCH=bool(TUNED["prefetch_pages"]),
        num_warps=TUNED["num_warps"] or (8 if s.page >= 128 else 4),
        num_stages=TUNED["num_stages"] if per == 1 and q.dtype != torch.float32 else SAFE_STAGES,
    )
