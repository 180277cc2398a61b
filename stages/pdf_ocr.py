"""OCR for pages without a usable text layer: Tesseract's words, with boxes in PDF points, as a text-layer page.

Tesseract (Debian's ``tesseract-ocr`` with its language packs; the Makefile installs it) reads the page rendered at
``dpi`` and reports every word with its pixel box, its block, paragraph and line, and a confidence (TSV output). The
words become a :class:`~stages.pdf_extract.PageContent` in the rotated page's points, exactly what the text layer
gives, so reading order, headings and the layout columns treat a scan like a born-digital page. Sizes are the line
heights (a scan has no fonts), bold is unknown (False).

Tesseract runs as a child process per page: rendering stays in the calling thread (MuPDF is not thread-safe), the
OCR of several pages, of one document or of a batch, runs in parallel threads that only wait on their child
(:class:`OcrPool`).
"""

from __future__ import annotations

import csv
import functools
import io
import logging
import math
import os
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pymupdf

from docfuse.stages.pdf_extract import Line, PageContent, Word

LOG = logging.getLogger("docfuse.ocr")
INSTALL_HINT = ("install Tesseract and its language data (Debian/Ubuntu: apt-get install tesseract-ocr "
                "tesseract-ocr-eng; `make setup` does it), or set pdf.text's ocr: never")
#: Mean word confidence under which a page is checked for text turned by 90, 180 or 270 degrees.
LOW_CONFIDENCE = 0.6
#: Tesseract's orientation confidence needed to turn a page (its scale: ~2 is a guess, 10+ is sure).
MIN_OSD_CONFIDENCE = 2.0
#: Skew (degrees) from which a page is read again straightened, and beyond which the estimate is not trusted.
MIN_SKEW_DEGREES = 0.5
MAX_SKEW_DEGREES = 10.0
#: Lines of three words or more needed to estimate a page's skew.
MIN_SKEW_LINES = 3
#: Seconds one page may take before it is an error row (a 2400-dpi page is rendered within the pixel cap first).
PAGE_TIMEOUT_S = 300


class OcrUnavailable(RuntimeError):
    """Tesseract, or a language asked for, is missing; the message names the install step."""


@dataclass(slots=True)
class OcrResult:
    """One page's OCR: its words as a usable PageContent, their mean confidence (0-1), and the dpi it ran at."""

    content: PageContent
    confidence: float | None
    dpi: float
    rotation: int = 0  # clockwise degrees the image was turned to read it (text baked in sideways or upside down)
    skew: float = 0.0  # degrees of skew straightened before the reading that was kept


@functools.lru_cache(maxsize=1)
def _binary() -> str:
    path = shutil.which("tesseract")
    if path is None:
        raise OcrUnavailable(f"OCR needs the tesseract program, which is not on PATH; {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=1)
def installed_languages() -> frozenset[str]:
    """Languages Tesseract has data for (``tesseract --list-langs``)."""
    out = subprocess.run([_binary(), "--list-langs"], capture_output=True, text=True, timeout=60)
    return frozenset(line.strip() for line in out.stdout.splitlines()[1:] if line.strip())


def check_languages(languages: Sequence[str]) -> str:
    """The ``-l`` argument for ``languages``; raises OcrUnavailable naming the package of a missing one."""
    missing = [lang for lang in languages if lang not in installed_languages()]
    if missing:
        packages = " ".join(f"tesseract-ocr-{lang}" for lang in missing)
        raise OcrUnavailable(f"Tesseract has no data for {', '.join(missing)} (installed: "
                             f"{', '.join(sorted(installed_languages())) or 'none'}); apt-get install {packages}, "
                             "or change pdf.text's languages")
    return "+".join(languages)


def available() -> bool:
    """Whether Tesseract can run here (tests and benchmarks skip without it)."""
    try:
        return bool(installed_languages())
    except (OcrUnavailable, OSError, subprocess.SubprocessError):
        return False


def render_for_ocr(page: pymupdf.Page, dpi: float) -> bytes:
    """The page as shown (its /Rotate applied), greyscale PNG at ``dpi``: what Tesseract reads. ``dpi`` may be
    fractional (a page fitted under ``ocr_max_pixels``, or ``ocr_dpi: 200`` validated as 200.0): the zoom takes it
    as it is, the image's own dpi field (an integer in MuPDF) is rounded."""
    zoom = float(dpi) / 72.0
    pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), colorspace=pymupdf.csGRAY, alpha=False)
    pix.set_dpi(max(1, round(dpi)), max(1, round(dpi)))
    return pix.tobytes("png")


