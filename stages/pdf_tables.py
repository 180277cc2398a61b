"""Tables on a page, as Markdown placed where the table sits.

Three detectors, in this order (each takes its words off the page before the next one looks):
- ruled tables (cell borders drawn as lines or rectangles): PyMuPDF's ``find_tables`` with its "lines"
  strategy. It costs tens to hundreds of milliseconds a page, so with ``tables="auto"`` it only runs where a
  cheap gate fires: the page's vector drawings hold at least 3 distinct horizontal and 3 distinct vertical
  segments (the least a 2x2 grid needs): rules, thin bars, and edges of stroked boxes, but not filled shading
  such as zebra rows, on which the line strategy finds nothing anyway. ``tables="always"`` runs it on every
  page with a text layer.
  ``use_layout=False`` keeps it deterministic: it does not depend on the optional ONNX layout model
  (pymupdf_layout), whose presence would otherwise change the results and add ~0.3 s a page.
- unruled tables of figures (financial statements, contents pages): our own analysis of word boxes, cheap
  enough (~2 ms a page) to run on every page, so it is its own gate. Rows split into cells at wide gaps; a data
  row is a text label followed by figures ("$ 6,779", "(1,234)", "12%", "—"); consecutive data rows whose
  figure columns overlap make a table, with the label-only rows between them ("Earnings per share:") and the
  header rows right above them (years, "Year ended December 31,", "(in thousands)"). It takes two data rows
  with two figures in two shared columns, or one such row under headers that name two of its columns, or a
  contents page (labels with right-aligned page numbers far from them). Prose does not qualify: its words
  are separated by ordinary spaces, so its figures never stand alone in cells.
- other unruled tables (columns made by whitespace alone): at least 3 consecutive rows whose words fall into
  at least 3 columns separated by the same whitespace gutters, with short cells (prose in columns has long
  ones, and its lines mostly start in lower case).

Cell text is rebuilt from the page's own words (not ``Table.extract()``, which splits "1,200" into "1200\\n,"
under MuPDF's small glyph heights), so the words a table claims are exactly the ones removed from the plain
text, and the Markdown holds the same strings as the word list.
"""

from __future__ import annotations

import inspect
import os
import re
import time
from dataclasses import dataclass, field
from typing import Literal

import pymupdf
import pymupdf.table

from docfuse.stages.pdf_extract import Line, PageContent, Word, bbox_of, extract_page

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
MAX_LOWER_SHARE = 0.4      # unruled: share of cells (below the first row) that may start in lower case


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
    top = bottom = 0.0  # the last row's extent, kept as it grows (a page of thousands of tiny spans is one long row)
    for w in sorted(words, key=lambda w: (w.cy, w.x0)):
        if rows:
            overlap = min(bottom, w.y1) - max(top, w.y0)
            if overlap >= 0.5 * min(w.y1 - w.y0, bottom - top):
                rows[-1].append(w)
                top, bottom = min(top, w.y0), max(bottom, w.y1)
                continue
        rows.append([w])
        top, bottom = w.y0, w.y1
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
    start = 0  # index of the run's first row in ``rows``

    def close() -> None:
        if len(run) >= MIN_ROWS:
            table = _table_from_run(run, rows[start - 1] if start else None)
            if table is not None:
                tables.append(table)

    for i, row in enumerate(rows):
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
        run, start = ([row] if len(row.cells) >= MIN_COLS else []), i
    close()
    return tables


def _table_from_run(run: list[_Row], above: _Row | None = None) -> PageTable | None:
    """The run as a table, unless it reads as something else; ``above``: the row just above the run."""
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
    widest = max(range(len(gaps)), key=lambda i: gaps[i][1] - gaps[i][0])
    if _reads_as_prose([t for row in texts[1:] for t in row if t]) or _is_form(texts) \
            or _drifting(rows_words, widest + 1) or _under_panel_titles(rows_words, above):
        return None
    return PageTable(bbox=bbox_of([w for w, _ in claimed]), rows=texts, words=claimed, ruled=False)


