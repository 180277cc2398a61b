"""The word reader: a small timm ViT that reads one word of a page image, character by character (CTC).

A hidden token's identity is on the page, where its box is; the page ViT's 16-px patches hold about two
characters each and, trained for minutes, never learned to tell word pieces apart (held-out reading top-1 0.06).
The reader looks closer: each word's box is cut out of the page image (``word_crops``: grey, aspect kept, height
``height`` px), a ViT over column strips (``patch_width`` px wide) gives a character distribution per column, and
greedy CTC decoding gives the word. ``read_tokens`` turns a read word back into the decoder's token ids, so a
hidden token is named by the word it sits in.

Characters: printable ASCII and common typographic marks; anything else reads as ``UNKNOWN``.
"""

from __future__ import annotations

import string
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from docfuse.fusion.tokens import GRID

CHARSET = (string.digits + string.ascii_letters + string.punctuation
           + "\u2018\u2019\u201c\u201d\u2013\u2014\u2022\u2026\u20ac\u00a3\u00b0\u00b1\u00d7\u00a7\u00a9\u00ae"
           + "\u00e9\u00e8\u00e0\u00e4\u00f6\u00fc\u00df\u00e7\u00f1\u00c9\u00b5\u00bd\u00b7\ufb01\ufb02")
UNKNOWN = len(CHARSET) + 1  # class of any character outside CHARSET; 0 is CTC's blank
_INDEX = {c: i + 1 for i, c in enumerate(CHARSET)}


@dataclass(frozen=True)
class ReaderConfig:
    """Sizes of a word reader; stored in its checkpoint."""

    height: int = 20       # crop height in pixels (a word's box, scaled)
    width: int = 256       # crop width: words longer than width/height times their height are squeezed
    patch_width: int = 2   # one column token per patch_width pixels
    dim: int = 128
    depth: int = 4
    heads: int = 4
    stem: int = 32         # channels of the convolutional stem (strokes and edges, before the column strips)

    def to_dict(self) -> dict:
        return asdict(self)


class WordReader(nn.Module):
    """A small convolutional stem, a column-strip ViT (timm) and a per-column character classifier (CTC)."""

    def __init__(self, config: ReaderConfig = ReaderConfig()) -> None:
        super().__init__()
        from timm.models.vision_transformer import VisionTransformer

        self.config = config
        self.stem = nn.Sequential(nn.Conv2d(1, config.stem, 3, padding=1), nn.GELU(),
                                  nn.Conv2d(config.stem, config.stem, 3, padding=1), nn.GELU())
        self.vit = VisionTransformer(img_size=(config.height, config.width), patch_size=(config.height, config.patch_width),
                                     in_chans=config.stem, num_classes=0, global_pool="", class_token=False,
                                     embed_dim=config.dim, depth=config.depth, num_heads=config.heads, mlp_ratio=2.0)
        self.head = nn.Linear(config.dim, UNKNOWN + 1)

    def forward(self, crops: torch.Tensor) -> torch.Tensor:
        """``crops`` [N, 1, height, width] ink (0 white .. 1 black) -> log-probabilities [N, columns, classes]."""
        return self.head(self.vit.forward_features(self.stem(crops))).float().log_softmax(-1)


def encode_text(text: str) -> list[int]:
    """Class indices of ``text`` (``UNKNOWN`` for characters outside CHARSET)."""
    return [_INDEX.get(c, UNKNOWN) for c in text]


def ctc_loss(logp: torch.Tensor, words: list[str]) -> torch.Tensor:
    """Mean CTC loss of ``logp`` [N, T, C] against the words (blank 0)."""
    targets = [torch.tensor(encode_text(w), dtype=torch.long) for w in words]
    lengths = torch.tensor([len(t) for t in targets], dtype=torch.long)
    flat = torch.cat(targets).to(logp.device)
    steps = torch.full((logp.shape[0],), logp.shape[1], dtype=torch.long)
    return F.ctc_loss(logp.transpose(0, 1), flat, steps, lengths, blank=0, reduction="mean", zero_infinity=True)


