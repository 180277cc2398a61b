"""The PDF stages: ``pdf.open`` (check, decrypt, repair), ``pdf.text`` (text layer in reading order, headings,
tables as Markdown, footnotes last) and ``pdf.render`` (pages as PNG within a pixel budget).

Every stage takes a batch of documents and turns whatever goes wrong with one document, or one page, into an
error row for it; the rest of the batch is unaffected.
"""

from __future__ import annotations

import contextlib
import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pyarrow as pa
import pymupdf
from pydantic import Field

from docfuse.pipelines.registry import register
from docfuse.pipelines.stage import Stage, StageParams, error_value
from docfuse.stages import schemas
from docfuse.stages.pdf_extract import PageContent, extract_page
from docfuse.stages.pdf_layout import Block, DocStyle, doc_style, layout_page
from docfuse.stages.pdf_lines import (LineNumber, LineNumbers, attach_raised_markers, drop_duplicate_words,
                                      join_label_values, join_spaced_letters, restore_line_numbers,
                                      take_line_numbers)
from docfuse.stages.pdf_ocr import OcrPool, OcrUnavailable
from docfuse.stages.pdf_open import PdfOpenError, open_pdf
from docfuse.stages.pdf_tables import PageTable, TablesMode, find_page_tables, word_tables

#: Absolute guard, whatever max_pixels says: no image side beyond this (MuPDF and most PNG readers cope,
#: and one such page already takes ~3 GiB as RGB at the side limit squared, so max_pixels binds long before).
MAX_SIDE_PX = 32768
#: Ceiling for the max_pixels parameter: 256 Mpx is 768 MiB of RGB for one page.
MAX_PIXELS_CEILING = 256_000_000
LOG = logging.getLogger(__name__)
#: Below this a page image is too coarse for OCR: the page becomes an error row instead.
MIN_OCR_DPI = 50

_PDF_IN = pa.schema([f for f in schemas.PDF_DOC if f.name in ("doc_id", "source", "pdf")])


def _docs(table: pa.Table, column: str):
    """(doc_id, source, value, error) per row; ``error`` is an upstream error to pass on (the engine
    normally filters those rows out before they get here)."""
    n = table.num_rows
    errors = table.column("error").to_pylist() if "error" in table.column_names else [None] * n
    return zip(table.column("doc_id").to_pylist(), table.column("source").to_pylist(),
               table.column(column).to_pylist(), errors)


def _open_bytes(pdf: bytes | None) -> pymupdf.Document:
    """Reopen what pdf.open produced; raises PdfOpenError when the bytes are not that."""
    if not pdf:
        raise PdfOpenError("empty_file", "the document has no bytes; run pdf.open before this stage")
    try:
        doc = pymupdf.open(stream=pdf, filetype="pdf")
    except Exception as exc:
        raise PdfOpenError("corrupt", f"MuPDF cannot open the document ({exc}); run pdf.open before this "
                           "stage, or re-export the PDF") from exc
    if doc.needs_pass:
        doc.close()
        raise PdfOpenError("encrypted", "the document is still encrypted; run pdf.open with "
                           "--set pages.password=... before this stage")
    return doc


def _extraction_failed(exc: Exception) -> str:
    """The error of a document whose text extraction failed outside any one page."""
    return error_value("corrupt", f"text extraction failed ({type(exc).__name__}: {exc}); re-export the PDF")


def _page_error(page: int, exc: Exception) -> str:
    return error_value("page_unreadable", f"MuPDF could not read page {page} ({type(exc).__name__}: {exc}); "
                       "the other pages are fine; re-export or print the PDF to a new file to repair it")


# --- pdf.open ---------------------------------------------------------------------------------------------

class PdfOpenParams(StageParams):
    password: str | None = Field(None, description="user (open) password of encrypted PDFs; applies to every "
                                 "document in the run")


