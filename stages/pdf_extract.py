"""Pull a page's text layer out of MuPDF as words with boxes, font sizes and lines, and judge whether it is usable.

A page has a usable text layer when it holds real words. It has none when it has no words at all (a scan, text
drawn as vector curves, a blank page), when its characters are mostly garbage, or when a few stray words sit on
a page that images cover (a scan with a stamp or page number). Garbage is what fonts without a /ToUnicode map
produce: U+FFFD, control and private-use characters, or, from a symbolic TrueType or Type3 font with no
mapping, the raw glyph codes read as ASCII (mostly punctuation). We flag such pages ``image_only`` and give
them no text rather than feed a model noise; the rendered page still carries what they show.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field

import pymupdf

#: Keep whitespace as MuPDF found it, clip to the media box, expand ligatures ("fi" not U+FB01), and leave
#: characters without a Unicode mapping as U+FFFD (not their CIDs) so the garbage check can see them.
TEXT_FLAGS = pymupdf.TEXT_PRESERVE_WHITESPACE | pymupdf.TEXT_MEDIABOX_CLIP

_BAD_CATEGORIES = {"Cc", "Co", "Cn", "Cs"}


@dataclass(slots=True)
class Word:
    text: str
    x0: float
    y0: float
    x1: float
    y1: float
    size: float
    bold: bool

    @property
    def cx(self) -> float:
        return (self.x0 + self.x1) / 2

    @property
    def cy(self) -> float:
        return (self.y0 + self.y1) / 2


@dataclass(slots=True)
class Line:
    words: list[Word]
    horizontal: bool = True

    @property
    def bbox(self) -> tuple[float, float, float, float]:
        return bbox_of(self.words)

    @property
    def size(self) -> float:
        """Character-weighted mean font size."""
        n = sum(len(w.text) for w in self.words) or 1
        return sum(w.size * len(w.text) for w in self.words) / n

    @property
    def text(self) -> str:
        return " ".join(w.text for w in self.words)


@dataclass
class PageContent:
    """One page's text layer, before layout: MuPDF's blocks as lists of lines."""

    number: int
    width: float
    height: float
    blocks: list[list[Line]] = field(default_factory=list)
    usable: bool = True
    reason: str = ""                      # why the text layer is not usable, when it is not

    @property
    def words(self) -> list[Word]:
        return [w for block in self.blocks for line in block for w in line.words]


def bbox_of(items) -> tuple[float, float, float, float]:
    return (min(i.x0 for i in items), min(i.y0 for i in items), max(i.x1 for i in items), max(i.y1 for i in items))


def extract_page(page: pymupdf.Page, min_words: int = 3, min_image_cover: float = 0.5) -> PageContent:
    """Words (with the size and weight of their span), grouped into MuPDF's lines and blocks, and the
    text-layer verdict for ``page``."""
    rect = page.rect
    content = PageContent(number=page.number, width=float(rect.width), height=float(rect.height))
    textpage = page.get_textpage(flags=TEXT_FLAGS)
    layout = page.get_text("dict", textpage=textpage)["blocks"]
    raw = page.get_text("words", textpage=textpage)
    # MuPDF reports text in unrotated page space; a page with /Rotate is shown (and rendered, and searched by
    # find_tables) turned, so words and line directions are turned with it.
    rot = page.rotation_matrix if page.rotation % 360 else None
    spans_text: list[str] = []
    lines: dict[tuple[int, int], Line] = {}
    for b, block in enumerate(layout):
        for ln, line in enumerate(block.get("lines", ())):
            spans_text.extend(s["text"] for s in line["spans"])
            dx, dy = line.get("dir", (1.0, 0.0))
            if rot is not None:
                dx, dy = dx * rot.a + dy * rot.c, dx * rot.b + dy * rot.d
            lines[(b, ln)] = Line(words=[], horizontal=dx > 0.9 and abs(dy) < 0.1)
    for x0, y0, x1, y1, text, b, ln, _ in raw:
        spans = layout[b]["lines"][ln]["spans"] if (b, ln) in lines else ()
        size, bold = _span_style(spans, x0, y0, x1, y1)
        if "\ufffd" in text or not text.isprintable():
            text = "".join(c for c in text if c != "\ufffd" and unicodedata.category(c) not in _BAD_CATEGORIES)
            if not text:
                continue       # unmappable glyphs: the garbage check below decides about the page
        if rot is not None:
            x0, y0, x1, y1 = pymupdf.Rect(x0, y0, x1, y1) * rot
        word = Word(text, float(x0), float(y0), float(x1), float(y1), size, bold)
        lines.setdefault((b, ln), Line(words=[])).words.append(word)
    by_block: dict[int, list[Line]] = {}
    for (b, _), line in sorted(lines.items()):
        if line.words:
            by_block.setdefault(b, []).append(line)
    content.blocks = list(by_block.values())
    content.usable, content.reason = text_layer_verdict(page, "".join(spans_text), len(raw), min_words,
                                                        min_image_cover)
    if not content.usable:
        content.blocks = []
    return content


def _span_style(spans, x0: float, y0: float, x1: float, y1: float) -> tuple[float, bool]:
    """Size and boldness of the span that overlaps the word most."""
    best, best_area = None, -1.0
    for span in spans:
        sx0, sy0, sx1, sy1 = span["bbox"]
        area = max(0.0, min(x1, sx1) - max(x0, sx0)) * max(0.0, min(y1, sy1) - max(y0, sy0))
        if area > best_area:
            best, best_area = span, area
    if best is None:
        return max(y1 - y0, 1.0), False
    return float(best["size"]), bool(best["flags"] & pymupdf.TEXT_FONT_BOLD) or "bold" in best["font"].lower()


def garbage_fraction(text: str) -> float:
    """Share of non-space characters that are U+FFFD, control, private-use, unassigned or surrogates."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    bad = sum(c == "\ufffd" or unicodedata.category(c) in _BAD_CATEGORIES for c in chars)
    return bad / len(chars)


