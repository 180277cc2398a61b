"""Page layout from words and lines: block roles (heading, body, footnote, running header/footer, table),
heading levels from font sizes, reading order across columns, and the page text as Markdown.

Font sizes are judged against the whole document: the body size is the most common size by characters, and
the sizes clearly above it rank as heading levels 1..3 (largest first; a 4th size and smaller share level 3).

Reading order: blocks are grouped into horizontal strips (blocks that overlap vertically), and consecutive
strips merge into a band while they share a vertical whitespace gutter. A block that crosses the gutter (a
full-width title or paragraph) starts a new band. Inside a band, columns are read left to right and each column
top to bottom. Footnotes (small type at the bottom of the page) come after the body; running headers and
footers (page numbers, lines repeated in the margins of several pages) are left out of the text.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from docfuse.stages.pdf_extract import Line, PageContent, Word
from docfuse.stages.pdf_tables import PageTable

HEADING_RATIO = 1.15       # a size this much above the body size is a heading candidate
SMALL_RATIO = 0.88         # at or below this, small type (footnote candidate)
TOP_ZONE = 0.12            # share of the page height at the top where running headers live
BOTTOM_ZONE = 0.15         # ... and at the bottom, for footers (LaTeX puts page numbers ~15% up)
MIN_GUTTER = 4.0           # pt of whitespace that separates columns
MAX_HEADING_LINES = 3
MAX_HEADING_WORDS = 30
PAGE_BODY_CHARS = 600      # a page with this many characters has a body size of its own

_PAGE_NUMBER = re.compile(
    r"^\s*[-–—(\[]?\s*(page|p\.|seite|pagina|página)?\s*"
    r"(\d{1,4}|(?=[ivxlcdm])m{0,3}(cm|cd|d?c{0,3})(xc|xl|l?x{0,3})(ix|iv|v?i{0,3}))"
    r"(\s*(of|/|von|de)\s*\d{1,4})?\s*[-–—)\]]?\s*$", re.IGNORECASE)
_SECTION_NUMBER = re.compile(r"^\s*(\d+(\.\d+)*|[A-Z]|[IVXLC]+)[.)]?\s")
_LIST_START = re.compile(r"^([•◦▪‣∙·\-–*]|\(?\d{1,3}[.)]|\(?[a-z][.)]|\([ivx]+\))\s")


@dataclass
class Block:
    """A unit of the page in reading order: a paragraph, a heading, a footnote, a table, a header/footer."""

    lines: list[Line]
    kind: str = "body"          # heading | body | footnote | table | header | footer
    level: int = 0              # heading level 1..3
    table: PageTable | None = None
    bbox: tuple[float, float, float, float] = field(default=(0.0, 0.0, 0.0, 0.0))

    def __post_init__(self) -> None:
        if self.lines:
            self.bbox = _lines_bbox(self.lines)
        elif self.table is not None:
            self.bbox = tuple(self.table.bbox)

    x0 = property(lambda self: self.bbox[0])
    y0 = property(lambda self: self.bbox[1])
    x1 = property(lambda self: self.bbox[2])
    y1 = property(lambda self: self.bbox[3])

    @property
    def words(self) -> list[Word]:
        return [w for line in self.lines for w in line.words]

    @property
    def size(self) -> float:
        words = self.words
        n = sum(len(w.text) for w in words) or 1
        return sum(w.size * len(w.text) for w in words) / n

    def text(self) -> str:
        """The block as Markdown: a heading line, a table, or lines joined into a paragraph."""
        if self.table is not None:
            return self.table.markdown()
        body = join_lines([line.text for line in self.lines])
        return f"{'#' * self.level} {body}" if self.kind == "heading" else body


def _lines_bbox(lines: list[Line]) -> tuple[float, float, float, float]:
    boxes = [line.bbox for line in lines]
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


def join_lines(lines: list[str]) -> str:
    """Reflow a block's lines into a paragraph: undo end-of-line hyphenation, keep list items on own lines."""
    out = ""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if not out:
            out = line
        elif _LIST_START.match(line):
            out += "\n" + line
        elif out.endswith("-") and len(out) > 1 and out[-2].isalpha() and line[:1].islower():
            out = out[:-1] + line
        else:
            out += " " + line
    return out


