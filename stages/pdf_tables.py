"""Tables on a page, as Markdown placed where the table sits.

Two detectors:
- ruled tables (cell borders drawn as lines or rectangles): PyMuPDF's ``find_tables`` with its "lines"
  strategy. It costs tens to hundreds of milliseconds a page, so with ``tables="auto"`` it only runs where a
  cheap gate fires: the page's vector drawings hold at least 3 distinct horizontal and 3 distinct vertical
  segments (the least a 2x2 grid needs): rules, thin bars, and edges of stroked boxes, but not filled shading
  such as zebra rows, on which the line strategy finds nothing anyway. ``tables="always"`` runs it on every
  page with a text layer.
  ``use_layout=False`` keeps it deterministic: it does not depend on the optional ONNX layout model
  (pymupdf_layout), whose presence would otherwise change the results and add ~0.3 s a page.
- unruled tables (columns made by whitespace alone): our own analysis of word boxes, which is both the gate
  and the detector, since it is cheap: at least 3 consecutive rows whose words fall into at least 3 columns
  separated by the same whitespace gutters, with short cells (prose in columns has long ones).

Cell text is rebuilt from the page's own words (not ``Table.extract()``, which splits "1,200" into "1200\\n,"
under MuPDF's small glyph heights), so the words a table claims are exactly the ones removed from the plain
text, and the Markdown holds the same strings as the word list.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import pymupdf
import pymupdf.table

from stages.pdf_extract import Line, PageContent, Word, bbox_of, extract_page

TablesMode = Literal["auto", "always", "never"]

# find_tables prints a hint to install pymupdf_layout once per process; we do not use the layout model.
os.environ.setdefault("PYMUPDF_SUGGEST_LAYOUT_ANALYZER", "0")
try:
    _FIND_TABLES_KW = ({"use_layout": False}
                       if "use_layout" in inspect.signature(pymupdf.table.find_tables).parameters else {})
except (TypeError, ValueError):   # a build whose signature cannot be read
    _FIND_TABLES_KW = {}

MIN_SEGMENT = 8.0          # pt: shorter strokes are glyph parts or decoration, not rules
MIN_GRID_LINES = 3         # distinct horizontal and vertical positions the gate wants
MIN_ROWS = 3               # unruled: rows in a run
MIN_COLS = 3               # unruled: columns in a run
MAX_WORDS_PER_CELL = 4.0   # unruled: mean words per filled cell; prose columns run longer


@dataclass
class PageTable:
    """A table found on a page: its box, its cells as text, and the words it took from the page."""

    bbox: tuple[float, float, float, float]
    rows: list[list[str]]
    words: list[tuple[Word, int]] = field(default_factory=list)   # (word, row index)
    ruled: bool = True

    def markdown(self) -> str:
        return to_markdown(self.rows)


def to_markdown(rows: list[list[str]]) -> str:
    """GitHub-style Markdown; the first row is the header."""
    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    width = max(len(r) for r in rows)
    rows = [[cell(c) for c in r] + [""] * (width - len(r)) for r in rows]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(" --- " for _ in range(width)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


# --- ruled tables -----------------------------------------------------------------------------------------

def grid_signal(page: pymupdf.Page) -> bool:
    """True when the page's drawings have enough horizontal and vertical strokes to form a grid."""
    hs: set[int] = set()
    vs: set[int] = set()
    for path in page.get_cdrawings():
        # Fill-only shapes count only when thin (rules drawn as filled bars): large filled boxes are shading
        # (zebra rows, highlights, backgrounds), which find_tables' line strategy does not turn into tables.
        stroked = path.get("type") != "f"
        for item in path.get("items", ()):
            op = item[0]
            if op == "l":
                (x0, y0), (x1, y1) = item[1], item[2]
                _add_box(hs, vs, min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1), True)
            elif op == "re":
                x0, y0, x1, y1 = item[1]
                _add_box(hs, vs, min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1), stroked)
            elif op == "qu":
                r = pymupdf.Quad(item[1]).rect
                _add_box(hs, vs, r.x0, r.y0, r.x1, r.y1, stroked)
        if len(hs) >= MIN_GRID_LINES and len(vs) >= MIN_GRID_LINES:
            return True
    return False


