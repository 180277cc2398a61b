"""Synthetic PDFs for teaching the fusion model to read page images.

Pages carry a real text layer in base-14 fonts (prose from stdlib docstrings, invoice lines, ruled tables, vector
charts), so the rendered image shows exactly the text layer's words. About one page in eight is "scanned": a skewed,
speckled picture with no text layer, its ground truth returned instead. One ``random.Random`` drives everything and
the file holds no dates or random ID, so a seed always gives the same bytes.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from dataclasses import dataclass
from datetime import date, timedelta
from functools import lru_cache
from pathlib import Path

import numpy as np
import pymupdf

_MODULES = ("json", "re", "os.path", "collections", "itertools", "functools", "textwrap", "string", "datetime",
            "decimal", "fractions", "statistics", "heapq", "bisect", "difflib", "csv", "shutil", "pathlib",
            "argparse", "logging", "email", "http.client", "urllib.parse", "zipfile", "tarfile", "sqlite3")
_SENTENCE = re.compile(r"[A-Z][A-Za-z0-9 ,;:'()\-]{20,220}\.")
_PAGE_SIZES = ((612.0, 792.0), (595.0, 842.0))  # letter, A4
_FONTS, _BOLD = ("helv", "tiro", "cour"), ("hebo", "tibo", "cobo")
_COLOURS = ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.22, 0.22, 0.22), (0.05, 0.12, 0.38))
_FILLS = ((0.25, 0.4, 0.65), (0.45, 0.45, 0.45), (0.15, 0.3, 0.45), (0.6, 0.3, 0.2))
_KINDS = ("prose", "numbers", "table", "chart", "mixed")
_CELLS = ("amount", "percent", "count", "id", "date")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_PREFIXES = ("INV", "PO", "ACC", "REF", "SKU", "ORD")
_SCAN_CHANCE, _SCAN_DPI = 1 / 8, 100
_FOOTER = 18.0  # points kept under the body for the page footer
Colour = tuple[float, float, float]


@lru_cache(maxsize=1)
def _sentences() -> tuple[str, ...]:
    """Plain sentences from stdlib docstrings (module, then public members by name): real prose, no download."""
    found: dict[str, None] = {}
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        members = [v for k, v in sorted(vars(module).items())
                   if not k.startswith("_") and (inspect.isroutine(v) or inspect.isclass(v))]
        for doc in filter(None, map(inspect.getdoc, [module, *members])):
            for piece in re.split(r"(?<=\.)\s+", " ".join(doc.split())):
                if (_SENTENCE.fullmatch(piece) and piece.count("(") == piece.count(")")
                        and max(map(len, piece.split())) <= 16):
                    found[piece] = None
    return tuple(found)


@lru_cache(maxsize=1)
def _vocab() -> tuple[str, ...]:
    """Lower-case words of the sentence pool, for headings, labels and item descriptions."""
    return tuple(sorted({w for s in _sentences() for w in s.split() if re.fullmatch(r"[a-z]{4,10}", w)}))


@lru_cache(maxsize=None)
def _advance(font: str, char: str) -> float:
    return pymupdf.get_text_length(char, fontname=font, fontsize=1)


def _width(text: str, font: str, size: float) -> float:
    """Width in points from cached glyph advances: get_text_length per string is slow, base-14 has no kerning."""
    return size * sum(_advance(font, char) for char in text)


def _wrap(text: str, font: str, size: float, width: float) -> list[str]:
    """Greedy line breaks measured in the font itself, so no line runs past its column."""
    lines: list[list[str]] = [[]]
    space = _width(" ", font, size)
    used = -space
    for word in text.split():
        needed = _width(word, font, size)
        if needed > width:
            continue
        if lines[-1] and used + space + needed > width:
            lines.append([])
            used = -space
        lines[-1].append(word)
        used += space + needed
    return [" ".join(line) for line in lines if line]


def _title(rng: random.Random, n: int) -> str:
    return " ".join(rng.sample(_vocab(), n)).title()


def _money(cents: int) -> str:
    return f"${cents // 100:,}.{cents % 100:02d}"


def _ident(rng: random.Random, prefix: str = "") -> str:
    return f"{prefix or rng.choice(_PREFIXES)}-{rng.randint(10000, 99999)}"


def _date(rng: random.Random, day: date | None = None) -> str:
    """A date in one of several common spellings, locale-free so the bytes never depend on the machine."""
    day = day or date(2012, 1, 1) + timedelta(days=rng.randint(0, 4500))
    month = _MONTHS[day.month - 1]
    return rng.choice((f"{day:%Y-%m-%d}", f"{day:%m/%d/%Y}", f"{day.day} {month[:3]} {day.year}",
                       f"{month} {day.day}, {day.year}"))


@dataclass
class _Canvas:
    """One page being drawn: a single Shape (one content stream) and a cursor that flows down its columns."""

    shape: pymupdf.Shape
    cols: list[pymupdf.Rect]
    rng: random.Random
    font: str
    bold: str
    size: float
    colour: Colour
    y: float
    col: int = 0
    words: int = 0

    @property
    def width(self) -> float:
        return self.cols[0].width

    def room(self, height: float) -> bool:
        """Whether ``height`` fits here or atop the next column (moving there if need be)."""
        if self.y + height <= self.cols[self.col].y1:
            return True
        if self.col + 1 == len(self.cols) or self.cols[self.col + 1].height < height:
            return False
        self.col, self.y = self.col + 1, self.cols[self.col + 1].y0
        return True

    def take(self, height: float) -> pymupdf.Rect | None:
        """A band of ``height`` at the cursor, which moves below it; None (and no move) where none fits."""
        if not self.room(height):
            return None
        self.y += height
        return pymupdf.Rect(self.cols[self.col].x0, self.y - height, self.cols[self.col].x1, self.y)

    def text(self, x: float, baseline: float, text: str, font: str = "", size: float = 0.0,
             colour: Colour | None = None) -> None:
        self.shape.insert_text((x, baseline), text, fontname=font or self.font, fontsize=size or self.size,
                               color=colour or self.colour)
        self.words += len(text.split())


def _lines(c: _Canvas, text: str, font: str, size: float) -> bool:
    """Wrapped text flowing down the columns; False when the page ran out and the text was cut short."""
    for line in _wrap(text, font, size, c.width):
        band = c.take(size * 1.3)
        if band is None:
            return False
        c.text(band.x0, band.y0 + size, line, font, size)
    return True


def _scramble(rng: random.Random, sentence: str) -> str:
    """A sentence with some words swapped for random ones and numbers: text no context predicts, only its image."""
    def word(w: str) -> str:
        roll = rng.random()
        return rng.choice(_vocab()) if roll < 0.3 else str(rng.randint(0, 99999)) if roll < 0.36 else w
    return " ".join(word(w) for w in sentence.split())


def _paragraph(c: _Canvas, sentences: int = 0) -> bool:
    chosen = c.rng.sample(_sentences(), sentences or c.rng.randint(2, 6))
    if c.rng.random() < 0.5:  # half the prose cannot be guessed from context, so a reader must look
        chosen = [_scramble(c.rng, s) for s in chosen]
    placed = _lines(c, " ".join(chosen), c.font, c.size)
    c.take(c.size * 0.6)
    return placed


def _heading(c: _Canvas, text: str) -> None:
    """A bold heading, left out where it would sit at the foot of a column with no body below it."""
    size = min(16.0, c.size + c.rng.choice((2, 3, 4, 6)))
    if c.room(size * 1.8 + c.size * 4):
        c.take(size * 0.5)
        _lines(c, text, c.bold, size)
        c.take(size * 0.3)


def _pair(c: _Canvas, left: str, right: str, font: str = "") -> bool:
    """A label on the left and a figure flush right, as on an invoice; the label is cut to leave room."""
    band, font = c.take(c.size * 1.35), font or c.font
    if band is None:
        return False
    words, room = left.split(), c.width - _width(right, font, c.size) - 12
    while words and _width(" ".join(words), font, c.size) > room:
        words.pop()
    c.text(band.x0, band.y0 + c.size, " ".join(words), font)
    c.text(band.x1 - _width(right, font, c.size), band.y0 + c.size, right, font)
    return True


def _ledger(c: _Canvas, rows: int) -> int:
    """Dated, numbered item lines with amounts; returns their total in cents."""
    total = 0
    for _ in range(rows):
        qty, cents = c.rng.randint(1, 40), c.rng.randint(500, 250_000)
        total += qty * cents
        item = " ".join(c.rng.sample(_vocab(), c.rng.randint(2, 4))).capitalize()
        if not _pair(c, f"{_date(c.rng)} {_ident(c.rng)} {item} {qty} x {_money(cents)}", _money(qty * cents)):
            break
    return total


def _invoice(c: _Canvas) -> None:
    rng = c.rng
    issued, terms = date(2012, 1, 1) + timedelta(days=rng.randint(0, 4500)), rng.choice((15, 30, 45, 60))
    _heading(c, f"Invoice {_ident(rng, 'INV')}")
    for label, value in (("Issued", _date(rng, issued)), ("Due", _date(rng, issued + timedelta(days=terms))),
                         ("Customer", _ident(rng, "ACC")), ("Terms", f"Net {terms} days")):
        _pair(c, label, value)
    c.take(c.size)
    total, tax = _ledger(c, rng.randint(5, 14)), rng.randint(0, 200)
    _pair(c, "Subtotal", _money(total), c.bold)
    _pair(c, f"Tax {tax / 10:.1f}%", _money(total * tax // 1000))
    _pair(c, "Total due", _money(total + total * tax // 1000), c.bold)
    c.take(c.size)


def _cell(rng: random.Random, kind: str) -> str:
    if kind == "amount":
        return _money(rng.randint(100, 5_000_000))
    if kind == "percent":
        return f"{rng.randint(0, 999) / 10:.1f}%"
    if kind == "count":
        return f"{rng.randint(0, 99_999):,}"
    return _ident(rng) if kind == "id" else f"{date(2015, 1, 1) + timedelta(days=rng.randint(0, 3000)):%Y-%m-%d}"


def _col_widths(c: _Canvas, rows: list[list[str]], size: float, pad: float) -> list[float]:
    return [max(_width(row[j], c.bold if i == 0 else c.font, size) for i, row in enumerate(rows)) + 2 * pad
            for j in range(len(rows[0]))]


def _table(c: _Canvas) -> None:
    """A ruled table: a label column of words, then columns of amounts, percentages, counts, IDs or dates."""
    rng, size, pad = c.rng, min(c.size, 10.0), 4.0
    kinds = [rng.choice(_CELLS) for _ in range(rng.randint(2, 5))]
    rows = [[_title(rng, 1) for _ in range(len(kinds) + 1)]]
    rows += [[_title(rng, rng.randint(1, 2)), *(_cell(rng, k) for k in kinds)] for _ in range(rng.randint(4, 12))]
    while len(rows[0]) > 2 and sum(_col_widths(c, rows, size, pad)) > c.width:
        rows = [row[:-1] for row in rows]  # too wide for the column: drop the last column
    widths, height = _col_widths(c, rows, size, pad), size * 1.7
    band = c.take(height * len(rows) + c.size) if sum(widths) <= c.width else None
    if band is None:
        return
    xs = [band.x0 + sum(widths[:j]) * c.width / sum(widths) for j in range(len(widths) + 1)]
    _rules(c, pymupdf.Rect(band.x0, band.y0, band.x1, band.y0 + height * len(rows)), xs, height)
    for i, row in enumerate(rows):
        font, baseline = c.bold if i == 0 else c.font, band.y0 + i * height + (height + size * 0.7) / 2
        for j, cell in enumerate(row):
            c.text(xs[j] + pad if j == 0 else xs[j + 1] - pad - _width(cell, font, size), baseline, cell, font, size)


def _rules(c: _Canvas, box: pymupdf.Rect, xs: list[float], height: float) -> None:
    """The table's ruled lines: a frame, every row, sometimes every column and a shaded header."""
    if c.rng.random() < 0.5:
        c.shape.draw_rect(pymupdf.Rect(box.x0, box.y0, box.x1, box.y0 + height))
        c.shape.finish(color=None, fill=(0.88, 0.9, 0.94), width=0)
    c.shape.draw_rect(box)
    for y in range(1, round(box.height / height)):
        c.shape.draw_line((box.x0, box.y0 + y * height), (box.x1, box.y0 + y * height))
    for x in xs[1:-1] if c.rng.random() < 0.6 else ():
        c.shape.draw_line((x, box.y0), (x, box.y1))
    c.shape.finish(color=(0.3, 0.3, 0.3), width=0.6, closePath=False)


