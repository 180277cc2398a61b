"""TieredCache whose decode steps attend through the fused kernel instead of a dequantised copy of the tiers.

Use::

    register_attention()                       # once: adds "docfuse_tiered" to transformers' attention functions
    cache = KernelTieredCache(model.config, kv)
    model.config._attn_implementation = ATTN_NAME

Prefill and multi-token steps behave exactly like :class:`~runtime.kv.tiered.TieredCache` (the attention function
falls back to SDPA over what ``update`` returned). A one-token step appends to the core, skips the dequantisation, and
the attention function reads the layer's tiers directly: the Triton kernel on CUDA, the fp32 reference elsewhere (so
CPU tests cover the same wiring).
"""

from __future__ import annotations

from typing import Any

import torch

from docfuse.runtime.gpu.attention_kernel import HAS_TRITON, kernel_supports, tiered_decode_attention
from docfuse.runtime.gpu.reference import tiered_decode_reference
from docfuse.runtime.kv import code_attention
from docfuse.runtime.kv.layer import TieredLayer
from docfuse.runtime.kv.tiered import TieredCache

ATTN_NAME = "docfuse_tiered"
GRAPH_ATTN_NAME = "docfuse_tiered_graph"


class KernelTieredLayer(TieredLayer):
    """TieredLayer whose one-token update hands the packed tiers to the attention function."""

    fused = True  # False: behave exactly like TieredLayer (dequantise, SDPA), e.g. to compare both paths
    graph_slot: torch.Tensor | None = None  # CUDA-graph decode (runtime.gpu.decode_graph): device write index [1]
    graph_count: torch.Tensor | None = None  # ... and device core length [1] (int32), both shared by all layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if (not self.fused or self.exact_reads or key_states.shape[2] != 1 or not self.is_initialized
                or not kernel_supports(self.assoc, key_states.shape[-1])):
            code_attention.take(self.layer_idx)  # nothing stale is left for this layer's attention call
            return super().update(key_states, value_states, *args, **kwargs)
        code_attention.hand_over(self)
        if self.graph_slot is not None:  # static shapes: write at a device index, counters advance on the device
            self.keys.index_copy_(2, self.graph_slot, key_states)
            self.values.index_copy_(2, self.graph_slot, value_states)
            return self.keys, self.values
        self._append_core(key_states, value_states, torch.arange(self.length, self.length + 1))
        self.length += 1
        return self.keys[:, :, : self.n_core], self.values[:, :, : self.n_core]

    def decode_attention(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of query [B, Hq, 1, D] over this layer's tiers -> [B, 1, Hq, D] (transformers' layout)."""
        q = query[:, :, 0]
        assoc = self.assoc if self.n_assoc else None
        covered = HAS_TRITON and q.is_cuda and kernel_supports(assoc, q.shape[-1])
        if self.graph_count is not None and covered:
            out = tiered_decode_attention(q, self.keys, self.values, self.keys.shape[2], assoc, scale,
                                          core_count=self.graph_count)
        elif self.graph_count is not None:  # static decode off the GPU: nothing is captured, a host read is fine
            out = tiered_decode_reference(q, self.keys, self.values, int(self.graph_count.item()), assoc,
                                          scale).to(q.dtype)
        elif covered:
            out = tiered_decode_attention(q, self.keys, self.values, self.n_core, assoc, scale)
        else:
            out = tiered_decode_reference(q, self.keys, self.values, self.n_core, assoc, scale).to(q.dtype)
        return out.unsqueeze(1)


class KernelTieredCache(TieredCache):
    """:class:`TieredCache` with :class:`KernelTieredLayer` layers; same budgets, tiers and accounting."""

    def __init__(self, config: Any, kv: Any = None) -> None:
        super().__init__(config, kv)
        self.layers = [KernelTieredLayer(self.kv, i) for i in range(len(self.layers))]

    def set_fused(self, fused: bool) -> None:
        """Switch one-token steps between the fused kernel (True) and the dequantising reference path (False)."""
        for layer in self.layers:
            layer.fused = fused


def register_attention() -> str:
    """Register ``runtime.kv.code_attention.attention_forward`` (the handed-over layer's ``decode_attention``, else
    SDPA) with SDPA's mask builder under :data:`ATTN_NAME`; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, code_attention.attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    # The graph variant has no mask builder: transformers then builds no mask (one-token steps need none), so no
    # host-side mask sizes are baked into a captured graph.
    AttentionInterface.register(GRAPH_ATTN_NAME, code_attention.attention_forward)
    return ATTN_NAME
