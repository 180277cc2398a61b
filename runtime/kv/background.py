"""The background tier: exact K/V, LZ4-compressed in host memory, by byte planes.

LZ4 finds almost nothing to shrink in dense floats because each byte interleaves sign, exponent and mantissa bits.
Split into byte planes (all high bytes together, then the next byte, ...) the exponent plane becomes highly repetitive
while the low mantissa planes stay near-random; compressing the planes separately is where the ratio comes from.
Values are laid out channel-major ([H, D, T]) first so a plane's runs follow one channel across tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lz4.block
import numpy as np
import torch


_RAW, _LZ4 = b"\x00", b"\x01"


@dataclass
class ExactBlob:
    """One tensor's bytes, split into planes and (optionally) LZ4-compressed; round trip is bit-exact."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    planes: list[bytes]
    codec: str | None

    def nbytes(self) -> int:
        return sum(len(p) for p in self.planes)

    def raw_nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def pack_exact(x: torch.Tensor, codec: str | None = "lz4") -> ExactBlob:
    """Compress a ``[..., T, D]`` tensor (any float dtype) losslessly into byte planes on the host.

    The byte shuffling runs in numpy: it is a strided byte copy, which torch does slowly (and, with several
    intra-op threads on a busy CPU, very slowly).
    """
    host = x.detach().to("cpu")
    size = host.element_size()
    ints = host.contiguous().view(_INT_VIEW[size]).numpy()
    flat = np.ascontiguousarray(np.swapaxes(ints, -1, -2)).reshape(-1).view(np.uint8)
    planes = []
    for i in range(size):
        data = flat[i::size].tobytes()
        packed = lz4.block.compress(data, store_size=True) if codec == "lz4" and data else b""
        # A plane LZ4 cannot shrink (low mantissa bytes) is kept raw behind a one-byte tag.
        planes.append(_LZ4 + packed if packed and len(packed) < len(data) else _RAW + data)
    return ExactBlob(host.dtype, tuple(host.shape), planes, codec)


def unpack_exact(blob: ExactBlob) -> torch.Tensor:
    """Decompress an :class:`ExactBlob` back into the identical CPU tensor."""
    size = len(blob.planes)
    raw = [lz4.block.decompress(p[1:]) if p[:1] == _LZ4 else p[1:] for p in blob.planes]
    flat = np.empty(len(raw[0]) * size, dtype=np.uint8)
    for i, plane in enumerate(raw):
        flat[i::size] = np.frombuffer(plane, dtype=np.uint8)
    shape = list(blob.shape)
    shape[-1], shape[-2] = shape[-2], shape[-1]
    ints = flat.view(_NP[size])
    swapped = torch.from_numpy(np.ascontiguousarray(np.swapaxes(ints.reshape(shape), -1, -2)))
    return swapped.view(blob.dtype)


@dataclass
class _Block:
    start: int
    end: int
    keys: ExactBlob
    values: ExactBlob


@dataclass
class ExactArchive:
    """Append-only store of one layer's exact K/V by position blocks; every archived token stays recoverable."""

    codec: str | None = "lz4"
    block_tokens: int = 256
    blocks: list[_Block] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Positions ``[0, length)`` are archived."""
        return self.blocks[-1].end if self.blocks else 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Archive ``k``/``v`` [B, H, T, D] for positions ``[length, length + T)``; tops up a short last block."""
        start = self.length
        if self.blocks and self.blocks[-1].end - self.blocks[-1].start < self.block_tokens:
            last = self.blocks.pop()
            start = last.start
            k = torch.cat([unpack_exact(last.keys), k.detach().to("cpu")], dim=2)
            v = torch.cat([unpack_exact(last.values), v.detach().to("cpu")], dim=2)
        for lo in range(0, k.shape[2], self.block_tokens):
            hi = min(lo + self.block_tokens, k.shape[2])
            self.blocks.append(_Block(start + lo, start + hi, pack_exact(k[:, :, lo:hi], self.codec),
                                      pack_exact(v[:, :, lo:hi], self.codec)))

    def read(self, index: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """Block ``index`` as ``(start, end, keys, values)``."""
        block = self.blocks[index]
        return block.start, block.end, unpack_exact(block.keys), unpack_exact(block.values)

    def block_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Block index of each position (all must be archived)."""
        bounds = torch.tensor([b.end for b in self.blocks], dtype=torch.long)
        return torch.searchsorted(bounds, positions.to(torch.long), right=True)

    def truncate(self, length: int) -> None:
        """Forget positions ``>= length`` (re-encoding a block cut in two)."""
        while self.blocks and self.blocks[-1].start >= length:
            self.blocks.pop()
        if self.blocks and self.blocks[-1].end > length:
            start, _, k, v = self.read(len(self.blocks) - 1)
            self.blocks.pop()
            keep = length - start
            self.blocks.append(_Block(start, length, pack_exact(k[:, :, :keep], self.codec),
                                      pack_exact(v[:, :, :keep], self.codec)))

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep/reorder batch rows (beam search, batch selection)."""
        idx = indices.to("cpu")
        for block in self.blocks:
            block.keys = pack_exact(unpack_exact(block.keys)[idx], self.codec)
            block.values = pack_exact(unpack_exact(block.values)[idx], self.codec)

    def nbytes(self) -> int:
        """Host bytes held (compressed)."""
        return sum(b.keys.nbytes() + b.values.nbytes() for b in self.blocks)

    def raw_nbytes(self) -> int:
        """Bytes the same tokens take uncompressed."""
        return sum(b.keys.raw_nbytes() + b.values.raw_nbytes() for b in self.blocks)
