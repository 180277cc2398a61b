"""runtime.citations: page spans from the prompt's markers, scores beyond a page's share, and, with the embedded
model, answers that cite the page their fact sits on."""

from __future__ import annotations

import pytest
import torch

from docfuse.runtime.citations import cite, page_spans, score_pages
from docfuse.runtime.prompt import ChatPrompt, document_text
from tests.test_decode_stage import FILLER, pages_table, stage

PAGES = [
    (0, "# Lease summary\n\n" + FILLER * 8),
    (1, FILLER * 4 + "The tenant is Harbour Foods Ltd. " + FILLER * 4),
    (2, FILLER * 5 + "The monthly rent is 7,340 euros, due on the first day of each month. " + FILLER * 3),
    (3, FILLER * 8 + "Signed in Cork."),
]


def test_scores_count_attention_beyond_a_pages_share():
    spans = [(0, 0, 10), (1, 10, 20), (2, 20, 40)]
    even = torch.full((40,), 1 / 40)
    assert all(abs(s) < 1e-6 for s in score_pages(even, spans).values())  # diffuse attention cites nothing
    assert cite(score_pages(even, spans)) == []
    peaked = even * 0.5
    peaked[25] += 0.5
    scores = score_pages(peaked, spans)
    assert cite(scores) == [2] and scores[2] > 0 > scores[0]
    two = even * 0.2
    two[5] += 0.45
    two[15] += 0.35
    assert cite(two_scores := score_pages(two, spans)) == [0, 1] and two_scores[0] > two_scores[1] > 0
    assert cite(two_scores, keep=0.9) == [0]
    assert cite(two_scores, most=1) == [0]
    quarters = [(0, 0, 10), (1, 10, 20), (2, 20, 30), (3, 30, 40)]
    habit = even * 0.2  # a model that looks at the last page whatever is asked: the baseline takes that away
    habit[35] += 0.8
    asked = habit * 0.5
    asked[15] += 0.5
    assert cite(score_pages(asked, quarters)) == [1, 3]
    assert cite(score_pages(asked, quarters, baseline=habit)) == [1]


@pytest.mark.slow
def test_page_spans_follow_the_markers_of_any_prefix(smollm2):
    _, tokenizer = smollm2
    prompt = ChatPrompt(tokenizer)
    prefix = prompt.prefix(document_text([(p, t) for p, t in PAGES if p != 1]))  # a page left out, as retrieve does
    spans = page_spans(tokenizer, prefix.ids, prefix.body_start)
    assert [page for page, _, _ in spans] == [0, 2, 3]
    assert spans[0][1] == prefix.body_start and spans[-1][2] == len(prefix.ids)
    for (_, _, end), (_, start, _) in zip(spans, spans[1:]):
        assert end == start
    for page, start, end in spans:
        text = tokenizer.decode(prefix.ids[start:end])
        assert text.lstrip().startswith(f"--- page {page + 1} ---")
        assert dict(PAGES)[page][:40] in text


@pytest.mark.slow
def test_answers_cite_the_page_their_fact_is_on():
    questions = ["What is the monthly rent?", "Who is the tenant?"]
    decode = stage(questions=questions, max_new_tokens=24, dtype="float32", device="cpu")
    rows = decode.run(pages_table([("lease", p, t) for p, t in PAGES])).to_pylist()
    rent, tenant = rows
    assert "7,340" in rent["answer"] and rent["cited_pages"] and rent["cited_pages"][0] == 2, rent
    assert "Harbour" in tenant["answer"] and tenant["cited_pages"] and tenant["cited_pages"][0] == 1, tenant
    off = stage(questions=questions[:1], max_new_tokens=8, dtype="float32", device="cpu", cite=False)
    assert off.run(pages_table([("lease", p, t) for p, t in PAGES])).to_pylist()[0]["cited_pages"] is None
    tiered = stage(questions=questions[:1], max_new_tokens=8, dtype="float32", device="cpu", kv={})
    row = tiered.run(pages_table([("lease", p, t) for p, t in PAGES])).to_pylist()[0]
    assert row["error"] is None and row["cited_pages"] is None  # the tiered cache does not record attention
