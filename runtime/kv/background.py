"""The background tier: exact K/V, LZ4-compressed in host memory, by byte planes.

LZ4 finds almost nothing to shrink in dense floats because each byte interleaves sign, exponent and mantissa bits.
Split into byte planes (all high bytes together, then the next byte, ...) the exponent plane becomes highly repetitive
while the low mantissa planes stay near-random; compressing the planes separately is where the ratio comes from.
Values are laid out channel-major ([H, D, T]) first so a plane's runs follow one channel across tokens.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import lz4.block
import numpy as np
import torch

from docfuse.runtime.kv.host_arena import HostArena


_RAW, _LZ4 = b"\x00", b"\x01"
#: Size of one pinned staging buffer of :class:`ArchiveWriter` (a piece of a layer's K/V in flight to the host).
STAGING_BYTES = 64 << 20


@dataclass
class ExactBlob:
    """One tensor's bytes, split into planes and (optionally) LZ4-compressed; round trip is bit-exact."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    planes: list[bytes | memoryview]  # memoryviews: slices of a HostArena (the ArchiveWriter's)
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

    The byte shuffling runs in numpy as two contiguous copies (channel-major, then plane-major); numpy and LZ4 both
    release the GIL there, so several blocks pack in parallel threads (:class:`ArchiveWriter`).
    """
    if x.device.type != "cpu":  # shuffled where it lies (a GPU does it at memory speed); one copy to the host
        return planes_blob(planes_of(x.detach()).cpu().numpy(), x.dtype, tuple(x.shape), codec)
    host = x.detach()
    size = host.element_size()
    ints = host.contiguous().view(_INT_VIEW[size]).numpy()
    flat = np.ascontiguousarray(np.swapaxes(ints, -1, -2)).reshape(-1).view(np.uint8)
    by_plane = np.ascontiguousarray(flat.reshape(-1, size).T)
    return planes_blob(by_plane, host.dtype, tuple(host.shape), codec)


def planes_of(x: torch.Tensor) -> torch.Tensor:
    """The byte planes of ``x`` [..., T, D] as uint8 ``[element size, elements]``, channel-major, in torch on
    ``x``'s device: the same bytes :func:`pack_exact`'s numpy shuffle makes on the host."""
    size = x.element_size()
    return x.transpose(-1, -2).contiguous().view(torch.uint8).reshape(-1, size).t().contiguous()


def tensor_of_planes(planes: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`planes_of`, in torch on ``planes``' device: uint8 ``[element size, elements]`` back
    into the ``shape`` tensor of ``dtype``."""
    swapped = list(shape)
    swapped[-1], swapped[-2] = swapped[-2], swapped[-1]
    ints = planes.t().contiguous().view(_INT_VIEW[planes.shape[0]]).reshape(swapped)
    return ints.transpose(-1, -2).contiguous().view(dtype)


def planes_blob(by_plane: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], codec: str | None,
                arena: HostArena | None = None) -> ExactBlob:
    """An :class:`ExactBlob` of a ``shape`` tensor from its byte planes ``[element size, elements]`` (uint8; plane
    ``i`` is byte ``i`` of every element, channel-major), as :func:`pack_exact` or :func:`byte_planes` lay them out.

    With an ``arena`` the planes are slices of its pre-faulted memory instead of ``bytes`` of their own."""
    planes: list[bytes | memoryview] = []
    for data in by_plane:
        packed = lz4.block.compress(data, store_size=True) if codec == "lz4" and data.size else b""
        # A plane LZ4 cannot shrink (low mantissa bytes) is kept raw behind a one-byte tag.
        tag, payload = (_LZ4, packed) if packed and len(packed) < data.size else (_RAW, data)
        planes.append(arena.tagged(tag, payload) if arena is not None else tag + bytes(payload))
    return ExactBlob(dtype, shape, planes, codec)