# --- document-level statistics ----------------------------------------------------------------------------

def _round_size(size: float) -> float:
    return round(size * 2) / 2


@dataclass
class DocStyle:
    """What the layout of every page needs to know about the whole document."""

    body_size: float
    heading_levels: dict[float, int]         # rounded font size -> heading level
    running: set[str]                        # normalised texts of running headers/footers

    def level_of(self, size: float) -> int:
        if size < self.body_size * HEADING_RATIO:
            return 0
        return self.heading_levels.get(_round_size(size), 0)


def _size_counts(pages: list[PageContent]) -> Counter[float]:
    """Characters per rounded font size over ``pages``."""
    sizes: Counter[float] = Counter()
    for page in pages:
        for block in page.blocks:
            for line in block:
                for w in line.words:
                    sizes[_round_size(w.size)] += len(w.text)
    return sizes


def doc_style(pages: list[PageContent]) -> DocStyle:
    """Body size, heading levels by size rank, and the margin texts that repeat across pages."""
    sizes = _size_counts(pages)
    body = sizes.most_common(1)[0][0] if sizes else 10.0
    candidates = set()
    for page in pages:
        for block in page.blocks:
            for line in block:
                if line.size >= body * HEADING_RATIO and sum(c.isalpha() for c in line.text) >= 2:
                    candidates.add(_round_size(line.size))
    levels: dict[float, int] = {}
    rank, last = 0, math.inf
    for size in sorted(candidates, reverse=True):
        if size < last * 0.95:       # sizes within 5% of each other share a level
            rank += 1
            last = size
        levels[size] = min(rank, 3)
    margin_texts: Counter[str] = Counter()
    for page in pages:
        boxes = [_lines_bbox(b) for b in page.blocks]
        seen = {_normalise(_block_text(page.blocks[i])) for i in edge_blocks(boxes, page.height)
                if _block_size(page.blocks[i]) < body * HEADING_RATIO}
        margin_texts.update(t for t in seen if t)
    need = max(2, math.ceil(0.3 * len(pages)))
    running = {t for t, n in margin_texts.items() if n >= need}
    return DocStyle(body_size=body, heading_levels=levels, running=running)


def _block_size(lines: list[Line]) -> float:
    return max(line.size for line in lines)


def _block_text(lines: list[Line]) -> str:
    return " ".join(line.text for line in lines)


def _normalise(text: str) -> str:
    return re.sub(r"\d+", "#", " ".join(text.lower().split()))


def edge_blocks(boxes: list[tuple[float, float, float, float]], height: float) -> dict[int, str]:
    """Blocks where running headers and footers live: in the top (bottom) zone of the page with nothing but
    other such blocks above (below) them, and the very first and last block wherever they sit (a page
    number right under a short page's text). Index -> "header" or "footer"."""
    edge: dict[int, str] = {}
    if not boxes:
        return edge
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][1]):
        if boxes[i][3] > height * TOP_ZONE:
            break
        edge[i] = "header"
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][3], reverse=True):
        if boxes[i][1] < height * (1 - BOTTOM_ZONE):
            break
        edge.setdefault(i, "footer")
    edge.setdefault(max(range(len(boxes)), key=lambda i: boxes[i][3]), "footer")
    edge.setdefault(min(range(len(boxes)), key=lambda i: boxes[i][1]), "header")
    return edge


# --- one page ---------------------------------------------------------------------------------------------

def _role(line: Line, style: DocStyle, page_body: float | None = None) -> tuple[str, int]:
    level = style.level_of(line.size) if line.horizontal else 0
    if level and (page_body is None or line.size >= page_body * HEADING_RATIO):
        return "heading", level
    if line.size <= style.body_size * SMALL_RATIO:
        return "small", 0
    return "body", 0


def page_body_size(page: PageContent) -> float | None:
    """The page's own body size (the most common by characters) when it holds enough text to have one: a heading
    must stand out on its page too, not only against the document (a page set larger than the rest)."""
    sizes = _size_counts([page])
    if sum(sizes.values()) < PAGE_BODY_CHARS:
        return None
    return sizes.most_common(1)[0][0]


