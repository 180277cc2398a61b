"""The association tier: packed low-bit K/V on the device, optionally as residuals to a per-page anchor.

Differential mode ("the seed's differential encoding") subtracts each page's mean key/value (kept in fp16) before
quantising, so the codes only spend their levels on what differs inside a page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from docfuse.runtime.kv.quant import Quantized, quantize_keys, quantize_values


def _gather_anchor(anchor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(anchor, 2, index.long().unsqueeze(-1).expand(-1, -1, -1, anchor.shape[-1]))


def page_means(x: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """Mean of ``x`` [B, H, T, D] over the tokens of each of ``count`` groups given per token by ``index`` [B, H, T]."""
    b, h, _, d = x.shape
    idx = index.long().unsqueeze(-1).expand(-1, -1, -1, d)
    sums = torch.zeros(b, h, count, d, dtype=torch.float32, device=x.device).scatter_add_(2, idx, x.float())
    counts = torch.zeros(b, h, count, 1, dtype=torch.float32, device=x.device)
    counts.scatter_add_(2, index.long().unsqueeze(-1), torch.ones_like(x[..., :1], dtype=torch.float32))
    return sums / counts.clamp(min=1)


@dataclass
class AssociationStore:
    """Quantised keys and values of the association tokens of one layer (same token order as the cache's index)."""

    keys: Quantized
    values: Quantized
    anchor_k: torch.Tensor | None = None  # fp16 [B, H, pages, D]
    anchor_v: torch.Tensor | None = None
    anchor_index: torch.Tensor | None = None  # int32 [B, H, T]: which anchor each token uses
    #: bool [B, H, T] or None. Set when the store holds every position of a prefix, quantised once in groups aligned
    #: to positions (``TieredLayer``'s fixed codes): the positions attention must skip because the core holds them
    #: exactly. Row ``t`` is then position ``t``.
    hidden: torch.Tensor | None = None

    @classmethod
    def build(cls, k: torch.Tensor, v: torch.Tensor, bits: int, group: int,
              page_ids: torch.Tensor | None = None, key_bits: int | None = None) -> AssociationStore:
        """Quantise ``k``/``v`` [B, H, T, D] (keys to ``key_bits`` when given, else ``bits``); with ``page_ids``
        [B, H, T] quantise residuals to page means.

        ``k`` may already carry the padding of its last quantisation group (T rounded up to ``group`` by repeating
        the last token, as ``quantize_keys`` would add it); ``v`` always has the T tokens alone."""
        kb = key_bits or bits
        t = v.shape[2]
        if k.shape[2] != t and (page_ids is not None or k.shape[2] != t + (-t) % group):
            raise ValueError(f"keys have {k.shape[2]} rows for {t} values: pad them to a multiple of {group} "
                             "(no page anchors), or pass the same tokens")
        if page_ids is None or t == 0:
            return cls(quantize_keys(k, kb, group, length=t), quantize_values(v, bits))
        uniq, inverse = torch.unique(page_ids, return_inverse=True)
        anchor_k = page_means(k, inverse, len(uniq)).to(torch.float16)
        anchor_v = page_means(v, inverse, len(uniq)).to(torch.float16)
        res_k = k.float() - _gather_anchor(anchor_k, inverse).float()
        res_v = v.float() - _gather_anchor(anchor_v, inverse).float()
        return cls(quantize_keys(res_k, kb, group), quantize_values(res_v, bits),
                   anchor_k, anchor_v, inverse.to(torch.int32))

    @property
    def length(self) -> int:
        return self.keys.length

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructed keys and values [B, H, T, D] in ``dtype``."""
        k = self.keys.dequantize(dtype)
        v = self.values.dequantize(dtype)
        if self.anchor_index is not None:
            k = k + _gather_anchor(self.anchor_k, self.anchor_index).to(dtype)
            v = v + _gather_anchor(self.anchor_v, self.anchor_index).to(dtype)
        return k, v

    def dequantize_into(self, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Reconstruct keys and values into the views ``k_out``/``v_out`` [B, H, T, D] (decode path)."""
        self.keys.dequantize_into(k_out)
        self.values.dequantize_into(v_out)
        if self.anchor_index is not None:
            k_out += _gather_anchor(self.anchor_k, self.anchor_index).to(k_out.dtype)
            v_out += _gather_anchor(self.anchor_v, self.anchor_index).to(v_out.dtype)

    def nbytes(self) -> int:
        """Device bytes: codes, scales, zeros, (differential) anchors with their per-token index, the hidden mask."""
        extra = [t for t in (self.anchor_k, self.anchor_v, self.anchor_index, self.hidden) if t is not None]
        return self.keys.nbytes() + self.values.nbytes() + sum(t.numel() * t.element_size() for t in extra)