def byte_planes(k: torch.Tensor, v: torch.Tensor, block: int) -> list[tuple[int, int, torch.Tensor]]:
    """K/V ``[B, H, T, D]`` as the byte planes of their archive blocks, shuffled where they lie (on the GPU).

    Returns ``(first token, tokens per block, planes)`` groups: ``planes`` is uint8 ``[blocks, 2 (K, V), element
    size, B*H*D*tokens]``, the whole blocks first, then a shorter last block if ``T`` is not a multiple of ``block``.
    Each ``planes[j, t]`` is what :func:`pack_exact` would build on the host for that block, so the host is left with
    LZ4 alone.
    """
    b, h, t, d = k.shape
    size = k.element_size()
    kv = torch.stack([k, v])
    full = t // block * block
    out = []
    for lo, hi in ((0, full), (full, t)):
        if hi == lo:
            continue
        span = block if hi - lo >= block else hi - lo
        n = (hi - lo) // span
        x = kv[:, :, :, lo:hi].reshape(2, b, h, n, span, d).permute(3, 0, 1, 2, 5, 4).contiguous()
        x = x.view(torch.uint8).reshape(n, 2, -1, size).transpose(2, 3).contiguous()
        out.append((lo, span, x))
    return out


def _raw_planes(blob: ExactBlob) -> list[bytes | memoryview]:
    """The blob's planes as raw bytes: LZ4 ones decompressed, raw ones as views past their tag (no copy)."""
    return [lz4.block.decompress(memoryview(p)[1:]) if p[:1] == _LZ4 else memoryview(p)[1:] for p in blob.planes]


def unpack_exact(blob: ExactBlob, device: torch.device | str | None = None) -> torch.Tensor:
    """Decompress an :class:`ExactBlob` back into the identical tensor: on the CPU, or on ``device`` (a GPU: the
    planes go over as they are and are interleaved there, :func:`tensor_of_planes`, instead of by the host)."""
    size = len(blob.planes)
    raw = _raw_planes(blob)
    if device is not None and torch.device(device).type != "cpu":
        planes = np.empty((size, len(raw[0])), dtype=np.uint8)
        for i, plane in enumerate(raw):
            planes[i] = np.frombuffer(plane, dtype=np.uint8)
        return tensor_of_planes(torch.from_numpy(planes).to(device), blob.dtype, tuple(blob.shape))
    flat = np.empty(len(raw[0]) * size, dtype=np.uint8)
    for i, plane in enumerate(raw):
        flat[i::size] = np.frombuffer(plane, dtype=np.uint8)
    shape = list(blob.shape)
    shape[-1], shape[-2] = shape[-2], shape[-1]
    ints = torch.from_numpy(flat.view(_NP[size]).reshape(shape))
    return ints.transpose(-1, -2).contiguous().view(blob.dtype)  # torch's transposing copy: ~1.6x numpy's here


def _plane_kernels():
    """:mod:`runtime.kv.plane_kernels`, imported at the first block read into a cache (numba's import cost)."""
    from docfuse.runtime.kv import plane_kernels

    return plane_kernels


def unpack_exact_into(blob: ExactBlob, out: torch.Tensor) -> torch.Tensor:
    """Decompress an :class:`ExactBlob` into ``out`` (a CPU tensor of the blob's shape and dtype; a slice of a cache
    is fine): one pass of :mod:`runtime.kv.plane_kernels` where it takes ``out``, else ``out.copy_(unpack_exact)``.
    Same bytes either way."""
    if tuple(out.shape) != tuple(blob.shape) or out.dtype != blob.dtype:
        raise ValueError(f"the block holds {blob.dtype} {tuple(blob.shape)}, not {out.dtype} {tuple(out.shape)}")
    kernels = _plane_kernels()
    if not kernels.takes(out) or len(blob.planes) != out.element_size():
        return out.copy_(unpack_exact(blob))
    kernels.interleave_into(_raw_planes(blob), out)
    return out


_READERS: list[ThreadPoolExecutor | None] = []  # the process's reader pool, once made (None: the caller's thread)
_READERS_LOCK = threading.Lock()


