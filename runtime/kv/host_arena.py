"""Host memory for the background archive, taken from the OS in large pre-faulted chunks.

A 128K-token archive of an 8B model is about 15 GB of host memory in some 65,000 pieces of up to 256 KB. Left to
malloc, pieces that size are mapped and unmapped one by one and every 4 KB page is faulted in on first touch, one
trap at a time, by the packing threads. On the sandboxed GPU machine (gVisor) that made a process's first 128K
layer-major prefill take 24.2 s, and later ones 20.2-23.7 s, against 18.2-18.4 s with this arena
(bench/experiments/diag_first_prefill.py, bench/RESULTS.md, issue 6). The arena maps ``chunk_bytes`` at a time with
``MAP_POPULATE``, so the kernel fills a chunk's pages in one call (the process still counts them as minor faults,
about 4 million either way), and hands out slices; the archive keeps ``memoryview`` s of them. A chunk goes back
to the OS when the last block in it is dropped.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

#: Size of one chunk: large enough that mapping it is rare, small enough that a dropped document frees most of its.
CHUNK_BYTES = 256 << 20
#: Size of the first chunk; each next one doubles up to ``CHUNK_BYTES``, so a small archive does not hold 256 MB.
FIRST_CHUNK_BYTES = 4 << 20


class HostArena:
    """Bump allocator over anonymous, pre-faulted memory maps; thread-safe.

    Slices are never freed one by one: a chunk lives as long as any ``memoryview`` into it (Python's buffer
    protocol keeps the map alive), so an archive that is dropped releases its chunks, except one it shares with a
    later archive.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, first_chunk_bytes: int = FIRST_CHUNK_BYTES) -> None:
        if chunk_bytes < 1 or first_chunk_bytes < 1:
            raise ValueError(f"chunk_bytes and first_chunk_bytes must be positive, got {chunk_bytes} and "
                             f"{first_chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._next = min(first_chunk_bytes, chunk_bytes)
        self._lock = threading.Lock()
        self._chunk: memoryview | None = None
        self._used = 0
        #: bytes mapped so far (all chunks, live or not): what the arena asked of the OS
        self.mapped_bytes = 0

    @staticmethod
    def _map(size: int) -> memoryview:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return memoryview(mmap.mmap(-1, size, flags=flags))

    def take(self, size: int) -> memoryview:
        """A writable slice of ``size`` bytes."""
        if size > self.chunk_bytes // 4:  # a piece this large gets its own map, so chunks are not wasted
            with self._lock:
                self.mapped_bytes += size
            return self._map(size)
        with self._lock:
            if self._chunk is None or self._used + size > len(self._chunk):
                grown = max(self._next, size)
                self._chunk, self._used = self._map(grown), 0
                self.mapped_bytes += grown
                self._next = min(2 * self._next, self.chunk_bytes)
            view = self._chunk[self._used: self._used + size]
            self._used += size
        return view

    def tagged(self, tag: bytes, payload: bytes | np.ndarray) -> memoryview:
        """``tag + payload`` in one slice (the archive's plane format) without building the concatenation."""
        data = memoryview(payload).cast("B") if not isinstance(payload, np.ndarray) else memoryview(
            np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
        view = self.take(len(tag) + len(data))
        view[: len(tag)] = tag
        view[len(tag):] = data
        return view