def run_tesseract(png: bytes, dpi: float, languages: str, psm: int = 3) -> str:
    """Tesseract's TSV for one page image (psm 3: automatic layout, no orientation; psm 0: orientation only, as
    text). One thread per child: pages run side by side instead."""
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    args = [_binary(), "stdin", "stdout", "--dpi", str(max(1, round(dpi))), "--psm", str(psm)]
    args += ["-l", languages, "tsv"] if psm else []
    try:
        out = subprocess.run(args, input=png, capture_output=True, timeout=PAGE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"OCR took over {PAGE_TIMEOUT_S} s on this page; lower pdf.text's ocr_dpi") from exc
    if out.returncode != 0:
        detail = out.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise OcrUnavailable(f"tesseract failed (exit {out.returncode}: {detail[0]}); {INSTALL_HINT}")
    return out.stdout.decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _warn_no_osd() -> None:
    LOG.warning("Tesseract has no orientation data (osd.traineddata): pages scanned sideways or upside down are read "
                "as they lie, and poorly; install it (Debian/Ubuntu: apt-get install tesseract-ocr-osd)")


def osd_rotation(png: bytes, dpi: float) -> int:
    """Clockwise degrees (0, 90, 180, 270) that turn the page image's text upright, by Tesseract's orientation
    detection; 0 when it cannot tell (too little text, no ``osd`` data: then a warning, once, names the package)."""
    try:
        if "osd" not in installed_languages():
            _warn_no_osd()
            return 0
        report = run_tesseract(png, dpi, "", psm=0)
    except (OcrUnavailable, RuntimeError):
        return 0
    fields = dict(line.split(":", 1) for line in report.splitlines() if ":" in line)
    try:
        rotate, confidence = int(fields["Rotate"].strip()), float(fields["Orientation confidence"].strip())
    except (KeyError, ValueError):
        return 0
    return rotate % 360 if confidence >= MIN_OSD_CONFIDENCE else 0


def turned_png(png: bytes, counter_clockwise: float, expand: bool) -> bytes:
    """The page image turned about its centre (PIL: positive is counter-clockwise). ``expand``: a quarter turn, the
    canvas grows to hold it and pixels move exactly (nearest); else a small skew: the size stays, pixels are
    interpolated (bicubic) and the corners fill white."""
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    out = io.BytesIO()
    resample = Image.NEAREST if expand else Image.BICUBIC
    image.rotate(counter_clockwise, resample=resample, expand=expand, fillcolor=None if expand else 255) \
        .save(out, format="PNG")
    return out.getvalue()


def read_page(png: bytes, dpi: float, languages: str, number: int, width: float, height: float) -> OcrResult:
    """OCR one page image of the page as shown (``width`` x ``height`` points). When the words read poorly (mean
    confidence under LOW_CONFIDENCE) or run up or down the page, and orientation detection finds the text turned (a
    scan fed in sideways or upside down), the image is turned upright and read again; the better reading wins. A
    page read turned has its words in the upright frame (``width`` and ``height`` swap at 90 and 270), so reading
    order follows the text, and ``rotation`` says by how much. A page read well is checked for skew instead."""
    first = parse_tsv(run_tesseract(png, dpi, languages), number, width, height, dpi)
    if first.confidence is not None and first.confidence >= LOW_CONFIDENCE and not _sideways(first.content):
        return _deskewed(first, png, dpi, languages, number, width, height)
    clockwise = osd_rotation(png, dpi)
    if not clockwise:
        return first
    w, h = (height, width) if clockwise in (90, 270) else (width, height)
    turned = parse_tsv(run_tesseract(turned_png(png, -clockwise, expand=True), dpi, languages), number, w, h, dpi)
    turned.rotation = clockwise
    if _sideways(first.content) and not _sideways(turned.content):
        # the words were read either way; the upright reading is the one whose boxes give the reading order
        return turned if (turned.confidence or 0.0) >= (first.confidence or 0.0) - 0.1 else first
    return turned if (turned.confidence or 0.0) > (first.confidence or 0.0) else first


