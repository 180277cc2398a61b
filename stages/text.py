"""text.pages: plain-text and Markdown documents as pages, in the same contract pdf.text produces.

So a decoder (or pdf_extract's consumer) reads a ``.txt`` or ``.md`` file exactly like a PDF's text layer: one row
per page with ``text``, ``image_only`` (always false here) and ``n_words``.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import ClassVar, Literal

import pyarrow as pa
from pydantic import Field

from docfuse.pipelines.registry import register
from docfuse.pipelines.stage import Stage, StageParams, error_value
from docfuse.stages import schemas
from docfuse.stages.text_decode import NotText, decode_text, looks_like_pdf
from docfuse.stages.text_split import split_pages

MARKDOWN_SUFFIXES = frozenset({".md", ".markdown", ".mdown", ".mkd", ".mkdn"})


class TextPagesParams(StageParams):
    page_chars: int = Field(3000, ge=100, description="target page size in characters when the file has no form feeds")
    format: Literal["auto", "text", "markdown"] = Field(
        "auto", description="markdown splits at headings and keeps code fences whole; auto decides by file suffix"
    )


@register
class TextPages(Stage):
    """Plain-text and Markdown sources to pages: split at form feeds, else at paragraphs (Markdown: headings)."""

    kind = "text.pages"
    version = "2"  # 2: the warning column of PAGE_TEXT
    Params = TextPagesParams
    inputs: ClassVar[dict[str, pa.Schema]] = {
        "sources": pa.schema([f for f in schemas.SOURCE if f.name in ("doc_id", "source", "data")]),
    }
    output_schema = schemas.PAGE_TEXT

    def run(self, sources: pa.Table) -> pa.Table:
        rows: list[dict] = []
        columns = (sources.column(name).to_pylist() for name in ("doc_id", "source", "data"))
        for doc_id, source, data in zip(*columns):
            rows.extend(self._pages(doc_id, source, data))
        return pa.Table.from_pylist(rows, schema=self.output_schema)

    def _pages(self, doc_id: str, source: str | None, data: bytes | None) -> list[dict]:
        name = repr(source or doc_id)
        if not data:
            return [_error(doc_id, source, "empty_file", f"{name} has no bytes; check the path or leave the file out")]
        if looks_like_pdf(data):
            return [_error(doc_id, source, "not_text",
                           f"{name} is a PDF, not text; use the pdf_* pipelines (pdf_extract, pdf_qa) for it")]
        try:
            text, _encoding = decode_text(data)
        except NotText as exc:
            return [_error(doc_id, source, "not_text", f"{name} is not a text file: {exc}; save it as UTF-8 .txt "
                                                      "or .md, or feed PDFs to the pdf_* pipelines")]
        if not text.strip():
            return [_error(doc_id, source, "empty_file", f"{name} holds only whitespace; add text or leave the file out")]
        pages = split_pages(text, self.params.page_chars, markdown=self._is_markdown(source))
        return [
            schemas.empty_row(self.output_schema, doc_id=doc_id, source=source, page=i, text=page,
                              image_only=False, n_words=len(page.split()))
            for i, page in enumerate(pages)
        ]

    def _is_markdown(self, source: str | None) -> bool:
        if self.params.format != "auto":
            return self.params.format == "markdown"
        return PurePath(source or "").suffix.lower() in MARKDOWN_SUFFIXES


def _error(doc_id: str, source: str | None, kind: str, message: str) -> dict:
    return schemas.empty_row(schemas.PAGE_TEXT, doc_id=doc_id, source=source, error=error_value(kind, message))
