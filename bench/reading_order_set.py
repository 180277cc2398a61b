"""A measured reading-order set: PDF pages whose true reading order is known because this module wrote the text.

Why: judging reading order on real PDFs needs hand labels, which are slow to make and few. Here every word is
laid out by the generator (its own line wrapping, with widths measured by ``pymupdf.get_text_length``), so the
truth is exact, and each layout family stresses one thing a reader of PDFs gets wrong.

Families (widths, fonts, sizes, margins and text drawn at random per page):

- ``one_column``, ``two_column``, ``three_column``: paragraphs (justified or ragged), bold headings, a full-width
  title above the columns on some pages. Justified lines place each word on its own, with no space characters
  (as TeX output does), so a reader has to infer spaces from gaps; Courier text is never justified.
- ``line_numbered``: transcript/pleading paper: a margin column of line numbers 1..25 or 1..28 on the left (most
  pages) or right, with or without a vertical rule; Q./A. lines and short ``Name: value`` lines.
- ``footnotes``: two or three columns with raised markers in the body; footnotes in small type under a short rule
  at the foot of column 1 or across the foot of the page. A body sentence always runs from the bottom of column 1
  to the top of column 2, so reading a column-1 footnote in between splits it.
- ``headers_footers``: running header, footer and page number repeated on every page of a PDF.
- ``sidebars``: a boxed sidebar beside the body, or a pull quote inside it.
- ``kv_forms``: label/value rows drawn as separate blocks, one group or two side by side.
- ``spaced_headings``: headings drawn letter-spaced ("S U M M A R Y").
- ``tables``: ruled (grid) and unruled (aligned columns) tables with a caption, between paragraphs.
- ``captions``: a drawn figure or an inserted image with a caption under it, in the body flow.

Truth conventions (the choices a benchmark has to state):

- body text in the order a person reads it: full-width title first, then column by column, top to bottom;
- footnotes after all body text, in marker order, each starting with its number ("1 See ..."); a marker in the
  body is kept as its own token after the word it follows ("rule. 1");
- running headers, footers, page numbers and margin line numbers are excluded (``line_numbered`` records also
  carry ``truth_numbered``, with each line's number kept at its start);
- a sidebar or pull quote is an aside: it comes after the body (and before footnotes; no page has both), so a
  reader that drops it into the middle of a paragraph loses points;
- a letter-spaced heading appears un-spaced ("SUMMARY"); the record's ``spaced_words`` lists those words;
- a key/value form reads group by group, each row "Label: value" (or "Label value" where the page shows no colon);
- a table reads as its caption, then its cells row by row; a figure caption sits where it is in the flow.

Each record also has ``sentences`` (the body sentences fully on the page, as written) and, for tables,
``tables`` (rows of cell strings, header row first).

    .venv/bin/python -c "from pathlib import Path; from bench.reading_order_set import make_set; \
print(len(make_set(Path('/tmp/ro_set'))))"
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pymupdf

T = TypeVar("T")

FAMILIES = ("one_column", "two_column", "three_column", "line_numbered", "footnotes", "headers_footers",
            "sidebars", "kv_forms", "spaced_headings", "tables", "captions")
PAGES_PER_FAMILY = 10            # 11 families x 10 = 110 pages
PAGES_PER_PDF = 5                # pages of one family share a PDF (running headers repeat across them)
PAPERS = {"letter": (612.0, 792.0), "a4": (595.0, 842.0)}

#: base-14 font families: (regular, bold, italic)
FONT_FAMILIES = {"helv": ("helv", "hebo", "heit"), "tiro": ("tiro", "tibo", "tiit"), "cour": ("cour", "cobo", "coit")}
BLACK = (0.0, 0.0, 0.0)


# --------------------------------------------------------------------------------------------------- prose

ADJECTIVES = ("regional annual careful formal modest steady local federal technical seasonal public private "
              "northern coastal rural urban early final detailed brief minor major quiet rapid gradual shared "
              "standard revised independent temporary southern western central national municipal").split()
NOUNS = ("committee survey program report agency council network harbor warehouse district budget contract "
         "review schedule pipeline library hospital school bridge market factory laboratory garden museum "
         "railway reservoir ministry tribunal clinic archive vessel orchard tunnel station office").split()
VERBS = [("approve", "approved"), ("review", "reviewed"), ("expand", "expanded"), ("delay", "delayed"),
         ("measure", "measured"), ("record", "recorded"), ("publish", "published"), ("replace", "replaced"),
         ("fund", "funded"), ("inspect", "inspected"), ("update", "updated"), ("reduce", "reduced"),
         ("extend", "extended"), ("examine", "examined"), ("reject", "rejected"), ("adopt", "adopted"),
         ("plan", "planned"), ("complete", "completed"), ("monitor", "monitored"), ("audit", "audited"),
         ("close", "closed"), ("repair", "repaired"), ("survey", "surveyed"), ("move", "moved")]
ADVERBS = ("Meanwhile", "In practice", "By contrast", "As a result", "In most cases", "Later that year", "For now",
           "In addition", "Even so", "At first", "Since then", "On balance")
PREPOSITIONS = ("across", "within", "near", "after", "before", "during", "under", "beyond", "along", "for",
                "behind", "around")
CONJUNCTIONS = ("because", "although", "while", "and", "but", "so", "whereas")
PLACES = ("Ashford", "Brookvale", "Carrow", "Dunmore", "Elmstead", "Fairhaven", "Glenrock", "Harwick",
          "Ivybridge", "Kestrel Bay", "Larkfield", "Millbrook", "Northam", "Oakridge", "Pemberton", "Queensbury",
          "Redcliff", "Stonehaven", "Thornbury", "Upton", "Westmere", "Yarrow")
FIRST = ("Maria", "James", "Aisha", "Tomas", "Helen", "Victor", "Grace", "Omar", "Lucy", "Daniel", "Priya",
         "Samuel", "Nora", "Felix", "Irene", "Marcus")
LAST = ("Lopez", "Carter", "Nguyen", "Okafor", "Brennan", "Fischer", "Hale", "Ramirez", "Sato", "Whitfield",
        "Kowalski", "Moreau", "Patel", "Lindqvist", "Adeyemi", "Morgan")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
CAPS_HEADINGS = ("SUMMARY", "BACKGROUND", "INTRODUCTION", "DISCUSSION", "FINDINGS", "PURPOSE", "SCOPE",
                 "DEFINITIONS", "PROCEDURE", "CONCLUSION", "GENERAL PROVISIONS", "EFFECTIVE DATE", "METHODS",
                 "RESULTS", "OVERVIEW", "RECOMMENDATIONS", "FURTHER INFORMATION", "APPENDIX")


def plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


class Prose:
    """Varied English from word lists and sentence shapes, so the set needs no external corpus."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, seq: Sequence[T]) -> T:
        return self.rng.choice(seq)

    def np(self) -> str:
        """A noun phrase: "the regional council", "the library"."""
        adj = f"{self.pick(ADJECTIVES)} " if self.rng.random() < 0.6 else ""
        return f"the {adj}{self.pick(NOUNS)}"

    def pp(self) -> str:
        return f"{self.pick(PREPOSITIONS)} {self.np()}"

    def person(self) -> str:
        return f"{self.pick(FIRST)} {self.pick(LAST)}"

    def number(self) -> str:
        n = self.rng.choice((self.rng.randint(2, 95), self.rng.randint(100, 9999)))
        return f"{n:,}"

    def date(self) -> str:
        return f"{self.pick(MONTHS)} {self.rng.randint(1, 28)}, {self.rng.randint(1994, 2024)}"

    def sentence(self) -> str:
        r, past = self.rng, self.pick(VERBS)[1]
        shapes: list[Callable[[], str]] = [
            lambda: f"{cap(self.np())} {past} {self.np()} {self.pp()}.",
            lambda: f"{self.pick(ADVERBS)}, {self.np()} in {self.pick(PLACES)} {past} {self.number()} "
                    f"{plural(self.pick(NOUNS))}.",
            lambda: f"In {r.randint(1990, 2024)}, {self.person()} {past} {self.np()}, {self.pick(CONJUNCTIONS)} "
                    f"{self.np()} {self.pick(VERBS)[1]} {self.pp()}.",
            lambda: f"Officials said {self.np()} had {past} about {r.randint(2, 60)} percent of the "
                    f"{plural(self.pick(NOUNS))} {self.pp()}.",
            lambda: f"Most {plural(self.pick(NOUNS))} {self.pp()} were {past} by {self.np()}.",
            lambda: f"{cap(self.np())} in {self.pick(PLACES)} was {past} on {self.date()}, {self.pick(CONJUNCTIONS)} "
                    f"{self.np()} remained {self.pick(ADJECTIVES)}.",
            lambda: f"Why {self.np()} was {past} {self.pp()} remains unclear.",
        ]
        return self.pick(shapes)()

    def sentences(self, lo: int, hi: int) -> list[str]:
        return [self.sentence() for _ in range(self.rng.randint(lo, hi))]

    def heading(self) -> str:
        shapes = [lambda: f"{cap(self.pick(ADJECTIVES))} {cap(self.pick(NOUNS))} {cap(self.pick(NOUNS))}",
                  lambda: f"{cap(plural(self.pick(NOUNS)))} and {cap(plural(self.pick(NOUNS)))}",
                  lambda: f"The {cap(self.pick(NOUNS))} in {self.pick(PLACES)}",
                  lambda: f"{cap(self.pick(ADJECTIVES))} {cap(plural(self.pick(NOUNS)))}"]
        return self.pick(shapes)()

    def title(self) -> str:
        return f"{self.heading()}: {cap(self.pick(ADJECTIVES))} {cap(plural(self.pick(NOUNS)))} in {self.pick(PLACES)}"

    def footnote(self) -> str:
        r = self.rng
        shapes = [lambda: f"See {self.person()}, {self.heading()} {r.randint(2, 40)} ({r.randint(1990, 2024)}).",
                  lambda: f"See {r.randint(40, 89)} FR {r.randint(1000, 99999)} ({self.date()}).",
                  lambda: self.sentence(),
                  lambda: f"The {self.pick(NOUNS)} {self.pick(VERBS)[1]} this figure in {r.randint(1990, 2024)}."]
        return self.pick(shapes)()

    def question(self) -> str:
        base = self.pick(VERBS)[0]
        shapes = [lambda: f"Did you {base} {self.np()} {self.pp()}?",
                  lambda: f"Where were you on {self.date()}?",
                  lambda: f"And what did {self.np()} {base} after that?",
                  lambda: f"How long had you worked at {self.np()} in {self.pick(PLACES)}?",
                  lambda: f"Who {self.pick(VERBS)[1]} {self.np()}?",
                  lambda: f"Can you tell the jury why {self.np()} was {self.pick(VERBS)[1]} {self.pp()}?"]
        return self.pick(shapes)()

    def answer(self) -> str:
        shapes = [lambda: "Yes, I did.", lambda: "No.", lambda: "I do not recall.",
                  lambda: f"I {self.pick(VERBS)[1]} {self.np()} {self.pp()}.",
                  lambda: f"About {self.number()} {plural(self.pick(NOUNS))}, I believe.",
                  lambda: f"It was {self.person()}.",
                  lambda: f"{self.sentence()} {self.sentence()}"]
        return self.pick(shapes)()


