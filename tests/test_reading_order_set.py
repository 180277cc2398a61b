"""The generated reading-order set (bench/reading_order_set.py) and its scoring (bench/bench_reading_order.py), on
one page per family: the truth is really on the page, and the metric can tell a right order from a wrong one (a
benchmark whose score cannot drop measures nothing)."""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pymupdf
import pytest

from bench.bench_reading_order import has_markdown_table, similarity, tables_found, unbroken, words
from bench.reading_order_set import FAMILIES, make_set

KEYS = {"pdf", "page", "family", "truth", "has_table", "tables", "sentences", "spaced_words"}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return make_set(tmp_path_factory.mktemp("reading_order"), seed=3, pages_per_family=1)


def test_every_family_has_its_page(records: list[dict]) -> None:
    assert sorted(r["family"] for r in records) == sorted(FAMILIES)
    for r in records:
        assert KEYS <= set(r), r["family"]
        assert r["has_table"] == (r["family"] == "tables") == bool(r["tables"])
        assert ("truth_numbered" in r) == (r["family"] == "line_numbered")
        assert r["sentences"] or r["family"] == "kv_forms"
    by_family = {r["family"]: r for r in records}
    assert re.search(r"\n\n1 \S", by_family["footnotes"]["truth"])      # footnotes last, each with its number
    assert by_family["spaced_headings"]["spaced_words"]
    numbered = by_family["line_numbered"]["truth_numbered"].splitlines()
    assert [line.split(" ", 1)[0] for line in numbered] == [str(k) for k in range(1, len(numbered) + 1)]


def page_words(record: dict) -> tuple[Counter, str]:
    """The page's words as PyMuPDF reads them (normalised like the truth), and its text without whitespace."""
    with pymupdf.open(record["pdf"]) as doc:
        page = doc[record["page"]]
        found = Counter(w for word in page.get_text("words") for w in words(word[4]))
        squeezed = re.sub(r"\s+", "", page.get_text()).lower()
    return found, squeezed


def test_every_truth_word_is_on_its_page(records: list[dict]) -> None:
    for r in records:
        found, squeezed = page_words(r)
        spaced = {w.lower() for w in r["spaced_words"]}
        missing = {w: n for w, n in Counter(words(r["truth"])).items() if found[w] < n and w not in spaced}
        assert not missing, (r["family"], missing)
        for word in spaced:   # drawn one letter at a time: the letters are there in order
            assert word in squeezed, (r["family"], word)


def test_the_score_is_one_for_the_truth_and_drops_for_a_shuffle(records: list[dict]) -> None:
    rng = random.Random(0)
    for r in records:
        assert similarity(r["truth"], r["truth"]) == 1.0
        assert unbroken(r["sentences"], r["truth"]) == len(r["sentences"])
        shuffled = r["truth"].split()
        rng.shuffle(shuffled)
        assert similarity(r["truth"], " ".join(shuffled)) < 0.9, r["family"]
        assert tables_found(r["tables"], r["truth"]) == 0     # the truth is not Markdown: no table rows


def test_markdown_is_stripped_and_tables_are_told_from_colons() -> None:
    assert words("## The **Harbor** | 1,200 |\n|---|---|") == ["the", "harbor", "1", "200"]
    table = "| Site | 2020 |\n| --- | --- |\n| Upton | 1,200 |\n| Carrow | 980 |"
    assert has_markdown_table(table)
    assert tables_found([[["Site", "2020"], ["Upton", "1,200"], ["Carrow", "980"]]], table) == 1
    assert not has_markdown_table("Witness: Maria Lopez\nDate: March 3, 2019\nQ. Where were you?")


def test_the_set_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    def strip(rs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "pdf"} for r in rs]

    first = make_set(tmp_path / "a", seed=5, pages_per_family=1, families=("footnotes", "kv_forms"))
    again = make_set(tmp_path / "b", seed=5, pages_per_family=1, families=("footnotes", "kv_forms"))
    other = make_set(tmp_path / "c", seed=6, pages_per_family=1, families=("footnotes", "kv_forms"))
    assert strip(first) == strip(again) != strip(other)
