"""A folder of prefilled KV caches: ask about a document again without reading it again (issue 24, first build).

An entry is one document's full KV cache after its prefill, keyed by everything that shapes those numbers: the
model's fingerprint (config, and a sample of every weight tensor's bytes), the exact prefix token ids, the fused
rows' bytes when fusion replaced embeddings, the dtype, the device type and the prefill chunk size (a bf16 prefill in
chunks of 256 is not the same state as in chunks of 512). A key that matches loads bit for bit the tensors the
prefill made; anything else misses.

Each entry is one file: a magic line, a JSON header (shapes, dtype, the byte planes' lengths), the K/V of every
layer as LZ4-compressed byte planes (``runtime.kv.background``: exact, lossless), and an XXH3-128 of everything before
it. Writes go to a temporary file in the same folder, are fsynced, then renamed over the entry, so a reader sees a
whole entry or none, and two writers of one entry leave one whole entry. A load that finds a torn, truncated or
altered file deletes it, warns with its name, and reports a miss: the caller prefills again. The folder keeps at
most ``max_bytes``, least recently used entries going first.

``Session`` stores full caches (``kv: null``, the default of ``docfuse ask`` and the QA pipelines) and tiered
caches after a token-major prefill (``kv.prefill: tokens``, the CPU default: every token is still exact in the core
then, and each question re-tiers from it); the GPU engine stores and loads the same tiered state for the documents it
prefills token by token. A layer-major prefill (tiered while it runs) is not stored. An entry larger than an eighth
of ``max_bytes`` is not stored either (``MAX_ENTRY_SHARE``): it would push most of the store out, and packing it costs
seconds a gigabyte on one core. Entries are memory-mapped when loaded: a tiered cache's background archive adopts the stored blocks as views
of the file, so they are read from disk when a question reads them back and take no memory of the process's own. The
run that stores an entry does the same right after storing it (:func:`adopt_archives`): its first question's re-tier
then has nothing left to compress.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from docfuse.runtime.kv.background import (ExactBlob, block_spans, pack_exact, reader_pool, unpack_exact,
                                          unpack_exact_into)

#: Second line of the file format: 2 checks entries with XXH3-128 (1: SHA-256, ten times slower to verify, a tenth
#: of a second a 6K-token entry; such entries are left unused and go with ``docfuse kv-store prune`` or ``clear``).
MAGIC = b"docfuse-kv-store 2\n"
OLD_MAGICS = (b"docfuse-kv-store 1\n",)
SUFFIX = ".dfkv"
DEFAULT_MAX_BYTES = 20 * 10**9
#: Largest entry, as a share of ``max_bytes``, that ``save`` writes: an 8B model's cache of a 128K-token document is
#: ~16 GB raw, ~50 s to pack on one core (340 MB/s measured on the dev machine), and would evict the whole default
#: store; raise ``kv_store_max_gb`` to keep documents that long.
MAX_ENTRY_SHARE = 1 / 8
_DIGEST = 16
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's config and, per weight tensor, its name, shape, dtype and up to 4,096 of its values
    taken evenly across it (reading every byte of a large model each run would cost seconds)."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update((config.to_json_string(use_diff=False) if config is not None else type(model).__name__).encode())
    with torch.no_grad():
        for name, p in model.state_dict().items():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            sample = flat[::step][:4096].to("cpu").contiguous()
            h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return h.hexdigest()  # not cached: a model changed in place (training) must get a new fingerprint


@dataclass
class Entry:
    """One stored document: its file, size, tokens, source and last use (the file's modification time)."""

    path: Path
    nbytes: int
    tokens: int
    source: str
    last_used: float


class KVStore:
    """Prefilled full KV caches in ``folder`` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self.hits = self.misses = self.refused = 0
        #: entries ``save`` left unwritten because they were larger than ``MAX_ENTRY_SHARE`` of ``max_bytes``
        self.too_large = 0

    # ---- keys ------------------------------------------------------------------------------------------------
    def key(self, model: torch.nn.Module, ids: Sequence[int], *, embeds: torch.Tensor | None = None,
            chunk_size: int = 512, kind: str = "full") -> str:
        """The entry name for this model, prefix and prefill: a SHA-256 over everything that shapes the cache.

        ``kind`` names the cache that made the state: ``full`` (a DynamicCache) or ``tiered`` (a TieredCache after a
        token-major prefill); the two never share an entry, even where their numbers would agree."""
        h = hashlib.sha256()
        device = next(model.parameters()).device
        fields = {"format": 1, "model": model_fingerprint(model), "dtype": str(model.dtype),
                  "device": device.type, "chunk": int(chunk_size), "tokens": len(ids)}
        if kind != "full":  # full entries keep the keys they had before tiered ones existed
            from docfuse.runtime.kv.layer import ARCHIVE_BLOCK

            fields.update(kind=kind, format=2, block=ARCHIVE_BLOCK)  # 2: the archive's blocks, not whole layers
        h.update(json.dumps(fields).encode())
        h.update(MAGIC)  # a new file format never reads an old entry
        h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
        if embeds is not None:
            h.update(embeds.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    # ---- write -----------------------------------------------------------------------------------------------
    def save(self, key: str, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], *, source: str = "",
             tokens: int | None = None) -> Path | None:
        """Store (keys, values) [B, H, T, D] pairs (a full cache's layers, or a tiered cache's archive blocks) under
        ``key``, atomically; ``tokens``: the document's length, shown by ``docfuse kv-store list`` (default: the
        first pair's T, right for whole layers). None, with a warning the first time, when the raw K/V pass
        ``MAX_ENTRY_SHARE`` of ``max_bytes``: nothing is written."""
        raw = sum(t.numel() * t.element_size() for pair in layers for t in pair)
        if raw > self.max_bytes * MAX_ENTRY_SHARE:
            if not self.too_large:
                warnings.warn(f"a document's KV cache ({raw / 1e9:.1f} GB) is larger than an eighth of the KV store's "
                              f"size cap ({self.max_bytes / 1e9:.0f} GB) and is not stored; raise kv_store_max_gb "
                              "(--set answer.kv_store_max_gb=N) to keep documents this long", stacklevel=2)
            self.too_large += 1
            return None
        tensors = [t for pair in layers for t in pair]
        pool = reader_pool()  # LZ4 releases the GIL, and GPU tensors are shuffled on the card: blocks pack side by side
        blobs = list(pool.map(pack_exact, tensors)) if pool is not None else [pack_exact(t) for t in tensors]
        if tokens is None:
            tokens = int(layers[0][0].shape[2]) if layers else 0
        header = {"tokens": int(tokens), "source": source, "saved": time.time(),
                  "tensors": [{"dtype": str(b.dtype), "shape": list(b.shape), "planes": [len(p) for p in b.planes]}
                              for b in blobs]}
        head = json.dumps(header).encode()
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=SUFFIX)
        try:
            digest = xxhash.xxh3_128()
            with os.fdopen(fd, "wb") as f:
                for piece in (MAGIC, struct.pack("<Q", len(head)), head, *(p for b in blobs for p in b.planes)):
                    f.write(piece)
                    digest.update(piece)
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))  # atomic: a reader sees the old entry, the new one, or none
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.prune()
        return self.path(key)

    # ---- read ------------------------------------------------------------------------------------------------
    def load(self, key: str, blobs: bool = False) -> list[tuple[Any, Any]] | None:
        """The stored (keys, values) pairs, on the host, or None on a miss (``blobs``: still packed, as
        :class:`ExactBlob`, checked but not unpacked). An entry that fails any check is deleted with a warning naming
        it (the caller prefills again): a damaged entry is never used."""
        path = self.path(key)
        try:
            data = _map(path)
        except FileNotFoundError:
            self.misses += 1
            return None
        try:
            layers = _decode(data, blobs)
        except Exception as exc:  # any damage at all: never use it
            self.refused += 1
            self.misses += 1
            path.unlink(missing_ok=True)
            warnings.warn(f"KV store entry {path} is damaged ({exc}); it was deleted and the document is read again",
                          stacklevel=2)
            return None
        os.utime(path)  # last use, for the least-recently-used pruning
        self.hits += 1
        return layers

    # ---- a prefill's state in and out ------------------------------------------------------------------------
    def restore(self, key: str, fill: Callable[[list[tuple[Any, Any]]], Any], blobs: bool = False) -> Any:
        """The cache ``fill`` makes of entry ``key`` (``fill_dynamic``, ``fill_tiered``), or None on a miss or an
        entry that does not fit it (checksummed but another shape: a warning names it, the caller prefills)."""
        layers = self.load(key, blobs=blobs)
        if layers is None:
            return None
        try:
            return fill(layers)
        except ValueError as exc:
            warnings.warn(f"KV store entry {self.path(key)} does not fit this cache ({exc}); the document is read "
                          "again", stacklevel=3)
            return None

    def keep(self, key: str, layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None, *, source: str, tokens: int,
             adopt_into: Any = None) -> bool:
        """Store a prefill's state (``save``) after its clock; ``adopt_into``: the tiered cache that made it, whose
        host archive then takes the entry's blocks (:func:`adopt_archives`). False when nothing was written: no
        state to keep, an entry over the size rule, or a full or read-only disk (a warning: the next run prefills
        again, nothing more)."""
        if layers is None:
            return False
        try:
            if self.save(key, layers, source=source, tokens=tokens) is None:
                return False
            if adopt_into is not None:
                blocks = self.load(key, blobs=True)
                if blocks is not None:
                    adopt_archives(adopt_into, blocks)
        except OSError as exc:
            warnings.warn(f"could not store the document's KV cache in {self.folder} ({exc}); the next run prefills "
                          "it again", stacklevel=3)
            return False
        return True

    # ---- housekeeping ----------------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry, most recently used first (tokens and source from each header; damaged ones say so)."""
        out = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name.startswith(".tmp-"):
                continue
            try:
                stat = path.stat()
                with path.open("rb") as f:
                    magic = f.read(len(MAGIC))
                    if magic in OLD_MAGICS:
                        out.append(Entry(path, stat.st_size, 0, "(old format, not used)", stat.st_mtime))
                        continue
                    if magic != MAGIC:
                        raise ValueError("not an entry")
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
                out.append(Entry(path, stat.st_size, int(header["tokens"]), str(header.get("source", "")),
                                 stat.st_mtime))
            except (OSError, ValueError, KeyError, struct.error):
                out.append(Entry(path, path.stat().st_size if path.exists() else 0, 0, "(damaged)", 0.0))
        return sorted(out, key=lambda e: -e.last_used)

    def prune(self, max_bytes: int | None = None) -> tuple[int, int]:
        """Delete least recently used entries until the folder holds at most ``max_bytes``; (entries, bytes) gone."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        entries = self.entries()
        total = sum(e.nbytes for e in entries)
        gone = freed = 0
        for entry in reversed(entries):  # least recently used first
            if total <= limit:
                break
            entry.path.unlink(missing_ok=True)
            total -= entry.nbytes
            gone, freed = gone + 1, freed + entry.nbytes
        return gone, freed

    def clear(self) -> tuple[int, int]:
        """Delete every entry (and stray temporary files); (entries, bytes) gone."""
        gone = freed = 0
        for path in list(self.folder.glob(f"*{SUFFIX}")):
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
            gone += 1
        return gone, freed


def _map(path: Path) -> mmap.mmap | bytes:
    """The entry's bytes, memory-mapped read-only: packed blocks that a tiered cache's archive adopts stay in the
    file, read by the operating system when a question reads them back and dropped by it under memory pressure,
    instead of living in the process's own memory. Safe against the store's writers: they replace an entry by
    renaming a new file over it, never by writing into the mapped one."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""  # mmap refuses empty files; _decode refuses this one
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _decode(data: bytes | mmap.mmap, blobs: bool = False) -> list[tuple[Any, Any]]:
    """Check and unpack one entry's bytes (``blobs``: check them, leave them packed, as views of ``data``); raises
    ValueError on any mismatch."""
    if len(data) < len(MAGIC) + 8 + _DIGEST or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a docfuse KV store entry, or truncated")
    # views, not slices: an entry is a hundred megabytes, and its planes are read where they lie in ``data``
    body, digest = memoryview(data)[:-_DIGEST], data[-_DIGEST:]
    if xxhash.xxh3_128(body).digest() != digest:
        raise ValueError("checksum mismatch")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    header = json.loads(bytes(body[start: start + n]))
    offset = start + n
    tensors = []
    for spec in header["tensors"]:
        planes = []
        for size in spec["planes"]:
            planes.append(body[offset: offset + size])
            offset += size
        dtype = _DTYPES[spec["dtype"]]
        blob = ExactBlob(dtype, tuple(spec["shape"]), planes, "lz4")
        tensors.append(blob if blobs else unpack_exact(blob))
    if offset != len(body) or len(tensors) % 2:
        raise ValueError("payload does not match its header")
    return [(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def tiered_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(keys, values) of a TieredCache straight after a token-major prefill, when every token is still in its
    core in position order (the exact state a question's re-tier starts from), cut layer by layer into the
    background archive's blocks; ``None`` otherwise (tiered during the prefill: that state is not stored). Stored
    in blocks, the entry becomes the archive as it is (:func:`fill_tiered`): a question's first re-tier then has
    nothing left to compress."""
    out = []
    for layer in cache.layers:
        if layer.n_assoc or layer.n_core != layer.length or not layer._core_in_order():
            return None
        for lo, hi in block_spans(layer.n_core, layer.archive.block_tokens):
            out.append((layer.keys[:, :, lo:hi], layer.values[:, :, lo:hi]))
    return out


def fill_tiered(cache: Any, blocks: Sequence[tuple[ExactBlob, ExactBlob]], device: torch.device,
                adopt: bool = True) -> Any:
    """An empty TieredCache given the state :func:`tiered_layers` took, as the packed blocks the store keeps:
    every token in the core, in order, and the same blocks adopted by each layer's archive without repacking
    (``adopt=False``: an archive that keeps exact K/V elsewhere, the engine's ``DeviceArchive``, fills itself from
    the core at the first re-tier, as after a prefill)."""
    layers = cache.layers
    if not blocks or len(blocks) % len(layers):
        raise ValueError(f"{len(blocks)} stored blocks do not split over {len(layers)} layers")
    per = len(blocks) // len(layers)
    pool = reader_pool()  # LZ4 and numpy release the GIL: on enough cores the blocks unpack side by side
    if torch.device(device).type == "cpu":  # each block straight into its layer's K/V: no per-block temporaries
        for i, layer in enumerate(layers):
            layer.store(*_unpacked_layer(blocks[i * per: (i + 1) * per], pool))
    else:
        blobs = [blob for pair in blocks for blob in pair]
        unpack = functools.partial(unpack_exact, device=device)  # on a GPU the planes interleave there
        tensors = list(pool.map(unpack, blobs) if pool is not None else map(unpack, blobs))
        for i, layer in enumerate(layers):
            keys, values = tensors[2 * i * per: 2 * (i + 1) * per: 2], tensors[2 * i * per + 1: 2 * (i + 1) * per: 2]
            layer.store(torch.cat(keys, dim=2).to(device), torch.cat(values, dim=2).to(device))
    if len({layer.length for layer in layers}) != 1:
        raise ValueError("the stored layers hold different numbers of tokens")
    if adopt and not adopt_archives(cache, blocks):
        raise ValueError("the stored blocks are not the archive's cut of the positions they hold")
    cache.peak_device = cache.device_bytes()
    return cache


def _unpacked_layer(pairs: Sequence[tuple[ExactBlob, ExactBlob]], pool: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values [B, H, T, D] on the host from its blocks in position order, each block unpacked
    into its own span (``unpack_exact_into``)."""
    out = []
    for side in (0, 1):
        first = pairs[0][side]
        shape = list(first.shape)
        shape[2] = sum(pair[side].shape[2] for pair in pairs)
        out.append(torch.empty(shape, dtype=first.dtype))
    jobs, at = [], 0
    for k, v in pairs:
        jobs += [(k, out[0][:, :, at: at + k.shape[2]]), (v, out[1][:, :, at: at + v.shape[2]])]
        at += k.shape[2]
    run = lambda job: unpack_exact_into(*job)  # noqa: E731
    list(pool.map(run, jobs) if pool is not None else map(run, jobs))
    return out[0], out[1]


def adopt_archives(cache: Any, blocks: Sequence[tuple[ExactBlob, ExactBlob]]) -> bool:
    """Hand a TieredCache that :func:`tiered_layers` has just stored its own entry's blocks (as loaded: views of the
    memory-mapped file) as each layer's archive, so that the first re-tier has nothing to compress and the archive
    is file-backed (page cache the OS may reclaim) rather than the process's own memory. False, and nothing
    changed, when the blocks are not the cut :func:`tiered_layers` makes of this cache."""
    layers = cache.layers
    spans = [block_spans(layer.length, layer.archive.block_tokens) for layer in layers]
    if len(blocks) != sum(len(s) for s in spans) or any(layer.archive.length for layer in layers):
        return False
    at, plan = 0, []
    for layer, cut in zip(layers, spans):
        mine = blocks[at: at + len(cut)]
        at += len(cut)
        if any(k.shape[2] != hi - lo or v.shape[2] != hi - lo for (lo, hi), (k, v) in zip(cut, mine)):
            return False
        plan.append([(lo, hi, k, v) for (lo, hi), (k, v) in zip(cut, mine)])
    for layer, adopted in zip(layers, plan):
        layer.archive.adopt(adopted)
    return True


def fill_dynamic(config: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> Any:
    """A DynamicCache holding ``layers`` on ``device``: the state a prefill of the same prefix leaves."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers):
        cache.update(k.to(device), v.to(device), i)
    return cache