# --------------------------------------------------------------------------------------------------- drawing

def _char_widths(font: str) -> dict[str, float]:
    """Per-character widths at size 1, measured once (base-14 text is not kerned, so widths add up exactly)."""
    return {c: pymupdf.get_text_length(c, fontname=font, fontsize=1000) / 1000 for c in string.printable[:95]}


_WIDTHS: dict[str, dict[str, float]] = {}


def text_width(text: str, font: str, size: float) -> float:
    table = _WIDTHS.get(font) or _WIDTHS.setdefault(font, _char_widths(font))
    return sum(table[c] for c in text) * size


@dataclass
class Tok:
    """One word to place, with an optional footnote marker raised after it."""

    text: str
    font: str
    size: float
    sup: str = ""

    @property
    def width(self) -> float:
        return text_width(self.text, self.font, self.size) + (text_width(self.sup, self.font, self.size * 0.6)
                                                              if self.sup else 0.0)

    @property
    def truth(self) -> str:
        return f"{self.text} {self.sup}" if self.sup else self.text


@dataclass
class Canvas:
    """A page's drawing as a list of operations, so a layout can be retried before anything touches a PDF."""

    width: float
    height: float
    texts: list[tuple[float, float, str, str, float, tuple]] = field(default_factory=list)
    lines: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    rects: list[tuple[pymupdf.Rect, tuple | None, tuple | None]] = field(default_factory=list)
    images: list[tuple[pymupdf.Rect, pymupdf.Pixmap]] = field(default_factory=list)

    def text(self, x: float, baseline: float, text: str, font: str, size: float, color: tuple = BLACK) -> None:
        self.texts.append((x, baseline, text, font, size, color))

    def line(self, x0: float, y0: float, x1: float, y1: float, width: float = 0.6) -> None:
        self.lines.append((x0, y0, x1, y1, width))

    def rect(self, rect: pymupdf.Rect, fill: tuple | None = None, stroke: tuple | None = BLACK) -> None:
        self.rects.append((pymupdf.Rect(rect), fill, stroke))

    def render(self, page: pymupdf.Page) -> None:
        """One Shape for the whole page: per-call page.insert_text costs ~6x more."""
        shape = page.new_shape()
        for rect, fill, stroke in self.rects:
            shape.draw_rect(rect)
            shape.finish(fill=fill, color=stroke, width=0.6)
        for x0, y0, x1, y1, width in self.lines:
            shape.draw_line((x0, y0), (x1, y1))
            shape.finish(color=BLACK, width=width)
        for x, y, text, font, size, color in self.texts:
            shape.insert_text((x, y), text, fontname=font, fontsize=size, color=color)
        shape.commit()
        for rect, pix in self.images:
            page.insert_image(rect, pixmap=pix)


