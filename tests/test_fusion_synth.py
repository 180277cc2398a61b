"""The synthetic training PDFs: deterministic, readable text layers that stay on the page, real scans, variety."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pymupdf
import pytest

from docfuse.fusion.synth import make_corpus, make_pdf

MIN_WORDS = 40
MARGIN = 36.0  # no text closer than this to a page edge (margins are drawn from 40-72 pt)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return make_corpus(tmp_path_factory.mktemp("synth"), 20, seed=0, pages=4)


def _pages(corpus: list[dict]) -> Iterator[tuple[pymupdf.Page, dict]]:
    """Every (page, metadata) pair of the corpus; a page is only valid until the loop moves past it."""
    for result in corpus:
        with pymupdf.open(result["path"]) as doc:
            assert len(doc) == len(result["pages"])
            yield from zip(doc, result["pages"])


def test_same_seed_gives_same_bytes_and_other_seeds_differ(tmp_path: Path) -> None:
    first, again, other = (make_pdf(tmp_path / f"{name}.pdf", seed) for name, seed in
                           (("a", 11), ("b", 11), ("c", 12)))
    assert Path(first["path"]).read_bytes() == Path(again["path"]).read_bytes()
    assert first["pages"] == again["pages"]
    assert Path(first["path"]).read_bytes() != Path(other["path"]).read_bytes()


def test_corpus_names_its_files_and_keeps_order(tmp_path: Path) -> None:
    results = make_corpus(tmp_path / "out", 3, seed=5, pages=2)
    assert [Path(r["path"]).name for r in results] == [f"synth-5-{i:04d}.pdf" for i in range(3)]
    assert all(len(r["pages"]) == 2 for r in results)
    longer = make_corpus(tmp_path / "more", 4, seed=5, pages=2)  # document i does not depend on n_docs
    assert [Path(r["path"]).read_bytes() for r in longer[:3]] == [Path(r["path"]).read_bytes() for r in results]


def test_corpus_in_processes_writes_the_same_bytes(tmp_path: Path) -> None:
    serial = make_corpus(tmp_path / "one", 3, seed=9, pages=2)
    parallel = make_corpus(tmp_path / "two", 3, seed=9, pages=2, workers=2)
    assert [r["pages"] for r in parallel] == [r["pages"] for r in serial]
    assert [Path(r["path"]).read_bytes() for r in parallel] == [Path(r["path"]).read_bytes() for r in serial]


def test_text_pages_have_words_inside_the_page(corpus: list[dict]) -> None:
    checked = 0
    for page, meta in _pages(corpus):
        if meta["kind"] == "scanned":
            continue
        assert meta["text"] is None
        words = page.get_text("words")
        assert len(words) >= MIN_WORDS, (meta["kind"], page.number)
        inner = page.rect + (MARGIN, MARGIN, -MARGIN, -MARGIN)
        outside = [w[4] for w in words if pymupdf.Rect(w[:4]) not in inner]
        assert not outside, (meta["kind"], page.number, outside[:5])
        checked += 1
    assert checked >= 40


def test_scanned_pages_are_images_with_ground_truth(corpus: list[dict]) -> None:
    scanned = 0
    for page, meta in _pages(corpus):
        if meta["kind"] == "scanned":
            assert page.get_text("words") == []
            assert page.get_images()
            assert len(meta["text"].split()) >= MIN_WORDS
            scanned += 1
    assert scanned >= 3, "expected about one page in eight to be scanned"


def test_kinds_and_drawings_cover_tables_and_charts(corpus: list[dict]) -> None:
    kinds = Counter(meta["kind"] for _, meta in _pages(corpus))
    assert {"table", "chart", "prose", "numbers"} <= set(kinds)
    for page, meta in _pages(corpus):
        if meta["kind"] in ("table", "chart"):
            assert page.get_drawings(), (meta["kind"], page.number)


def test_content_varies_in_fonts_sizes_and_numbers(corpus: list[dict]) -> None:
    fonts, sizes, shapes, text = set(), set(), set(), []
    for page, meta in _pages(corpus):
        fonts |= {font[3] for font in page.get_fonts()}
        shapes.add((round(min(page.rect.width, page.rect.height)), page.rect.width > page.rect.height))
        text.append(page.get_text() if meta["text"] is None else meta["text"])
        for block in page.get_text("dict")["blocks"]:
            sizes |= {round(span["size"]) for line in block.get("lines", []) for span in line["spans"]}
    assert {"Helvetica", "Times-Roman", "Courier"} <= fonts and len(fonts) >= 5
    assert min(sizes) >= 8 and max(sizes) <= 16 and len(sizes) >= 5
    assert {(612, False), (595, False)} <= shapes and any(landscape for _, landscape in shapes)
    joined = "\n".join(text)
    for pattern in (r"\$\d{1,3}(,\d{3})*\.\d{2}", r"\d+\.\d%", r"\b(INV|PO|ACC|REF|SKU|ORD)-\d{5}\b",
                    r"\b\d{4}-\d{2}-\d{2}\b"):
        assert re.search(pattern, joined), pattern
