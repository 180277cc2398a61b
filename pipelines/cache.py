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


class StageCache:
    def __init__(self, root: str | os.PathLike | None) -> None:
        self.root = Path(root) if root else None
        self.hits = 0
        self.writes = 0

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
