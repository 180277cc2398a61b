"""The stage-output cache: one Arrow IPC file per (stage, batch of documents).

A key hashes the stage's kind, version and parameters, the pipeline params it reads, and the keys of its
inputs (which reach back to the documents' ids, themselves hashes of their bytes). Files are written to a
temporary name and renamed, so a run killed at any instant leaves only whole entries; the next run resumes from
them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc


def stable_hash(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:24]


def default_max_bytes() -> int:
    """The cache's size cap: ``DOCFUSE_CACHE_MAX_GB`` (default 10) gigabytes."""
    try:
        return int(float(os.environ.get("DOCFUSE_CACHE_MAX_GB", "10")) * 1e9)
    except ValueError:
        return int(10e9)


class StageCache:
    """Entries under ``root``; past ``max_bytes`` the least recently used entries go (a hit counts as a use).

    ``max_bytes=None`` means :func:`default_max_bytes`."""

    def __init__(self, root: str | os.PathLike | None, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root else None
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.hits = 0
        self.writes = 0
        self.evicted = 0
        self._total: int | None = None  # bytes held, counted once from disk and then kept up to date by put()

    def _path(self, stage: str, key: str) -> Path:
        assert self.root is not None
        return self.root / stage / f"{key}.arrow"

    def get(self, stage: str, key: str) -> pa.Table | None:
        if self.root is None:
            return None
        path = self._path(stage, key)
        if not path.is_file():
            return None
        try:
            with pa.memory_map(str(path)) as source:
                table = ipc.open_file(source).read_all()
        except (pa.ArrowInvalid, OSError):
            return None  # unreadable entry: recompute and overwrite it
        self.hits += 1
        try:
            os.utime(path)  # a use: the entry is the most recent for eviction
        except OSError:
            pass
        return table

    def put(self, stage: str, key: str, table: pa.Table) -> None:
        if self.root is None:
            return
        path = self._path(stage, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh, ipc.new_file(fh, table.schema) as writer:
                writer.write_table(table)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.writes += 1
        if self._total is None:
            self._total = sum(size for _, size, _ in self.entries())
        else:
            self._total += path.stat().st_size
        if self._total > self.max_bytes:  # only then walk the folder (another process may have written too)
            self._evict(keep=path)

    def entries(self) -> list[tuple[Path, int, float]]:
        """Every entry as (path, bytes, last use), oldest first."""
        if self.root is None or not self.root.is_dir():
            return []
        out = []
        for path in self.root.glob("*/*.arrow"):
            try:
                st = path.stat()
            except OSError:
                continue
            out.append((path, st.st_size, st.st_mtime))
        return sorted(out, key=lambda e: e[2])

    def _evict(self, keep: Path) -> None:
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            total -= size
            self.evicted += 1
        self._total = total

    def info(self) -> dict[str, tuple[int, int]]:
        """Per stage: (entries, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for path, size, _ in self.entries():
            n, b = out.get(path.parent.name, (0, 0))
            out[path.parent.name] = (n + 1, b + size)
        return out

    def clear(self, stage: str | None = None) -> tuple[int, int]:
        """Remove every entry (or one stage's); returns (entries, bytes) removed."""
        removed = freed = 0
        for path, size, _ in self.entries():
            if stage is None or path.parent.name == stage:
                path.unlink(missing_ok=True)
                removed, freed = removed + 1, freed + size
        self._total = None
        return removed, freed
