"""The fusion: text-token embeddings and a page's vision patches into one stream for the decoder.

    patches --PatchProjector--> [P, H] --+
    boxes  --CoordinateEmbedding--------+--> GatedCrossAttention(text -> its page's patches) --> fused [T, H]
    windows without words --pool--> visual tokens, tanh-gated, inserted in reading order -----> [T + V, H]

With every gate at 0 (a fresh fusion) ``fuse_page`` returns the text embeddings themselves and no visual tokens:
text-only, bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from docfuse.fusion.coords import CoordinateEmbedding
from docfuse.fusion.layers import GatedCrossAttention, PatchProjector
from docfuse.fusion.visual import insertion_points, uncovered, windows


@dataclass(frozen=True)
class FusionConfig:
    """Sizes of a fusion; stored in its checkpoint."""

    hidden: int            # the decoder's hidden size
    vision_dim: int        # the ViT's feature width
    grid_rows: int         # the ViT's patch grid
    grid_cols: int
    heads: int = 4
    head_dim: int = 64
    neighbours: int = 48
    mlp_hidden: int = 1024
    coord_frequencies: int = 16
    pool: int = 4                # visual-token window side, in patches
    max_visual_tokens: int = 64  # per page; more windows are pooled coarser
    min_ink: float = 0.01        # share of non-white pixels for a window to count as content
    read_hidden: int = 0         # width of the read-steering MLP (0: no read path; see Fusion.steer_reads)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FusedPage:
    """One page's fused stream: ``embeds`` [N, H] and which rows are pooled visual tokens (``visual`` [N] bool)."""

    embeds: torch.Tensor
    visual: torch.Tensor
    text_index: torch.Tensor  # [T] row of each text token in ``embeds``