def _add_box(hs: set[int], vs: set[int], x0: float, y0: float, x1: float, y1: float, edges: bool) -> None:
    """Record a stroke or rectangle: thin ones are one rule; larger boxes give four edges when ``edges``."""
    w, h = x1 - x0, y1 - y0
    if h <= 2 and w >= MIN_SEGMENT:
        hs.add(round(y0))
    elif w <= 2 and h >= MIN_SEGMENT:
        vs.add(round(x0))
    elif edges and w >= MIN_SEGMENT and h >= MIN_SEGMENT:
        hs.update((round(y0), round(y1)))
        vs.update((round(x0), round(x1)))


def ruled_tables(page: pymupdf.Page, words: list[Word]) -> list[PageTable]:
    """``find_tables`` on the page; each cell's text is the page words whose centres fall in it."""
    found = page.find_tables(**_FIND_TABLES_KW)
    tables: list[PageTable] = []
    taken: set[int] = set()
    for table in found.tables:
        cells = [[tuple(c) if c else None for c in row.cells] for row in table.rows]
        if len(cells) < 2 or max(len(r) for r in cells) < 2:
            continue
        rows: list[list[list[Word]]] = [[[] for _ in r] for r in cells]
        claimed: list[tuple[Word, int]] = []
        for word in words:
            if id(word) in taken:
                continue
            hit = _cell_of(cells, word.cx, word.cy)
            if hit is not None:
                r, c = hit
                rows[r][c].append(word)
                claimed.append((word, r))
        texts = [[_join(ws) for ws in row] for row in rows]
        if sum(1 for row in texts for t in row if t) < 2:
            continue   # boxes with no text: a frame or a form, not a table
        taken.update(id(w) for w, _ in claimed)
        tables.append(PageTable(bbox=tuple(table.bbox), rows=texts, words=claimed, ruled=True))
    return tables


def _cell_of(cells: list[list[tuple | None]], x: float, y: float) -> tuple[int, int] | None:
    for r, row in enumerate(cells):
        for c, box in enumerate(row):
            if box is not None and box[0] <= x <= box[2] and box[1] <= y <= box[3]:
                return r, c
    return None


def _join(words: list[Word]) -> str:
    return " ".join(w.text for w in sorted(words, key=lambda w: (round(w.cy / 3), w.x0)))


# --- unruled tables ---------------------------------------------------------------------------------------

@dataclass
class _Row:
    words: list[Word]
    cells: list[tuple[float, float]]      # x-extents of the row's cells
    y0: float
    y1: float