#: Fewer usable cores than this and blocks are unpacked by the caller's thread: on two cores a pool of readers ran
#: 2x slower than one thread (blocks of ~0.08 ms each pass the GIL back and forth more than they run in parallel).
POOL_FROM_CORES = 4


def reader_pool() -> ThreadPoolExecutor | None:
    """The threads that unpack archive blocks for :func:`read_blocks_into` and the KV store (one pool per process);
    ``None`` on a machine of fewer than ``POOL_FROM_CORES`` usable cores."""
    with _READERS_LOCK:
        if not _READERS:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _READERS.append(ThreadPoolExecutor(min(8, cores), thread_name_prefix="docfuse-archive-read")
                            if cores >= POOL_FROM_CORES else None)
        return _READERS[0]


def read_blocks_into(archive: Any, indices: list[int], keys: torch.Tensor, values: torch.Tensor) -> list[tuple[int, int]]:
    """Write blocks ``indices`` of ``archive`` into ``keys``/``values`` [B, H, >= end, D] at their positions; returns
    their ``(start, end)`` spans in the order asked.

    A host archive's blocks are unpacked and written by the reader threads themselves, each into its own span, so
    memory holds one unpacked block a thread and the caller's thread copies nothing a second time. A question's
    exact read at 128K unpacks some 500 blocks a layer; one after another that ran at ~0.6 GB/s (27 s for two
    questions on an H100 host), while LZ4 and numpy release the GIL, so many cores can share it (on two cores the
    caller's thread alone is faster, ``POOL_FROM_CORES``)."""
    inference = torch.is_inference_mode_enabled()  # thread-local: the readers write as the caller would

    def put(index: int) -> tuple[int, int]:
        if hasattr(archive, "read_into") and keys.device.type == "cpu" and values.device.type == "cpu":
            with torch.inference_mode(inference), torch.no_grad():
                return archive.read_into(index, keys, values)  # one pass a block, no temporaries
        start, end, k, v = archive.read(index)
        with torch.inference_mode(inference), torch.no_grad():
            keys[:, :, start:end].copy_(k)
            values[:, :, start:end].copy_(v)
        return start, end

    pool = reader_pool()
    if getattr(archive, "on_device", False) or len(indices) < 2 or pool is None:
        return [put(i) for i in indices]
    archive.settle()  # pending ranges are joined here, once, not by racing reader threads
    return [f.result() for f in [pool.submit(put, i) for i in indices]]


@dataclass
class _Block:
    start: int
    end: int
    keys: ExactBlob
    values: ExactBlob


