"""TieredCache: a transformers Cache whose device holds only what the current question needs.

Lifecycle: prefill the document (chunks allowed; tokens enter the core exactly, so prefill is exact), optionally
``set_pages`` with the document's page spans, then ``retier`` for a question (``runtime.kv.queries.prepare_question``
does record-queries -> rollback -> retier in one call). Decode appends to the core. A later question re-tiers the same
cache without a second prefill; ``rollback(length)`` removes the question and answer tokens again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.generation import StoppingCriteria

from docfuse.runtime.kv.config import KVConfig, auto_core_tokens, resolve_budget
from docfuse.runtime.kv.layer import TieredLayer
from docfuse.runtime.kv.summaries import PageTable

#: Page-score reduction over a question's queries (see summaries.page_scores); chosen by measurement.
SCORE_REDUCE = "softmax"


def as_kv_config(kv: KVConfig | dict[str, Any] | None) -> KVConfig:
    """Validate a ``kv:`` block (dict from YAML, or a KVConfig)."""
    if isinstance(kv, KVConfig):
        return kv
    return KVConfig.model_validate(kv or {})


class TieredCache(Cache):
    """Three-tier KV cache for Llama-family (full-attention) decoders.

    Args:
        config: the model's config (its text config gives layers and KV heads).
        kv: a :class:`KVConfig` or the dict of the ``kv:`` block; ``None`` means the defaults.
    """

    def __init__(self, config: Any, kv: KVConfig | dict[str, Any] | None = None) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.kv = as_kv_config(kv)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
            raise ValueError("TieredCache supports full-attention decoders only; this model uses sliding windows")
        super().__init__(layers=[TieredLayer(self.kv, i) for i in range(text.num_hidden_layers)])
        self.pages = PageTable(self.kv.page_tokens)
        self.retiered_at = 0  # length at the last re-tier
        self.retiers = 0
        self.peak_device = 0  # largest device_bytes() seen after a forward pass or a re-tier
        #: (core, association) fixed for a layer-by-layer fill (runtime.layer_prefill): every layer must get the
        #: same sizes even when ``core_tokens: auto`` sees free memory change between layers.
        self.pinned_budgets: tuple[int, int] | None = None
        self._retier_from: int | None = None  # set by exact_view(retier_from=...): re-tier each layer as it reads
        self._retiered_layers = 0
        #: set by exact_view(select_queries=...): picks, from a pass's recorded queries, those that rank the tiers
        self._select_queries: Any = None
        #: queries each layer keeps while recording (``None``: ``kv.query_tokens``); a pass of several questions
        #: keeps all of its tokens' and picks each question's own
        self.record_limit: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache.update, plus peak tracking once the last layer has appended."""
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self._retier_from is not None:
            # exact_view(retier_from=...): this layer has just read every position exactly for the question; re-tier
            # it now from that read and the question's queries at this layer, instead of reading the archive again
            # after the pass. The attention of this pass uses ``out``, which the re-tier leaves alone.
            layer = self.layers[layer_idx]
            queries = layer.take_queries()
            if self._select_queries is not None and queries is not None:
                queries = self._select_queries(queries)
            with layer.serving(*out):
                self.retier_layer(layer_idx, queries, self._retier_from)
            self._retiered_layers += 1
        if layer_idx == len(self.layers) - 1:
            self.peak_device = max(self.peak_device, self.device_bytes())
        return out

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Append K/V to a layer without attending: what a skipped attention block writes (runtime.pruning)."""
        self.layers[layer_idx].store(key_states, value_states)
        if layer_idx == len(self.layers) - 1:
            self.peak_device = max(self.peak_device, self.device_bytes())

    # ---- pages and queries ---------------------------------------------------------------------------------------
    def set_pages(self, spans: Sequence[tuple[int, int]]) -> None:
        """Score by these token spans (e.g. one per document page); positions outside them use fixed blocks."""
        self.pages = PageTable(self.kv.page_tokens, spans)
        for layer in self.layers:
            layer.truncate_summaries(0)

    def record_query(self, layer_idx: int, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Called by :func:`runtime.kv.queries.record_queries` for each layer of each recorded forward."""
        self.layers[layer_idx].record_query(queries, positions, self.record_limit or self.kv.query_tokens)

    def take_queries(self) -> list[torch.Tensor | None]:
        """Recorded queries per layer, removed from the cache."""
        return [layer.take_queries() for layer in self.layers]

    @contextmanager
    def exact_view(self, retier_from: int | None = None, select_queries: Any = None) -> Iterator[None]:
        """While active, attention reads every cached position at full precision (one layer at a time, read back
        from the archive): a question read this way has the full cache's hidden states, queries and first token.

        ``retier_from``: also re-tier each layer for the pass's queries as soon as it has read, keeping positions
        from ``retier_from`` on in the core; one archive read per layer serves the question and its re-tier (the
        pass must record queries: ``runtime.kv.queries.record_queries``). ``select_queries``: maps a layer's recorded
        queries [B, Hq, M, D] to those the re-tier ranks by (several questions read in one pass: each one's own)."""
        for layer in self.layers:
            layer.exact_reads = True
        self._retier_from, self._retiered_layers = retier_from, 0
        self._select_queries = select_queries
        try:
            yield
        finally:
            for layer in self.layers:
                layer.exact_reads = False
            if self._retier_from is not None and self._retiered_layers:
                self._retiered()
            self._retier_from = self._select_queries = None

    # ---- tiering -------------------------------------------------------------------------------------------------
    def budgets(self, length: int | None = None) -> tuple[int, int]:
        """(core, association) token counts per layer and head for ``length`` cached tokens."""
        length = self.get_seq_length() if length is None else length
        if self.pinned_budgets is not None:
            return self.pinned_budgets
        layer = next((l for l in self.layers if l.is_initialized), self.layers[0])
        if self.kv.core_tokens == "auto":
            # every layer is the same size; counted from one, so the answer does not depend on how many are filled
            per_token = layer.token_bytes() * len(self.layers)
            core = auto_core_tokens(layer.device, per_token, length)
        else:
            core = resolve_budget(self.kv.core_tokens, length)
        forced = min(length, self.kv.sink_tokens + self.kv.recent_tokens)
        core = min(length, max(core, forced))
        assoc = min(length - core, resolve_budget(self.kv.association_tokens, length))
        return core, assoc

    def retier(self, queries: Sequence[torch.Tensor | None] | None = None, keep_from: int | None = None,
               exact: bool = False) -> dict[str, int]:
        """Assign every cached token to a tier for the current question; no prefill, nothing dropped.

        ``queries``: per layer, post-RoPE query vectors [B, Hq, M, D] of the question (from ``take_queries``);
        ``None`` uses queries recorded in the cache, or else the newest core keys as a stand-in.
        ``keep_from``: positions from here on stay in the core (the question's own tokens, already in the cache).
        ``exact``: each layer re-tiers with every position's exact K/V at hand, as a question's exact pass does
        inside it (``exact_view(retier_from=keep_from)``): for a pass that only read (``read_question(...,
        retier=False)``), whose tiers then come out the same bit for bit.
        Returns the token counts per tier (per layer and head).
        """
        length = self.get_seq_length()
        if length == 0:
            return self.tier_tokens()
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                with layer.reading_all() if exact else nullcontext():
                    self.retier_layer(i, queries[i] if queries is not None else layer.queries, keep_from)
        self._retiered()
        return self.tier_tokens()

    def _retiered(self) -> None:
        """Book a finished re-tier of every layer (by ``retier`` or inside a question's exact pass)."""
        self.retiered_at = self.get_seq_length()
        self.retiers += 1
        self.peak_device = max(self.peak_device, self.device_bytes())

    def retier_layer(self, layer_idx: int, queries: torch.Tensor | None, keep_from: int | None = None) -> None:
        """Re-tier one layer (``retier`` does every layer; the layer-major prefill does each as soon as it is full).

        ``queries``: post-RoPE query vectors [B, Hq, M, D], or ``None`` for the newest core keys as a stand-in.
        ``keep_from``: as in ``retier``.
        """
        layer = self.layers[layer_idx]
        length = layer.get_seq_length()
        core, assoc = self.budgets(length)
        starts = self.pages.starts(length)
        page_ids = self.pages.page_ids(length)
        forced = torch.zeros(length, dtype=torch.bool)
        forced[: self.kv.sink_tokens] = True
        recent = self.kv.recent_tokens if keep_from is None else max(self.kv.recent_tokens, length - keep_from)
        forced[max(0, length - recent):] = True
        core = min(length, max(core, int(forced.sum())))
        assoc = min(assoc, length - core)
        layer._archive_all(keep_from)
        candidates = resolve_budget(self.kv.candidate_tokens, length)
        # Every token scored exactly: one read of the archive serves the summaries, the votes and the rebuild.
        once = layer.reading_all() if self.kv.scoring == "tokens" and candidates >= length else nullcontext()
        with once:
            layer.refresh_summaries(starts, page_ids)
            if self.kv.scoring == "tokens":
                priority = layer.vote_priority(queries, self.kv_heads, page_ids, candidates, SCORE_REDUCE)
            else:
                page_score = layer.scores(queries, self.kv_heads, SCORE_REDUCE).cpu()
                priority = page_score.gather(2, page_ids.expand(*page_score.shape[:2], -1)).double()
            priority[:, :, forced.to(priority.device)] = float("inf")
            layer.rebuild(priority, core, assoc, page_ids, keep_from=keep_from)

    def append_read(self, read: Any) -> None:
        """Put a question's own K/V (a :class:`~runtime.kv.queries.QuestionRead`, read exactly before the shared
        re-tier) behind the tiers, as if the question had just been read: its answer decodes from here."""
        if len(read.keys) != len(self.layers):
            raise ValueError(f"the question was read by a model of {len(read.keys)} layers, this cache has "
                             f"{len(self.layers)}")
        for layer, k, v in zip(self.layers, read.keys, read.values):
            layer.store(k, v)
        self.peak_device = max(self.peak_device, self.device_bytes())

    def start_decode(self) -> None:
        """Count ``retier_every`` in decode steps from here (the question's suffix does not count)."""
        self.retiered_at = self.get_seq_length()

    def maybe_retier(self) -> bool:
        """Re-tier when ``retier_every`` tokens were added since the last re-tier; call between decode steps.

        Inside ``record_queries`` (as ``Session`` runs a decode with ``retier_every`` set) the ranking uses the
        newest recorded queries: the question's and then the answer's own, so the tokens the answer is reading
        from move into the core; otherwise the newest core keys stand in for queries.
        """
        every = self.kv.retier_every
        if every is None or self.get_seq_length() - self.retiered_at < every:
            return False
        self.retier()
        return True

    def rollback(self, length: int) -> None:
        """Forget every token at position ``>= length`` (e.g. a question and its answer), in all tiers."""
        length = max(0, int(length))
        if length >= self.get_seq_length():
            return
        final_pages = max(0, len(self.pages.starts(length)) - 1)
        page_ids = self.pages.page_ids(length)
        for layer in self.layers:
            layer.truncate(length, page_ids, final_pages)
        self.retiered_at = min(self.retiered_at, length)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: negative = remove that many tokens from the end (see ``rollback``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count, or use rollback(length)")
        self.rollback(self.get_seq_length() + tokens_to_remove)

    # ---- inspection and accounting -------------------------------------------------------------------------------
    def tier_tokens(self) -> dict[str, int]:
        """Tokens per tier, per layer and KV head (equal across layers and heads)."""
        layer = self.layers[0]
        length = layer.get_seq_length()
        return {"core": layer.n_core, "association": layer.n_assoc,
                "background": length - layer.n_core - layer.n_assoc, "total": length}

    def membership(self, layer_idx: int) -> torch.Tensor:
        """Tier of each position [B, H_kv, length]: 0 core, 1 association, 2 background."""
        return self.layers[layer_idx].membership()

    def tier_bytes(self) -> dict[str, int]:
        """Bytes per tier summed over layers: core, association, summaries (device), background_host, index_host."""
        total: dict[str, int] = {}
        for layer in self.layers:
            if layer.is_initialized:
                for key, value in layer.bytes_by_tier().items():
                    total[key] = total.get(key, 0) + value
        return total or {"core": 0, "association": 0, "summaries": 0, "background_host": 0, "index_host": 0}

    def device_bytes(self) -> int:
        """KV bytes on the compute device: core + association + page summaries (checked after every forward, so it
        leaves the host archive alone)."""
        return sum(layer.device_bytes() for layer in self.layers if layer.is_initialized)

    def host_bytes(self) -> int:
        """KV bytes in host memory: the compressed exact archive plus tier bookkeeping."""
        t = self.tier_bytes()
        return t["background_host"] + t["index_host"]

    def full_bytes(self) -> int:
        """What a DynamicCache would hold for the same tokens."""
        return sum(layer.token_bytes() * layer.get_seq_length() for layer in self.layers if layer.is_initialized)

    def accounting(self) -> dict[str, int]:
        """The per-row metrics of the decode stage: kv_device_bytes, kv_host_bytes, kv_full_bytes, and the KV peak
        on the device (the prefill, before the first re-tier, usually sets it)."""
        return {"kv_device_bytes": self.device_bytes(), "kv_host_bytes": self.host_bytes(),
                "kv_full_bytes": self.full_bytes(), "kv_peak_device_bytes": self.peak_device}


class RetierOnSchedule(StoppingCriteria):
    """Hands ``generate`` a between-steps hook: re-tiers the cache every ``retier_every`` tokens, never stops.

    Use ``model.generate(..., cache=cache, stopping_criteria=StoppingCriteriaList([RetierOnSchedule(cache)]))``.
    Re-tiering must happen between forward passes (the causal mask is sized before the first layer runs).
    """

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.cache.maybe_retier()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def make_cache(config: Any, kv: KVConfig | dict[str, Any] | None) -> Cache:
    """The cache a ``kv:`` block asks for: ``None`` -> a plain DynamicCache; ``method: evict`` -> the SnapKV-style
    baseline; else a :class:`TieredCache`."""
    if kv is None:
        from transformers import DynamicCache

        return DynamicCache(config=config)
    kv = as_kv_config(kv)
    if kv.method == "evict":
        from docfuse.runtime.kv.eviction import SnapKVCache

        return SnapKVCache(config, kv.core_tokens, window_tokens=kv.query_tokens, kernel=kv.vote_pool)
    return TieredCache(config, kv)
