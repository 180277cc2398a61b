"""CPU kernels (numba) that read an 8-bit association tier's codes where they lie, for one decode step.

``code_attention`` dequantises an 8-bit tier into float32 and attends with one matmul: four passes over a float32 copy
four times the codes' size, every layer, every token. These loops read each uint8 code once, convert it in a
register and fold the scales in (keys: into the query, per group of tokens; values: into the attention weight, per
token and channel group), so the tier is read at one byte a value and nothing is written back. The arithmetic is the
same float32 sums as ``code_attention``'s folded form, in another order (tests: 1e-4 of the reference).

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
