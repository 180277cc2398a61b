"""Pages and their key summaries: per-channel min/max of the keys of each page (Quest-style).

A page is a run of token positions scored as a unit. By default pages are fixed blocks of ``page_tokens``; a caller
that knows the document's structure passes explicit spans (one per PDF page, paragraph, ...) and the gaps between
and after them fall back to fixed blocks. The upper bound of ``q . k`` over a page is
``sum_d max(q_d * min_d, q_d * max_d)``, computed from the summaries alone, so ranking pages never decompresses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class PageTable:
    """Page boundaries over positions ``[0, length)``."""

    def __init__(self, page_tokens: int, spans: Sequence[tuple[int, int]] | None = None) -> None:
        self.page_tokens = page_tokens
        self.spans = self._check(spans or [])

    @staticmethod
    def _check(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        clean = sorted((int(s), int(e)) for s, e in spans)
        previous = 0
        for start, end in clean:
            if start < 0 or end <= start:
                raise ValueError(f"page span ({start}, {end}) is empty or negative; give (start, end) with end > start")
            if start < previous:
                raise ValueError(f"page span ({start}, {end}) overlaps the previous one; spans must not overlap")
            previous = end
        return clean

    def starts(self, length: int) -> list[int]:
        """Sorted first positions of the pages covering ``[0, length)``."""
        out: list[int] = []
        cursor = 0
        for start, end in [*self.spans, (length, length)]:
            start, end = min(start, length), min(end, length)
            out.extend(range(cursor, start, self.page_tokens))  # gap before this span: fixed blocks
            if end > start:
                out.append(start)
            cursor = max(cursor, end)
        if cursor < length:
            out.extend(range(cursor, length, self.page_tokens))
        return sorted(set(out))

    def page_ids(self, length: int) -> torch.Tensor:
        """Page index of each position ``[0, length)`` (int64, host)."""
        starts = torch.tensor(self.starts(length), dtype=torch.long)
        return torch.searchsorted(starts, torch.arange(length), right=True) - 1


def page_minmax(keys: torch.Tensor, page_ids: torch.Tensor, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page per-channel min and max of ``keys`` [B, H, T, D] given each token's page [T] (pages absent: +-inf).

    Pages of one fixed size in position order (the default page table) reduce over a reshaped view, ~7x faster on
    the CPU than the general scatter (0.013 against 0.088 s for 30 layers of 6K tokens); min and max are exact
    either way, so both paths give the same numbers."""
    b, h, t, d = keys.shape
    size = _fixed_page_size(page_ids, pages)
    if size is not None:
        full = t // size
        body = keys[:, :, : full * size].reshape(b, h, full, size, d)
        lo, hi = body.amin(3), body.amax(3)
        if full < pages:  # the last page, shorter
            tail = keys[:, :, full * size:]
            lo = torch.cat([lo, tail.amin(2, keepdim=True)], dim=2)
            hi = torch.cat([hi, tail.amax(2, keepdim=True)], dim=2)
        return lo, hi
    idx = page_ids.to(keys.device).view(1, 1, -1, 1).expand(b, h, -1, d)
    lo = torch.full((b, h, pages, d), math.inf, dtype=keys.dtype, device=keys.device)
    hi = torch.full((b, h, pages, d), -math.inf, dtype=keys.dtype, device=keys.device)
    return lo.scatter_reduce_(2, idx, keys, "amin"), hi.scatter_reduce_(2, idx, keys, "amax")


def _fixed_page_size(page_ids: torch.Tensor, pages: int) -> int | None:
    """The page size when ``page_ids`` are pages ``0..pages-1`` in order, each of that size but the last (which is no
    longer), none empty; otherwise None."""
    if page_ids.numel() == 0 or pages < 1 or page_ids.device.type != "cpu":
        return None
    counts = torch.bincount(page_ids, minlength=pages)
    if counts.numel() != pages or int(counts[-1]) == 0:
        return None
    size = int(counts[0])
    if size == 0 or bool((counts[:-1] != size).any()) or int(counts[-1]) > size:
        return None
    return size if bool((page_ids[1:] >= page_ids[:-1]).all()) else None


def upper_bounds(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q . k`` for each query and page: [B, H, M, P] from queries [B, H, M, D] grouped per KV head."""
    q = queries.to(kmax.dtype)
    lo = torch.nan_to_num(kmin, posinf=0.0, neginf=0.0)
    hi = torch.nan_to_num(kmax, posinf=0.0, neginf=0.0)
    return q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)


def group_queries(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, T, D] query heads -> [B, H_kv, G * T, D]: each KV head scores with all the query heads that read it."""
    b, hq, t, d = queries.shape
    return queries.reshape(b, kv_heads, (hq // kv_heads) * t, d)


def page_scores(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, reduce: str = "softmax") -> torch.Tensor:
    """Relevance of each page [B, H, P] for grouped queries [B, H, M, D].

    ``softmax`` (default): the attention mass each query would give a page if every token of it hit the upper bound,
    summed over queries, so high-norm queries do not dominate. ``max``: the largest raw upper bound.
    """
    bounds = upper_bounds(queries, kmin, kmax).float() / math.sqrt(queries.shape[-1])
    empty = torch.isinf(kmin).all(dim=-1).unsqueeze(2)  # pages with no token in this layer/head
    bounds = bounds.masked_fill(empty, -math.inf)
    if reduce == "max":
        return bounds.amax(dim=2)
    if reduce == "softmax":
        return torch.softmax(bounds, dim=-1).nan_to_num(0.0).sum(dim=2)
    raise ValueError(f"unknown page score reduction '{reduce}'; use softmax or max")