def draw_line_of_toks(canvas: Canvas, toks: list[Tok], x: float, baseline: float, width: float,
                      justify: bool) -> None:
    """Draw one typeset line: justified lines place each word; ragged lines draw runs of plain words at once."""
    space = text_width(" ", toks[0].font, toks[0].size)
    stretch = 0.0
    if justify and len(toks) > 1:
        natural = sum(t.width for t in toks) + space * (len(toks) - 1)
        stretch = (width - natural) / (len(toks) - 1)
        stretch = stretch if 0 < stretch < 2.5 * space else 0.0   # a near-empty line stays ragged
    xs = []
    for tok in toks:
        xs.append(x)
        x += tok.width + space + stretch
    runs: list[list[int]] = []
    for k, tok in enumerate(toks):
        prev = toks[k - 1] if k else None
        if not stretch and prev and not prev.sup and (prev.font, prev.size) == (tok.font, tok.size):
            runs[-1].append(k)
        else:
            runs.append([k])
    for run in runs:
        first = toks[run[0]]
        canvas.text(xs[run[0]], baseline, " ".join(toks[k].text for k in run), first.font, first.size)
    for k, tok in enumerate(toks):
        if tok.sup:   # smaller and raised, right after the word
            canvas.text(xs[k] + text_width(tok.text, tok.font, tok.size), baseline - tok.size * 0.35, tok.sup,
                        tok.font, tok.size * 0.6)


def take_line(toks: list[Tok], start: int, width: float) -> int:
    """Greedy line breaking: the index after the last token that fits in ``width`` (at least one token)."""
    used, end = 0.0, start
    while end < len(toks):
        w = toks[end].width + (text_width(" ", toks[end].font, toks[end].size) if end > start else 0.0)
        if end > start and used + w > width:
            break
        used += w
        end += 1
    return end


def wrap(toks: list[Tok], width: float) -> list[list[Tok]]:
    lines, i = [], 0
    while i < len(toks):
        j = take_line(toks, i, width)
        lines.append(toks[i:j])
        i = j
    return lines


def toks_of(text: str, font: str, size: float) -> list[Tok]:
    return [Tok(w, font, size) for w in text.split()]


class Flow:
    """Pour lines into column frames, each top to bottom, left to right, as a typesetter fills columns."""

    def __init__(self, canvas: Canvas, frames: list[pymupdf.Rect], indent: bool = False, para_gap: float = 0.6
                 ) -> None:
        self.canvas, self.frames = canvas, frames
        self.indent, self.para_gap = indent, para_gap   # first-line indents, or block paragraphs with a gap
        self.i, self.y = 0, frames[0].y0
        self.splits: list[tuple[int, Tok, Tok]] = []   # (frame left, its last token, next frame's first token)

    @property
    def frame(self) -> pymupdf.Rect:
        return self.frames[self.i]

    @property
    def full(self) -> bool:
        return self.i >= len(self.frames)

    def room(self) -> float:
        return 0.0 if self.full else self.frame.y1 - self.y

    def next_frame(self) -> bool:
        self.i += 1
        if not self.full:
            self.y = self.frame.y0
        return not self.full

    def skip(self, height: float) -> None:
        """Vertical space, dropped at the top of a frame."""
        if not self.full and self.y > self.frame.y0:
            self.y = min(self.y + height, self.frame.y1)

    def reserve(self, height: float) -> pymupdf.Rect | None:
        """A box of ``height`` in this frame or the next that has room; None when the frames run out."""
        while not self.full:
            if self.room() >= height:
                box = pymupdf.Rect(self.frame.x0, self.y, self.frame.x1, self.y + height)
                self.y += height
                return box
            self.next_frame()
        return None

    def paragraph(self, toks: list[Tok], leading: float = 1.3, justify: bool = False, indent: float = 0.0,
                  keep: int = 1) -> int:
        """Set ``toks`` as a paragraph; return how many were placed (fewer when the frames fill up). ``keep`` lines
        must fit together in the frame where the paragraph starts (headings keep with their next line)."""
        if not toks or self.full:
            return 0
        height = toks[0].size * leading
        if self.room() < height * keep:
            self.next_frame()
        i = 0
        while i < len(toks) and not self.full:
            if self.room() < height:
                last = toks[i - 1] if i else None
                if not self.next_frame():
                    break
                if last is not None:
                    self.splits.append((self.i - 1, last, toks[i]))
                continue
            first = i == 0
            width = self.frame.width - (indent if first else 0.0)
            j = take_line(toks, i, width)
            baseline = self.y + toks[i].size * 0.9
            draw_line_of_toks(self.canvas, toks[i:j], self.frame.x0 + (indent if first else 0.0), baseline, width,
                              justify and j < len(toks))
            self.y += height
            i = j
        return i


# --------------------------------------------------------------------------------------------------- truth

@dataclass
class Truth:
    """What a page says, in reading order, as the page is built."""

    body: list[str] = field(default_factory=list)
    asides: list[str] = field(default_factory=list)       # sidebars, pull quotes: after the body
    notes: list[str] = field(default_factory=list)        # footnotes: last
    sentences: list[str] = field(default_factory=list)
    tables: list[list[list[str]]] = field(default_factory=list)
    spaced: list[str] = field(default_factory=list)
    numbered: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n\n".join(self.body + self.asides + self.notes)


@dataclass
class Style:
    """A page's body typography."""

    family: str
    size: float
    leading: float
    justify: bool

    @property
    def regular(self) -> str:
        return FONT_FAMILIES[self.family][0]

    @property
    def bold(self) -> str:
        return FONT_FAMILIES[self.family][1]

    @property
    def italic(self) -> str:
        return FONT_FAMILIES[self.family][2]


def random_style(rng: random.Random, lo: float = 9.0, hi: float = 11.5,
                 fonts: tuple[str, ...] = ("helv", "tiro", "tiro", "helv", "cour")) -> Style:
    """Body typography; typewriter (Courier) text stays ragged, as it is in real documents."""
    font = rng.choice(fonts)
    return Style(font, round(rng.uniform(lo, hi), 1), rng.uniform(1.2, 1.45), rng.random() < 0.6 and font != "cour")