@register
class PdfOpen(Stage):
    """Open PDFs: detect non-PDFs and empty files, decrypt with the password, repair broken xref tables."""

    kind = "pdf.open"
    version = "1"
    Params = PdfOpenParams
    inputs: ClassVar[dict[str, pa.Schema]] = {
        "sources": pa.schema([f for f in schemas.SOURCE if f.name in ("doc_id", "source", "data")]),
    }
    output_schema = schemas.PDF_DOC

    def run(self, sources: pa.Table) -> pa.Table:
        rows = []
        for doc_id, source, data, upstream in _docs(sources, "data"):
            row = schemas.empty_row(self.output_schema, doc_id=doc_id, source=source, error=upstream)
            if upstream:
                rows.append(row)
                continue
            try:
                opened = open_pdf(bytes(data or b""), self.params.password)
                row.update(pdf=opened.pdf, n_pages=opened.n_pages)
            except PdfOpenError as exc:
                row["error"] = error_value(exc.kind, exc.message)
            except Exception as exc:  # MuPDF can raise almost anything on hostile input
                row["error"] = error_value("corrupt", f"MuPDF failed on the file ({type(exc).__name__}: {exc}); "
                                           "re-export it, or print it to a new PDF")
            rows.append(row)
        return pa.Table.from_pylist(rows, schema=self.output_schema)


# --- pdf.text ---------------------------------------------------------------------------------------------

class PdfTextParams(StageParams):
    layout: bool = Field(False, description="add page size, words with boxes and blocks (PAGE_LAYOUT_FIELDS)")
    tables: TablesMode = Field("auto", description="ruled-table detection: auto runs find_tables where the "
                               "page's drawings form a grid; always on every page; never turns tables off")
    min_words: int = Field(3, ge=0, description="a page with fewer words whose images cover at least "
                           "min_image_cover of it counts as a scan (image_only)")
    min_image_cover: float = Field(0.5, ge=0.0, le=1.0)
    ocr: Literal["auto", "always", "never"] = Field(
        "auto", description="auto OCRs the pages without a usable text layer (scans, fonts without a Unicode map); "
        "always OCRs every page (the text layer is kept where OCR finds nothing); never leaves scans empty")
    languages: list[str] = Field(["eng"], min_length=1, description="Tesseract languages to read (eng, fra, deu, ...; "
                                 "each needs its tesseract-ocr-<lang> package)")
    ocr_dpi: float = Field(300, gt=0, le=2400, description="resolution pages are OCR'd at")
    max_layout_words: int = Field(6000, ge=1, description="work budget: a page with more words is read in "
                                  "PyMuPDF's own order (no tables, no layout), and its row says so in warning")
    line_numbers: LineNumbers = Field("keep", description="margin line numbers (transcripts, pleadings): keep puts "
                                      "each at the start of the line it numbers, drop leaves them out")
    ocr_max_pixels: int = Field(12_000_000, ge=1, le=MAX_PIXELS_CEILING,
                                description="pixel budget of a page image for OCR: larger pages are read at a lower "
                                            "dpi")


