"""Which pages an answer rests on: the pages whose tokens the answer's own attention reached most.

After an answer is decoded, its tokens are run once more over the cache (teacher-forced, one forward pass) with an
attention function that, besides SDPA's output, records each answer token's softmax weights over the document's
tokens (each head's 16 strongest reads only), averaged over heads and layers. A page's score is the attention its tokens drew *beyond* what they draw from
a question-free answer ("The document is about", once per document): a small model's heads look at the last page and
at fixed positions whatever is asked, and only the difference follows the question. The cited pages are those within
``keep`` of the best page's score, at most ``most``, best first, each drawing at least 2% of the attention beyond
its share.

Pages are found in the prompt by their markers (``runtime.prompt.page_marker``), so any prefix works: the whole
document, a ``head`` cut, or the pages ``truncate: retrieve`` chose. Needs a cache whose attention sees every
document token exactly and in order (a full cache); the tiered cache and the GPU engine do not record it.
"""

from __future__ import annotations

import bisect
import contextlib
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_MARKER = re.compile(r"--- page (\d+) ---")
#: Positions kept per head and answer token: the 16 it attends to most. Chosen on the fidelity cases' tuning half
#: (bench/bench_citations.py, 20 documents): the fact's page cited first for 34 of 35 answered facts, against 23 of 35
#: with every position counted (a word such as "monthly" draws attention to every page that uses it).
TOP_POSITIONS = 16
_recording = threading.local()  # .weights: the running sum [T] of body attention, .count: rows added


def page_spans(tokenizer: Any, ids: Sequence[int], body_start: int) -> list[tuple[int, int, int]]:
    """``(page, start, end)`` token ranges of the document's pages (``page`` 0-based), from the markers in ``ids``.

    Each token is decoded on its own and the pieces joined, so a marker's characters map back to token indices
    (a multi-byte character split across tokens only garbles that character, never a marker)."""
    pieces = tokenizer.batch_decode([[int(i)] for i in ids[body_start:]])
    ends, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    text = "".join(pieces)
    starts = []
    for match in _MARKER.finditer(text):
        token = bisect.bisect_right(ends, match.start())  # the token whose text holds the marker's first character
        starts.append((int(match.group(1)) - 1, body_start + token))
    spans = []
    for n, (page, start) in enumerate(starts):
        end = starts[n + 1][1] if n + 1 < len(starts) else len(ids)
        spans.append((page, start, end))
    return spans


def page_mass(weights: torch.Tensor, spans: list[tuple[int, int, int]]) -> dict[int, float]:
    """The share of ``weights`` (attention over the document, summing to 1 over ``spans``) each page holds."""
    mass: dict[int, float] = {}
    for page, start, end in spans:
        mass[page] = mass.get(page, 0.0) + float(weights[start:end].sum())
    return mass


def score_pages(weights: torch.Tensor, spans: list[tuple[int, int, int]],
                baseline: torch.Tensor | None = None) -> dict[int, float]:
    """Attention each page drew beyond what it draws anyway: beyond ``baseline`` (the same document's attention
    from a question-free answer, which carries the model's positional habits: the last page, the first) or, without
    one, beyond the page's share of the document's tokens."""
    mass = page_mass(weights, spans)
    if baseline is not None:
        usual = page_mass(baseline, spans)
    else:
        body = sum(end - start for _, start, end in spans) or 1
        usual = {}
        for page, start, end in spans:
            usual[page] = usual.get(page, 0.0) + (end - start) / body
    return {page: mass[page] - usual[page] for page in mass}


def cite(scores: dict[int, float], keep: float = 0.5, most: int = 3, floor: float = 0.02) -> list[int]:
    """Pages within ``keep`` of the best page's score, at most ``most``, best first; a page must draw at least
    ``floor`` of the attention beyond its share (attention spread evenly cites nothing)."""
    ranked = sorted(((s, p) for p, s in scores.items() if s >= floor), reverse=True)
    if not ranked:
        return []
    best = ranked[0][0]
    return [p for s, p in ranked[:most] if s >= keep * best]