def alnum_fraction(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalnum() for c in chars) / len(chars) if chars else 0.0


def has_unmapped_font(page: pymupdf.Page) -> bool:
    """A Type3 font, or a simple font with neither /Encoding nor /ToUnicode, on the page: its character codes
    say nothing reliable about the letters they draw."""
    doc = page.parent
    for xref, _ext, ftype, _name, _ref, encoding in page.get_fonts():
        if xref <= 0 or doc.xref_get_key(xref, "ToUnicode")[0] != "null":
            continue
        if ftype == "Type3" or (ftype in ("TrueType", "Type1", "MMType1") and not encoding):
            return True
    return False


def image_cover(page: pymupdf.Page) -> float:
    """Fraction of the page that images cover (overlaps counted once per image, capped at 1)."""
    bounds = page.rect * page.derotation_matrix          # image boxes come in unrotated page space
    area = abs(bounds) or 1.0
    covered = 0.0
    for info in page.get_image_info():
        box = pymupdf.Rect(info["bbox"]) & bounds
        covered += abs(box) if not box.is_empty else 0.0
    return min(covered / area, 1.0)


def text_layer_verdict(page: pymupdf.Page, chars: str, n_words: int, min_words: int,
                       min_image_cover: float) -> tuple[bool, str]:
    """(usable, reason): whether the page's text layer holds real text; see the module docstring."""
    if n_words == 0:
        return False, "no words in the text layer"
    if garbage_fraction(chars) >= 0.3:
        return False, "text is mostly unmappable characters (a font without /ToUnicode)"
    if alnum_fraction(chars) < 0.5 and has_unmapped_font(page):
        return False, "text comes from a font without a Unicode mapping and reads as glyph codes"
    if n_words < min_words and image_cover(page) >= min_image_cover:
        return False, f"only {n_words} word(s) on a page that images cover"
    return True, ""
