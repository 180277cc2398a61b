"""Token-level relevance for a question: the attention mass its queries give each cached token whose key is known.

Page summaries (``summaries.py``) bound ``q . k`` over a page, but on a small model those bounds are loose enough
that ranking pages by them misses the needle often (bench/RESULTS.md, issue 3). Votes score single tokens with the
keys the device already holds: exact core keys, the association tier's dequantised codes, and exact keys of the
background pages the summaries nominate (promoted from the host archive). Every query spreads one unit of softmax mass
over the known tokens, so tokens the question really reads rise, whatever the queries' norms; an average pool keeps
the neighbours of a hit (the digits after "pass key is"), as SnapKV does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: Width of the average pool over votes (odd: centred).
POOL_KERNEL = 7
#: Score memory one slice of queries may take in ``token_votes``.
VOTE_SLICE_BYTES = 256 << 20


def token_votes(grouped: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                kernel: int = POOL_KERNEL) -> torch.Tensor:
    """Pooled attention mass [B, H, T] (float32) of ``grouped`` queries [B, H, M, D] over ``keys`` [B, H, T, D].

    ``visible`` (bool, on the keys' device) says which keys each query may read: [B, H, T] for the same tokens for
    every query (the tiered cache: the tokens whose key is known), or anything broadcastable to [B, H, M, T] (SnapKV:
    a causal mask). Hidden tokens get no direct mass, only what the pool spreads from a visible neighbour.
    """
    if visible.dim() == 3:
        visible = visible.unsqueeze(2)
    hidden = None if bool(visible.all()) else ~visible
    b, h, m, _ = grouped.shape
    t = keys.shape[2]
    # Queries in slices, so that the float32 scores stay near VOTE_SLICE_BYTES (at 128K tokens, 256 queries of
    # 8 heads would otherwise need several GB at once).
    step = max(1, min(m, VOTE_SLICE_BYTES // max(1, b * h * t * 4)))
    mass = torch.zeros(b, h, t, dtype=torch.float32, device=keys.device)
    for lo in range(0, m, step):
        logits = (grouped[:, :, lo: lo + step].to(keys.dtype) @ keys.transpose(-1, -2)).float()
        logits.mul_(1.0 / math.sqrt(keys.shape[-1]))
        if hidden is not None:
            mask = hidden if hidden.shape[2] == 1 else hidden[:, :, lo: lo + step]
            logits.masked_fill_(mask, -math.inf)
        weights = torch.softmax(logits, dim=-1)
        if hidden is not None or keys.dtype == torch.float16:  # a fully hidden row, or an fp16 overflow: NaN
            weights.nan_to_num_(0.0)
        mass += weights.sum(dim=2)
    if kernel > 1 and mass.shape[-1] >= kernel:
        mass = F.avg_pool1d(mass, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return mass


def nominate(page_score: torch.Tensor, eligible: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` eligible positions per head with the highest page score (whole pages first, earlier first).

    ``page_score`` [B, H, T] is each position's page score, ``eligible`` [B, H, T] the positions that may be
    nominated (the background); returns a bool mask [B, H, T] on the host.
    """
    count = min(count, int(eligible.sum(dim=-1).min()))
    out = torch.zeros_like(eligible)
    if count <= 0:
        return out
    score = page_score.double().masked_fill(~eligible, -math.inf)
    order = torch.sort(-score, dim=-1, stable=True).indices[..., :count]
    return out.scatter_(2, order, True)