@register
class PdfText(Stage):
    """Text layer per page: reading order across columns, Markdown headings and tables, footnotes last.

    A page without a usable text layer (a scan, vector-drawn text, or text in a font without /ToUnicode whose
    characters come out as U+FFFD, control codes or raw glyph codes) gets ``image_only=True`` and, with ``ocr:
    auto`` (the default), the words Tesseract reads from its image, laid out like a text layer's
    (stages/pdf_ocr.py); ``text_source`` says which (``layer``, ``ocr``, ``none``) and ``ocr_confidence`` how sure
    the OCR was. With ``ocr: never``, or when OCR finds nothing, its text is empty and the rendered page is what
    carries it. A page that needs OCR where Tesseract is missing is an error row naming the install step.
    """

    kind = "pdf.text"
    version = "3"  # 3: line repairs (issue 28), the warning column
    Params = PdfTextParams
    inputs: ClassVar[dict[str, pa.Schema]] = {"pages": _PDF_IN}
    output_schema = schemas.PAGE_TEXT

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Pages seen and pages find_tables ran on, summed over runs: what the table gate costs.
        self.stats = {"pages": 0, "find_tables_pages": 0, "tables": 0, "ocr_pages": 0}

    def output(self) -> pa.Schema:
        if not self.params.layout:
            return self.output_schema
        fields = [f for f in schemas.PAGE_TEXT if f.name != "error"]
        return pa.schema(fields + schemas.PAGE_LAYOUT_FIELDS + [schemas.ERROR])

    def run(self, pages: pa.Table) -> pa.Table:
        """Every document's pages are extracted first, their OCR running meanwhile in the pool's threads (so the
        scans of a batch of one-page documents are read side by side), then each document is laid out."""
        schema = self.output()
        docs: list[tuple[dict, list | None]] = []  # (row base, the pages of the document or None after an error row)
        rows: list[dict] = []
        with contextlib.ExitStack() as stack:
            pool = _LazyPool(self.params, stack)
            for doc_id, source, pdf, upstream in _docs(pages, "pdf"):
                base = {"doc_id": doc_id, "source": source}
                if upstream:
                    docs.append(({**base, "error": upstream}, None))
                    continue
                try:
                    doc = _open_bytes(pdf)
                except PdfOpenError as exc:
                    docs.append(({**base, "error": error_value(exc.kind, exc.message)}, None))
                    continue
                try:
                    extracted = self._extract(doc)
                    if self.params.ocr != "never":
                        self._submit_ocr(doc, extracted, pool)
                    docs.append((base, extracted))
                except Exception as exc:  # a failure outside any one page: the whole document
                    docs.append(({**base, "error": _extraction_failed(exc)}, None))
                finally:
                    doc.close()
            for base, extracted in docs:
                if extracted is None:
                    rows.append(schemas.empty_row(schema, **base))
                    continue
                try:
                    rows.extend(schemas.empty_row(schema, **base, **r) for r in self._layout(extracted))
                except Exception as exc:
                    rows.append(schemas.empty_row(schema, **base, error=_extraction_failed(exc)))
        return pa.Table.from_pylist(rows, schema=schema)

    def _extract(self, doc: pymupdf.Document) -> list[_Extracted | Exception]:
        """Every page's text layer and tables. The words of a batch's documents are held until they are laid out
        (some 100 bytes a word): a batch of 64 documents of 300 pages is a few hundred MB at most."""
        p = self.params
        extracted: list = []
        for number in range(doc.page_count):
            try:
                page = doc.load_page(number)
                content = extract_page(page, p.min_words, p.min_image_cover)
                words = len(content.words)
                if content.usable and words > p.max_layout_words:
                    extracted.append(_Extracted(content, [], image_only=False, source="layer",
                                                plain=_plain_text(page), warning=(
                                                    f"page has {words} words, more than pdf.text's work budget "
                                                    f"({p.max_layout_words}): read in PyMuPDF's order, without "
                                                    "tables or headings; raise text.max_layout_words to lay it out")))
                else:
                    numbers = repair_lines(content)
                    tables, ran = find_page_tables(page, content, p.tables)
                    self.stats["find_tables_pages"] += ran
                    self.stats["tables"] += len(tables)
                    extracted.append(_Extracted(content, tables, image_only=not content.usable,
                                                source="layer" if content.usable else "none", numbers=numbers))
            except Exception as exc:
                extracted.append(exc)
            self.stats["pages"] += 1
        return extracted

    def _submit_ocr(self, doc: pymupdf.Document, extracted: list, pool: _LazyPool) -> None:
        """Hand the pages that need OCR (``ocr: auto``: those without a usable text layer; ``always``: all) to the
        pool; each becomes ``(its extraction, a future)`` until ``_layout`` collects it. A page OCR cannot read
        becomes an error value that says why and what to install or set."""
        p = self.params
        for i, item in enumerate(extracted):
            if not isinstance(item, _Extracted) or (p.ocr == "auto" and item.content.usable):
                continue
            try:
                self._submit_page(doc, i, item, extracted, pool)
            except Exception as exc:  # one page's render or hand-over failed: that page says so, the rest go on
                if not item.content.usable:
                    extracted[i] = error_value("ocr_failed", f"OCR of page {i} failed ({type(exc).__name__}: "
                                               f"{exc}); the other pages are fine")

    def _submit_page(self, doc: pymupdf.Document, i: int, item: _Extracted, extracted: list, pool: _LazyPool) -> None:
        """Render page ``i`` for OCR at the dpi its pixel budget allows and hand it to the pool."""
        p = self.params
        page = doc.load_page(i)
        dpi = fit_dpi(float(page.rect.width), float(page.rect.height), p.ocr_dpi, p.ocr_max_pixels)
        if dpi < MIN_OCR_DPI:
            if not item.content.usable:
                extracted[i] = error_value("page_too_large", f"page {i} is too large to OCR within ocr_max_pixels "
                                           f"({p.ocr_max_pixels}) at {MIN_OCR_DPI} dpi or more; raise pdf.text's "
                                           "ocr_max_pixels")
            return
        if dpi < p.ocr_dpi:
            LOG.warning("page %d is OCR'd at %.0f dpi, not %.0f: the page image would exceed ocr_max_pixels",
                        i, dpi, p.ocr_dpi)
        try:
            extracted[i] = (item, pool.get().submit(page, dpi))
        except OcrUnavailable as exc:  # no engine or no language data: the page says what to install
            if not item.content.usable:
                extracted[i] = error_value("ocr_unavailable", str(exc))

    def _collect(self, number: int, item: _Extracted, future: Future) -> _Extracted | str:
        """A page's OCR result in place of its text layer (``always`` keeps the layer where OCR found nothing)."""
        try:
            result = future.result()
        except Exception as exc:
            if item.content.usable:
                return item
            kind = "ocr_unavailable" if isinstance(exc, OcrUnavailable) else "ocr_failed"
            return error_value(kind, f"OCR of page {number} failed ({exc}); the other pages are fine")
        self.stats["ocr_pages"] += 1
        if not result.content.usable and item.content.usable:
            return item
        numbers = repair_lines(result.content)
        # a scan's rulings are pixels, not drawings: its tables are the ones its words' alignment shows
        tables = word_tables(result.content) if result.content.usable and self.params.tables != "never" else []
        self.stats["tables"] += len(tables)
        return _Extracted(result.content, tables, image_only=item.image_only,
                          source="ocr" if result.content.usable else "none", confidence=result.confidence,
                          numbers=numbers)

    def _layout(self, extracted: list) -> list[dict]:
        """Lay the pages out with the document's font sizes (OCR results collected first, waiting where needed)."""
        extracted = [self._collect(i, *e) if isinstance(e, tuple) else e for i, e in enumerate(extracted)]
        # a page past the work budget is not laid out: its thousands of words would only slow the style's count
        style = doc_style([e.content for e in extracted
                           if isinstance(e, _Extracted) and e.content.usable and e.plain is None])
        rows = []
        for number, item in enumerate(extracted):
            if isinstance(item, str):  # an error value already (OCR)
                rows.append({"page": number, "image_only": True, "text_source": "none", "error": item})
                continue
            if isinstance(item, Exception):
                rows.append({"page": number, "error": _page_error(number, item)})
                continue
            try:
                rows.append(self._page_row(item, style))
            except Exception as exc:
                rows.append({"page": number, "error": _page_error(number, exc)})
        return rows

    def _page_row(self, item: _Extracted, style: DocStyle) -> dict:
        content = item.content
        row: dict[str, Any] = {"page": content.number, "image_only": item.image_only, "text_source": item.source,
                               "ocr_confidence": item.confidence}
        if self.params.layout:
            row.update(page_width=content.width, page_height=content.height, words=[], blocks=[])
        if not content.usable:
            return {**row, "text": "", "n_words": 0}
        if item.plain is not None:  # past the work budget: PyMuPDF's own order
            return {**row, "text": item.plain, "n_words": len(content.words), "warning": item.warning}
        restore_line_numbers(item.numbers, self.params.line_numbers)
        join_label_values(content)
        layout = layout_page(content, item.tables, style)
        words, blocks = _layout_columns(layout.blocks, layout.dropped)
        row.update(text=layout.text(), n_words=len(words))
        if self.params.layout:
            row.update(words=words, blocks=blocks)
        return row


