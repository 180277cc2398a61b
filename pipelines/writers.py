"""Table writers for a run's output file, chosen by its suffix: Parquet (default), CSV, or JSON Lines.

Parquet keeps every column as it is. CSV and JSON Lines are for people and tools that want text: a CSV cell holds
one value, so list, struct and map columns are written as JSON text, and bytes as base64 (a JSON Lines row keeps its
lists and structs as JSON, bytes as base64). Every writer streams: batches are written as they come.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

#: Output suffixes and what they write.
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class TableWriter(Protocol):
    def write_table(self, table: pa.Table) -> None: ...

    def close(self) -> None: ...


def output_format(path: str | Path) -> str:
    """The format a path's suffix asks for (a path without a suffix is Parquet); ValueError naming the choices."""
    suffix = Path(path).suffix.lower()
    if not suffix:
        return "parquet"
    if suffix not in FORMATS:
        raise ValueError(f"--output {path}: docfuse writes .parquet, .csv or .jsonl (.ndjson), not {suffix}; "
                         f"e.g. -o {Path(path).with_suffix('.parquet')}")
    return FORMATS[suffix]


def _flat(field: pa.Field) -> bool:
    t = field.type
    return not (pa.types.is_nested(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or pa.types.is_fixed_size_binary(t) or isinstance(t, pa.ExtensionType))


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _as_text(column: pa.ChunkedArray) -> pa.Array:
    """A nested or binary column as one string per row (JSON; bytes as base64); nulls stay null."""
    return pa.array([None if v is None else (_jsonable(v) if isinstance(v, bytes) else
                                             json.dumps(_jsonable(v), ensure_ascii=False))
                     for v in column.to_pylist()], pa.string())


class CsvWriter:
    """CSV with a header row; nested and binary columns as text (see the module docstring)."""

    def __init__(self, path: str | Path, schema: pa.Schema) -> None:
        self.text = [not _flat(f) for f in schema]
        self.schema = pa.schema([pa.field(f.name, pa.string()) if t else f for f, t in zip(schema, self.text)])
        self.sink = open(path, "wb")
        self.writer = pcsv.CSVWriter(self.sink, self.schema)

    def write_table(self, table: pa.Table) -> None:
        columns = [_as_text(table.column(i)) if t else table.column(i) for i, t in enumerate(self.text)]
        self.writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))

    def close(self) -> None:
        self.writer.close()
        self.sink.close()


class JsonLinesWriter:
    """One JSON object per row, keys in the schema's order."""

    def __init__(self, path: str | Path, schema: pa.Schema) -> None:
        self.sink = open(path, "w", encoding="utf-8")

    def write_table(self, table: pa.Table) -> None:
        for row in table.to_pylist():
            self.sink.write(json.dumps(_jsonable(row), ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.sink.close()


def open_writer(path: str | Path, schema: pa.Schema, fmt: str | None = None) -> TableWriter:
    """A streaming writer of ``schema`` tables to ``path`` in ``fmt`` (default: by the suffix of ``path``)."""
    fmt = fmt or output_format(path)
    if fmt == "csv":
        return CsvWriter(path, schema)
    if fmt == "jsonl":
        return JsonLinesWriter(path, schema)
    return pq.ParquetWriter(str(path), schema)
