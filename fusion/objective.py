"""The training objective: masked-token recovery through a frozen decoder, and captions for pages without text.

A share of a page's text tokens is hidden (their embedding replaced by the fusion's mask vector; their boxes
stay, as a text layer that lost a word would keep its place). The decoder predicts each token from the row
before it, as always; text-only, a hidden token can only be guessed from context, since a causal decoder never
sees the row it is predicting. The fusion can do better only by reading the image where the next token is: what
only the image holds. Tokens that stay visible keep their usual next-token loss, so the fusion learns to leave
good text alone. A page without a text layer whose text is known (synthetic scans) becomes visual tokens
followed by that text, and the text is the target: visual tokens must carry what the page says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusion.model import Fusion, FusedPage


@dataclass
class PageTensors:
    """One page ready for the objective: token ids and boxes, and its patches' features, boxes and ink."""

    ids: torch.Tensor           # [T] long
    boxes: torch.Tensor         # [T, 4] grid
    caption: bool               # True: ids are the page's known text, read from visual tokens only


def choose_mask(boxes: torch.Tensor, rate: float, generator: torch.Generator) -> torch.Tensor:
    """[T] bool: a ``rate`` share of the tokens that have a box (never the first token, which nothing predicts)."""
    eligible = boxes[:, 2] >= 0
    eligible[0] = False
    draw = torch.rand(boxes.shape[0], generator=generator) < rate
    return eligible & draw


@dataclass
class PageTargets:
    """One page of a batch: its stream, and for every predicted token the row that predicts it and its id."""

    stream: FusedPage
    rows: torch.Tensor     # [N] rows of ``stream``
    targets: torch.Tensor  # [N] token ids
    hidden: torch.Tensor   # [N] bool: the token was hidden (the rows the objective is about)
    read: torch.Tensor | None  # [N, H] the cross-attention's ungated read at each predicting token (training)


def batch_streams(fusion: Fusion, embed: torch.nn.Embedding, pages: list[PageTensors], feats: torch.Tensor,
                  patch_boxes: torch.Tensor, inks: torch.Tensor, masks: list[torch.Tensor],
                  visual_tokens: bool = True) -> list[PageTargets]:
    """Fused streams of a batch of pages (``feats`` [B, P, D], ``inks`` [B, P]); ``masks[b]`` [T_b] marks hidden
    tokens. Text pages go through the cross-attention together; caption pages become visual tokens + text."""
    device = feats.device
    patches = fusion.project(feats)
    text = [b for b, p in enumerate(pages) if not p.caption]
    out: dict[int, PageTargets] = {}
    if text:
        t = max(pages[b].ids.shape[0] for b in text)
        ids = torch.zeros((len(text), t), dtype=torch.long, device=device)
        boxes = torch.full((len(text), t, 4), -1.0, device=device)
        hidden = torch.zeros((len(text), t), dtype=torch.bool, device=device)
        for i, b in enumerate(text):
            n = pages[b].ids.shape[0]
            ids[i, :n], boxes[i, :n], hidden[i, :n] = pages[b].ids, pages[b].boxes, masks[b]
        x = embed(ids)
        x = torch.where(hidden.unsqueeze(-1), fusion.mask_embedding.to(x.dtype), x)
        fused = fusion.fuse_text(x, boxes, patches[text], patch_boxes)
        for i, b in enumerate(text):
            n = pages[b].ids.shape[0]
            stream = fusion.with_visual_tokens(fused[i, :n], boxes[i, :n], patches[b], patch_boxes,
                                               inks[b] if visual_tokens else None)
            read = fusion.cross.read[i, :n - 1] if fusion.cross.read is not None else None
            out[b] = PageTargets(stream, stream.text_index[1:] - 1, ids[i, 1:n], hidden[i, 1:n], read)
    for b, page in enumerate(pages):
        if page.caption:
            out[b] = caption_stream(fusion, embed, page, patches[b], patch_boxes, inks[b])
    return [out[b] for b in range(len(pages))]


def caption_stream(fusion: Fusion, embed: torch.nn.Embedding, page: PageTensors, patches: torch.Tensor,
                   patch_boxes: torch.Tensor, ink: torch.Tensor) -> PageTargets:
    """A page without a text layer: its visual tokens, then its known text, which is the target."""
    device = patches.device
    ids = page.ids.to(device)
    no_words = torch.full((0, 4), -1.0, device=device)
    vis, _ = fusion.visual_tokens(no_words, patches, patch_boxes, ink)
    x = embed(ids)
    v = vis.shape[0]
    stream = FusedPage(torch.cat([vis.to(x.dtype), x]), torch.arange(v + len(ids), device=device) < v,
                       torch.arange(v, v + len(ids), device=device))
    rows = stream.text_index - 1
    keep = rows >= 0
    n = int(keep.sum())
    return PageTargets(stream, rows[keep], ids[keep], torch.zeros(n, dtype=torch.bool, device=device), None)


def pad_streams(streams: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, N, H] embeddings and their [B, N] attention mask."""
    n = max(s.shape[0] for s in streams)
    out = streams[0].new_zeros((len(streams), n, streams[0].shape[1]))
    attn = torch.zeros((len(streams), n), dtype=torch.long, device=streams[0].device)
    for b, s in enumerate(streams):
        out[b, :s.shape[0]] = s
        attn[b, :s.shape[0]] = 1
    return out, attn