def put_paragraph(flow: Flow, truth: Truth, sentences: list[str], style: Style, markers: dict[int, str] | None = None,
                  indent: float | None = None) -> bool:
    """Set sentences as one paragraph; record the placed words and the sentences placed whole. True if all fit."""
    markers = markers or {}
    toks: list[Tok] = []
    ends: list[int] = []
    for k, sentence in enumerate(sentences):
        toks += toks_of(sentence, style.regular, style.size)
        if k in markers:
            toks[-1].sup = markers[k]
        ends.append(len(toks))
    if indent is None:
        indent = style.size * 1.5 if flow.indent else 0.0
    placed = flow.paragraph(toks, style.leading, style.justify, indent)
    if placed:
        truth.body.append(" ".join(t.truth for t in toks[:placed]))
    truth.sentences += [s for s, end in zip(sentences, ends, strict=True) if end <= placed]
    flow.skip(style.size * flow.para_gap)
    return placed == len(toks)


def put_heading(flow: Flow, truth: Truth, text: str, font: str, size: float) -> bool:
    flow.skip(size * 0.6)
    placed = flow.paragraph(toks_of(text, font, size), 1.25, keep=3)
    if placed:
        truth.body.append(" ".join(text.split()[:placed]))
    flow.skip(size * 0.3)
    return placed > 0


def fill_body(flow: Flow, truth: Truth, prose: Prose, style: Style, heading_p: float = 0.3,
              extra: Callable[[int], None] | None = None) -> None:
    """Headings and paragraphs until the frames are full. ``extra(k)`` runs before paragraph k (figures, tables)."""
    rng, k = prose.rng, 0
    while not flow.full:
        if extra is not None:
            extra(k)
            if flow.full:
                break
        if k and rng.random() < heading_p:
            put_heading(flow, truth, prose.heading(), style.bold, round(style.size * rng.uniform(1.1, 1.5), 1))
        put_paragraph(flow, truth, prose.sentences(2, 6), style)
        k += 1


def new_flow(canvas: Canvas, frames: list[pymupdf.Rect], rng: random.Random) -> Flow:
    indent = rng.random() < 0.5
    return Flow(canvas, frames, indent, 0.2 if indent else rng.uniform(0.5, 1.0))


@dataclass
class Page:
    """The geometry a page builder starts from."""

    width: float
    height: float
    left: float
    right: float
    top: float
    bottom: float

    @property
    def text_width(self) -> float:
        return self.right - self.left


def page_box(rng: random.Random, paper: str) -> Page:
    w, h = PAPERS[paper]
    lm, rm = rng.uniform(45, 85), rng.uniform(45, 85)
    return Page(w, h, lm, w - rm, rng.uniform(50, 80), h - rng.uniform(50, 80))


def columns(box: Page, top: float, bottom: float, n: int, gutter: float) -> list[pymupdf.Rect]:
    width = (box.text_width - gutter * (n - 1)) / n
    return [pymupdf.Rect(box.left + i * (width + gutter), top, box.left + i * (width + gutter) + width, bottom)
            for i in range(n)]


def full_width_text(canvas: Canvas, truth: Truth, box: Page, y: float, text: str, font: str, size: float,
                    center: bool = False) -> float:
    """A title or lead paragraph across the page; return the y below it."""
    for line in wrap(toks_of(text, font, size), box.text_width):
        s = " ".join(t.text for t in line)
        x = box.left + ((box.text_width - text_width(s, font, size)) / 2 if center else 0.0)
        canvas.text(x, y + size * 0.9, s, font, size)
        y += size * 1.25
    truth.body.append(text)
    return y


# --------------------------------------------------------------------------------------------------- families

@dataclass
class DocContext:
    """What pages of one PDF share: paper, running header and footer, first page number."""

    paper: str
    header: tuple[str, str] = ("", "")
    footer: str = ""
    first_number: int = 1
    rule: bool = False
    ncols: int = 1
    style: Style | None = None
    page_index: int = 0


def build_columns(rng: random.Random, prose: Prose, ctx: DocContext, ncols: int) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    canvas, truth = Canvas(box.width, box.height), Truth()
    style = random_style(rng, 8.5 if ncols == 3 else 9.0, 10.0 if ncols == 3 else 11.5)
    y = box.top
    if rng.random() < 0.5:
        size = round(rng.uniform(15, 22), 1)
        y = full_width_text(canvas, truth, box, y, prose.title(), style.bold, size, center=rng.random() < 0.5) + 8
        if ncols > 1 and rng.random() < 0.4:
            y = full_width_text(canvas, truth, box, y, " ".join(prose.sentences(2, 3)), style.italic, style.size) + 10
    flow = new_flow(canvas, columns(box, y, box.bottom, ncols, rng.uniform(14, 30)), rng)
    fill_body(flow, truth, prose, style)
    return canvas, truth