class _LazyPool:
    """The batch's OcrPool, made on the first page that needs OCR (a born-digital batch starts no threads and never
    asks for Tesseract); ``get`` raises OcrUnavailable again for each page while the engine is missing."""

    def __init__(self, params: PdfTextParams, stack: contextlib.ExitStack) -> None:
        self.params, self.stack, self.pool = params, stack, None

    def get(self) -> OcrPool:
        if self.pool is None:
            self.pool = self.stack.enter_context(OcrPool(self.params.languages))
        return self.pool


@dataclass
class _Extracted:
    """One page before layout: its words (text layer or OCR), tables, and how the text was obtained."""

    content: PageContent
    tables: list[PageTable]
    image_only: bool  # the page has no usable text layer (whatever OCR then found)
    source: str  # layer, ocr or none
    confidence: float | None = None
    numbers: list[LineNumber] = field(default_factory=list)  # margin line numbers lifted off the page
    plain: str | None = None  # PyMuPDF's sorted text of a page past the work budget
    warning: str | None = None


def _plain_text(page: pymupdf.Page) -> str:
    """PyMuPDF's own reading order: its text blocks sorted top to bottom, then left to right (``sort=True`` on
    blocks), each line's runs of spaces collapsed and blank lines out. Sorting whole blocks is linear in practice;
    ``get_text(sort=True)`` regroups every line in Python and takes 0.7 s on a page of 20,000 spans."""
    blocks = page.get_text("blocks", sort=True)
    lines = (" ".join(line.split()) for b in blocks if b[6] == 0 for line in b[4].splitlines())
    return "\n".join(line for line in lines if line)