def split_blocks(page: PageContent, style: DocStyle) -> list[Block]:
    """MuPDF's blocks, split wherever the role of a line changes (a heading glued to its paragraph)."""
    blocks: list[Block] = []
    page_body = page_body_size(page)
    for lines in page.blocks:
        current: list[Line] = []
        current_role = None
        for line in lines:
            role = _role(line, style, page_body)
            if current and role != current_role:
                blocks.append(_make_block(current, current_role))
                current = []
            current.append(line)
            current_role = role
        if current:
            blocks.append(_make_block(current, current_role))
    return blocks


def _make_block(lines: list[Line], role: tuple[str, int]) -> Block:
    kind, level = role
    if kind == "heading" and (len(lines) > MAX_HEADING_LINES or sum(len(l.words) for l in lines) > MAX_HEADING_WORDS):
        kind, level = "body", 0        # a long run of large type is display text, not a heading
    return Block(lines=lines, kind=kind, level=level)


def classify_margins_and_footnotes(blocks: list[Block], page: PageContent, style: DocStyle) -> None:
    """Mark running headers/footers (in the margins: page numbers or repeated text) and footnotes (small type
    in the lower half of the page with no body text below it in its own column)."""
    for i, where in edge_blocks([b.bbox for b in blocks], page.height).items():
        b = blocks[i]
        if b.table is None and b.kind != "heading" and len(b.words) <= 15:
            text = _block_text(b.lines)
            if _PAGE_NUMBER.match(text) or _normalise(text) in style.running:
                b.kind = where
    body = [b for b in blocks if b.kind not in ("header", "footer", "small")]
    for b in blocks:
        if b.kind == "small" and b.y0 >= page.height * 0.5 and not any(
                c.y0 >= b.y1 - 1.0 and c.x0 < b.x1 and b.x0 < c.x1 for c in body):
            b.kind = "footnote"      # small type with no body text below it in its column
    for b in blocks:
        if b.kind == "small":
            b.kind = "body"


def reading_order(blocks: list[Block], min_gutter: float = MIN_GUTTER) -> list[Block]:
    """Blocks in reading order: bands of shared columns top to bottom, columns left to right."""
    strips: list[list[Block]] = []
    bottom = -math.inf
    for b in sorted(blocks, key=lambda b: (b.y0, b.x0)):
        if strips and b.y0 < bottom - 2.0:
            strips[-1].append(b)
            bottom = max(bottom, b.y1)
        else:
            strips.append([b])
            bottom = b.y1
    def joins(band: list[Block], strip: list[Block]) -> bool:
        shared = gutters(band + strip, min_gutter)
        if shared:
            # ... unless the band would hide columns of the strip (a title over two of three columns)
            return len(shared) >= len(gutters(strip, min_gutter))
        return not (gutters(band, min_gutter) or gutters(strip, min_gutter))

    bands: list[list[Block]] = []
    panels: list[bool] = []  # per band: whether a row of side-by-side headings opened it (a form's boxes)
    for i, strip in enumerate(strips):
        # under a band of panels, a heading below the end of every panel starts what follows them (a form's next
        # box), not more of the left panel
        after_panels = bool(panels) and panels[-1] and strip[0].kind == "heading" and \
            min(b.y0 for b in strip) >= max(b.y1 for b in bands[-1]) - 2.0
        if bands and joins(bands[-1], strip) and not _heading_row(strip) and not after_panels:
            nxt = strips[i + 1] if i + 1 < len(strips) else None
            # A heading under a multi-column band belongs to what follows it: if that is full-width, the
            # heading opens the next section rather than continuing the column it happens to sit under.
            opens_section = (all(b.kind == "heading" for b in strip) and gutters(bands[-1], min_gutter)
                             and nxt is not None and not joins(bands[-1] + strip, nxt))
            if not opens_section:
                bands[-1] = bands[-1] + strip
                continue
        bands.append(list(strip))
        panels.append(_heading_row(strip))
    ordered: list[Block] = []
    for band in bands:
        bounds = [(g0 + g1) / 2 for g0, g1 in gutters(band, min_gutter)]
        ordered.extend(sorted(band, key=lambda b: (sum((b.x0 + b.x1) / 2 > x for x in bounds), b.y0, b.x0)))
    return ordered


