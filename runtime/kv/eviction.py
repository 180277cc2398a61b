"""SnapKV-style eviction baseline: keep the tokens the question's window attends to most, drop the rest.

For the benchmark against the tiered cache at the same device budget. After prefill, the queries of an observation
window (the question suffix, recorded like the tiered cache's) vote with their attention weights over the cached
tokens, per KV head (summed over its query heads); votes are smoothed by an average pool so neighbours of a hit
survive, and the top tokens are kept. Dropped tokens are gone for every later question: that is the point of the
comparison. Layout and masking follow the tiered cache: kept tokens first, new ones last, ``kv_offset`` = dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from docfuse.runtime.kv.config import resolve_budget
from docfuse.runtime.kv.summaries import group_queries
from docfuse.runtime.kv.votes import token_votes


class SnapKVLayer(CacheLayerMixin):
    """One layer: the kept tokens, exact, with their positions."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.positions: torch.Tensor | None = None  # host [B, H, n], ascending
        self.queries: torch.Tensor | None = None
        self.query_pos: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = key_states.new_empty(b, h, 0, d), value_states.new_empty(b, h, 0, d)
        self.positions = torch.empty(b, h, 0, dtype=torch.long)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        new = torch.arange(self.length, self.length + q).expand(b, h, -1)
        self.positions = torch.cat([self.positions, new], dim=2)
        self.length += q
        return self.keys, self.values

    @property
    def kept(self) -> int:
        return self.keys.shape[2] if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kept + query_length, self.length - self.kept

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count, or use rollback(length)")
        self.truncate(self.length + tokens_to_remove)

    def truncate(self, length: int) -> None:
        """Forget positions ``>= length``; the kept set stays the same size in every head (tokens past the
        observation window start are never evicted), otherwise the extra newest ones go too."""
        if not self.is_initialized or length >= self.length:
            return
        keep = (self.positions < length).sum(dim=-1)
        n = int(keep.min())
        self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        self.positions = self.positions[:, :, :n]
        self.length = length
        if self.queries is not None:
            mask = self.query_pos < length
            self.queries, self.query_pos = self.queries[:, :, mask.to(self.device)], self.query_pos[mask]

    def reset(self) -> None:
        self.__init__()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            dev = indices.to(self.device)
            self.keys, self.values = self.keys[dev], self.values[dev]
            self.positions = self.positions[indices.to("cpu")]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def record_query(self, queries: torch.Tensor, positions: torch.Tensor, limit: int) -> None:
        if self.queries is not None and self.queries.shape[0] == queries.shape[0]:
            queries = torch.cat([self.queries, queries], dim=2)
            positions = torch.cat([self.query_pos, positions])
        self.queries, self.query_pos = queries[:, :, -limit:], positions[-limit:]

    def votes(self, queries: torch.Tensor, query_pos: torch.Tensor, kernel: int) -> torch.Tensor:
        """Pooled attention mass [B, H, n] the observation queries give each kept token (causal)."""
        hq, h = queries.shape[1], self.keys.shape[1]
        qpos = query_pos.repeat(hq // h).to(self.device).view(1, 1, -1, 1)  # the order group_queries lays out
        causal = self.positions.to(self.device).unsqueeze(2) <= qpos
        return token_votes(group_queries(queries, h), self.keys, causal, kernel)

    def evict(self, keep_idx: torch.Tensor) -> None:
        """Keep the entries ``keep_idx`` [B, H, k] (ascending)."""
        d = self.keys.shape[-1]
        idx = keep_idx.to(self.device).unsqueeze(-1).expand(-1, -1, -1, d)
        self.keys, self.values = self.keys.gather(2, idx), self.values.gather(2, idx)
        self.positions = self.positions.gather(2, keep_idx)


class SnapKVCache(Cache):
    """Eviction baseline with the same call pattern as TieredCache (``retier`` evicts).

    Args:
        config: the model's config.
        budget_tokens: tokens kept per layer and head (int) or a fraction of the length at eviction time.
        window_tokens: observation window (recorded queries kept per layer).
        kernel: average-pool width over the votes.
    """

    def __init__(self, config: Any, budget_tokens: int | float, window_tokens: int = 64, kernel: int = 7) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must not be negative, got {budget_tokens}")
        self.budget_tokens, self.window_tokens, self.kernel = budget_tokens, window_tokens, kernel
        super().__init__(layers=[SnapKVLayer() for _ in range(text.num_hidden_layers)])

    def record_query(self, layer_idx: int, queries: torch.Tensor, positions: torch.Tensor) -> None:
        self.layers[layer_idx].record_query(queries, positions, self.window_tokens)

    def take_queries(self) -> list[torch.Tensor | None]:
        out = []
        for layer in self.layers:
            out.append(None if layer.queries is None else (layer.queries, layer.query_pos))
            layer.queries = layer.query_pos = None
        return out

    def retier(self, queries: Sequence[Any] | None = None) -> dict[str, int]:
        """Evict down to the budget using the observation window's attention; tokens newer than the window's start
        (when the window is in the cache) are always kept."""
        length = self.get_seq_length()
        budget = resolve_budget(self.budget_tokens, length)
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized or layer.kept <= budget:
                continue
            entry = queries[i] if queries is not None else (layer.queries, layer.query_pos)
            if entry is None or entry[0] is None:  # no recorded queries: the newest keys stand in
                m = min(self.window_tokens, layer.kept)
                q, qpos = layer.keys[:, :, -m:], layer.positions[0, 0, -m:]
            else:
                q, qpos = entry
            window_start = int(qpos.min())
            mass = layer.votes(q, qpos, self.kernel)
            protected = layer.positions.to(mass.device) >= window_start
            keep = max(budget, int(protected.sum(dim=-1).max()))
            mass = mass.masked_fill(protected, math.inf)
            keep_idx = mass.topk(keep, dim=-1).indices.sort(dim=-1).values.cpu()
            layer.evict(keep_idx)
        return {"kept": self.layers[0].kept, "total": length}

    def maybe_retier(self) -> bool:
        """Sessions call this between decode steps; eviction never re-tiers."""
        return False

    def rollback(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count, or use rollback(length)")
        self.rollback(self.get_seq_length() + tokens_to_remove)

    def device_bytes(self) -> int:
        return sum(l.keys.numel() * l.keys.element_size() * 2 for l in self.layers if l.is_initialized)

    def full_bytes(self) -> int:
        return sum(l.keys.shape[0] * l.keys.shape[1] * l.keys.shape[3] * l.keys.element_size() * 2 * l.length
                   for l in self.layers if l.is_initialized)

    def accounting(self) -> dict[str, int]:
        return {"kv_device_bytes": self.device_bytes(), "kv_host_bytes": 0, "kv_full_bytes": self.full_bytes()}
