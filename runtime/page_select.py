"""Which pages of a document too long for the context a question should read (``truncate: retrieve``).

A long report does not fit the embedded model's 8,192 positions, and cutting it at the head answers only questions
about its first pages. Instead each question ranks the pages by BM25 over their text (``rank_bm25``), takes the best
pages that fit the token budget, then their neighbours while room is left (an answer often continues across a page
break), and reads them in page order. Questions that pick the same pages share one prefill.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from docfuse.runtime.prompt import document_text

_WORD = re.compile(r"\w+", re.UNICODE)
#: Tokens added between two pages when they are joined (the blank line), on top of each page's own count.
JOIN_TOKENS = 2


def words(text: str) -> list[str]:
    """Lower-cased word tokens for BM25 (letters and digits; amounts and codes stay whole)."""
    return [w.lower() for w in _WORD.findall(text)]


def terms(text: str) -> list[str]:
    """What BM25 indexes: the words, and for words of six letters or more also their first five letters, so that
    a typo or another form of the word ("advertsing", "memberships") still meets the page's word."""
    out = []
    for w in words(text):
        out.append(w)
        if len(w) >= 6 and w.isalpha():
            out.append(w[:5] + "~")
    return out


@dataclass(frozen=True)
class Selection:
    """Pages (0-based, ascending) a question reads, and whether pages with text were left out."""

    pages: tuple[int, ...]
    truncated: bool


class PageIndex:
    """BM25 over a document's pages, with each page's token cost as ``document_text`` joins it.

    Args:
        pages: ``(page, text)`` pairs (pages without text are ignored).
        count_tokens: tokens of a piece of text for the model's tokenizer.
    """

    def __init__(self, pages: Sequence[tuple[int, str]], count_tokens: Callable[[str], int]) -> None:
        from rank_bm25 import BM25Okapi

        self.pages = sorted((p, t) for p, t in pages if t and t.strip())
        self.cost = {p: count_tokens(document_text([(p, t)])) + JOIN_TOKENS for p, t in self.pages}
        corpus = [terms(t) or ["\x00"] for _, t in self.pages]
        self.bm25 = BM25Okapi(corpus) if corpus else None

    def scores(self, question: str) -> dict[int, float]:
        if self.bm25 is None:
            return {}
        raw = self.bm25.get_scores(terms(question))
        return {p: float(s) for (p, _), s in zip(self.pages, raw)}

    def select(self, question: str, budget: int) -> Selection:
        """Pages for ``question`` within ``budget`` tokens of document text.

        First the pages that match it, best first (one that does not fit is skipped, so a smaller one further down
        may still come in); then their neighbours, the best match's first; then, while room is left, the other pages
        from the start of the document. The best page always comes in, even alone over the budget (the prompt is
        then cut at its end, and the row says it was truncated).
        """
        scores = self.scores(question)
        present = [p for p, _ in self.pages]
        hits = sorted((p for p in present if scores.get(p, 0.0) > 0), key=lambda p: (-scores[p], p))
        chosen: list[int] = []
        used = 0

        def take(p: int) -> None:
            nonlocal used
            if p not in chosen and (not chosen or used + self.cost[p] <= budget):
                chosen.append(p)
                used += self.cost[p]

        for p in hits:
            take(p)
        known = set(present)
        for p in list(chosen):
            for q in (p - 1, p + 1):
                if q in known:
                    take(q)
        for p in present:
            take(p)
        kept = tuple(sorted(chosen))
        return Selection(kept, truncated=len(kept) < len(self.pages) or used > budget)

    def text(self, selection: Selection) -> str:
        wanted = set(selection.pages)
        return document_text([(p, t) for p, t in self.pages if p in wanted])