def repair_lines(content: PageContent) -> list[LineNumber]:
    """The line repairs of ``pdf_lines`` that must precede table finding (see there); returns the line numbers."""
    if not content.usable:
        return []
    drop_duplicate_words(content)
    join_spaced_letters(content)
    attach_raised_markers(content)
    return take_line_numbers(content)


def _layout_columns(ordered: list[Block], dropped: list[Block]) -> tuple[list[dict], list[dict]]:
    """WORD and BLOCK structs: words of the text in reading order, ``block`` indexing ``blocks``; running
    headers/footers come last in ``blocks`` with ``order`` -1 and no words."""
    words, blocks = [], []
    for index, block in enumerate(ordered + dropped):
        in_text = index < len(ordered)
        x0, y0, x1, y1 = block.bbox
        blocks.append({"x0": x0, "y0": y0, "x1": x1, "y1": y1, "kind": block.kind, "level": block.level,
                       "order": index if in_text else -1, "text": block.text()})
        if not in_text:
            continue
        if block.table is not None:
            pairs = sorted(block.table.words, key=lambda wr: (wr[1], wr[0].x0))
        else:
            pairs = [(w, n) for n, line in enumerate(block.lines) for w in line.words]
        words.extend({"text": w.text, "x0": w.x0, "y0": w.y0, "x1": w.x1, "y1": w.y1, "block": index, "line": n}
                     for w, n in pairs)
    return words, blocks


# --- pdf.render -------------------------------------------------------------------------------------------


class PdfRenderParams(StageParams):
    dpi: float = Field(96, gt=0, le=2400, description="resolution pages are rendered at")
    max_pixels: int = Field(4_000_000, ge=1, le=MAX_PIXELS_CEILING,
                            description="pixel budget per page: larger pages are rendered at a lower dpi")
    min_dpi: float = Field(9, gt=0, description="below this the page is an error row page_too_large")


