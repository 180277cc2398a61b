"""Small stages for engine tests: real Arrow in and out, no models, behaviour the tests can steer."""

from __future__ import annotations

import time
from typing import Literal

import pyarrow as pa
from pydantic import Field

from docfuse.pipelines.registry import register
from docfuse.pipelines.sources import SOURCE_SCHEMA
from docfuse.pipelines.stage import Stage, StageParams, Unread, error_value

LINES = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("page", pa.int32()),
                   ("text", pa.string()), ("error", pa.string())])
COUNTS = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("page", pa.int32()),
                    ("n_chars", pa.int64()), ("error", pa.string())])


class SplitParams(StageParams):
    delay_s: float = Field(0.0, ge=0, description="Sleep per document, to make runs slow enough to kill.")
    fail_on: str | None = Field(None, description="Raise when a document contains this text.")


@register
class SplitLines(Stage):
    """Split text documents into one row per line ('page'); 'BAD' documents become error rows."""

    kind = "test.lines"
    Params = SplitParams
    inputs = {"sources": SOURCE_SCHEMA}
    output_schema = LINES
    setups = 0

    def setup(self) -> None:
        type(self).setups += 1

    def run(self, sources: pa.Table) -> pa.Table:
        rows = []
        for r in sources.to_pylist():
            time.sleep(self.params.delay_s)
            text = r["data"].decode("utf-8", "replace")
            if self.params.fail_on and self.params.fail_on in text:
                raise RuntimeError(f"cannot split {r['source']}")
            if text.startswith("BAD"):
                rows.append({"doc_id": r["doc_id"], "source": r["source"], "page": None, "text": None,
                             "error": error_value("bad_doc", "starts with BAD; remove it")})
                continue
            for i, line in enumerate(text.splitlines()):
                rows.append({"doc_id": r["doc_id"], "source": r["source"], "page": i, "text": line, "error": None})
        return pa.Table.from_pylist(rows, schema=LINES)


class CountParams(StageParams):
    upper: bool = False


@register
class CountChars(Stage):
    """Count characters per line."""

    kind = "test.count"
    Params = CountParams
    inputs = {"lines": pa.schema([("doc_id", pa.string()), ("page", pa.int32()), ("text", pa.string())])}
    output_schema = COUNTS
    runs = 0

    def run(self, lines: pa.Table) -> pa.Table:
        type(self).runs += 1
        rows = [{"doc_id": r["doc_id"], "source": r["source"], "page": r["page"], "n_chars": len(r["text"]),
                 "error": None} for r in lines.to_pylist()]
        return pa.Table.from_pylist(rows, schema=COUNTS)


@register
class NeedsInts(Stage):
    """Consumes an int64 'text' column, to provoke a schema mismatch."""

    kind = "test.needs_ints"
    inputs = {"lines": pa.schema([("doc_id", pa.string()), ("text", pa.int64())])}
    output_schema = COUNTS

    def run(self, lines: pa.Table) -> pa.Table:  # pragma: no cover - never valid
        return COUNTS.empty_table()


@register
class JoinCounts(Stage):
    """Two inputs: lines and counts, joined on (doc_id, page)."""

    kind = "test.join"
    inputs = {"lines": LINES, "counts": pa.schema([("doc_id", pa.string()), ("n_chars", pa.int64())])}
    output_schema = COUNTS

    def run(self, lines: pa.Table, counts: pa.Table) -> pa.Table:
        return counts


class PickParams(StageParams):
    use: Literal["both", "lines", "lines quietly"] = "both"


@register
class PickCounts(Stage):
    """Lines with their counts, or with -1 when told to ignore the counts (then the plan skips what makes them)."""

    kind = "test.pick"
    Params = PickParams
    inputs = {"lines": LINES, "counts": pa.schema([("doc_id", pa.string()), ("page", pa.int32()),
                                                  ("n_chars", pa.int64())])}
    output_schema = COUNTS
    seen_counts: list[int] = []

    def unread_inputs(self) -> dict[str, Unread]:
        if self.params.use == "both":
            return {}
        if self.params.use == "lines quietly":
            return {"counts": Unread("use: lines quietly")}
        return {"counts": Unread("told to use lines only", {"use": "both"}, "counting every line")}

    def run(self, lines: pa.Table, counts: pa.Table) -> pa.Table:
        type(self).seen_counts.append(counts.num_rows)
        n = {(r["doc_id"], r["page"]): r["n_chars"] for r in counts.to_pylist()}
        rows = [{"doc_id": r["doc_id"], "source": r["source"], "page": r["page"],
                 "n_chars": n.get((r["doc_id"], r["page"]), -1), "error": None} for r in lines.to_pylist()]
        return pa.Table.from_pylist(rows, schema=COUNTS)