def decode(logp: torch.Tensor) -> list[tuple[str, float]]:
    """Greedy CTC decoding of [N, T, C]: (word, probability of the greedy path) for each crop."""
    best, score = logp.argmax(-1).cpu(), logp.max(-1).values.sum(-1).exp().cpu()
    out = []
    for row, p in zip(best.tolist(), score.tolist()):
        chars, last = [], 0
        for c in row:
            if c != last and c != 0:
                chars.append(CHARSET[c - 1] if c <= len(CHARSET) else "\ufffd")
            last = c
        out.append(("".join(chars), float(p)))
    return out


def ink_image(pixels: torch.Tensor) -> torch.Tensor:
    """[H, W, 3] uint8 page to [1, 1, H, W] float ink (0 white .. 1 black), on the pixels' device."""
    return (1.0 - pixels.float().mean(-1) / 255.0)[None, None]


def word_crops(ink: torch.Tensor, boxes: torch.Tensor, config: ReaderConfig) -> torch.Tensor:
    """Crops [N, 1, height, width] of the words whose grid boxes [N, 4] are given, from ``ink`` [1, 1, H, W].

    The crop keeps the word's aspect (scaled to ``height``), left-aligned; the canvas right of the word is blank,
    so neighbouring words never show. A word wider than ``width / height`` times its height is squeezed to fit.
    """
    from torchvision.ops import roi_align

    n = boxes.shape[0]
    if n == 0:
        return ink.new_zeros((0, 1, config.height, config.width))
    h_img, w_img = ink.shape[-2:]
    b = boxes.to(ink.device, torch.float32)
    x0, x1 = b[:, 0] / GRID * w_img - 1.0, b[:, 2] / GRID * w_img + 1.0
    y0, y1 = b[:, 1] / GRID * h_img - 1.0, b[:, 3] / GRID * h_img + 1.0
    height = (y1 - y0).clamp(min=2.0)
    reach = torch.maximum(x0 + height * config.width / config.height, x1)
    rois = torch.stack([torch.zeros_like(x0), x0, y0, reach, y1], dim=1)
    crops = roi_align(ink, rois, (config.height, config.width), spatial_scale=1.0, sampling_ratio=2, aligned=True)
    used = ((x1 - x0) / (reach - x0) * config.width).ceil()
    cols = torch.arange(config.width, device=ink.device)
    return crops * (cols[None, :] < used[:, None]).to(crops.dtype).view(n, 1, 1, config.width)


def word_groups(boxes: np.ndarray) -> np.ndarray:
    """[T] word index of each token (-1 without a box): a word is a run of tokens whose boxes touch on one line.

    fusion.tokens cuts a word's box at shared x positions, so the tokens of one word touch exactly; the next word
    starts after a space, which has no box."""
    t = boxes.shape[0]
    boxed = boxes[:, 2] >= 0
    joins = np.zeros(t, dtype=bool)
    if t > 1:
        joins[1:] = (boxed[1:] & boxed[:-1] & (boxes[1:, 0] == boxes[:-1, 2])
                     & (boxes[1:, 1] == boxes[:-1, 1]) & (boxes[1:, 3] == boxes[:-1, 3]))
    starts = boxed & ~joins
    group = np.cumsum(starts) - 1
    return np.where(boxed, group, -1)


def group_boxes(boxes: np.ndarray, group: np.ndarray) -> np.ndarray:
    """[G, 4] union box of each word group."""
    n = int(group.max()) + 1 if group.size and group.max() >= 0 else 0
    out = np.zeros((n, 4), dtype=np.float32)
    if n == 0:
        return out
    sel = group >= 0
    g, b = group[sel], boxes[sel]
    out[:, 0], out[:, 1] = np.inf, np.inf
    out[:, 2], out[:, 3] = -np.inf, -np.inf
    np.minimum.at(out[:, 0], g, b[:, 0])
    np.minimum.at(out[:, 1], g, b[:, 1])
    np.maximum.at(out[:, 2], g, b[:, 2])
    np.maximum.at(out[:, 3], g, b[:, 3])
    return out


