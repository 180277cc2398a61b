"""Masked-token recovery on held-out pages: the same hidden tokens, read with the trained fusion and text-only.

Text-only is the same fusion with every gate at 0 (exactly the text stream: the hidden tokens stay hidden).
A token counts as recovered when the frozen decoder's top-1 prediction for it is right.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from docfuse.fusion.features import encode
from docfuse.fusion.model import Fusion
from docfuse.fusion.objective import batch_streams, choose_mask
from docfuse.fusion.prepare import Prepared, patch_grid_boxes
from docfuse.fusion.reader import read_tokens


def text_only(fusion: Fusion) -> Fusion:
    """A copy of ``fusion`` with every gate at 0: its stream is the text stream, bit for bit."""
    fusion.cross.read = None  # a training-time activation: not part of the module's state
    off = copy.deepcopy(fusion)
    with torch.no_grad():
        off.cross.attn_gate.zero_()
        off.cross.mlp_gate.zero_()
        off.visual_gate.zero_()
        if off.read_gate is not None:
            off.read_gate.zero_()
    return off.eval()


@torch.no_grad()
def masked_recovery(decoder: Any, vit: Any, fusion: Fusion, pages: Sequence[Prepared], mask_rate: float = 0.15,
                    seed: int = 1234, reader: Any = None, tokenizer: Any = None) -> dict:
    """``{"masked_recovery_fused", "masked_recovery_text_only", "pages", "masked_tokens", ...}`` over ``pages``.

    With a word ``reader`` (and the decoder's ``tokenizer``) the fused stream also carries the read path;
    ``read_top1`` says how often the reader alone named the hidden token, and ``*_without_reads`` give the same
    fusion without its read path (what a stage runs on a complete text layer, where nothing is hidden)."""
    device = next(decoder.parameters()).device
    embed = decoder.get_input_embeddings()
    rows, cols = vit.patch_embed.grid_size
    patch_boxes = patch_grid_boxes(rows, cols).to(device)
    plain = text_only(fusion)
    hits = {"fused": 0, "text_only": 0, "without_reads": 0}
    visible = {"fused": 0, "text_only": 0, "without_reads": 0}
    n_hidden = n_visible = n_pages = read_right = 0
    use_reads = reader is not None and tokenizer is not None and fusion.read_steer is not None
    for i, page in enumerate(p for p in pages if not p.tokens.caption):
        gen = torch.Generator().manual_seed(seed + i)
        mask = choose_mask(page.tokens.boxes, mask_rate, gen)
        if not mask.any():
            continue
        feats = encode(vit, page.pixels.unsqueeze(0))
        ink = page.ink.to(device).unsqueeze(0)
        reads = None
        if use_reads:
            read = read_tokens(reader, tokenizer, page.pixels, page.tokens.ids, page.tokens.boxes, mask)
            read_right += int((read[mask] == page.tokens.ids[mask]).sum())
            reads = [read.to(device)]
        runs = [("fused", fusion, reads), ("text_only", plain, None)] + \
            ([("without_reads", fusion, None)] if use_reads else [])
        for name, f, r in runs:
            out = batch_streams(f, embed, [page.tokens], feats, patch_boxes, ink, [mask.to(device)], reads=r)[0]
            logits = decoder(inputs_embeds=out.stream.embeds.unsqueeze(0).to(embed.weight.dtype)).logits[0]
            right = logits[out.rows].argmax(-1) == out.targets
            hits[name] += int(right[out.hidden].sum())
            visible[name] += int(right[~out.hidden].sum())
            hidden = out.hidden
        n_hidden += int(hidden.sum())
        n_visible += int((~hidden).sum())
        n_pages += 1
    return {
        "masked_recovery_fused": hits["fused"] / max(n_hidden, 1),
        "masked_recovery_text_only": hits["text_only"] / max(n_hidden, 1),
        "visible_top1_fused": visible["fused"] / max(n_visible, 1),
        "visible_top1_text_only": visible["text_only"] / max(n_visible, 1),
        "pages": n_pages,
        "masked_tokens": n_hidden,
        "gates": fusion.gates(),
    } | ({"read_top1": read_right / max(n_hidden, 1),
          "masked_recovery_without_reads": hits["without_reads"] / max(n_hidden, 1),
          "visible_top1_without_reads": visible["without_reads"] / max(n_visible, 1)} if use_reads else {})
