"""truncate: retrieve picks the pages a question needs when the document does not fit (runtime.page_select)."""

from __future__ import annotations

from docfuse.runtime.page_select import JOIN_TOKENS, PageIndex, words

FILLER = "The committee reviewed the general budget and the usual items of business. "


def count(text: str) -> int:
    return len(text.split())


def pages() -> list[tuple[int, str]]:
    out = [(i, FILLER * 5) for i in range(12)]
    out[7] = (7, FILLER * 2 + "The vault access code is 5521 and it changes monthly. " + FILLER * 2)
    out[3] = (3, FILLER * 2 + "Invoices are paid within 30 days of receipt. " + FILLER * 2)
    out[10] = (10, "")  # an image-only page: never read
    return out


def test_the_matching_page_and_its_neighbours_come_first_in_page_order() -> None:
    index = PageIndex(pages(), count)
    per_page = index.cost[0]
    chosen = index.select("What is the vault access code?", budget=3 * per_page)
    assert chosen.pages == (6, 7, 8) and chosen.truncated
    assert "5521" in index.text(chosen) and index.text(chosen).index("page 7") < index.text(chosen).index("page 8")


def test_two_questions_choose_their_own_pages_and_the_budget_holds() -> None:
    index = PageIndex(pages(), count)
    per_page = index.cost[0]
    a = index.select("When are invoices paid?", budget=4 * per_page)
    b = index.select("What is the vault access code?", budget=4 * per_page)
    assert 3 in a.pages and 7 not in a.pages and 7 in b.pages and 3 not in b.pages
    for chosen in (a, b):
        assert sum(index.cost[p] for p in chosen.pages) <= 4 * per_page


def test_everything_fits_means_every_page_with_text_and_nothing_truncated() -> None:
    index = PageIndex(pages(), count)
    chosen = index.select("What is the vault access code?", budget=10 ** 6)
    assert chosen.pages == tuple(p for p in range(12) if p != 10) and not chosen.truncated


def test_a_question_that_matches_nothing_reads_from_the_start_and_one_huge_page_still_comes_in() -> None:
    index = PageIndex(pages(), count)
    per_page = index.cost[0]
    assert index.select("zebra quantum?", budget=2 * per_page).pages == (0, 1)
    big = PageIndex([(0, "short page"), (1, "the secret code is 42 " * 500), (2, "another short page"),
                     (3, "a last page")], count)
    chosen = big.select("what is the secret code", budget=50)
    assert chosen.pages == (1,) and chosen.truncated  # over the budget alone: the prompt is cut at its end
    assert words("Fee: 4,250.00 EUR") == ["fee", "4", "250", "00", "eur"]
    assert JOIN_TOKENS > 0