def _is_form(rows: list[list[str]]) -> bool:
    """Label/value rows ("Name: | Ada Lovelace | Date: | 1843"): a column of labels ending in ':' makes a form, which
    reads as text row by row, not a table."""
    for c in range(max(len(r) for r in rows)):
        cells = [r[c] for r in rows if c < len(r) and r[c]]
        if len(cells) >= 2 and sum(t.endswith(":") for t in cells) >= 0.8 * len(cells):
            return True
    return False


def _drifting(rows_words: list[list[list[Word]]], split: int) -> bool:
    """Two lists side by side (a form's panels, each with its own line pitch) rather than a table: the cells of a
    table's row share a baseline; here the baselines left and right of the widest gutter (columns before and from
    ``split``) move apart row after row, by over a seventh of a line in the end."""
    def baseline(cells: list[list[Word]]) -> float | None:
        ys = sorted(w.y1 for cell in cells for w in cell)
        return ys[len(ys) // 2] if ys else None

    offsets, sizes = [], []
    for row in rows_words:
        left, right = baseline(row[:split]), baseline(row[split:])
        if left is not None and right is not None:
            offsets.append(left - right)
            sizes.extend(w.y1 - w.y0 for cell in row for w in cell)
    if len(offsets) < MIN_ROWS:
        return False
    size = sorted(sizes)[len(sizes) // 2]
    steps = [b - a for a, b in zip(offsets, offsets[1:])]
    one_way = all(d > 0.02 * size for d in steps) or all(d < -0.02 * size for d in steps)
    return one_way and abs(offsets[-1] - offsets[0]) > 0.15 * size


def _under_panel_titles(rows_words: list[list[list[Word]]], above: _Row | None) -> bool:
    """Two panels side by side (a form's groups, each under its own title) rather than a table: the row just above
    holds exactly two titles, bold or larger than the rows below, one flush with the first column and one flush with
    a later column (where the second panel starts). A table's own header names every column; a spanning header is
    centred over its columns, not set flush with them."""
    if above is None or len(above.cells) != 2:
        return False
    body = [w for row in rows_words for cell in row for w in cell]
    if not body:
        return False
    size = sorted(w.size for w in body)[len(body) // 2]
    if above.y0 < min(w.y0 for w in body) - 4 * size:
        return False
    if not all(w.bold or w.size > 1.05 * size for w in above.words):
        return False
    starts = [min((w.x0 for row in rows_words for w in row[c]), default=None) for c in range(len(rows_words[0]))]
    first, second = above.cells[0][0], above.cells[1][0]
    return (starts[0] is not None and abs(first - starts[0]) <= size
            and any(x is not None and abs(second - x) <= size for x in starts[1:]))


def _reads_as_prose(cells: list[str]) -> bool:
    """Cells that are lines of running text: columns of prose side by side (a narrow three-column page) share
    their gutters like a table, but most of their lines start in lower case, continuing a sentence."""
    return bool(cells) and sum(c[0].islower() for c in cells) > MAX_LOWER_SHARE * len(cells)


# --- unruled tables of figures (financial statements) -----------------------------------------------------

#: A figure as statements print it: 1,234  (1,234)  -3.5  12%  $6,779  0.29  4.1†; also dashes and "n/a".
_FIGURE = re.compile(r"^[(\[]?[-+−–]?[$€£¥]?\(?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\)?%?\)?[*†‡]?$")
_PLACEHOLDERS = {"—", "–", "-", "--", "%", ")%", "n/a", "na", "nm", "n.m.", "*"}   # stand in a figure's place
_CURRENCY = {"$", "€", "£", "¥", "us$", "c$", "a$"}
_YEAR = re.compile(r"^(19|20)\d\d$")
CELL_GAP = 0.8             # em: a wider gap between two words of a row separates cells
MAX_VALUE_WORDS = 5        # words in a text cell among a row's figures ("April 15 and October 15")
MAX_LABEL_ROWS = 3         # label-only rows ("Earnings per share:") between two rows of figures
MAX_HEADER_ROWS = 5        # header rows ("Year ended December 31,", "2015 2014", "(in thousands)")
MAX_HEADER_WORDS = 8       # words in one header cell; prose runs longer
MIN_TOC_ROWS = 3           # a single column of figures (a contents page) needs this many rows


def is_figure(text: str) -> bool:
    """A word that can fill a cell of a column of figures: a number as statements print it, or a placeholder.
    Not a number inside a sentence ("2016," "31,") nor a code ("10-Q", "2015-16")."""
    t = text.lower()
    return t in _PLACEHOLDERS or bool(_FIGURE.match(t))


def _is_currency(word: Word) -> bool:
    return word.text.lower() in _CURRENCY


@dataclass
class _Cell:
    words: list[Word]
    figure: bool            # every word is a figure or a currency sign

    @property
    def x0(self) -> float:
        return self.words[0].x0

    @property
    def x1(self) -> float:
        return self.words[-1].x1

    @property
    def fx0(self) -> float:
        """Left edge without the currency sign: what lines up within a column of right-aligned figures."""
        return next((w.x0 for w in self.words if not _is_currency(w)), self.x0)

    @property
    def cx(self) -> float:
        return (self.x0 + self.x1) / 2


@dataclass
class _Line:
    row: _Row
    cells: list[_Cell]
    kind: str               # "data": a label then values, mostly figures; "years": a header of years; "other"
    first: int = 0          # index of the first value cell of a data row (the cells before are its label)

    @property
    def values(self) -> list[_Cell]:
        return self.cells[self.first:] if self.kind == "data" else []


def _cells(words: list[Word]) -> list[_Cell]:
    """A row's words split into cells at gaps wider than CELL_GAP em and before currency signs; a currency
    sign joins the figure after it ("$" ... "6,779,511" is one cell)."""
    size = sorted(w.size for w in words)[len(words) // 2]
    groups: list[list[Word]] = []
    for w in words:
        if groups and not _is_currency(w) and not _is_currency(groups[-1][-1]) \
                and w.x0 - groups[-1][-1].x1 <= CELL_GAP * size:
            groups[-1].append(w)
        else:
            groups.append([w])
    cells: list[_Cell] = []
    for g in groups:
        figure = all(is_figure(w.text) or _is_currency(w) for w in g) and not all(_is_currency(w) for w in g)
        if cells and all(_is_currency(w) for w in cells[-1].words) and figure:
            cells[-1] = _Cell(cells[-1].words + g, True)
        else:
            cells.append(_Cell(g, figure))
    return cells


def _line(row: _Row) -> _Line:
    """Classify a row: a data row is an optional text label, then value cells that start with a figure and
    are mostly figures (a short text cell such as a date may sit among them)."""
    cells = _cells(row.words)
    first = next((i for i, c in enumerate(cells) if c.figure), None)
    if first is None:
        return _Line(row, cells, "other")
    figures = [c for c in cells[first:] if c.figure]
    texts = [c for c in cells[first:] if not c.figure]
    if first == 0 and len(figures) >= 2 and all(_YEAR.match(c.words[-1].text) and len(c.words) == 1
                                                for c in figures):
        return _Line(row, cells, "years")
    if len(figures) >= len(texts) and all(len(c.words) <= MAX_VALUE_WORDS for c in texts) \
            and (first > 0 or len(figures) >= 2):
        return _Line(row, cells, "data", first)
    return _Line(row, cells, "other")


def _near(a: _Row, b: _Row) -> bool:
    return b.y0 - a.y1 <= 1.5 * max(a.y1 - a.y0, b.y1 - b.y0)


def _columns(lines: list[_Line]) -> list[list[float]]:
    """Value columns: the x-extents of the data rows' value cells (figures without their currency signs),
    merged where they overlap; each is [x0, x1, leftmost x0 with currency signs, rows in it, rows with a
    figure in it]."""
    spans = sorted((c.fx0, c.x1, c.x0, id(line), c.figure) for line in lines for c in line.values)
    cols: list[list] = []
    for x0, x1, cx0, owner, figure in spans:
        if cols and x0 < cols[-1][1]:
            col = cols[-1]
            col[1], col[2] = max(col[1], x1), min(col[2], cx0)
        else:
            col = [x0, x1, cx0, set(), set()]
            cols.append(col)
        col[3].add(owner)
        if figure:
            col[4].add(owner)
    return [[x0, x1, cx0, len(owners), len(figures)] for x0, x1, cx0, owners, figures in cols]


def figure_tables(words: list[Word]) -> list[PageTable]:
    """Tables of figures drawn without rules: data rows (a label, then figures) whose value columns line up,
    with the label-only rows between them and the header rows above them."""
    lines = [_line(r) for r in _rows(words) if r.words]
    tables: list[PageTable] = []
    used: set[int] = set()
    i = 0
    while i < len(lines):
        if lines[i].kind != "data":
            i += 1
            continue
        block, pending = [i], []
        values = list(lines[i].values)
        for j in range(i + 1, len(lines)):
            if not _near(lines[(pending or block)[-1]].row, lines[j].row):
                break
            if lines[j].kind == "data":
                block += pending + [j]
                values += lines[j].values
                pending = []
            elif len(pending) < MAX_LABEL_ROWS and _label_row(lines[j], values):
                pending.append(j)
            else:
                break
        table = _figure_table(lines, block, used)
        if table is not None:
            tables.append(table)
        i = block[-1] + 1
    return tables


def _label_row(line: _Line, values: list[_Cell]) -> bool:
    """A row inside a table that is no data row: text left of every value cell so far (a section label such
    as "Earnings per share:"), or one figure under one of them (a value whose label wrapped)."""
    if line.cells[-1].x1 < min(c.x0 for c in values):
        return True
    only = line.cells[0]
    return len(line.cells) == 1 and only.figure and any(c.fx0 < only.x1 and only.fx0 < c.x1 for c in values)


def _figure_table(lines: list[_Line], block: list[int], used: set[int]) -> PageTable | None:
    """The table a block of rows makes with its header rows, or None when its figures do not line up as a
    table does; the rows it takes (``used``) cannot serve as headers of a later table."""
    data = [lines[k] for k in block if lines[k].kind == "data"]
    cols = _columns(data)
    sizes = sorted(w.size for line in data for w in line.row.words)
    size = sizes[len(sizes) // 2]
    # Cells outside data rows go to the column their centre falls in; columns split halfway between the
    # extents (labels, then each value column with its currency signs).
    labels = [c.x1 for line in data for c in line.cells[:line.first]]
    first_x0 = cols[0][2]
    split = (max(labels) + first_x0) / 2 if labels and max(labels) < first_x0 else first_x0 - 0.5
    bounds = [split] + [(a[1] + b[2]) / 2 for a, b in zip(cols, cols[1:])]
    header = _header_rows(lines, block[0], used, bounds, cols[-1][1], size)
    header_cols = {sum(c.cx > b for b in bounds) for k in header for c in lines[k].cells} - {0}
    multi = [line for line in data if sum(c.figure for c in line.values) >= 2]
    pure = [line for line in multi if all(c.figure for c in line.values)]
    supported = [c for c in cols if c[3] >= 2 and c[4] >= c[3] / 2]
    # Two rows of figures in two shared columns; or one row of figures alone (after its label) under
    # headers that name two of its columns ("Amortization  1,420  701  71" under "Streaming  DVD  Total").
    if not ((len(supported) >= 2 and len(multi) >= 2)
            or (pure and len(header_cols) >= 2)
            or _contents_like(data, cols, size)):
        return None
    rows = header + block
    used.update(rows)
    grid: list[list[list[Word]]] = [[[] for _ in range(len(cols) + 1)] for _ in rows]
    claimed: list[tuple[Word, int]] = []
    for r, k in enumerate(rows):
        line = lines[k]
        for n, cell in enumerate(line.cells):
            if line.kind != "data":
                c = sum(cell.cx > b for b in bounds)
            elif n < line.first:
                c = 0
            else:
                c = 1 + max(range(len(cols)), key=lambda q: min(cols[q][1], cell.x1) - max(cols[q][0], cell.fx0))
            grid[r][c].extend(cell.words)
            claimed.extend((w, r) for w in cell.words)
    keep = [c for c in range(len(cols) + 1) if any(row[c] for row in grid)]
    texts = [[_join(row[c]) for c in keep] for row in grid]
    return PageTable(bbox=bbox_of([w for w, _ in claimed]), rows=texts, words=claimed, ruled=False)


def _header_rows(lines: list[_Line], first: int, used: set[int], bounds: list[float], right: float,
                 size: float) -> list[int]:
    """Rows just above the first data row that read as column headers: short cells over the value columns
    ("Year ended December 31,", "2015 2014", "(in thousands)"), at most a short caption over the label
    column. Label-only rows between them and the data ("Memberships:") come along only when headers do."""
    out: list[int] = []
    pending: list[int] = []
    k, below = first - 1, first
    while k >= 0 and k not in used and len(out) + len(pending) < MAX_HEADER_ROWS \
            and _near(lines[k].row, lines[below].row):
        cells = lines[k].cells
        over = [c for c in cells if c.cx > bounds[0]]
        under = [c for c in cells if c.cx <= bounds[0]]
        if any(len(c.words) > MAX_HEADER_WORDS or _sentence(c) for c in cells) \
                or max(c.x1 for c in cells) > right + 3 * size:
            break
        if not over:
            if len(cells) > 1 or len(pending) >= 2 or len(cells[0].words) > MAX_HEADER_WORDS:
                break
            pending.insert(0, k)
        elif len(under) > 1 or lines[k].kind == "data":
            break
        else:
            out[:0] = [k] + pending
            pending = []
        below = k
        k -= 1
    return out


def _sentence(cell: _Cell) -> bool:
    """Three or more words ending in a full stop: a sentence of prose, not a column header."""
    return len(cell.words) >= 3 and cell.words[-1].text.endswith(".")


def _contents_like(data: list[_Line], cols: list[list[float]], size: float) -> bool:
    """A contents page or index: >= MIN_TOC_ROWS rows of a label and one figure, the figures right-aligned in
    one column, far from their labels."""
    if len(cols) != 1 or len(data) < MIN_TOC_ROWS:
        return False
    ends = sorted(line.values[-1].x1 for line in data)
    mid = ends[len(ends) // 2]
    aligned = [line for line in data if line.first > 0 and len(line.values) == 1 and line.values[0].figure
               and abs(line.values[0].x1 - mid) <= 0.5 * size
               and line.values[0].x0 - line.cells[line.first - 1].x1 >= 2 * size]
    return len(aligned) >= max(MIN_TOC_ROWS, 0.8 * len(data))


# --- per page, and the gate report ------------------------------------------------------------------------

def find_page_tables(page: pymupdf.Page, content: PageContent, mode: TablesMode) -> tuple[list[PageTable], bool]:
    """Tables on a page whose text layer is ``content``, and whether ``find_tables`` ran; removes the words
    the tables claim from ``content``'s lines so they do not appear twice."""
    if mode == "never" or not content.usable:
        return [], False
    words = content.words
    ran = mode == "always" or grid_signal(page)
    tables = ruled_tables(page, words) if ran else []
    return word_tables(content, tables), ran


def word_tables(content: PageContent, tables: list[PageTable] | None = None) -> list[PageTable]:
    """The tables the words alone show (figure columns, then whitespace-aligned runs), after ``tables`` found
    otherwise; removes the words every table claims from ``content``'s lines. An OCR'd page has only this: a
    scan's rulings are pixels, not drawings ``find_tables`` could follow."""
    tables = list(tables or [])
    taken = {id(w) for t in tables for w, _ in t.words}
    upright = [w for block in content.blocks for line in block if line.horizontal for w in line.words]
    tables += figure_tables([w for w in upright if id(w) not in taken])
    taken = {id(w) for t in tables for w, _ in t.words}
    tables += unruled_tables([w for w in upright if id(w) not in taken])
    if tables:
        taken = {id(w) for t in tables for w, _ in t.words}
        content.blocks = _without(content.blocks, taken)
    return tables


def _without(blocks: list[list[Line]], taken: set[int]) -> list[list[Line]]:
    """The blocks without the words in ``taken``; lines keep their identity (``pdf_lines``' line numbers point at
    them), emptied lines and blocks go."""
    out = []
    for block in blocks:
        lines = []
        for line in block:
            line.words = [w for w in line.words if id(w) not in taken]
            if line.words:
                lines.append(line)
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
