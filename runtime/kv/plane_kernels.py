"""A numba loop that puts an archive block's byte planes back together straight into the cache's K/V (CPU).

``background.unpack_exact`` rebuilds a block in three copies (planes interleaved into a flat buffer, a transposing
copy from channel-major to token-major, then the caller's copy into the destination), and a question's exact read
does that for every block of every layer (0.67 of a later question's 1.85 s at 7K tokens in float32 on two AVX2
cores). :func:`interleave_into` does it in one pass: each element is assembled from its bytes in a register and
written once, in the destination's own layout (token-major, possibly a strided slice). Same bytes, bit for bit.

numba is imported on first use (``runtime.kv.code_kernels`` pays the same import); where it is missing, or
``DOCFUSE_CODE_KERNELS=0``, :func:`available` is False and the three copies stay.
"""

from __future__ import annotations

import numpy as np
import torch

# one switch for both modules: whether numba imports and ``DOCFUSE_CODE_KERNELS`` is not ``0``
from docfuse.runtime.kv.code_kernels import available, numba

if numba is not None:
    from numba import njit

    @njit(nogil=True, cache=True)
    def _words4(p0, p1, p2, p3, dst, dim, tokens):  # pragma: no cover - compiled
        """``dst[bh, t, d]`` = the little-endian word of bytes ``p*[(bh * dim + d) * tokens + t]``."""
        for bh in range(dst.shape[0]):
            for t in range(tokens):
                for d in range(dim):
                    i = (bh * dim + d) * tokens + t
                    dst[bh, t, d] = (np.uint32(p0[i]) | (np.uint32(p1[i]) << 8) | (np.uint32(p2[i]) << 16)
                                     | (np.uint32(p3[i]) << 24))

    @njit(nogil=True, cache=True)
    def _words2(p0, p1, dst, dim, tokens):  # pragma: no cover - compiled
        """As :func:`_words4` for two-byte elements (bf16, fp16)."""
        for bh in range(dst.shape[0]):
            for t in range(tokens):
                for d in range(dim):
                    i = (bh * dim + d) * tokens + t
                    dst[bh, t, d] = np.uint16(p0[i]) | (np.uint16(p1[i]) << 8)


_WORDS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}


def takes(out: torch.Tensor) -> bool:
    """Whether :func:`interleave_into` can write ``out`` (a CPU tensor of 2- or 4-byte elements, ``[B, H, T, D]``
    whose batch and head dimensions merge into one)."""
    if not available() or out.device.type != "cpu" or out.element_size() not in _WORDS or out.dim() != 4:
        return False
    b, h, t, d = out.shape
    return b == 1 or out.stride(0) == h * out.stride(1)


def interleave_into(planes: list, out: torch.Tensor) -> None:
    """Write the tensor whose byte planes (uint8 buffers, channel-major ``[B, H, D, T]``, plane ``i`` = byte ``i``)
    are ``planes`` into ``out`` ``[B, H, T, D]`` (``takes(out)``)."""
    b, h, t, d = out.shape
    view, unsigned = _WORDS[out.element_size()]
    dst = out.view(view).as_strided((b * h, t, d), (out.stride(1), out.stride(2), out.stride(3))).numpy()
    arrays = [np.frombuffer(p, dtype=np.uint8) for p in planes]
    if len(arrays) == 4:
        _words4(*arrays, dst.view(unsigned), d, t)
    else:
        _words2(*arrays, dst.view(unsigned), d, t)
