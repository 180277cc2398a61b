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

from docfuse.fusion.model import Fusion, FusedPage


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
                  visual_tokens: bool = True, reads: list[torch.Tensor] | None = None) -> list[PageTargets]:
    """Fused streams of a batch of pages (``feats`` [B, P, D], ``inks`` [B, P]); ``masks[b]`` [T_b] marks hidden
    tokens. Text pages go through the cross-attention together; caption pages become visual tokens + text.
    ``reads[b]`` [T_b]: the token the word reader read at each hidden position (-1: none), for the read path."""
    device = feats.device
    patches = fusion.project(feats)
    text = [b for b, p in enumerate(pages) if not p.caption]
    out: dict[int, PageTargets] = {}
    if text:
        ids, boxes, hidden, x = text_batch(fusion, embed, [pages[b] for b in text], [masks[b] for b in text], device)
        fused = fusion.fuse_text(x, boxes, patches[text], patch_boxes)
        if reads is not None and fusion.read_steer is not None:
            fused = with_reads(fusion, embed, fused, [reads[b] for b in text])
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


def with_reads(fusion: Fusion, embed: torch.nn.Embedding, fused: torch.Tensor,
               reads: list[torch.Tensor]) -> torch.Tensor:
    """``fused`` [B, T, H] with the read path at every row whose next token was read (``reads[b]`` [T_b])."""
    b, t = fused.shape[:2]
    nxt = torch.full((b, t), -1, dtype=torch.long, device=fused.device)
    for i, r in enumerate(reads):
        n = min(r.shape[0], t)
        nxt[i, :n - 1] = r[1:n].to(fused.device)
    return fusion.steer_reads(fused, embed(nxt.clamp(min=0)), nxt >= 0)


def text_batch(fusion: Fusion, embed: torch.nn.Embedding, pages: list[PageTensors], masks: list[torch.Tensor],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``ids`` [B, T], ``boxes`` [B, T, 4] (NO_BOX as padding), ``hidden`` [B, T] and the embeddings
    [B, T, H] with hidden tokens replaced by the mask vector, for B text pages."""
    t = max(p.ids.shape[0] for p in pages)
    ids = torch.zeros((len(pages), t), dtype=torch.long, device=device)
    boxes = torch.full((len(pages), t, 4), -1.0, device=device)
    hidden = torch.zeros((len(pages), t), dtype=torch.bool, device=device)
    for i, (page, mask) in enumerate(zip(pages, masks)):
        n = page.ids.shape[0]
        ids[i, :n], boxes[i, :n], hidden[i, :n] = page.ids, page.boxes, mask
    x = embed(ids)
    return ids, boxes, hidden, torch.where(hidden.unsqueeze(-1), fusion.mask_embedding.to(x.dtype), x)


def reading_logits(fusion: Fusion, embed: torch.nn.Embedding, pages: list[PageTensors], feats: torch.Tensor,
                   patch_boxes: torch.Tensor, masks: list[torch.Tensor], max_rows: int | None = None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-attention's own guess at each next token, without the decoder: (logits [N, vocab], targets [N]).

    Every row whose token and next token both have a box reads the image at the next token's box; its ungated
    read scored against the (tied) embedding table says which token it saw. This is the reading phase's whole
    loss (fusion.train): it teaches the ViT and the cross-attention to read before any gate opens, at a fraction
    of a decoder step's cost. Caption pages are left out; ``max_rows`` keeps a random subset of the rows. Needs
    ``fusion`` in training mode (the read is kept only then).
    """
    keep = [i for i, p in enumerate(pages) if not p.caption]
    device = feats.device
    ids, boxes, _, x = text_batch(fusion, embed, [pages[i] for i in keep], [masks[i] for i in keep], device)
    fusion.fuse_text(x, boxes, fusion.project(feats[keep]), patch_boxes)
    read = fusion.cross.read[:, :-1]                                    # [B, T-1, H]: row r reads token r + 1
    valid = (boxes[:, :-1, 2] >= 0) & (boxes[:, 1:, 2] >= 0)
    rows, targets = read[valid], ids[:, 1:][valid]
    if max_rows is not None and rows.shape[0] > max_rows:
        pick = torch.randperm(rows.shape[0], generator=generator)[:max_rows].to(device)
        rows, targets = rows[pick], targets[pick]
    return rows.float() @ embed.weight.float().T, targets


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