class Fusion(nn.Module):
    """Patch projector, shared coordinate embedding, gated cross-attention, pooled visual tokens, mask vector."""

    def __init__(self, config: FusionConfig) -> None:
        super().__init__()
        self.config = config
        self.coords = CoordinateEmbedding(config.hidden, config.coord_frequencies)
        self.projector = PatchProjector(config.vision_dim, config.hidden)
        self.cross = GatedCrossAttention(config.hidden, config.heads, config.head_dim,
                                         config.neighbours, config.mlp_hidden)
        self.visual_proj = nn.Linear(config.hidden, config.hidden)
        self.visual_gate = nn.Parameter(torch.zeros(()))
        # never exactly zero rows: a run of all-zero embeddings gives the decoder's backward NaNs
        #: marks a pooled visual token; its content enters through tanh(visual_gate)
        self.visual_marker = nn.Parameter(torch.randn(config.hidden) * 0.1)
        #: stands in for a hidden token in masked-token training and evaluation
        self.mask_embedding = nn.Parameter(torch.randn(config.hidden) * 0.1)
        #: the read path: the embedding of the token the word reader read for a hidden slot, mapped so that the
        #: frozen decoder, at the row before the slot, predicts it (fusion.reader, Fusion.steer_reads)
        self.read_steer = nn.Sequential(nn.Linear(config.hidden, config.read_hidden), nn.GELU(),
                                        nn.Linear(config.read_hidden, config.hidden)) if config.read_hidden else None
        self.read_gate = nn.Parameter(torch.zeros(())) if config.read_hidden else None

    @property
    def is_identity(self) -> bool:
        return (self.cross.is_identity and bool(self.visual_gate.detach() == 0)
                and (self.read_gate is None or bool(self.read_gate.detach() == 0)))

    def gates(self) -> dict[str, float]:
        """tanh of each gate: how much of each branch enters the stream."""
        gates = {"attention": self.cross.attn_gate, "mlp": self.cross.mlp_gate, "visual_tokens": self.visual_gate}
        if self.read_gate is not None:
            gates["read"] = self.read_gate
        return {name: float(torch.tanh(g.detach())) for name, g in gates.items()}

    def project(self, patch_feats: torch.Tensor) -> torch.Tensor:
        """ViT features [..., P, D] to the decoder's hidden size [..., P, H]."""
        return self.projector(patch_feats.to(self.projector.fc1.weight.dtype))

    def fuse_text(self, embeds: torch.Tensor, boxes: torch.Tensor, patches: torch.Tensor,
                  patch_boxes: torch.Tensor) -> torch.Tensor:
        """Text rows of B pages after gated cross-attention: ``embeds`` [B, T, H], ``boxes`` [B, T, 4],
        ``patches`` [B, P, H] projected, ``patch_boxes`` [P, 4]; returns [B, T, H]."""
        return self.cross(embeds, boxes, following(boxes), patches, patch_boxes, self.coords)

    def steer_reads(self, fused: torch.Tensor, read_embeds: torch.Tensor, has_read: torch.Tensor) -> torch.Tensor:
        """``fused`` [B, T, H] plus ``tanh(read_gate) * read_steer(read_embeds)`` at the rows ``has_read`` [B, T]
        marks: those before a hidden token the reader read (``read_embeds``: the read token's decoder embedding).

        The decoder predicts token j at row j - 1, and adding token j's own embedding there makes it read row j - 1
        as token j (bench/experiments/diag_fusion_oracle.py); the learnt steering map instead makes it predict token j.
        Other rows, and every row with the gate at 0, come back bit for bit."""
        if self.read_steer is None or not bool(has_read.any()) or (not self.training and self.read_gate.detach() == 0):
            return fused
        dtype = self.read_steer[0].weight.dtype
        delta = torch.tanh(self.read_gate) * self.read_steer(read_embeds.to(dtype))
        return torch.where(has_read.unsqueeze(-1), fused + delta.to(fused.dtype), fused)

    def fuse_page(self, embeds: torch.Tensor, boxes: torch.Tensor, patch_feats: torch.Tensor,
                  patch_boxes: torch.Tensor, patch_ink: torch.Tensor | None = None,
                  visual_tokens: bool = True) -> FusedPage:
        """Fuse one page: ``embeds`` [T, H] decoder embeddings of its tokens, ``boxes`` [T, 4] their grid boxes,
        ``patch_feats`` [P, D] ViT features, ``patch_boxes`` [P, 4] grid boxes, ``patch_ink`` [P] ink share."""
        t = embeds.shape[0]
        text_index = torch.arange(t, device=embeds.device)
        if not self.training and self.is_identity:
            return FusedPage(embeds, torch.zeros(t, dtype=torch.bool, device=embeds.device), text_index)
        patches = self.project(patch_feats)
        fused = self.fuse_text(embeds[None], boxes[None], patches[None], patch_boxes)[0]
        return self.with_visual_tokens(fused, boxes, patches, patch_boxes, patch_ink if visual_tokens else None)

    def with_visual_tokens(self, fused: torch.Tensor, boxes: torch.Tensor, patches: torch.Tensor,
                           patch_boxes: torch.Tensor, patch_ink: torch.Tensor | None) -> FusedPage:
        """One page's fused text rows with its visual tokens interleaved (none without ink or with the gate at 0)."""
        t = fused.shape[0]
        if patch_ink is None or (not self.training and self.visual_gate.detach() == 0):
            return FusedPage(fused, torch.zeros(t, dtype=torch.bool, device=fused.device),
                             torch.arange(t, device=fused.device))
        vis, where = self.visual_tokens(boxes, patches, patch_boxes, patch_ink)
        return interleave(fused, vis.to(fused.dtype), where)

    def visual_tokens(self, boxes: torch.Tensor, patches: torch.Tensor, patch_boxes: torch.Tensor,
                      patch_ink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[V, H] pooled tokens of one page's word-free regions with ink, and where each goes in its text stream."""
        c = self.config
        free = uncovered(patch_boxes, boxes)
        win = windows(c.grid_rows, c.grid_cols, patches, free, patch_ink, c.pool, c.max_visual_tokens, c.min_ink)
        tokens = self.visual_marker + torch.tanh(self.visual_gate) * (self.visual_proj(win.pooled)
                                                                      + self.coords(win.boxes))
        return tokens, insertion_points(boxes, win.boxes)


def following(boxes: torch.Tensor) -> torch.Tensor:
    """Each token's next token's box (NO_BOX for the last): where a reader's eye goes next."""
    out = torch.full_like(boxes, -1.0)
    out[:-1] = boxes[1:]
    return out


def interleave(text: torch.Tensor, visual: torch.Tensor, where: torch.Tensor) -> FusedPage:
    """Text rows with visual rows inserted before text index ``where[v]`` (stable: equal points keep order)."""
    t, v = text.shape[0], visual.shape[0]
    if v == 0:
        return FusedPage(text, torch.zeros(t, dtype=torch.bool, device=text.device), torch.arange(t, device=text.device))
    # position of text row i = i + number of visual tokens inserted at or before it
    before = torch.bincount(where.clamp(max=t), minlength=t + 1).cumsum(0)  # [t+1]
    device = text.device
    text_pos = torch.arange(t, device=device) + before[:t]
    order = torch.argsort(where, stable=True)  # the k-th visual token in order goes after k-1 others
    vis_pos = torch.empty(v, dtype=torch.long, device=device)
    vis_pos[order] = where[order] + torch.arange(v, device=device)
    out = text.new_empty((t + v, text.shape[1]))
    out[text_pos] = text
    out[vis_pos] = visual
    is_visual = torch.zeros(t + v, dtype=torch.bool, device=device)
    is_visual[vis_pos] = True
    return FusedPage(out, is_visual, text_pos)