def group_texts(tokenizer: Any, ids: np.ndarray, group: np.ndarray) -> list[str]:
    """The text of each word group (its tokens decoded, spaces stripped): the reader's training labels."""
    n = int(group.max()) + 1 if group.size and group.max() >= 0 else 0
    members: list[list[int]] = [[] for _ in range(n)]
    for i, g in enumerate(group.tolist()):
        if g >= 0:
            members[g].append(int(ids[i]))
    return [tokenizer.decode(m).strip() for m in members]


def _prefix(tokenizer: Any, ids: np.ndarray, boxes: np.ndarray, first: int) -> str:
    """What precedes a word in the page text, as the tokenizer saw it: a space, or nothing at a line start.

    Uses only boxes and visible (box-less) tokens: a boxed token before the word is another word, so a space
    separates them; a box-less one (newline, space, pipe) is never hidden and says itself."""
    if first == 0:
        return ""
    if boxes[first - 1, 2] >= 0:
        return " "
    return " " if tokenizer.decode([int(ids[first - 1])]).endswith(" ") else ""


@torch.no_grad()
def read_tokens(reader: WordReader, tokenizer: Any, pixels: torch.Tensor, ids: torch.Tensor, boxes: torch.Tensor,
                want: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """[T] the token id the image shows at each ``want``-ed position (-1 elsewhere and where nothing was read).

    The reader reads the word each wanted token sits in; the read word, after the space or line start before it,
    is tokenised as the page text was, and the token at the same place in the word is taken (by index when the
    read word has as many tokens as the word's boxes, else by the token's horizontal position). The ids of the
    wanted tokens themselves are never looked at.
    """
    want_np = want.cpu().numpy()
    b = boxes.cpu().numpy()
    group = word_groups(b)
    needed = sorted({int(g) for g in group[want_np] if g >= 0})
    if not needed:
        return torch.full((ids.shape[0],), -1, dtype=torch.long)
    gboxes = group_boxes(b, group)
    ink = ink_image(pixels.to(next(reader.parameters()).device))
    dtype = next(reader.parameters()).dtype
    words: list[str] = []
    for s in range(0, len(needed), batch):
        sel = torch.from_numpy(gboxes[needed[s:s + batch]])
        words += [w for w, _ in decode(reader(word_crops(ink, sel, reader.config).to(dtype)))]
    return place_words(tokenizer, ids, boxes, want, dict(zip(needed, words)), groups=(group, gboxes))


def place_words(tokenizer: Any, ids: torch.Tensor, boxes: torch.Tensor, want: torch.Tensor,
                read: dict[int, str], groups: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
    """[T] token ids of the ``want``-ed positions, from the words read for their word groups (``read``: group ->
    word; ``word_groups`` numbers them); -1 where a group was not read. Never looks at the wanted ids.
    ``groups``: ``(word_groups(boxes), group_boxes(...))`` when the caller has them already."""
    out = torch.full((ids.shape[0],), -1, dtype=torch.long)
    ids_np, b, want_np = ids.cpu().numpy(), boxes.cpu().numpy(), want.cpu().numpy()
    if groups is None:
        group = word_groups(b)
        groups = (group, group_boxes(b, group))
    group, gboxes = groups
    for g, word in read.items():
        members = np.flatnonzero(group == g)
        if not word or not want_np[members].any():
            continue
        prefix = _prefix(tokenizer, ids_np, b, int(members[0]))
        text = prefix + word
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        pieces = [(tid, a, e) for tid, (a, e) in zip(enc.input_ids, enc.offset_mapping) if text[a:e].strip()]
        if not pieces:
            continue
        x0, x1 = float(gboxes[g, 0]), float(gboxes[g, 2])
        for k, t in enumerate(members.tolist()):
            if not want_np[t]:
                continue
            if len(pieces) == len(members):
                out[t] = pieces[k][0]
                continue
            centre = ((b[t, 0] + b[t, 2]) / 2 - x0) / max(x1 - x0, 1e-6)
            at = len(prefix) + min(int(centre * len(word)), len(word) - 1)
            out[t] = next((tid for tid, a, e in pieces if a <= at < e), pieces[-1][0])
    return out
