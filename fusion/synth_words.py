"""Word sheets: synthetic PDF pages dense with words in many fonts and sizes, for training the word reader.

Every line is set in its own font (the base-14 faces; with the ``pymupdf-fonts`` package, Fira, Noto, Ubuntu,
Space Mono and Cascadia too; DejaVu where the system has it) and size (6.5-14 pt). Words mix real prose (stdlib
docstrings, as fusion.synth), numbers, amounts, dates, identifiers and random letter strings, so the reader
cannot lean on a vocabulary. One seed gives the same bytes.
"""

from __future__ import annotations

import random
import string
from functools import lru_cache
from pathlib import Path

import pymupdf

from docfuse.fusion.synth import _date, _ident, _money, _sentences

_BASE14 = ("helv", "hebo", "heit", "hebi", "tiro", "tibo", "tiit", "tibi", "cour", "cobo")
_EXTRA = ("figo", "figbo", "figit", "figbi", "fimo", "notos", "notosbo", "notosit", "notosbi", "ubuntu",
          "ubuntubo", "ubuntuit", "spacemo")


@lru_cache(maxsize=1)
def fonts() -> tuple[tuple[str, bytes | None], ...]:
    """(name, font file bytes or None for base-14) of every face the sheets may use on this machine."""
    out: list[tuple[str, bytes | None]] = [(name, None) for name in _BASE14]
    try:
        import pymupdf_fonts  # noqa: F401 - registers its faces with pymupdf
        out += [(name, pymupdf.Font(name).buffer) for name in _EXTRA if name in pymupdf.fitz_fontdescriptors]
    except ImportError:
        pass
    return tuple(out)


def _word(rng: random.Random, prose: list[str]) -> str:
    roll = rng.random()
    if roll < 0.55:
        w = rng.choice(prose)
        return w.upper() if rng.random() < 0.05 else (w.capitalize() if rng.random() < 0.15 else w)
    if roll < 0.75:
        return rng.choice((
            lambda: str(rng.randint(0, 99999)), lambda: f"{rng.randint(1, 999_999):,}", lambda: _money(rng.randint(0, 10**8)),
            lambda: f"{rng.uniform(0, 100):.{rng.randint(1, 2)}f}%", lambda: _date(rng).split()[0],
            lambda: _ident(rng), lambda: f"({rng.randint(1, 9999)})", lambda: f"{rng.uniform(-99, 99):.2f}"))()
    if roll < 0.9:
        n = rng.randint(1, 12)
        letters = string.ascii_lowercase if rng.random() < 0.7 else string.ascii_letters
        return "".join(rng.choice(letters) for _ in range(n))
    return "".join(rng.choice(string.ascii_letters + string.digits + string.punctuation) for _ in range(rng.randint(1, 8)))


def make_sheet(path: str | Path, seed: int, pages: int = 2) -> str:
    """Write a word-sheet PDF of ``pages`` pages; returns its path."""
    rng, doc = random.Random(seed), pymupdf.open()
    faces = fonts()
    prose = [w for s in _sentences() for w in s.split()]
    for _ in range(pages):
        width, height = rng.choice(((612.0, 792.0), (595.0, 842.0)))
        page = doc.new_page(width=width, height=height)
        used: set[str] = set()
        y, margin = rng.uniform(30, 60), rng.uniform(30, 70)
        while True:
            name, buffer = rng.choice(faces)
            if name not in used and buffer is not None:
                page.insert_font(fontname=name, fontbuffer=buffer)
            used.add(name)
            size = rng.uniform(6.5, 14.0)
            y += size * rng.uniform(1.15, 1.6)
            if y > height - 30:
                break
            colour = rng.choice(((0, 0, 0), (0, 0, 0), (0.2, 0.2, 0.2), (0.05, 0.1, 0.4), (0.35, 0.05, 0.05)))
            font = pymupdf.Font(fontname=name) if buffer is None else pymupdf.Font(fontbuffer=buffer)
            x, line = margin + rng.uniform(0, 40), []
            while True:
                w = _word(rng, prose)
                nxt = x + font.text_length(" ".join(line + [w]), fontsize=size)
                if nxt > width - margin:
                    break
                line.append(w)
            if line:
                page.insert_text((x, y), " ".join(line), fontname=name, fontsize=size, color=colour)
    doc.set_metadata({})
    doc.subset_fonts()
    doc.save(str(path), garbage=3, deflate=True, no_new_id=True)
    doc.close()
    return str(path)


def _make(job: tuple[str, int, int]) -> str:
    return make_sheet(*job)


def make_sheets(out_dir: str | Path, n: int, seed: int = 0, pages: int = 2, workers: int = 1) -> list[Path]:
    """``n`` word-sheet PDFs in ``out_dir`` (``workers`` processes; the same bytes either way)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seeds = random.Random(seed)
    jobs = [(str(out / f"words-{seed}-{i:04d}.pdf"), seeds.getrandbits(48), pages) for i in range(n)]
    if workers <= 1 or n < 2:
        return [Path(_make(job)) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [Path(p) for p in pool.map(_make, jobs, chunksize=4)]
