"""Arrow schemas shared between stages: the data contracts of docs/ARCHITECTURE.md.

Coordinates are PDF points, origin at the page's top left. Every table carries ``doc_id`` and, where it
applies, ``page`` (0-based), and ends with ``error`` (null on good rows, ``"kind: message"`` on bad ones).
"""

import pyarrow as pa

from docfuse.pipelines.sources import SOURCE_SCHEMA

ERROR = pa.field("error", pa.string())
DOC = [pa.field("doc_id", pa.string()), pa.field("source", pa.string())]

#: What the engine reads from --input: one row per document, with its bytes.
SOURCE = SOURCE_SCHEMA

#: pdf.open: one row per document, decrypted and repaired, ready for the page stages.
PDF_DOC = pa.schema(DOC + [pa.field("pdf", pa.large_binary()), pa.field("n_pages", pa.int32()), ERROR])

WORD = pa.struct([
    ("text", pa.string()),
    ("x0", pa.float32()), ("y0", pa.float32()), ("x1", pa.float32()), ("y1", pa.float32()),
    ("block", pa.int32()), ("line", pa.int32()),
])
BLOCK = pa.struct([
    ("x0", pa.float32()), ("y0", pa.float32()), ("x1", pa.float32()), ("y1", pa.float32()),
    ("kind", pa.string()),   # heading | body | footnote | table | header | footer
    ("level", pa.int8()),    # heading level 1..3, 0 otherwise
    ("order", pa.int32()),   # position in reading order
    ("text", pa.string()),
])

#: pdf.text / text.pages: one row per page; the pdf_extract contract.
PAGE_TEXT = pa.schema(DOC + [
    pa.field("page", pa.int32()),
    pa.field("text", pa.string()),
    pa.field("image_only", pa.bool_()),
    pa.field("n_words", pa.int32()),
    # pdf.text: where the text came from (layer, ocr, none) and the OCR's mean word confidence (0-1)
    pa.field("text_source", pa.string()),
    pa.field("ocr_confidence", pa.float32()),
    # pdf.text: why this page's text may read worse than usual (a page past the layout's work budget), else null
    pa.field("warning", pa.string()),
    ERROR,
])
#: Extra columns pdf.text adds with ``layout: true``.
PAGE_LAYOUT_FIELDS = [
    pa.field("page_width", pa.float32()), pa.field("page_height", pa.float32()),
    pa.field("words", pa.list_(WORD)), pa.field("blocks", pa.list_(BLOCK)),
]

#: pdf.render: one row per page, a PNG.
PAGE_IMAGE = pa.schema(DOC + [
    pa.field("page", pa.int32()),
    pa.field("page_width", pa.float32()), pa.field("page_height", pa.float32()),
    pa.field("dpi", pa.float32()),
    pa.field("width_px", pa.int32()), pa.field("height_px", pa.int32()),
    pa.field("image", pa.large_binary()),
    ERROR,
])

#: decode.generate: the pdf_qa contract, one row per (document, question).
QA = pa.schema(DOC + [
    pa.field("question", pa.string()),
    pa.field("answer", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("ttft_s", pa.float64()),
    pa.field("decode_tokens_per_s", pa.float64()),
    pa.field("kv_device_bytes", pa.int64()),
    pa.field("kv_host_bytes", pa.int64()),
    pa.field("kv_full_bytes", pa.int64()),
    pa.field("skipped_fraction", pa.float64()),
    pa.field("peak_memory_bytes", pa.int64()),
    pa.field("pages_used", pa.list_(pa.int32())),
    pa.field("truncated", pa.bool_()),
    pa.field("cited_pages", pa.list_(pa.int32())),
    ERROR,
])


def empty_row(schema: pa.Schema, **values) -> dict:
    """A row of ``schema`` with the given values and nulls elsewhere."""
    return {name: values.get(name) for name in schema.names}