def _rows(words: list[Word]) -> list[_Row]:
    """Words grouped into visual rows (by vertical overlap), each split into cells at wide gaps."""
    rows: list[list[Word]] = []
    for w in sorted(words, key=lambda w: (w.cy, w.x0)):
        if rows:
            last = rows[-1]
            top, bottom = min(x.y0 for x in last), max(x.y1 for x in last)
            overlap = min(bottom, w.y1) - max(top, w.y0)
            if overlap >= 0.5 * min(w.y1 - w.y0, bottom - top):
                last.append(w)
                continue
        rows.append([w])
    out = []
    for ws in rows:
        ws.sort(key=lambda w: w.x0)
        size = sorted(w.size for w in ws)[len(ws) // 2]
        cells = [[ws[0].x0, ws[0].x1]]
        for w in ws[1:]:
            if w.x0 - cells[-1][1] > 1.5 * size:
                cells.append([w.x0, w.x1])
            else:
                cells[-1][1] = max(cells[-1][1], w.x1)
        out.append(_Row(ws, [tuple(c) for c in cells], min(w.y0 for w in ws), max(w.y1 for w in ws)))
    return out


def _gaps(cells: list[tuple[float, float]], min_gap: float = 3.0) -> list[tuple[float, float]]:
    gaps, end = [], cells[0][1]
    for x0, x1 in cells[1:]:
        if x0 - end >= min_gap:
            gaps.append((end, x0))
        end = max(end, x1)
    return gaps


def _run_gaps(run: list[_Row]) -> list[tuple[float, float]]:
    """Gutters shared by every row of a run: gaps in the x-projection of all their cells."""
    return _gaps(sorted(c for row in run for c in row.cells))


def unruled_tables(words: list[Word]) -> list[PageTable]:
    """Runs of >= 3 rows whose words sit in >= 3 whitespace-separated columns shared by all rows."""
    rows = [r for r in _rows(words) if r.words]
    tables: list[PageTable] = []
    run: list[_Row] = []

    def close() -> None:
        if len(run) >= MIN_ROWS:
            table = _table_from_run(run)
            if table is not None:
                tables.append(table)

    for row in rows:
        if len(row.cells) < 2:
            close()
            run = []
            continue
        if run:
            near = row.y0 - run[-1].y1 <= 1.5 * (run[-1].y1 - run[-1].y0)
            if near and len(_run_gaps(run + [row])) >= MIN_COLS - 1:
                run.append(row)
                continue
            close()
        run = [row] if len(row.cells) >= MIN_COLS else []
    close()
    return tables


def _table_from_run(run: list[_Row]) -> PageTable | None:
    gaps = _run_gaps(run)
    bounds = [(g0 + g1) / 2 for g0, g1 in gaps]
    n_cols = len(bounds) + 1
    if n_cols < MIN_COLS:
        return None
    rows_words = [[[] for _ in range(n_cols)] for _ in run]
    claimed = []
    for r, row in enumerate(run):
        for w in row.words:
            c = sum(w.cx > b for b in bounds)
            rows_words[r][c].append(w)
            claimed.append((w, r))
    filled = [cell for row in rows_words for cell in row if cell]
    if len(filled) < 0.5 * len(run) * n_cols:
        return None
    if sum(len(c) for c in filled) / len(filled) > MAX_WORDS_PER_CELL:
        return None
    texts = [[_join(ws) for ws in row] for row in rows_words]
    return PageTable(bbox=bbox_of([w for w, _ in claimed]), rows=texts, words=claimed, ruled=False)


# --- per page, and the gate report ------------------------------------------------------------------------

def find_page_tables(page: pymupdf.Page, content: PageContent, mode: TablesMode) -> tuple[list[PageTable], bool]:
    """Tables on a page whose text layer is ``content``, and whether ``find_tables`` ran; removes the words
    the tables claim from ``content``'s lines so they do not appear twice."""
    if mode == "never" or not content.usable:
        return [], False
    words = content.words
    ran = mode == "always" or grid_signal(page)
    tables = ruled_tables(page, words) if ran else []
    taken = {id(w) for t in tables for w, _ in t.words}
    upright = [w for block in content.blocks for line in block if line.horizontal for w in line.words]
    tables += unruled_tables([w for w in upright if id(w) not in taken])
    if tables:
        taken = {id(w) for t in tables for w, _ in t.words}
        content.blocks = _without(content.blocks, taken)
    return tables, ran


def _without(blocks: list[list[Line]], taken: set[int]) -> list[list[Line]]:
    out = []
    for block in blocks:
        lines = []
        for line in block:
            kept = [w for w in line.words if id(w) not in taken]
            if kept:
                lines.append(Line(words=kept, horizontal=line.horizontal))
        if lines:
            out.append(lines)
    return out


@dataclass
class GateReport:
    """What the table gate chose on a document, for benchmarks (recall and time against ``always``)."""

    pages: int
    find_tables_pages: int
    ruled_tables: int
    unruled_tables: int
    seconds: float


def table_gate_report(pdf: bytes, mode: TablesMode = "auto") -> GateReport:
    """Run the table step of ``pdf.text`` on every page of ``pdf`` and count where ``find_tables`` ran."""
    doc = pymupdf.open(stream=pdf, filetype="pdf")
    ran_on = ruled = unruled = 0
    seconds = 0.0
    try:
        for page in doc:
            content = extract_page(page)
            start = time.perf_counter()
            tables, ran = find_page_tables(page, content, mode)
            seconds += time.perf_counter() - start
            ran_on += ran
            ruled += sum(t.ruled for t in tables)
            unruled += sum(not t.ruled for t in tables)
        return GateReport(doc.page_count, ran_on, ruled, unruled, seconds)
    finally:
        doc.close()
