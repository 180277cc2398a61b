"""Read --input into bounded Arrow batches of documents.

Inputs are files, folders (searched recursively for documents), globs, and Arrow/Parquet datasets with a column
of paths or of bytes. Each document becomes one row ``doc_id, source, data, error``; ``doc_id`` is a hash of the
bytes plus the path, so it is stable across runs and distinct for equal bytes at two paths. A path that cannot
be read becomes an error row, not an exception. Batches hold at most ``batch_docs`` documents, so memory does
not grow with the corpus.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from docfuse.pipelines.stage import error_value

SOURCE_SCHEMA = pa.schema([
    pa.field("doc_id", pa.string()),
    pa.field("source", pa.string()),
    pa.field("data", pa.large_binary()),
    pa.field("error", pa.string()),
])
#: The name under which the documents given as input travel: the input of every stage without ``from`` (validate.py)
#: and the key of a batch's SOURCE table among its stage tables (both executors). No stage may take this name.
SOURCES = "__sources__"
DOCUMENT_SUFFIXES = {".pdf", ".txt", ".md", ".markdown"}
DATASET_SUFFIXES = {".parquet": "parquet", ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc"}
BYTES_COLUMNS = ("data", "bytes", "content", "pdf")
PATH_COLUMNS = ("path", "source", "file", "filename")


def doc_id_for(data: bytes, source: str) -> str:
    h = hashlib.sha256()
    h.update(hashlib.sha256(data).digest())
    h.update(source.encode())
    return h.hexdigest()[:20]


@dataclass
class Entry:
    """One document to read: a path on disk, or bytes already in hand (from a dataset)."""

    source: str
    path: str | None = None
    data: bytes | None = None
    error: str | None = None


class InputError(ValueError):
    """A usage problem with --input as a whole (as opposed to one unreadable document)."""


def expand(inputs: Sequence[str | os.PathLike], column: str | None = None) -> Iterator[Entry]:
    """Every document the inputs name, in a stable order."""
    if not inputs:
        raise InputError("no input given: pass --input FILE, a folder, a glob or a Parquet/Arrow dataset")
    for item in inputs:
        text = str(item)
        path = Path(text)
        if any(ch in text for ch in "*?[") and not path.exists():
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise InputError(f"--input {text}: the glob matches no file; check the pattern and folder")
            for m in matches:
                yield from _expand_path(Path(m), column)
        else:
            yield from _expand_path(path, column)


def _expand_path(path: Path, column: str | None) -> Iterator[Entry]:
    if path.is_dir():
        found = False
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                p = Path(root) / name
                if p.suffix.lower() in DOCUMENT_SUFFIXES:
                    found = True
                    yield Entry(source=str(p), path=str(p))
                elif p.suffix.lower() in DATASET_SUFFIXES:
                    found = True
                    yield from _dataset_entries(p, column)
        if not found:
            raise InputError(f"--input {path}: the folder holds no .pdf, .txt, .md, .parquet or .arrow file")
    elif path.suffix.lower() in DATASET_SUFFIXES and path.is_file():
        yield from _dataset_entries(path, column)
    else:
        yield Entry(source=str(path), path=str(path))


def _dataset_entries(path: Path, column: str | None) -> Iterator[Entry]:
    dataset = ds.dataset(str(path), format=DATASET_SUFFIXES[path.suffix.lower()])
    names = dataset.schema.names
    col = column or next((c for c in BYTES_COLUMNS + PATH_COLUMNS if c in names), None)
    if col is None or col not in names:
        raise InputError(
            f"--input {path}: no column of paths or bytes found (columns: {', '.join(names)}); "
            f"name one with --column, or call it one of {', '.join(BYTES_COLUMNS + PATH_COLUMNS)}"
        )
    typ = dataset.schema.field(col).type
    is_bytes = pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
    if not is_bytes and not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise InputError(f"--input {path}: column '{col}' is {typ}; it must hold paths (string) or bytes (binary)")
    name_col = next((c for c in PATH_COLUMNS if c in names and c != col), None) if is_bytes else None
    cols = [col] + ([name_col] if name_col else [])
    row = 0
    for batch in dataset.to_batches(columns=cols, batch_size=64):
        values = batch.column(0).to_pylist()
        labels = batch.column(1).to_pylist() if name_col else [None] * len(values)
        for value, label in zip(values, labels):
            if is_bytes:
                if value is None:
                    yield Entry(source=f"{path}#{row}", error=error_value(
                        "missing_data", f"row {row} of {path} has no bytes in column '{col}'"))
                else:
                    yield Entry(source=label or f"{path}#{row}", data=value)
            elif value is None:
                yield Entry(source=f"{path}#{row}", error=error_value(
                    "missing_path", f"row {row} of {path} has no path in column '{col}'"))
            else:
                p = Path(value)
                if not p.is_absolute():
                    p = path.parent / p if (path.parent / p).exists() else p
                yield Entry(source=str(value), path=str(p))
            row += 1


def read_entry(entry: Entry) -> dict:
    """One SOURCE row for ``entry``: its bytes read here; a path that cannot be read gives an error row instead."""
    data, error = entry.data, entry.error
    if data is None and error is None:
        try:
            data = Path(entry.path).read_bytes()
        except FileNotFoundError:
            error = error_value("unreadable", f"{entry.path} does not exist; check the path")
        except IsADirectoryError:
            error = error_value("unreadable", f"{entry.path} is a folder; pass the folder itself as --input")
        except PermissionError:
            error = error_value("unreadable", f"no permission to read {entry.path}; fix its permissions")
        except OSError as exc:
            error = error_value("unreadable", f"cannot read {entry.path}: {exc.strerror or exc}")
    return {
        "doc_id": doc_id_for(data or b"", entry.source),
        "source": entry.source,
        "data": data if error is None else None,
        "error": error,
    }


def table_batches(table: pa.Table, batch_docs: int) -> list[pa.Table]:
    """A SOURCE table given in memory, cut into slices of at most ``batch_docs`` documents (zero-copy)."""
    return [table.slice(i, batch_docs) for i in range(0, table.num_rows, batch_docs)]


def count(inputs: Sequence[str | os.PathLike], column: str | None = None) -> int:
    """How many documents the inputs name (cheap: reads no document bytes)."""
    return sum(1 for _ in expand(inputs, column))


def read_batches(
    inputs: Sequence[str | os.PathLike], batch_docs: int = 8, column: str | None = None
) -> Iterator[pa.Table]:
    """The documents as SOURCE_SCHEMA tables of at most ``batch_docs`` rows each."""
    if batch_docs < 1:
        raise InputError("batch_docs must be at least 1")
    rows: list[dict] = []
    for entry in expand(inputs, column):
        rows.append(read_entry(entry))
        if len(rows) == batch_docs:
            yield pa.Table.from_pylist(rows, schema=SOURCE_SCHEMA)
            rows = []
    if rows:
        yield pa.Table.from_pylist(rows, schema=SOURCE_SCHEMA)