def _heading_row(strip: list[Block]) -> bool:
    """Headings side by side on one baseline (boxes of a form, panels of a brochure): each opens its own column of
    content below, so the strip starts a new band rather than continuing the columns above it."""
    heads = [b for b in strip if b.kind == "heading" or _bold_title(b)]
    if len(heads) < 2 or len(heads) < len(strip) / 2:
        return False
    # numbered sections ("4.1 Availability | 4.3 Support") are columns of a document: their numbers run down each
    # column, so the columns above continue
    if any(_SECTION_NUMBER.match(b.lines[0].text) for b in heads if b.lines):
        return False
    tops = sorted(b.y1 for b in heads)
    return tops[-1] - tops[0] <= 0.5 * min(b.y1 - b.y0 for b in heads) and bool(gutters(heads))


def _bold_title(b: Block) -> bool:
    """A one-line run of bold words that is not a label: a title in body size."""
    words = b.words
    return (b.kind == "body" and len(b.lines) == 1 and 0 < len(words) <= 8 and all(w.bold for w in words)
            and not words[-1].text.endswith((":", ".")))


def gutters(blocks: list[Block], min_gutter: float = MIN_GUTTER) -> list[tuple[float, float]]:
    """Vertical whitespace strips (x intervals) that no block of the set crosses."""
    spans = sorted((b.x0, b.x1) for b in blocks)
    out, end = [], spans[0][1]
    for x0, x1 in spans[1:]:
        if x0 - end >= min_gutter:
            out.append((end, x0))
        end = max(end, x1)
    return out


@dataclass
class PageLayout:
    blocks: list[Block]         # reading order: body (with headings and tables), then footnotes
    dropped: list[Block]        # running headers and footers, not in the text

    def text(self) -> str:
        return "\n\n".join(t for t in (b.text() for b in self.blocks) if t)


def layout_page(page: PageContent, tables: list[PageTable], style: DocStyle) -> PageLayout:
    """Roles, reading order and text of one page whose table words were already taken out of its lines."""
    blocks = split_blocks(page, style)
    blocks += [Block(lines=[], kind="table", table=t) for t in tables]
    classify_margins_and_footnotes(blocks, page, style)
    dropped = [b for b in blocks if b.kind in ("header", "footer")]
    footnotes = sorted((b for b in blocks if b.kind == "footnote"), key=lambda b: (b.y0, b.x0))
    body = [b for b in blocks if b.kind not in ("header", "footer", "footnote")]
    ordered = reading_order(body) if body else []
    return PageLayout(blocks=merge_paragraphs(ordered, line_gap(page)) + footnotes, dropped=dropped)


def line_gap(page: PageContent) -> float | None:
    """The page's usual white space between two lines of one paragraph (median over MuPDF's multi-line
    blocks), or None when no block has two lines."""
    gaps = []
    for block in page.blocks:
        boxes = [line.bbox for line in block if line.horizontal]
        gaps.extend(b[1] - a[3] for a, b in zip(boxes, boxes[1:]) if b[1] - a[3] > -2)
    return sorted(gaps)[len(gaps) // 2] if gaps else None


def merge_paragraphs(ordered: list[Block], gap: float | None) -> list[Block]:
    """Join consecutive body blocks that continue one paragraph: MuPDF sometimes starts a new block at an
    ordinary line break. They continue it when the second starts under the first (same column, left edges
    within two em), in the same type size, after no more white space than between the lines of a paragraph."""
    if gap is None:
        return ordered
    out: list[Block] = []
    for b in ordered:
        if out and _continues(out[-1], b, gap):
            out[-1] = Block(lines=out[-1].lines + b.lines, kind="body")
            continue
        out.append(b)
    return out


def _continues(a: Block, b: Block, gap: float) -> bool:
    if a.kind != "body" or b.kind != "body" or a.table is not None or b.table is not None:
        return False
    size = a.size
    return (abs(size - b.size) < 0.5 and -1.0 <= b.y0 - a.y1 <= gap + max(1.0, 0.15 * size)
            and abs(b.x0 - a.x0) <= 2 * size and b.x0 < a.x1 and a.x0 < b.x1)