class ExactArchive:
    """Append-only store of one layer's exact K/V by position blocks; every archived token stays recoverable.

    Blocks may arrive later than their positions: :class:`ArchiveWriter` registers a pending range at once (so
    ``length`` is right immediately) and fills it from worker threads; anything that reads blocks waits for them.
    """

    def __init__(self, codec: str | None = "lz4", block_tokens: int = 256) -> None:
        self.codec = codec
        self.block_tokens = block_tokens
        self._blocks: list[_Block] = []
        self._pending: list[Future] = []  # each resolves to the list of blocks of one pending range, in order
        self._pending_end = 0

    @property
    def blocks(self) -> list[_Block]:
        """The archived blocks, in position order (waits for pending ones)."""
        self.settle()
        return self._blocks

    def settle(self) -> None:
        """Wait for every pending range (re-raising a worker's error here, where the caller can see it)."""
        while self._pending:
            self._blocks.extend(self._pending.pop(0).result())

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    @property
    def length(self) -> int:
        """Positions ``[0, length)`` are archived (or on their way, see :class:`ArchiveWriter`)."""
        if self._pending:
            return self._pending_end
        return self._blocks[-1].end if self._blocks else 0

    def add_pending(self, end: int, future: Future) -> None:
        """Positions ``[length, end)`` will be the blocks ``future`` returns (used by :class:`ArchiveWriter`)."""
        if self.length % self.block_tokens and not self._pending:
            raise ValueError("a pending range must start on a block boundary; append() tops up short blocks")
        self._pending.append(future)
        self._pending_end = end

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Archive ``k``/``v`` [B, H, T, D] for positions ``[length, length + T)``; tops up a short last block."""
        blocks = self.blocks
        start = self.length
        if blocks and blocks[-1].end - blocks[-1].start < self.block_tokens:
            last = blocks.pop()
            start = last.start
            k = torch.cat([unpack_exact(last.keys), k.detach().to("cpu")], dim=2)
            v = torch.cat([unpack_exact(last.values), v.detach().to("cpu")], dim=2)
        blocks.extend(pack_blocks(k, v, start, self.block_tokens, self.codec))

    def adopt(self, blocks: list[tuple[int, int, ExactBlob, ExactBlob]]) -> None:
        """Take blocks packed elsewhere (a KV store entry) as this empty archive's, without unpacking them: they must
        tile ``[0, end)`` in order, ``block_tokens`` each (the last may be short), as :meth:`append` would cut them."""
        if self._blocks or self._pending:
            raise ValueError("adopt() fills an empty archive only")
        expected = 0
        for i, (start, end, _, _) in enumerate(blocks):
            short_inside = end - start != self.block_tokens and i != len(blocks) - 1
            if start != expected or end <= start or end - start > self.block_tokens or short_inside:
                raise ValueError(f"block {i} covers [{start}, {end}); blocks must tile the positions from 0 in "
                                 f"steps of {self.block_tokens}")
            expected = end
        self._blocks = [_Block(start, end, k, v) for start, end, k, v in blocks]

    def read(self, index: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """Block ``index`` as ``(start, end, keys, values)``."""
        block = self.blocks[index]
        return block.start, block.end, unpack_exact(block.keys), unpack_exact(block.values)

    def read_into(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
        """Block ``index`` written into ``keys``/``values`` [B, H, >= end, D] at its positions (CPU; no block-sized
        temporaries where :mod:`runtime.kv.plane_kernels` runs); returns its ``(start, end)``."""
        block = self.blocks[index]
        with torch.no_grad():
            unpack_exact_into(block.keys, keys[:, :, block.start: block.end])
            unpack_exact_into(block.values, values[:, :, block.start: block.end])
        return block.start, block.end

    def block_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Block index of each position (all must be archived)."""
        bounds = torch.tensor([b.end for b in self.blocks], dtype=torch.long)
        return torch.searchsorted(bounds, positions.to(torch.long), right=True)

    def truncate(self, length: int) -> None:
        """Forget positions ``>= length`` (re-encoding a block cut in two)."""
        blocks = self.blocks
        while blocks and blocks[-1].start >= length:
            blocks.pop()
        if blocks and blocks[-1].end > length:
            start, _, k, v = self.read(len(blocks) - 1)
            blocks.pop()
            keep = length - start
            blocks.append(_Block(start, length, pack_exact(k[:, :, :keep], self.codec),
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


class DeviceArchive:
    """:class:`ExactArchive`'s interface over one uncompressed buffer where the K/V already are (the GPU).

    For a document that is read again and again while it is open (the engine starts each question from it), the
    exact K/V stay in device memory: a question's exact read and its re-tier are then slices, not decompression and a
    host-to-device copy. Bit-exact like the LZ4 archive, so the tiers come out the same. One block covers every
    position, so readers take the whole range in one piece.
    """

    codec = None
    on_device = True

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._length = 0
        self.block_tokens = 1 << 30

    @property
    def length(self) -> int:
        return self._length

    @property
    def pending(self) -> bool:
        return False

    @property
    def blocks(self) -> list[_Block]:
        return [] if not self._length else [_Block(0, self._length, None, None)]  # type: ignore[arg-type]

    def settle(self) -> None:
        pass

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        new = self._length + k.shape[2]
        if self.keys is None or new > self.keys.shape[2]:
            capacity = max(new, 2 * self._length)
            grown_k = k.new_empty(*k.shape[:2], capacity, k.shape[3])
            grown_v = v.new_empty(*v.shape[:2], capacity, v.shape[3])
            if self._length:
                grown_k[:, :, : self._length] = self.keys[:, :, : self._length]
                grown_v[:, :, : self._length] = self.values[:, :, : self._length]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self._length: new] = k
        self.values[:, :, self._length: new] = v
        self._length = new

    def read(self, index: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        if index != 0 or not self._length:
            raise IndexError(f"block {index} of a device archive of {self._length} positions")
        return 0, self._length, self.keys[:, :, : self._length], self.values[:, :, : self._length]

    def block_of(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(positions, dtype=torch.long)

    def truncate(self, length: int) -> None:
        self._length = min(self._length, max(0, length))

    def select_batch(self, indices: torch.Tensor) -> None:
        idx = indices.to(self.keys.device) if self.keys is not None else indices
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]

    def nbytes(self) -> int:
        """Host bytes: none (see :meth:`device_nbytes`)."""
        return 0

    def device_nbytes(self) -> int:
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()

    def raw_nbytes(self) -> int:
        return 0 if self.keys is None else 2 * self.keys[:, :, : self._length].numel() * self.keys.element_size()


def block_spans(tokens: int, block_tokens: int) -> list[tuple[int, int]]:
    """How an archive cuts ``tokens`` positions into blocks: ``(lo, hi)`` spans of ``block_tokens``, the last shorter
    (the store keeps a document in the same blocks, so a loaded archive adopts them as they are)."""
    return [(lo, min(lo + block_tokens, tokens)) for lo in range(0, tokens, block_tokens)]


def pack_blocks(k: torch.Tensor, v: torch.Tensor, start: int, block_tokens: int, codec: str | None
                ) -> list[_Block]:
    """``k``/``v`` [B, H, T, D] (host) as archive blocks for positions ``[start, start + T)``."""
    return [_Block(start + lo, start + hi, pack_exact(k[:, :, lo:hi], codec), pack_exact(v[:, :, lo:hi], codec))
            for lo, hi in block_spans(k.shape[2], block_tokens)]


class ArchiveWriter:
    """Moves exact K/V into archives off the critical path: device -> pinned host buffer -> LZ4 in worker threads.

    ``submit`` records, on a side CUDA stream, the byte-plane shuffle of the blocks (:func:`byte_planes`, on the GPU)
    and the copy into a pinned staging buffer, and returns at once; the GPU goes on computing while the copy engine
    moves the bytes and the workers compress them (LZ4 releases the GIL; the host does no shuffling of its own).
    At most ``staging`` buffers are in flight: a further ``submit`` waits for one, which bounds host memory and makes
    a host that cannot keep up slow the prefill down instead of filling RAM. Off CUDA the copy is a plain one.

    Args:
        workers: compression threads (default: the CPUs this process may use, at most 8: more only contend for
            the GIL with the thread that drives the GPU).
        staging: pinned buffers (of ``STAGING_BYTES``) in flight.
        arena: host memory the archived blocks are written into (default: a fresh :class:`HostArena`, whose
            pre-faulted chunks spare the process millions of page faults; ``None``: plain ``bytes``). The writer
            keeps the arena's open chunk (up to ``CHUNK_BYTES``) mapped while it lives.
    """

    def __init__(self, workers: int | None = None, staging: int = 8,
                 arena: HostArena | None | Literal["new"] = "new") -> None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.workers = max(1, min(8, cpus) if workers is None else workers)
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="docfuse-archive")
        self.arena = HostArena() if arena == "new" else arena
        self.slots = threading.Semaphore(staging)
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._free: list[torch.Tensor] = []  # pinned buffers to reuse
        self._lock = threading.Lock()
        #: seconds ``submit`` waited for a free staging buffer (the host falling behind the GPU), and seconds the
        #: workers spent packing (summed over threads): where a prefill's time goes when the host is the bottleneck
        self.wait_s = 0.0
        self.pack_s = 0.0

    def _staging(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
        return torch.empty(max(nbytes, STAGING_BYTES), dtype=torch.uint8, pin_memory=pinned)

    def submit(self, archive: ExactArchive, k: torch.Tensor, v: torch.Tensor) -> None:
        """Archive ``k``/``v`` [B, H, T, D] at positions ``[archive.length, archive.length + T)``, asynchronously.

        The caller may drop or overwrite ``k``/``v`` right away (their memory is held until the copy is done).
        The tokens travel in pieces of at most ``STAGING_BYTES`` (whole blocks), so the pinned buffers keep one
        size and are reused whatever the document length.
        """
        start, tokens = archive.length, k.shape[2]
        if tokens == 0:
            return
        if getattr(archive, "on_device", False):  # a DeviceArchive keeps its copy where the K/V are
            archive.append(k, v)
            return
        if start % archive.block_tokens:
            archive.append(k, v)  # a short last block must be topped up first: the plain path
            return
        per_token = 2 * k[:, :, :1].numel() * k.element_size()
        piece = max(1, STAGING_BYTES // per_token // archive.block_tokens) * archive.block_tokens
        for lo in range(0, tokens, piece):
            self._submit_piece(archive, k[:, :, lo: lo + piece], v[:, :, lo: lo + piece])

    def _submit_piece(self, archive: ExactArchive, k: torch.Tensor, v: torch.Tensor) -> None:
        start, shape = archive.length, tuple(k.shape)
        t0 = time.perf_counter()
        self.slots.acquire()
        self.wait_s += time.perf_counter() - t0
        cuda = self.stream is not None and k.is_cuda
        try:
            if cuda:
                self.stream.wait_stream(torch.cuda.current_stream(k.device))
            with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
                groups = byte_planes(k, v, archive.block_tokens)  # the shuffle runs where the K/V are
                base = self._staging(sum(g.numel() for _, _, g in groups), pinned=cuda)
                staged, offset = [], 0
                for lo, span, g in groups:
                    host = base[offset: offset + g.numel()].view(g.shape)
                    host.copy_(g, non_blocking=cuda)
                    staged.append((lo, span, host))
                    offset += g.numel()
                done = torch.cuda.Event() if cuda else None
                if done is not None:
                    done.record(self.stream)
            if cuda:
                k.record_stream(self.stream)
                v.record_stream(self.stream)
        except BaseException:
            self.slots.release()
            raise
        blocks = [self.pool.submit(self._pack, host[j], done, start + lo + j * span,
                                   (shape[0], shape[1], span, shape[3]), k.dtype, archive.codec)
                  for lo, span, host in staged for j in range(host.shape[0])]
        gather = self.pool.submit(self._gather, blocks, base)
        archive.add_pending(start + shape[2], gather)

    def _pack(self, planes: torch.Tensor, done: Any, start: int, shape: tuple[int, ...], dtype: torch.dtype,
              codec: str | None) -> _Block:
        if done is not None:
            done.synchronize()  # the copy into the staging buffer
        t0 = time.perf_counter()
        arr = planes.numpy()
        out = _Block(start, start + shape[2], planes_blob(arr[0], dtype, shape, codec, self.arena),
                     planes_blob(arr[1], dtype, shape, codec, self.arena))
        with self._lock:
            self.pack_s += time.perf_counter() - t0
        return out

    def _gather(self, blocks: list[Future], base: torch.Tensor) -> list[_Block]:
        # Runs in the same pool after its blocks (FIFO), so the blocks it waits for are already taken or done.
        try:
            return [f.result() for f in blocks]
        finally:
            with self._lock:
                self._free.append(base)
            self.slots.release()

    def close(self) -> None:
        """Wait for the workers and free the pinned buffers (archives keep what was written)."""
        self.pool.shutdown(wait=True)
        self._free.clear()

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
