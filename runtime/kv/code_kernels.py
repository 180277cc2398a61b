"""CPU kernels (numba) that read an 8-bit association tier's codes where they lie, for one decode step.

``code_attention`` dequantises an 8-bit tier into float32 and attends with one matmul: four passes over a float32 copy
four times the codes' size, every layer, every token. These loops read each uint8 code once, convert it in a
register and fold the scales in (keys: into the query, per group of tokens; values: into the attention weight, per
token and channel group), so the tier is read at one byte a value and nothing is written back. The arithmetic is the
same float32 sums as ``code_attention``'s folded form, in another order (tests: 1e-4 of the reference).

``step`` does a layer's whole one-token attention in one launch (association codes and the exact core, read as
stored, bf16 bits included; a softmax per token chunk, the chunks merged by their maxima as flash decoding does),
so no score row, concatenation or float copy of the core is made; ``scores`` and ``values`` stay for A/B
(``DOCFUSE_CODE_KERNELS=split``).

numba is a dependency of docfuse; where it cannot be imported (or ``DOCFUSE_CODE_KERNELS=0``), ``available()`` is
False and ``code_attention`` keeps its torch path. The kernels compile on first use (a few seconds; cached on disk by
numba after that) and use as many threads as torch does.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

try:  # pragma: no cover - exercised where numba is missing
    import numba
    from numba import njit, prange
except Exception:  # noqa: BLE001 - any import failure (missing, or a broken llvmlite) means: use torch
    numba = None

#: One kernel at a time per process: numba's fallback threading layer (workqueue, where no OpenMP or TBB is found)
#: aborts the process when two threads launch parallel kernels at once.
_LAUNCH = threading.Lock()

#: Token chunks a head's values are summed in, side by side (partial sums added after): more chunks than threads
#: keeps both of two cores busy on three KV heads.
VALUE_CHUNKS = 8

#: ``2**-k`` for k in 0..127: the integer part of :func:`_exp`'s power.
_POW2 = (np.float32(2.0) ** -np.arange(128)).astype(np.float32)


def available() -> bool:
    """Whether the kernels can run here (numba imports, and ``DOCFUSE_CODE_KERNELS`` is not ``0``)."""
    return numba is not None and os.environ.get("DOCFUSE_CODE_KERNELS", "1") != "0"


if numba is not None:

    @njit(parallel=True, fastmath=True, cache=True)
    def _scores(qs, qz, codes, n, out):  # pragma: no cover - compiled
        """``out[bh, r, t] = sum_d qs[bh, g, r, d] * codes[bh, t, d] + qz[bh, g, r]`` for ``t < n``, ``g = t //
        group``: one job per (head, token group)."""
        heads, groups, rows, dim = qs.shape
        group = codes.shape[1] // groups
        for job in prange(heads * groups):
            bh = job // groups
            gi = job % groups
            for tt in range(group):
                t = gi * group + tt
                if t < n:
                    for r in range(rows):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += qs[bh, gi, r, d] * np.float32(codes[bh, t, d])
                        out[bh, r, t] = acc + qz[bh, gi, r]

    @njit(parallel=True, fastmath=True, cache=True)
    def _values(p, scale, zero, codes, partial):  # pragma: no cover - compiled
        """``partial[bh, c, r, :] = sum_{t in chunk c} p[bh, r, t] * (codes[bh, t, :] * scale[bh, t, cg] +
        zero[bh, t, cg])``, channel group ``cg`` of each channel: one job per (head, token chunk)."""
        heads, rows, n = p.shape
        chunks = partial.shape[1]
        per = (n + chunks - 1) // chunks
        cgroups = scale.shape[2]
        dim = codes.shape[2]
        width = dim // cgroups
        for job in prange(heads * chunks):
            bh = job // chunks
            ci = job % chunks
            acc = np.zeros((rows, dim), np.float32)
            zs = np.zeros((rows, cgroups), np.float32)
            for t in range(ci * per, min(n, (ci + 1) * per)):
                for r in range(rows):
                    pr = p[bh, r, t]
                    for cg in range(cgroups):
                        w = pr * scale[bh, t, cg]
                        zs[r, cg] += pr * zero[bh, t, cg]
                        for j in range(width):
                            acc[r, cg * width + j] += w * np.float32(codes[bh, t, cg * width + j])
            for r in range(rows):
                for cg in range(cgroups):
                    for j in range(width):
                        acc[r, cg * width + j] += zs[r, cg]
            partial[bh, ci] = acc

    @njit(fastmath=True, cache=True, inline="always")
    def _exp(x):  # pragma: no cover - compiled
        """``exp(x)`` for ``x <= 0`` in float32 without a libm call (which numba cannot vectorise without SVML):
        ``2**(x log2 e)``, the fraction's power by its Taylor series, the integer part's from a table.
        Relative error < 1e-6; below -87 it returns 0."""
        y = x * np.float32(1.4426950408889634)
        if y < np.float32(-126.0):
            return np.float32(0.0)
        k = np.floor(y + np.float32(0.5))
        f = y - k  # in [-0.5, 0.5]: the power's Taylor series to degree 6 is within 1.2e-7
        p = np.float32(1.5403530e-4)
        p = p * f + np.float32(1.3333558e-3)
        p = p * f + np.float32(9.6181291e-3)
        p = p * f + np.float32(5.5504109e-2)
        p = p * f + np.float32(2.4022651e-1)
        p = p * f + np.float32(6.9314718e-1)
        p = p * f + np.float32(1.0)
        return p * _POW2[-np.int32(k)]

    @njit(parallel=True, fastmath=True, cache=True)
    def _step(qg, kscale, kzero, kcodes, n_assoc, hidden, vscale, vzero, vcodes, core_k, core_v, n_core, shift,
              chunk, part_m, part_l, part_acc, out):  # pragma: no cover - compiled
        """One decode step of attention over ``[association codes, core[:n_core]]`` for every (head, row), split
        into token chunks (one job per (head, chunk): scores, a local softmax, weighted values), then the chunks
        merged by their maxima (flash decoding's combine). Core rows are bits: ``uint32(row) << shift`` is the
        float32 value (bf16: ``shift`` 16; float32 viewed as uint32: 0)."""
        heads, rows, dim = qg.shape
        chunks = part_m.shape[1]
        group = kcodes.shape[1] // kscale.shape[1]
        cgroups = vscale.shape[2]
        width = dim // cgroups
        n = n_assoc + n_core
        masked = hidden.shape[1] > 0
        for job in prange(heads * chunks):
            bh = job // chunks
            ci = job % chunks
            lo = ci * chunk
            hi = min(n, lo + chunk)
            s = np.empty((rows, chunk), np.float32)
            qs = np.empty((rows, dim), np.float32)
            qz = np.empty(rows, np.float32)
            bits = np.empty(dim, np.uint32)
            row = bits.view(np.float32)
            cur = -1
            for i in range(lo, hi):
                j = i - lo
                if i < n_assoc:
                    g = i // group
                    if g != cur:  # the group's channel scales folded into the query
                        cur = g
                        for r in range(rows):
                            z = np.float32(0.0)
                            for d in range(dim):
                                qs[r, d] = qg[bh, r, d] * kscale[bh, g, d]
                                z += qg[bh, r, d] * kzero[bh, g, d]
                            qz[r] = z
                    if masked and hidden[bh, i]:  # the core holds this position exactly
                        for r in range(rows):
                            s[r, j] = -np.inf
                        continue
                    for r in range(rows):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += qs[r, d] * np.float32(kcodes[bh, i, d])
                        s[r, j] = acc + qz[r]
                else:
                    for d in range(dim):
                        bits[d] = np.uint32(core_k[bh, i - n_assoc, d]) << shift
                    for r in range(rows):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += qg[bh, r, d] * row[d]
                        s[r, j] = acc
            acc = np.zeros((rows, dim), np.float32)
            zs = np.zeros((rows, cgroups), np.float32)
            for r in range(rows):
                m = -np.inf
                for j in range(hi - lo):
                    m = max(m, s[r, j])
                total = np.float32(0.0)
                if m > -np.inf:
                    for j in range(hi - lo):
                        e = _exp(s[r, j] - m)
                        s[r, j] = e
                        total += e
                else:
                    for j in range(hi - lo):
                        s[r, j] = 0.0
                part_m[bh, ci, r] = m
                part_l[bh, ci, r] = total
            for i in range(lo, hi):
                j = i - lo
                if i < n_assoc:
                    for r in range(rows):
                        pr = s[r, j]
                        for cg in range(cgroups):
                            w = pr * vscale[bh, i, cg]
                            zs[r, cg] += pr * vzero[bh, i, cg]
                            for k in range(width):
                                acc[r, cg * width + k] += w * np.float32(vcodes[bh, i, cg * width + k])
                else:
                    for d in range(dim):
                        bits[d] = np.uint32(core_v[bh, i - n_assoc, d]) << shift
                    for r in range(rows):
                        pr = s[r, j]
                        for d in range(dim):
                            acc[r, d] += pr * row[d]
            for r in range(rows):
                for cg in range(cgroups):
                    for k in range(width):
                        part_acc[bh, ci, r, cg * width + k] = acc[r, cg * width + k] + zs[r, cg]
        for bh in range(heads):  # after the parallel loop: merge the chunks
            for r in range(rows):
                m = -np.inf
                for ci in range(chunks):
                    m = max(m, part_m[bh, ci, r])
                total = np.float32(0.0)
                for d in range(dim):
                    out[bh, r, d] = 0.0
                for ci in range(chunks):
                    if part_m[bh, ci, r] > -np.inf:
                        f = _exp(part_m[bh, ci, r] - m)
                        total += f * part_l[bh, ci, r]
                        for d in range(dim):
                            out[bh, r, d] += f * part_acc[bh, ci, r, d]
                for d in range(dim):
                    out[bh, r, d] /= total


def _threads() -> None:
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)


def scores(qg: torch.Tensor, keys) -> torch.Tensor:
    """Scaled scores ``[B, H, r, n]`` of grouped queries ``qg`` [B, H, r, D] (float32) over 8-bit per-channel keys
    (a :class:`~runtime.kv.quant.Quantized`: codes [B, H, T_pad, D], scale/zero [B, H, G, 1, D])."""
    _threads()
    b, h, r, d = qg.shape
    groups = keys.scale.shape[2]
    qs = (qg.unsqueeze(2) * keys.scale.float()).reshape(b * h, groups, r, d)  # the query with each group's scales
    qz = torch.matmul(qg, keys.zero.float().squeeze(3).transpose(-1, -2)).transpose(-1, -2)  # [B, H, G, r]
    out = torch.empty(b * h, r, keys.length, dtype=torch.float32)
    with _LAUNCH:
        _scores(qs.numpy(), qz.reshape(b * h, groups, r).contiguous().numpy(),
                keys.codes.reshape(b * h, -1, d).numpy(), keys.length, out.numpy())
    return out.view(b, h, r, keys.length)


def values(p: torch.Tensor, vals) -> torch.Tensor:
    """``sum_t p[t] * v[t]`` [B, H, r, D] for weights ``p`` [B, H, r, n] (float32) over 8-bit per-token values
    (codes [B, H, T, D], scale/zero [B, H, T, D // group, 1])."""
    _threads()
    b, h, r, n = p.shape
    d = vals.codes.shape[-1]
    cgroups = vals.scale.shape[3]
    scale = vals.scale[:, :, :n, :, 0].float().reshape(b * h, n, cgroups)
    zero = vals.zero[:, :, :n, :, 0].float().reshape(b * h, n, cgroups)
    partial = torch.empty(b * h, VALUE_CHUNKS, r, d, dtype=torch.float32)
    with _LAUNCH:
        _values(p.reshape(b * h, r, n).contiguous().numpy(), scale.contiguous().numpy(), zero.contiguous().numpy(),
                vals.codes.reshape(b * h, -1, d).numpy(), partial.numpy())
    return partial.sum(1).view(b, h, r, d)


#: Token chunks a head's step is split into (``step``): enough jobs to keep two cores busy on three KV heads, few
#: enough that each chunk's merge is cheap.
STEP_CHUNKS = 8

_CORE_BITS = {torch.bfloat16: (torch.int16, np.uint16, 16), torch.float32: (torch.int32, np.uint32, 0)}


def fuses(core: torch.Tensor, assoc) -> bool:
    """Whether :func:`step` takes this layer: 8-bit keys and values without page anchors, a bf16 or float32 core
    (``DOCFUSE_CODE_KERNELS=split``: the scores and values kernels apart, with torch's softmax between, for A/B)."""
    return (assoc.keys.bits == 8 and assoc.values.bits == 8 and assoc.anchor_index is None
            and core.dtype in _CORE_BITS and available() and os.environ.get("DOCFUSE_CODE_KERNELS") != "split")


def _bits(core: torch.Tensor) -> np.ndarray:
    view, unsigned, _ = _CORE_BITS[core.dtype]
    return core.view(view).numpy().view(unsigned)


def step(qg: torch.Tensor, core_k: torch.Tensor, core_v: torch.Tensor, n_core: int, assoc) -> torch.Tensor:
    """The whole one-token attention of ``code_attention`` in one launch: scaled grouped queries ``qg`` [B, H, r, D]
    (float32) over an 8-bit association tier (``fuses``) and the exact core ``core_k``/``core_v`` [B, H, >=n_core,
    D] (bf16 or float32, read as stored) -> [B, H, r, D] float32. The softmax is computed per token chunk and merged,
    so nothing of the size of the tiers is allocated: no concatenated scores, no float copy of the core."""
    _threads()
    b, h, r, d = qg.shape
    keys, vals = assoc.keys, assoc.values
    n_assoc = keys.length
    groups = keys.scale.shape[2]
    cgroups = vals.scale.shape[3]
    n = n_assoc + n_core
    chunk = -(-max(n, 1) // STEP_CHUNKS)
    chunk += (-chunk) % keys.group  # whole key groups per chunk: one query fold per group and chunk
    chunks = -(-max(n, 1) // chunk)
    hidden = (assoc.hidden.reshape(b * h, -1).numpy() if assoc.hidden is not None
              else np.zeros((b * h, 0), np.bool_))
    part_m = np.empty((b * h, chunks, r), np.float32)
    part_l = np.empty((b * h, chunks, r), np.float32)
    part_acc = np.empty((b * h, chunks, r, d), np.float32)
    out = torch.empty(b * h, r, d, dtype=torch.float32)
    with _LAUNCH:
        _step(qg.reshape(b * h, r, d).contiguous().numpy(),
              keys.scale.float().reshape(b * h, groups, d).numpy(), keys.zero.float().reshape(b * h, groups, d).numpy(),
              keys.codes.reshape(b * h, -1, d).numpy(), n_assoc, hidden,
              vals.scale[:, :, :n_assoc, :, 0].float().reshape(b * h, n_assoc, cgroups).contiguous().numpy(),
              vals.zero[:, :, :n_assoc, :, 0].float().reshape(b * h, n_assoc, cgroups).contiguous().numpy(),
              vals.codes.reshape(b * h, -1, d).numpy(),
              _bits(core_k.reshape(b * h, -1, d)), _bits(core_v.reshape(b * h, -1, d)), n_core,
              _CORE_BITS[core_k.dtype][2], chunk, part_m, part_l, part_acc, out.numpy())
    return out.view(b, h, r, d)
