"""The fusion's layers: the patch projector and tanh-gated cross-attention from text tokens to their page's patches.

Every text token looks at the ``neighbours`` patches nearest to its own box or to the next token's box (a reader's
eye moves on to the next word, and a causal decoder predicts that word here), with a learned per-head
distance bias. The result enters the stream as ``x + tanh(g) * attention`` and ``+ tanh(g') * mlp``, both gates
starting at 0 (Flamingo, Llama 3.2 Vision): an untrained fusion returns its input unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from docfuse.fusion.coords import CoordinateEmbedding, centres, has_box


class PatchProjector(nn.Module):
    """Vision patch features to the decoder's hidden size."""

    def __init__(self, vision_dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(vision_dim)
        self.fc1 = nn.Linear(vision_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(feats))))


class GatedCrossAttention(nn.Module):
    """Text tokens attend to nearby patches of their own page; the result is added through tanh gates."""

    def __init__(self, hidden: int, heads: int = 4, head_dim: int = 64,
                 neighbours: int = 48, mlp_hidden: int = 1024) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim, self.neighbours = heads, head_dim, neighbours
        self.text_norm = nn.LayerNorm(hidden)
        self.patch_norm = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, inner)
        self.k = nn.Linear(hidden, inner)
        self.v = nn.Linear(hidden, inner)
        self.o = nn.Linear(inner, hidden)
        self.next_coords = nn.Linear(hidden, hidden, bias=False)
        # per head: how far toward the next token its centre sits, and how steeply distance costs
        self.lookahead = nn.Parameter(torch.linspace(-2.0, 2.0, heads))
        self.distance_scale = nn.Parameter(torch.zeros(heads))
        # mlp_hidden 0: no MLP branch (on the shipped checkpoint that branch is what costs held-out recovery)
        self.mlp_norm = nn.LayerNorm(hidden) if mlp_hidden else None
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, hidden)) \
            if mlp_hidden else None
        self.attn_gate = nn.Parameter(torch.zeros(()))
        self.mlp_gate = nn.Parameter(torch.zeros(()))
        self.read: torch.Tensor | None = None

    @property
    def is_identity(self) -> bool:
        return bool(self.attn_gate.detach() == 0) and bool(self.mlp_gate.detach() == 0)

    def forward(self, x: torch.Tensor, boxes: torch.Tensor, next_boxes: torch.Tensor,
                patches: torch.Tensor, patch_boxes: torch.Tensor, coords: CoordinateEmbedding) -> torch.Tensor:
        """``x`` [B, T, H] token embeddings of B pages, ``patches`` [B, P, H] their projected patches, ``boxes`` and
        ``next_boxes`` [B, T, 4], ``patch_boxes`` [P, 4] (the same grid on every page); returns [B, T, H].

        ``coords`` is the fusion's one coordinate embedding, shared with the patches and the visual tokens. The
        ungated read (``self.read``, [B, T, H]) is kept for the training's auxiliary loss.
        """
        if patches.shape[1] == 0 or x.shape[1] == 0 or (not self.training and self.is_identity):
            self.read = None
            return x  # exactly the text-only stream
        b, t, _ = x.shape
        p = patches.shape[1]
        own = has_box(boxes)
        nxt = torch.where(has_box(next_boxes).unsqueeze(-1), next_boxes, boxes)
        c_own, c_next, c_patch = centres(boxes.float()), centres(nxt.float()), centres(patch_boxes.float())
        # the K patches nearest to either centre: far patches would get ~zero weight anyway
        dist = torch.minimum(torch.cdist(c_own, c_patch.expand(b, -1, -1)),
                             torch.cdist(c_next, c_patch.expand(b, -1, -1)))  # [B, T, P]
        k = min(self.neighbours, p)
        index = dist.topk(k, dim=-1, largest=False).indices  # [B, T, K]
        flat = (index + torch.arange(b, device=x.device).view(b, 1, 1) * p).reshape(-1)  # rows of [B*P, ...]

        dtype = self.q.weight.dtype
        tq = self.text_norm(x.to(dtype)) + coords(boxes) + self.next_coords(coords(nxt))
        q = self.q(tq).view(b, t, self.heads, self.head_dim)
        pn = self.patch_norm(patches.to(dtype))
        keys = self.k(pn + coords(patch_boxes)).reshape(b * p, -1)[flat].view(b, t, k, self.heads, self.head_dim)
        values = self.v(pn).reshape(b * p, -1)[flat].view(b, t, k, self.heads, self.head_dim)
        mix = torch.sigmoid(self.lookahead).view(1, 1, self.heads, 1)
        centre = c_own.unsqueeze(2) + mix * (c_next - c_own).unsqueeze(2)          # [B, T, h, 2]
        near = c_patch[index]                                                      # [B, T, K, 2]
        d = ((centre.unsqueeze(3) - near.unsqueeze(2)).square().sum(-1) + 1.0).sqrt()  # [B, T, h, K]
        bias = -F.softplus(self.distance_scale).view(1, 1, -1, 1) * d / 10.0
        scores = torch.einsum("bthd,btkhd->bthk", q, keys) / self.head_dim ** 0.5 + bias.to(q.dtype)
        attn = torch.einsum("bthk,btkhd->bthd", scores.softmax(-1), values).reshape(b, t, -1)
        keep = own.unsqueeze(-1).to(dtype)  # tokens without a box (newlines, pipes) stay as they are
        read = self.o(attn) * keep
        self.read = read if self.training else None
        delta = torch.tanh(self.attn_gate) * read
        if self.mlp is not None:
            delta = delta + torch.tanh(self.mlp_gate) * self.mlp(self.mlp_norm(x.to(dtype) + delta)) * keep
        return x + delta.to(x.dtype)  # in x's own precision: rows without a box come back bit for bit