def fit_dpi(width_pt: float, height_pt: float, dpi: float, max_pixels: int) -> float:
    """The highest dpi <= ``dpi`` whose image has at most ``max_pixels`` pixels and no side over MAX_SIDE_PX."""
    def size(d: float) -> tuple[int, int]:
        return _pixels(width_pt, d), _pixels(height_pt, d)

    w, h = size(dpi)
    if w * h <= max_pixels and max(w, h) <= MAX_SIDE_PX:
        return dpi
    fitted = min(72.0 * math.sqrt(max_pixels / (width_pt * height_pt)), 72.0 * MAX_SIDE_PX / max(width_pt, height_pt))
    fitted = math.floor(fitted * 1000) / 1000
    while fitted > 0:
        w, h = size(fitted)
        if w * h <= max_pixels and max(w, h) <= MAX_SIDE_PX:
            return fitted
        fitted *= 0.995          # ceil() of the sides can tip the product over; step down until it fits
    return 0.0


def _pixels(points: float, dpi: float) -> int:
    return max(1, math.ceil(points * dpi / 72.0 - 1e-6))


@register
class PdfRender(Stage):
    """Render pages to PNG at ``dpi``; pages over ``max_pixels`` are rendered at the dpi that fits (the row's
    ``dpi`` says which), down to ``min_dpi``, below which the page is an error row ``page_too_large``."""

    kind = "pdf.render"
    version = "1"
    Params = PdfRenderParams
    inputs: ClassVar[dict[str, pa.Schema]] = {"pages": _PDF_IN}
    output_schema = schemas.PAGE_IMAGE

    def run(self, pages: pa.Table) -> pa.Table:
        rows = []
        for doc_id, source, pdf, upstream in _docs(pages, "pdf"):
            base = {"doc_id": doc_id, "source": source}
            if upstream:
                rows.append(schemas.empty_row(self.output_schema, **base, error=upstream))
                continue
            try:
                doc = _open_bytes(pdf)
            except PdfOpenError as exc:
                rows.append(schemas.empty_row(self.output_schema, **base, error=error_value(exc.kind, exc.message)))
                continue
            try:
                for number in range(doc.page_count):
                    rows.append(schemas.empty_row(self.output_schema, **base, **self._page(doc, number)))
            finally:
                doc.close()
        return pa.Table.from_pylist(rows, schema=self.output_schema)

    def _page(self, doc: pymupdf.Document, number: int) -> dict:
        p = self.params
        try:
            page = doc.load_page(number)
            rect = page.rect
            width, height = float(rect.width), float(rect.height)
            row: dict[str, Any] = {"page": number, "page_width": width, "page_height": height}
            if not (width >= 1 and height >= 1 and math.isfinite(width * height)):
                return {**row, "error": error_value("bad_page_size", f"page {number} is {width} x {height} pt; "
                                                    "fix its /MediaBox by re-exporting the PDF")}
            dpi = fit_dpi(width, height, p.dpi, p.max_pixels)
            if dpi < p.min_dpi:
                need = _pixels(width, p.min_dpi) * _pixels(height, p.min_dpi)
                return {**row, "error": error_value(
                    "page_too_large", f"page {number} is {width:.0f} x {height:.0f} pt: even at min_dpi "
                    f"{p.min_dpi:g} it needs {need:,} pixels, over max_pixels {p.max_pixels:,}; raise "
                    f"--set render.max_pixels=... or lower --set render.min_dpi=...")}
            zoom = dpi / 72.0
            pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), alpha=False, colorspace=pymupdf.csRGB)
            return {**row, "dpi": dpi, "width_px": pix.width, "height_px": pix.height, "image": pix.tobytes("png")}
        except Exception as exc:
            return {"page": number, "error": _page_error(number, exc)}