def skew_degrees(content: PageContent) -> float:
    """The page's skew (degrees, clockwise positive in image coordinates) from its lines: the median slope of the
    word centres along every line of three words or more (0 when too few lines say)."""
    slopes = []
    for block in content.blocks:
        for line in block:
            if len(line.words) < 3:
                continue
            xs = [w.cx for w in line.words]
            ys = [w.cy for w in line.words]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            if var > 0:
                slopes.append(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
    if len(slopes) < MIN_SKEW_LINES:
        return 0.0
    slopes.sort()
    return math.degrees(math.atan(slopes[len(slopes) // 2]))


def _deskewed(first: OcrResult, png: bytes, dpi: float, languages: str, number: int, width: float,
              height: float) -> OcrResult:
    """Read a skewed scan again straightened (a skew of a degree or more breaks dense lines and tables apart);
    the straightened reading's boxes are turned back into the page as shown. Keeps it unless it read clearly fewer
    words confidently than the skewed one."""
    angle = skew_degrees(first.content)
    if abs(angle) < MIN_SKEW_DEGREES or abs(angle) > MAX_SKEW_DEGREES:
        return first
    # a clockwise skew (lines falling to the right, angle > 0) turns back counter-clockwise
    straight = parse_tsv(run_tesseract(turned_png(png, angle, expand=False), dpi, languages), number, width, height,
                         dpi)
    # the straightened image was turned about the page centre: turn each word's box centre back
    cx, cy, rad = width / 2, height / 2, math.radians(angle)
    cos, sin = math.cos(rad), math.sin(rad)
    for word in straight.content.words:
        x, y = word.cx - cx, word.cy - cy
        nx, ny = cx + x * cos - y * sin, cy + x * sin + y * cos  # PIL's turn (y down), undone
        dx, dy = nx - word.cx, ny - word.cy
        word.x0, word.x1, word.y0, word.y1 = word.x0 + dx, word.x1 + dx, word.y0 + dy, word.y1 + dy
    straight.skew = angle

    def letters(r: OcrResult) -> int:  # words split by a skewed line count once, not twice
        return sum(len(w.text) for w in r.content.words)

    # the straight reading's lines are real lines (what reading order and tables build on): it wins unless it
    # read clearly less, or less surely
    worse = letters(straight) < 0.95 * letters(first) or (straight.confidence or 0.0) < (first.confidence or 0.0) - 0.02
    return first if worse else straight


def _sideways(content: PageContent) -> bool:
    """Most words of three letters or more are taller than wide: Tesseract read lines running up or down the image
    (it reads such text well, but the boxes then order the lines backwards or across)."""
    long = [w for w in content.words if len(w.text) >= 3]
    return bool(long) and sum((w.y1 - w.y0) > (w.x1 - w.x0) for w in long) > len(long) / 2


def parse_tsv(tsv: str, number: int, width: float, height: float, dpi: float) -> OcrResult:
    """Words of Tesseract's TSV as a PageContent in page points (``width`` x ``height``, the page as shown)."""
    scale = 72.0 / dpi
    content = PageContent(number=number, width=width, height=height)
    lines: dict[tuple[int, int, int], Line] = {}
    line_height: dict[tuple[int, int, int], float] = {}
    confidences: list[float] = []
    for row in csv.DictReader(io.StringIO(tsv), delimiter="\t", quoting=csv.QUOTE_NONE):
        try:
            level = int(row["level"])
            key = (int(row["block_num"]), int(row["par_num"]), int(row["line_num"]))
            left, top, w, h = (float(row[k]) for k in ("left", "top", "width", "height"))
        except (KeyError, TypeError, ValueError):
            continue
        if level == 4:
            line_height[key] = h * scale
            continue
        text = (row.get("text") or "").strip()
        if level != 5 or not text:
            continue
        conf = float(row.get("conf") or -1)
        if conf >= 0:
            confidences.append(conf / 100.0)
        x0, y0 = left * scale, top * scale
        word = Word(text, x0, y0, x0 + w * scale, y0 + h * scale, max(line_height.get(key, h * scale), 1.0), False)
        lines.setdefault(key, Line(words=[])).words.append(word)
    blocks: dict[int, list[Line]] = {}
    for key in sorted(lines):
        blocks.setdefault(key[0], []).append(lines[key])
    content.blocks = list(blocks.values())
    content.usable = bool(content.blocks)
    content.reason = "" if content.usable else "OCR found no words on the page"
    mean = sum(confidences) / len(confidences) if confidences else None
    return OcrResult(content, mean, dpi)


class OcrPool:
    """OCR pages in worker threads while the caller goes on (to the next document of a batch).

    ``submit`` renders the page here, in the calling thread (MuPDF is not thread-safe), and hands the image to a
    worker that runs Tesseract as a child process; when ``2 * workers`` images are already waiting or running it
    first waits for the oldest, so a 200-page scan holds a handful of page images, not 200. Use as a context manager.
    """

    def __init__(self, languages: Sequence[str], workers: int | None = None) -> None:
        self.languages = check_languages(languages)  # raises OcrUnavailable before any page is rendered
        self.workers = workers or max(1, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="docfuse-ocr")
        self._live: list[Future] = []

    def submit(self, page: pymupdf.Page, dpi: float) -> Future:
        self._live = [f for f in self._live if not f.done()]
        while len(self._live) >= 2 * self.workers:
            self._live.pop(0).exception()  # waits; the caller reads the result or the error from its future
        rect = page.rect  # the page as shown: /Rotate applied, as the rendered image is
        png = render_for_ocr(page, dpi)
        future = self._pool.submit(read_page, png, dpi, self.languages, page.number, float(rect.width),
                                   float(rect.height))
        self._live.append(future)
        return future

    def __enter__(self) -> OcrPool:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