def _chart(c: _Canvas) -> None:
    """A bar or line chart of vector shapes; its title, tick labels and bar values are real text."""
    rng, size = c.rng, 8.0
    band = c.take(rng.uniform(170, 250))
    if band is None:
        return
    bars, scale, start = rng.random() < 0.5, rng.choice((10, 50, 100, 500, 5000)), rng.randint(0, 11)
    n = rng.randint(4, 8) if bars else rng.randint(6, 12)
    labels = rng.choice(([_MONTHS[(start + i) % 12][:3] for i in range(n)], [f"Q{i % 4 + 1}" for i in range(n)],
                         [str(2004 + start + i) for i in range(n)]))
    series = [_series(rng, n, scale) for _ in range(1 if bars else rng.randint(1, 2))]
    title = _wrap(f"Figure {rng.randint(1, 9)}. {_title(rng, rng.randint(2, 4))}", c.bold, 9, c.width)[0]
    c.text(band.x0, band.y0 + 9, title, c.bold, 9)
    ticks = [f"{scale * i // 5:,}" for i in range(6)]
    left = max(_width(t, c.font, size) for t in ticks) + 6
    plot = pymupdf.Rect(band.x0 + left, band.y0 + 9 + size + 8, band.x1 - 4, band.y1 - size - 6)
    _axes(c, plot, ticks, labels, size)
    slot, ys = plot.width / n, [[plot.y1 - plot.height * v / scale for v in values] for values in series]
    if bars:
        _bars(c, plot, slot, series[0], ys[0])
    else:
        _curves(c, plot, slot, ys)
    c.take(c.size)