def build_one_column(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    return build_columns(rng, prose, ctx, 1)


def build_two_column(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    return build_columns(rng, prose, ctx, 2)


def build_three_column(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    return build_columns(rng, prose, ctx, 3)


def transcript_lines(prose: Prose, width: float, font: str, size: float, n: int) -> list[tuple[str, float]]:
    """``n`` physical lines of a transcript as (text, indent): a caption block, Q./A. turns and colloquy."""
    rng, out = prose.rng, []
    if rng.random() < 0.6:   # short "Name: value" lines, which are not a table
        for label, value in rng.sample([("Witness", prose.person()), ("Date", prose.date()),
                                        ("Case No.", f"{rng.randint(10, 24)}-cv-{rng.randint(1000, 9999)}"),
                                        ("Examination by", f"Ms. {rng.choice(LAST)}"),
                                        ("Location", f"{rng.choice(PLACES)} County Courthouse")], rng.randint(2, 4)):
            out.append((f"{label}: {value}", 0.0))
    while len(out) < n:
        r = rng.random()
        if r < 0.8:
            turns = [("Q.", prose.question()), ("A.", prose.answer())]
        else:
            speaker = rng.choice(("THE COURT", f"MR. {rng.choice(LAST).upper()}", f"MS. {rng.choice(LAST).upper()}"))
            turns = [(f"{speaker}:", rng.choice(("Overruled. You may answer.", "Sustained.",
                                                 "Objection, Your Honor. Leading the witness.",
                                                 "Let the record reflect that the witness nodded.",
                                                 f"{prose.sentence()}")))]
        for label, text in turns:
            toks = toks_of(f"{label} {text}", font, size)
            indent = size * 3
            first = take_line(toks, 0, width - indent)
            out.append((" ".join(t.text for t in toks[:first]), indent))
            out += [(" ".join(t.text for t in line), 0.0) for line in wrap(toks[first:], width)]
    return out[:n]


def build_line_numbered(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    w, h = PAPERS[ctx.paper]
    canvas, truth = Canvas(w, h), Truth()
    n = rng.choice((25, 28))
    font = rng.choice(("cour", "cour", "tiro", "helv"))
    size = round(rng.uniform(10, 12), 1)
    top, bottom = rng.uniform(60, 80), h - rng.uniform(60, 80)
    pitch = (bottom - top) / n
    right_side = rng.random() < 0.25
    if right_side:   # numbers in the right margin
        text_x0, text_x1 = rng.uniform(60, 80), w - rng.uniform(80, 100)
        num_x, rule_x = text_x1 + 18, text_x1 + 10
    else:
        text_x0, text_x1 = rng.uniform(95, 115), w - rng.uniform(55, 75)
        num_x, rule_x = text_x0 - 22, text_x0 - 10
    rule = rng.random() < 0.6
    if rule:
        canvas.line(rule_x, top - 10, rule_x, bottom + 10, 0.8)
        if rng.random() < 0.5:
            canvas.line(rule_x - 3, top - 10, rule_x - 3, bottom + 10, 0.8)
    lines = transcript_lines(prose, text_x1 - text_x0, font, size, n)
    for k, (text, indent) in enumerate(lines, start=1):
        baseline = top + (k - 1) * pitch + size
        number = str(k)
        nx = num_x if right_side else num_x - text_width(number, font, size * 0.9)   # right-aligned on the left
        canvas.text(nx, baseline, number, font, size * 0.9)
        canvas.text(text_x0 + indent, baseline, text, font, size)
        truth.numbered.append(f"{k} {text}")
    truth.body = [t for t, _ in lines]
    truth.sentences = transcript_sentences(lines)
    if rng.random() < 0.5:   # a page number under the grid (not in the truth)
        canvas.text(w / 2 - 5, h - 30, str(rng.randint(2, 240)), font, size * 0.9)
    return canvas, truth


def transcript_sentences(lines: list[tuple[str, float]]) -> list[str]:
    """The Q./A. turns that are whole on the page (a turn starts with an indented line), without their label."""
    turns: list[list[str]] = []
    for text, indent in lines:
        if indent:
            turns.append([text])
        elif turns:
            turns[-1].append(text)
    whole = turns[:-1]   # the last turn may run past the page
    return [" ".join(t).split(" ", 1)[1] for t in whole if t[0][:2] in ("Q.", "A.")]


def footnote_block(prose: Prose, count: int, font: str, size: float,
                   width: float) -> tuple[list[tuple[str, list[list[Tok]]]], float]:
    """Footnote texts, each wrapped after its number; and the block's height."""
    notes, height = [], 0.0
    for k in range(1, count + 1):
        text = prose.footnote()
        indent = text_width(f"{k} ", font, size)
        lines = wrap(toks_of(text, font, size), width - indent)
        notes.append((text, lines))
        height += len(lines) * size * 1.2 + 2
    return notes, height


def build_footnotes(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    ncols = rng.choice((2, 2, 3))
    style = Style("tiro" if rng.random() < 0.7 else "helv", round(rng.uniform(8.5, 10), 1), 1.25, rng.random() < 0.7)
    fsize = max(6.5, round(style.size * 0.78, 1))
    at_column = rng.random() < 0.5    # at the foot of column 1, else across the foot of the page
    sup_marker = rng.random() < 0.5
    gutter = rng.uniform(12, 24)
    agency = " ".join((rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(("board", "office", "service")))).upper()
    count = rng.randint(1, 3)
    col_w = (box.text_width - gutter * (ncols - 1)) / ncols
    notes, notes_h = footnote_block(prose, count, style.regular, fsize, col_w if at_column else box.text_width)
    first_paragraph = prose.sentences(4, 6)
    marked = sorted(rng.sample(range(len(first_paragraph)), count))
    state = rng.getstate()
    for attempt in range(12):   # until a sentence runs from column 1 into column 2
        rng.setstate(state)
        canvas, truth = Canvas(box.width, box.height), Truth()
        y = full_width_text(canvas, truth, box, box.top, agency, style.bold, style.size + 2) + 6
        notes_top = box.bottom - notes_h
        frames = columns(box, y, notes_top - 8, ncols, gutter)
        if at_column:
            frames[0].y1 -= attempt * style.size * style.leading * 0.5
            frames[1:] = [pymupdf.Rect(f.x0, f.y0, f.x1, box.bottom) for f in frames[1:]]
        else:
            for f in frames:
                f.y1 -= attempt * style.size * style.leading * 0.5
        flow = new_flow(canvas, frames, rng)
        put_paragraph(flow, truth, first_paragraph, style, {s: str(k + 1) for k, s in enumerate(marked)})
        fill_body(flow, truth, prose, style, heading_p=0.15)
        if any(f == 0 and not last.text.endswith((".", "?", "!")) for f, last, _ in flow.splits):
            break
    else:
        raise RuntimeError("no layout splits a sentence across columns")
    x0 = box.left
    canvas.line(x0, notes_top - 4, x0 + rng.uniform(40, 90), notes_top - 4, 0.5)
    y = notes_top
    for k, (text, lines) in enumerate(notes, start=1):
        marker = str(k)
        indent = text_width(f"{k} ", style.regular, fsize)
        if sup_marker:
            canvas.text(x0, y + fsize * 0.9 - fsize * 0.3, marker, style.regular, fsize * 0.7)
        else:
            canvas.text(x0, y + fsize * 0.9, marker, style.regular, fsize)
        for line in lines:
            canvas.text(x0 + indent, y + fsize * 0.9, " ".join(t.text for t in line), style.regular, fsize)
            y += fsize * 1.2
        y += 2
        truth.notes.append(f"{marker} {text}")
    return canvas, truth


def build_headers_footers(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    box.top, box.bottom = max(box.top, 70.0), min(box.bottom, box.height - 70.0)
    canvas, truth = Canvas(box.width, box.height), Truth()
    number = ctx.first_number + ctx.page_index
    hsize = ctx.style.size * 0.8
    left, right = ctx.header
    if number % 2 == 0:
        left, right = right, left
    canvas.text(box.left, box.top - 22, left, ctx.style.italic, hsize)
    canvas.text(box.right - text_width(right, ctx.style.regular, hsize), box.top - 22, right, ctx.style.regular, hsize)
    if ctx.rule:
        canvas.line(box.left, box.top - 16, box.right, box.top - 16, 0.5)
    foot = ctx.footer.format(n=number)
    fx = (box.left + box.right - text_width(foot, ctx.style.regular, hsize)) / 2
    canvas.text(fx, box.bottom + 28, foot, ctx.style.regular, hsize)
    flow = new_flow(canvas, columns(box, box.top, box.bottom, ctx.ncols, 20), rng)
    fill_body(flow, truth, prose, ctx.style, heading_p=0.2)
    return canvas, truth


def build_sidebars(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    canvas, truth = Canvas(box.width, box.height), Truth()
    style = random_style(rng, fonts=("helv", "tiro"))
    y = box.top
    if rng.random() < 0.6:
        y = full_width_text(canvas, truth, box, y, prose.title(), style.bold, round(rng.uniform(15, 20), 1)) + 8
    if rng.random() < 0.55:
        side_box(rng, prose, canvas, truth, box, y, style)
    else:
        pull_quote(rng, prose, canvas, truth, box, y, style)
    return canvas, truth


def side_box(rng: random.Random, prose: Prose, canvas: Canvas, truth: Truth, box: Page, y: float, style: Style) -> None:
    """A shaded, boxed sidebar in a strip beside the body column."""
    side_w = box.text_width * rng.uniform(0.28, 0.36)
    on_right = rng.random() < 0.7
    gap = rng.uniform(14, 24)
    body = pymupdf.Rect(box.left, y, box.right - side_w - gap, box.bottom)
    strip = pymupdf.Rect(box.right - side_w, y, box.right, box.bottom)
    if not on_right:
        body = pymupdf.Rect(box.left + side_w + gap, y, box.right, box.bottom)
        strip = pymupdf.Rect(box.left, y, box.left + side_w, box.bottom)
    title, text = prose.heading(), " ".join(prose.sentences(2, 4))
    size = round(style.size * 0.9, 1)
    pad = 6.0
    title_lines = wrap(toks_of(title, style.bold, size + 1), side_w - 2 * pad)
    text_lines = wrap(toks_of(text, style.regular, size), side_w - 2 * pad)
    height = (len(title_lines) * (size + 1) + len(text_lines) * size) * 1.3 + 2 * pad + 4
    top = strip.y0 + rng.uniform(0, max(0.0, strip.height - height) * 0.5)
    canvas.rect(pymupdf.Rect(strip.x0, top, strip.x1, top + height), fill=(0.9, 0.92, 0.95),
                stroke=BLACK if rng.random() < 0.7 else None)
    yy = top + pad
    for line, s in [(ln, size + 1) for ln in title_lines] + [(ln, size) for ln in text_lines]:
        canvas.text(strip.x0 + pad, yy + s * 0.9, " ".join(t.text for t in line), line[0].font, s)
        yy += s * 1.3 + (4 if line is title_lines[-1] else 0)
    flow = new_flow(canvas, [body], rng)
    fill_body(flow, truth, prose, style, heading_p=0.25)
    truth.asides.append(f"{title}\n{text}")


def pull_quote(rng: random.Random, prose: Prose, canvas: Canvas, truth: Truth, box: Page, y: float,
               style: Style) -> None:
    """A pull quote between rules, inside the body flow after the first or second paragraph."""
    quote = prose.sentence()
    size = round(style.size * rng.uniform(1.3, 1.6), 1)
    inset = box.text_width * rng.uniform(0.08, 0.2)
    lines = wrap(toks_of(quote, style.italic, size), box.text_width - 2 * inset)
    height = len(lines) * size * 1.3 + 20
    after = rng.randint(1, 2)

    def extra(k: int) -> None:
        if k != after:
            return
        area = flow.reserve(height + 12)
        if area is None:
            return
        canvas.line(box.left + inset, area.y0 + 4, box.right - inset, area.y0 + 4, 1.2)
        yy = area.y0 + 12
        for line in lines:
            s = " ".join(t.text for t in line)
            canvas.text((box.left + box.right - text_width(s, style.italic, size)) / 2, yy + size * 0.9, s,
                        style.italic, size)
            yy += size * 1.3
        canvas.line(box.left + inset, yy + 4, box.right - inset, yy + 4, 1.2)
        truth.asides.append(quote)

    flow = new_flow(canvas, [pymupdf.Rect(box.left, y, box.right, box.bottom)], rng)
    fill_body(flow, truth, prose, style, heading_p=0.2, extra=extra)


KV_LABELS = {
    "Applicant name": lambda p: p.person(), "Date of birth": lambda p: p.date(),
    "Street address": lambda p: f"{p.rng.randint(1, 999)} {p.pick(PLACES)} Road",
    "City": lambda p: p.pick(PLACES), "Postal code": lambda p: f"{p.rng.randint(10000, 99999)}",
    "Phone": lambda p: f"555 {p.rng.randint(100, 999)} {p.rng.randint(1000, 9999)}",
    "Email": lambda p: f"{p.pick(FIRST).lower()}.{p.pick(LAST).lower()}@example.org",
    "Account number": lambda p: f"AC{p.rng.randint(100000, 999999)}",
    "Policy number": lambda p: f"PL {p.rng.randint(1000, 9999)} {p.rng.randint(100, 999)}",
    "Amount claimed": lambda p: f"${p.rng.randint(100, 99999):,}.00",
    "Employer": lambda p: f"{p.pick(PLACES)} {cap(p.pick(NOUNS))} Ltd",
    "Position": lambda p: f"{cap(p.pick(ADJECTIVES))} {p.pick(NOUNS)} officer", "Start date": lambda p: p.date(),
    "Reference": lambda p: f"REF {p.rng.randint(1000, 9999)}", "Tax year": lambda p: str(p.rng.randint(2010, 2024)),
    "Filing status": lambda p: p.pick(("Single", "Married filing jointly", "Head of household")),
    "Signature date": lambda p: p.date(), "Contact person": lambda p: p.person(),
    "Department": lambda p: f"{cap(p.pick(NOUNS))} services",
    "Number of dependants": lambda p: str(p.rng.randint(0, 5)),
}
KV_GROUPS = ("Applicant Details", "Employment", "Claim Information", "Contact", "Account Summary", "Household")


def build_kv_forms(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    canvas, truth = Canvas(box.width, box.height), Truth()
    style = random_style(rng, 9, 11, ("helv", "helv", "tiro", "cour"))
    title = f"{cap(prose.pick(NOUNS))} {rng.choice(('Application', 'Claim', 'Registration'))} Form"
    y = full_width_text(canvas, truth, box, box.top, title, style.bold, round(rng.uniform(14, 18), 1)) + 6
    if rng.random() < 0.5:
        instructions = prose.sentences(1, 2)
        flow = new_flow(canvas, [pymupdf.Rect(box.left, y, box.right, box.bottom)], rng)
        put_paragraph(flow, truth, instructions, style, indent=0.0)
        y = flow.y + 8
    colon = rng.random() < 0.6
    boxed = rng.random() < 0.4
    titles = rng.sample(KV_GROUPS, len(KV_GROUPS))
    while y < box.bottom - 120:
        side_by_side = rng.random() < 0.5
        halves = ([(box.left, box.left + box.text_width / 2 - 12), (box.left + box.text_width / 2 + 12, box.right)]
                  if side_by_side else [(box.left, box.right)])
        bottom = y
        for x0, x1 in halves:
            title = titles.pop() if titles else "Other"
            bottom = max(bottom, kv_group(prose, canvas, truth, style, title, (x0, x1, y), colon, boxed))
        y = bottom + rng.uniform(16, 30)
    return canvas, truth


def kv_group(prose: Prose, canvas: Canvas, truth: Truth, style: Style, title: str, at: tuple[float, float, float],
             colon: bool, boxed: bool) -> float:
    """One group at (x0, x1, top): a bold title, then rows with the label at x0 and the value at a shared x; return
    the bottom."""
    rng, (x0, x1, y) = prose.rng, at
    size = style.size
    rows = [(label + (":" if colon else ""), KV_LABELS[label](prose))
            for label in rng.sample(sorted(KV_LABELS), rng.randint(3, 6))]
    labels_end = x0 + 4 + max(text_width(lab, style.bold, size) for lab, _ in rows)
    widest = max(text_width(v, style.regular, size) for _, v in rows)
    value_x = labels_end + max(12.0, min(rng.uniform(12, 40), x1 - widest - labels_end))
    rows = [(lab, fit(v, style.regular, size, x1 - value_x)) for lab, v in rows]
    rows = [(lab, v) for lab, v in rows if text_width(v, style.regular, size) <= x1 - value_x]   # a long e-mail
    canvas.text(x0 + 4, y + size * 1.1, title, style.bold, size * 1.15)
    truth.body.append(title)
    pitch = size * rng.uniform(1.6, 2.2)
    yy = y + size * 1.2 + pitch
    for label, value in rows:
        canvas.text(x0 + 4, yy, label, style.bold if rng.random() < 0.5 else style.regular, size)
        canvas.text(value_x, yy, value, style.regular, size)
        truth.body.append(f"{label} {value}")
        yy += pitch
    if boxed:
        canvas.rect(pymupdf.Rect(x0, y, x1, yy - pitch + size * 0.8))
    return yy


def fit(text: str, font: str, size: float, width: float) -> str:
    """Drop words from the end until ``text`` fits (a form value never wraps)."""
    words = text.split()
    while len(words) > 1 and text_width(" ".join(words), font, size) > width:
        words.pop()
    return " ".join(words)


def spaced_width(text: str, font: str, size: float, tracking: float) -> float:
    words = text.split()
    letters = sum(len(w) for w in words)
    return (text_width(text, font, size) + tracking * (letters - len(words))
            + (len(words) - 1) * 3 * tracking)


def spaced_heading(canvas: Canvas, x: float, baseline: float, text: str, font: str, size: float,
                   tracking: float) -> None:
    """Draw ``text`` one character at a time with ``tracking`` extra space (three times that between words)."""
    for k, word in enumerate(text.split()):
        if k:
            x += text_width(" ", font, size) + 3 * tracking
        for ch in word:
            canvas.text(x, baseline, ch, font, size)
            x += text_width(ch, font, size) + tracking


def build_spaced_headings(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    canvas, truth = Canvas(box.width, box.height), Truth()
    style = random_style(rng)
    ncols = rng.choice((1, 1, 2))
    flow = new_flow(canvas, columns(box, box.top, box.bottom, ncols, 20), rng)
    names = rng.sample(CAPS_HEADINGS, len(CAPS_HEADINGS))
    title_case = rng.random() < 0.25

    def extra(k: int) -> None:
        if (k and rng.random() > 0.45) or not names:
            return
        text = names.pop()
        text = text.title() if title_case else text
        size = round(style.size * rng.uniform(1.1, 1.6), 1)
        flow.skip(size * 0.6)
        if flow.room() < size * 1.6 + style.size * style.leading * 3:
            flow.next_frame()
        area = flow.reserve(size * 1.6)
        if area is None:
            return
        tracking = size * rng.uniform(0.3, 0.6)
        while spaced_width(text, style.bold, size, tracking) > area.width:   # a narrow column: tighter, smaller
            tracking, size = tracking * 0.9, size * 0.97
        spaced_heading(canvas, area.x0, area.y0 + size * 1.1, text, style.bold, size, tracking)
        truth.body.append(text)
        truth.spaced += text.split()

    fill_body(flow, truth, prose, style, heading_p=0.0, extra=extra)
    return canvas, truth


def table_rows(prose: Prose) -> list[list[str]]:
    rng = prose.rng
    ncols = rng.randint(3, 5)
    first = rng.choice(("Site", "Region", "Program", "Item", "District"))
    heads = rng.choice([[str(y) for y in range(2016 + rng.randint(0, 4), 2030)],
                        ["Budget", "Actual", "Change", "Share"], ["Staff", "Visits", "Cost", "Rating"]])
    rows = [[first] + heads[:ncols - 1]]
    labels = rng.sample(PLACES, rng.randint(3, 7))
    for label in labels:
        cells = [label]
        for _ in range(ncols - 1):
            kind = rng.random()
            cells.append(f"{rng.randint(10, 99999):,}" if kind < 0.5 else f"{rng.uniform(0, 99):.1f}%" if kind < 0.8
                         else f"{rng.uniform(0, 9):.2f}")
        rows.append(cells)
    return rows


def draw_table(canvas: Canvas, rows: list[list[str]], x0: float, y0: float, style: Style, ruled: bool,
               widths: list[float], pitch: float) -> float:
    """Cells left-aligned (labels) or right-aligned (figures); a full grid when ruled. Return the bottom."""
    size, pad = style.size, 5.0
    xs = [x0]
    for w in widths:
        xs.append(xs[-1] + w)
    for r, row in enumerate(rows):
        baseline = y0 + r * pitch + pitch * 0.5 + size * 0.35
        for c, cell in enumerate(row):
            font = style.bold if r == 0 else style.regular
            w = text_width(cell, font, size)
            x = xs[c] + pad if c == 0 else xs[c + 1] - pad - w
            canvas.text(x, baseline, cell, font, size)
    bottom = y0 + len(rows) * pitch
    if ruled:
        for r in range(len(rows) + 1):
            canvas.line(xs[0], y0 + r * pitch, xs[-1], y0 + r * pitch, 0.6)
        for x in xs:
            canvas.line(x, y0, x, bottom, 0.6)
    return bottom


def build_tables(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    canvas, truth = Canvas(box.width, box.height), Truth()
    style = random_style(rng, 9, 11, ("helv", "tiro"))
    flow = new_flow(canvas, [pymupdf.Rect(box.left, box.top, box.right, box.bottom)], rng)
    at = {rng.randint(1, 2)}
    if rng.random() < 0.4:
        at.add(max(at) + rng.randint(1, 2))
    number = [rng.randint(1, 9)]

    def extra(k: int) -> None:
        if k not in at:
            return
        rows = table_rows(prose)
        widths = [max(text_width(row[c], style.bold, style.size) for row in rows) + rng.uniform(16, 40)
                  for c in range(len(rows[0]))]
        while sum(widths) > box.text_width:
            widths = [w * 0.95 for w in widths]
        pitch = style.size * rng.uniform(1.5, 2.0)
        caption = f"Table {number[0]}. {prose.sentence()}"
        cap_lines = wrap(toks_of(caption, style.italic, style.size), box.text_width)
        height = len(rows) * pitch + len(cap_lines) * style.size * 1.3 + 14
        flow.skip(style.size)
        area = flow.reserve(height)
        if area is None:
            return
        below = rng.random() < 0.25
        x0 = box.left + (box.text_width - sum(widths)) / 2 * rng.choice((0, 1))
        ty = area.y0 if below else area.y0 + len(cap_lines) * style.size * 1.3 + 6
        bottom = draw_table(canvas, rows, x0, ty, style, rng.random() < 0.5, widths, pitch)
        cy = bottom + 6 if below else area.y0
        for line in cap_lines:
            canvas.text(box.left, cy + style.size * 0.9, " ".join(t.text for t in line), style.italic, style.size)
            cy += style.size * 1.3
        cells = " ".join(c for row in rows for c in row)
        truth.body.append(f"{cells}\n{caption}" if below else f"{caption}\n{cells}")
        truth.tables.append(rows)
        number[0] += 1
        flow.skip(style.size)

    fill_body(flow, truth, prose, style, heading_p=0.2, extra=extra)
    return canvas, truth


def figure_pixmap(rng: random.Random, w: int = 64, h: int = 40) -> pymupdf.Pixmap:
    """A small smooth RGB picture (two gradients and a random tint), made in memory."""
    tint = [rng.randint(60, 200) for _ in range(3)]
    data = bytearray()
    for y in range(h):
        for x in range(w):
            data += bytes(((tint[0] + 2 * x) % 256, (tint[1] + 3 * y) % 256, (tint[2] + x + y) % 256))
    return pymupdf.Pixmap(pymupdf.csRGB, w, h, bytes(data), 0)


def build_captions(rng: random.Random, prose: Prose, ctx: DocContext) -> tuple[Canvas, Truth]:
    box = page_box(rng, ctx.paper)
    canvas, truth = Canvas(box.width, box.height), Truth()
    style = random_style(rng, fonts=("helv", "tiro"))
    ncols = rng.choice((1, 1, 2))
    flow = new_flow(canvas, columns(box, box.top, box.bottom, ncols, 20), rng)
    at = {rng.randint(1, 2)} | ({rng.randint(3, 4)} if rng.random() < 0.5 else set())
    number = [rng.randint(1, 9)]

    def extra(k: int) -> None:
        if k not in at:
            return
        frame_w = flow.frame.width if not flow.full else box.text_width
        fw, fh = frame_w * rng.uniform(0.5, 0.95), rng.uniform(70, 180)
        caption = f"Figure {number[0]}. {prose.sentence()}"
        csize = round(style.size * 0.9, 1)
        cap_lines = wrap(toks_of(caption, style.italic, csize), frame_w)
        flow.skip(style.size)
        area = flow.reserve(fh + 8 + len(cap_lines) * csize * 1.3)
        if area is None:
            return
        x0 = area.x0 + (area.width - fw) / 2
        fig = pymupdf.Rect(x0, area.y0, x0 + fw, area.y0 + fh)
        if rng.random() < 0.5:
            canvas.images.append((fig, figure_pixmap(rng)))
        else:
            canvas.rect(fig, fill=(0.85, 0.88, 0.92))
            for b in range(rng.randint(3, 7)):   # a few bars of a chart, no text
                bar_h = fh * rng.uniform(0.2, 0.85)
                bx = fig.x0 + 10 + b * (fw - 20) / 7
                canvas.rect(pymupdf.Rect(bx, fig.y1 - 6 - bar_h, bx + (fw - 20) / 9, fig.y1 - 6), fill=(0.3, 0.45, 0.7),
                            stroke=None)
        cy = fig.y1 + 8
        for line in cap_lines:
            canvas.text(area.x0, cy + csize * 0.9, " ".join(t.text for t in line), style.italic, csize)
            cy += csize * 1.3
        truth.body.append(caption)
        number[0] += 1
        flow.skip(style.size * 0.5)

    fill_body(flow, truth, prose, style, heading_p=0.2, extra=extra)
    return canvas, truth


BUILDERS: dict[str, Callable[[random.Random, Prose, DocContext], tuple[Canvas, Truth]]] = {
    "one_column": build_one_column, "two_column": build_two_column, "three_column": build_three_column,
    "line_numbered": build_line_numbered, "footnotes": build_footnotes, "headers_footers": build_headers_footers,
    "sidebars": build_sidebars, "kv_forms": build_kv_forms, "spaced_headings": build_spaced_headings,
    "tables": build_tables, "captions": build_captions,
}


# --------------------------------------------------------------------------------------------------- the set

def doc_context(rng: random.Random, prose: Prose, family: str) -> DocContext:
    ctx = DocContext(paper=rng.choice(("letter", "letter", "a4")))
    if family == "headers_footers":
        journal = f"Journal of {cap(rng.choice(ADJECTIVES))} {cap(plural(rng.choice(NOUNS)))}"
        ctx.header = (journal, f"Vol. {rng.randint(3, 60)}, No. {rng.randint(1, 12)}" if rng.random() < 0.5
                      else prose.heading())
        ctx.footer = rng.choice(("{n}", "Page {n}", "- {n} -", f"{{n}} | {journal}"))
        ctx.first_number = rng.randint(1, 400)
        ctx.rule = rng.random() < 0.5
        ctx.ncols = rng.choice((1, 2))
        ctx.style = random_style(rng)
    return ctx


def write_pdf(family: str, index: int, n_pages: int, out_dir: Path, seed: int) -> list[dict]:
    """One PDF of ``n_pages`` pages of a family; its records."""
    rng = random.Random(f"{seed}:{family}:{index}")
    prose = Prose(rng)
    ctx = doc_context(rng, prose, family)
    path = out_dir / f"{family}_{index:02d}.pdf"
    records = []
    with pymupdf.open() as doc:
        for p in range(n_pages):
            ctx.page_index = p
            canvas, truth = BUILDERS[family](rng, prose, ctx)
            canvas.render(doc.new_page(width=canvas.width, height=canvas.height))
            record = {"pdf": str(path), "page": p, "family": family, "truth": truth.text,
                      "has_table": bool(truth.tables), "tables": truth.tables, "sentences": truth.sentences,
                      "spaced_words": truth.spaced}
            if family == "line_numbered":
                record["truth_numbered"] = "\n".join(truth.numbered)
            records.append(record)
        doc.save(path, garbage=3, deflate=True, no_new_id=True)
    return records


def make_set(out_dir: Path, seed: int = 0, pages_per_family: int = PAGES_PER_FAMILY,
             families: tuple[str, ...] | list[str] = FAMILIES) -> list[dict]:
    """Write the set's PDFs into ``out_dir``; return one record per page (see the module docstring)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    for family in families:
        if family not in BUILDERS:
            raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
        left, index = pages_per_family, 0
        while left > 0:
            n = min(PAGES_PER_PDF, left)
            records += write_pdf(family, index, n, out_dir, seed)
            left -= n
            index += 1
    return records