def record_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
    """Add this layer's attention of ``query`` rows over the recorded span of ``key`` to the running sum (nothing
    outside :func:`recording`).

    ``query`` [B, Hq, n, D] are the answer tokens, the last ``n`` positions of ``key`` [B, Hkv, T, D]; row ``i``
    sees keys up to ``T - n + i`` (causal). Only the document span ``[start, end)`` is kept, renormalised per row."""
    rec = getattr(_recording, "state", None)
    if rec is None:
        return
    b, hq, n, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    q = query.float().view(b, hkv, hq // hkv, n, d)
    scores = torch.matmul(q, key.float().unsqueeze(2).transpose(-1, -2)) * (d ** -0.5)  # [B, Hkv, r, n, T]
    visible = torch.arange(t, device=key.device) <= (t - n + torch.arange(n, device=key.device)).unsqueeze(1)
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)[..., rec["start"]:rec["end"]]
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    if TOP_POSITIONS < p.shape[-1]:  # each head's sharp reads only: diffuse attention follows words, not sources
        top = p.topk(TOP_POSITIONS, dim=-1)
        p = torch.zeros_like(p).scatter_(-1, top.indices, top.values)
    rec["weights"] += p.mean(dim=(0, 1, 2)).sum(0).cpu()  # sum over answer rows, mean over heads
    rec["rows"] += n


@contextlib.contextmanager
def recording(start: int, end: int) -> Iterator[dict]:
    """Inside, ``record_forward`` (called by the swapped attention) sums attention over positions ``[start, end)``."""
    state = {"start": start, "end": end, "weights": torch.zeros(end - start), "rows": 0}
    _recording.state = state
    try:
        yield state
    finally:
        _recording.state = None


#: The question-free turn whose attention is the baseline: what the model reads on its own habits, not a question.
NULL_QUESTION, NULL_ANSWER = "What is in the document?", "The document is about"


def attention_over(model: Any, cache: Any, ids: Sequence[int], start: int, end: int) -> torch.Tensor | None:
    """Forward ``ids`` on top of ``cache`` and return their attention over positions ``[start, end)`` (summed over
    layers, heads and rows, then normalised), as ``[end]`` with zeros before ``start``; None if it cannot be read."""
    from docfuse.runtime.kv.code_attention import swapped_attention
    from docfuse.runtime.session import forward_tokens

    with swapped_attention(model) as on, recording(start, end) as rec:
        if not on:
            return None
        forward_tokens(model, cache, list(ids))
    if not rec["rows"]:
        return None
    weights = torch.zeros(end)
    weights[start:end] = rec["weights"] / rec["weights"].sum()
    return weights


class Citer:
    """Cites pages for the answers of one prefilled document (``Session`` keeps one per prefill).

    ``cite`` is called after an answer was decoded, with the cache holding the prefix, the question's suffix and
    the answer; it leaves the cache at the prefix (the caller crops there after every answer anyway)."""

    def __init__(self, model: Any, tokenizer: Any, prompt: Any, prefix_ids: Sequence[int]) -> None:
        self.model, self.prompt = model, prompt
        self.prefix_length = len(prefix_ids)
        self.spans = page_spans(tokenizer, prefix_ids, 0)
        self.baseline: torch.Tensor | None = None

    @torch.inference_mode()
    def cite(self, cache: Any, suffix: Sequence[int], answer: Sequence[int], *, keep: float = 0.5,
             most: int = 3) -> list[int]:
        from docfuse.runtime.session import crop_cache, forward_tokens

        if not self.spans or not answer:
            return []
        start, end = self.spans[0][1], self.spans[-1][2]
        # the answer again, from the token that predicted its first word, over the prefix and the question
        crop_cache(cache, self.prefix_length + len(suffix) - 1)
        weights = attention_over(self.model, cache, [suffix[-1], *answer], start, end)
        if weights is None:
            return []
        if self.baseline is None:
            crop_cache(cache, self.prefix_length)
            null = self.prompt.suffix(NULL_QUESTION)
            forward_tokens(self.model, cache, null[:-1])
            self.baseline = attention_over(self.model, cache, [null[-1], *self.prompt.encode(NULL_ANSWER)], start,
                                           end)
        crop_cache(cache, self.prefix_length)
        return cite(score_pages(weights, self.spans, self.baseline), keep, most)