def _axes(c: _Canvas, plot: pymupdf.Rect, ticks: list[str], labels: list[str], size: float) -> None:
    """Both axes with evenly spaced ticks; category labels on every k-th slot, k as small as keeps them apart."""
    for i, tick in enumerate(ticks):
        y = plot.y1 - plot.height * i / (len(ticks) - 1)
        c.shape.draw_line((plot.x0 - 3, y), (plot.x0, y))
        c.text(plot.x0 - 5 - _width(tick, c.font, size), y + size * 0.35, tick, c.font, size)
    c.shape.draw_polyline([plot.tl, plot.bl, plot.br])
    c.shape.finish(color=(0.2, 0.2, 0.2), width=0.7, closePath=False)
    slot, widest = plot.width / len(labels), max(_width(label, c.font, size) for label in labels)
    every = next((k for k in range(1, len(labels)) if widest < k * slot - 2), len(labels))
    for i in range(0, len(labels), every):
        x = plot.x0 + slot * (i + 0.5) - _width(labels[i], c.font, size) / 2
        c.text(x, plot.y1 + size + 3, labels[i], size=size)


def _series(rng: random.Random, n: int, scale: int) -> list[int]:
    """A random walk kept within (0, scale], so every value lies on the chart's fixed axis."""
    values = [rng.randint(scale // 3, scale)]
    for _ in range(n - 1):
        values.append(min(scale, max(1, values[-1] + rng.randint(-scale // 4, scale // 4))))
    return values


def _bars(c: _Canvas, plot: pymupdf.Rect, slot: float, values: list[int], tops: list[float]) -> None:
    share = c.rng.uniform(0.45, 0.75)
    for i, (value, y) in enumerate(zip(values, tops)):
        x, label = plot.x0 + slot * (i + 0.5), f"{value:,}"
        c.shape.draw_rect(pymupdf.Rect(x - slot * share / 2, y, x + slot * share / 2, plot.y1))
        if _width(label, c.font, 8) < slot:
            c.text(x - _width(label, c.font, 8) / 2, y - 2, label, size=8)
    c.shape.finish(color=None, fill=c.rng.choice(_FILLS), width=0)


def _curves(c: _Canvas, plot: pymupdf.Rect, slot: float, ys: list[list[float]]) -> None:
    for heights, colour in zip(ys, c.rng.sample(_FILLS, len(ys))):
        points = [pymupdf.Point(plot.x0 + slot * (i + 0.5), y) for i, y in enumerate(heights)]
        c.shape.draw_polyline(points)
        c.shape.finish(color=colour, width=1.4, closePath=False)
        for point in points:
            c.shape.draw_circle(point, 1.8)
        c.shape.finish(color=colour, fill=colour, width=0.5)


def _compose(c: _Canvas, kind: str) -> None:
    """The blocks of one page kind, then prose up to a word target so that every page has plenty to read."""
    rng = c.rng
    _heading(c, f"{rng.randint(1, 12)}. {_title(rng, rng.randint(2, 5))}" if rng.random() < 0.5
             else _title(rng, rng.randint(2, 6)))
    if kind == "numbers":
        _invoice(c)
    elif kind in ("table", "chart"):
        for _ in range(rng.randint(1, 2)):
            _paragraph(c, rng.randint(1, 2))
            (_table if kind == "table" else _chart)(c)
    elif kind == "mixed":
        _paragraph(c, rng.randint(1, 3))
        rng.choice((_table, _chart))(c)
        _ledger(c, rng.randint(3, 6))
        c.take(c.size)
    target = 10 ** 6 if kind in ("prose", "mixed") else rng.randint(80, 400)
    while c.words < target and _paragraph(c):
        if rng.random() < 0.25:
            _heading(c, _title(rng, rng.randint(2, 5)))


def _draw(page: pymupdf.Page, rng: random.Random, kind: str, footer: str) -> None:
    """Lay out one page in a random font, size, colour, margin and column count."""
    margin = rng.uniform(40, 72)
    body = pymupdf.Rect(margin, margin, page.rect.width - margin, page.rect.height - margin - _FOOTER)
    ncols, gap = (2 if body.width > 420 and rng.random() < 0.35 else 1), 18.0
    width = (body.width - gap * (ncols - 1)) / ncols
    cols = [pymupdf.Rect(body.x0 + i * (width + gap), body.y0, body.x0 + i * (width + gap) + width, body.y1)
            for i in range(ncols)]
    c = _Canvas(page.new_shape(), cols, rng, rng.choice(_FONTS), rng.choice(_BOLD),
                float(rng.choice((8, 9, 10, 10, 11, 12))), rng.choice(_COLOURS), body.y0)
    _compose(c, kind)
    c.text(body.x0, page.rect.height - margin, footer, size=8.0, colour=(0.35, 0.35, 0.35))
    c.shape.commit()


def _speckle(pix: pymupdf.Pixmap, rng: random.Random) -> pymupdf.Pixmap:
    """Greyed paper and scattered specks so scans do not look like clean renders (sparse, so the PNG stays small)."""
    noise = np.random.default_rng(rng.getrandbits(32))
    grey = np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.stride)[:, :pix.width] * 0.88 + 22
    specks = noise.random(grey.shape) < 0.0015
    grey[specks] = noise.integers(60, 180, int(specks.sum()))
    return pymupdf.Pixmap(pymupdf.csGRAY, pix.width, pix.height, grey.astype(np.uint8).tobytes(), False)


def _scan(doc: pymupdf.Document, rng: random.Random, width: float, height: float, footer: str) -> str:
    """Draw a text page aside, render it slightly skewed as a scanner would, and keep only the picture."""
    source = pymupdf.open()
    page = source.new_page(width=width, height=height)
    _draw(page, rng, rng.choice(_KINDS), footer)
    text, zoom = page.get_text(), _SCAN_DPI / 72
    pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom).prerotate(rng.uniform(-1, 1)), colorspace=pymupdf.csGRAY)
    source.close()
    doc.new_page(width=width, height=height).insert_image(pymupdf.Rect(0, 0, width, height),
                                                          stream=_speckle(pix, rng).tobytes("png"))
    return text


def make_pdf(path: str | Path, seed: int, pages: int = 4) -> dict:
    """Write a synthetic PDF; returns {"path": str, "pages": [{"kind": "prose|numbers|table|chart|mixed|scanned", "text": str_or_None}, ...]}."""
    rng, doc, meta = random.Random(seed), pymupdf.open(), []
    doc_id = _ident(rng, "DOC")
    for number in range(1, pages + 1):
        width, height = rng.choice(_PAGE_SIZES)
        width, height = (height, width) if rng.random() < 0.12 else (width, height)  # now and then landscape
        footer = f"{doc_id} | page {number} of {pages}"
        if rng.random() < _SCAN_CHANCE:
            meta.append({"kind": "scanned", "text": _scan(doc, rng, width, height, footer)})
        else:
            kind = rng.choice(_KINDS)
            _draw(doc.new_page(width=width, height=height), rng, kind, footer)
            meta.append({"kind": kind, "text": None})
    doc.set_metadata({})
    doc.save(str(path), garbage=3, deflate=True, no_new_id=True)
    doc.close()
    return {"path": str(path), "pages": meta}


def _make_one(job: tuple[str, int, int]) -> dict:
    return make_pdf(*job)


def make_corpus(out_dir: str | Path, n_docs: int, seed: int = 0, pages: int = 4, workers: int = 1) -> list[dict]:
    """n_docs PDFs named synth-{seed}-{i:04d}.pdf in out_dir; returns make_pdf's results in order.

    ``workers`` > 1 writes them in that many processes: the same bytes, since every document's seed is drawn first.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seeds = random.Random(seed)  # one stream of document seeds: document i is the same whatever n_docs is
    jobs = [(str(out / f"synth-{seed}-{i:04d}.pdf"), seeds.getrandbits(48), pages) for i in range(n_docs)]
    if workers <= 1 or n_docs < 2:
        return [_make_one(job) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_make_one, jobs, chunksize=8))
