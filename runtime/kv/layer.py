"""One layer of the tiered cache: core (exact, device), association (packed codes, device), background (host).

Every position ``[0, length)`` lives in exactly one tier per (batch row, KV head). The core and association tiers
hold the same number of tokens in every head and every layer, so the tensors handed to attention are dense and one
causal mask serves all layers: attention sees ``[association..., core...]`` where the core ends with the tokens of
the current forward pass, and ``get_mask_sizes`` reports ``kv_offset = length - active`` so the causal comparison
``kv_index + kv_offset <= query_position`` admits every cached token and keeps the new ones causal. Attention is
invariant to the order of cached keys (RoPE was applied before caching), so tiers may be laid out per head.

The background archive holds an exact copy of every token older than the last re-tier (not only background ones):
promotion and re-quantisation then always start from exact values, and a demotion costs no compression work.

Fixed codes (on the host, when the association takes every token the core does not, without page anchors): the
association is quantised once per document, over every position of the prefix in groups aligned to positions, and a
later question's re-tier only chooses its core: the core's positions are hidden in the codes (attention skips them)
instead of every other token being quantised again. A question's re-tier then costs its votes and the core's rows,
not a pass over the whole document (bench/RESULTS.md, issue 29). The codes of the core's positions stay on the
device too (a tenth more codes at the default budgets).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import CacheLayerMixin

from docfuse.runtime.kv import code_attention
from docfuse.runtime.kv.association import AssociationStore
from docfuse.runtime.kv.background import ExactArchive, read_blocks_into
from docfuse.runtime.kv.config import KVConfig
from docfuse.runtime.kv.summaries import group_queries, page_minmax, page_scores
from docfuse.runtime.kv.votes import nominate, token_votes

ARCHIVE_BLOCK = 256
#: Re-tier on the device when every exact key is at hand (the on-device branches of ``vote_priority`` and
#: ``rebuild``); False takes the general path (tests compare the two).
ALL_ON_DEVICE = True
#: Quantise the association once per document and hide the core's positions in it (see the module docstring); False
#: quantises the non-core tokens again at every re-tier (tests compare the two).
FIXED_CODES = True


def _expand(index: torch.Tensor, d: int, device: torch.device) -> torch.Tensor:
    return index.to(device).unsqueeze(-1).expand(-1, -1, -1, d)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, T, D] at ``index`` [B, H, N] along T: ``x.gather(2, index expanded)``, as one ``index_select`` of
    whole rows when the rows are contiguous (several times faster than gather on the host, same values)."""
    b, h, _, d = x.shape
    s0, s1, s2, s3 = x.stride()
    if s3 != 1 or s2 != d or s1 % d or s0 % d or x.numel() == 0 or index.numel() == 0:
        return x.gather(2, _expand(index, d, x.device))
    base = (torch.arange(b) * (s0 // d)).view(b, 1, 1) + (torch.arange(h) * (s1 // d)).view(1, h, 1)
    flat = (index.to(x.device) + base.to(x.device)).flatten()
    rows = (b - 1) * (s0 // d) + (h - 1) * (s1 // d) + x.shape[2]
    table = x.as_strided((rows, d), (d, 1), x.storage_offset())
    return table.index_select(0, flat).view(b, h, index.shape[2], d)


def _put_rows(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``x.scatter_(2, index expanded, src)`` for ``x`` [B, H, T, D] contiguous and ``src`` [B, H, N, D]: whole rows
    copied by one ``index_copy_`` (on the host 3-10x faster than scatter, same values; where ``index`` repeats a row,
    one of its sources lands there, as with scatter)."""
    b, h, t, d = x.shape
    if not x.is_contiguous() or index.numel() == 0:
        x.scatter_(2, _expand(index, d, x.device), src)
        return
    base = (torch.arange(b * h) * t).view(b, h, 1).to(x.device)
    x.view(b * h * t, d).index_copy_(0, (index.to(x.device) + base).flatten(), src.reshape(b * h * index.shape[2], d))


def _page_rank(per_page: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Each position's place [B, H, T] in a stable ascending sort of its page's score, from ``per_page`` [B, H, P]
    and the positions' pages ``page_ids`` [T] (ascending: pages are runs of positions).

    The same numbers as a stable argsort of the argsort of the per-position scores, with the sorts over pages
    instead of positions: equal scores keep position order, and a page's positions all precede the next page's."""
    b, h, p = per_page.shape
    sizes = torch.bincount(page_ids, minlength=p)
    starts = sizes.cumsum(0) - sizes
    order = torch.argsort(per_page, dim=-1, stable=True)
    ranked = sizes[order]
    offset = torch.empty_like(order).scatter_(2, order, ranked.cumsum(-1) - ranked)
    inside = torch.arange(page_ids.shape[0], device=page_ids.device) - starts[page_ids]
    return offset.gather(2, page_ids.expand(b, h, -1)) + inside


def _top_mask(priority: torch.Tensor, k: int) -> torch.Tensor:
    """Mask [B, H, T] of the ``k`` highest priorities per row, ties to the earlier position: the first ``k`` of a
    stable descending sort, as a set. A partial selection (top-k, then the ties at the k-th value) instead of the
    sort: 0.2 vs 0.9 ms a layer at 6K positions on the host, where the sort was a quarter of a later question's
    re-tier."""
    if k == 0:
        return torch.zeros_like(priority, dtype=torch.bool)
    kth = torch.topk(priority, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, at = priority > kth, priority == kth
    return above | (at & (at.cumsum(-1) <= k - above.sum(-1, keepdim=True)))


def _ascending(chosen: torch.Tensor, length: int) -> torch.Tensor:
    """The positions ``chosen`` [B, H, N] (distinct per row) sorted ascending. On the host a mask and ``nonzero``
    beat a sort; on an accelerator the sort stays (``nonzero`` would wait for the device)."""
    if chosen.device.type != "cpu" or chosen.shape[2] == 0:
        return chosen.sort(dim=-1).values
    b, h, n = chosen.shape
    mask = torch.zeros(b, h, length, dtype=torch.bool).scatter_(2, chosen, True)
    return mask.view(b * h, length).nonzero()[:, 1].view(b, h, n)


class TieredLayer(CacheLayerMixin):
    """Cache of one attention layer; see the module docstring for the layout."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    #: One-token steps hand the packed tiers to ``code_attention.attention_forward`` instead of dequantising them
    #: (set by ``code_attention.reading_codes`` while the model's attention is that function).
    read_codes = False
    #: While set (``TieredCache.exact_view``), attention reads every cached position at full precision, in position
    #: order: the core, plus the association and background tokens read back exactly from the archive.
    exact_reads = False
    #: Whether this layer may keep fixed codes (see the module docstring); the GPU engine's page pool copies compact
    #: association tiers, so it turns them off for the caches it prefills.
    fixed_codes = True
    #: Exact K/V of every position while ``reading_all`` is active; ``_materialize`` serves every request from it.
    _all: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, kv: KVConfig, layer_idx: int) -> None:
        super().__init__()
        self.kv = kv
        self.layer_idx = layer_idx
        self.length = 0
        self.n_core = 0
        self.core_pos: torch.Tensor | None = None  # host int64 [B, H, capacity], ascending in [:n_core]
        self.assoc: AssociationStore | None = None
        self.assoc_pos: torch.Tensor | None = None  # host int64 [B, H, A], ascending
        self.archive = ExactArchive(codec=kv.background, block_tokens=ARCHIVE_BLOCK)
        self.kmin: torch.Tensor | None = None  # device [B, H, pages, D]
        self.kmax: torch.Tensor | None = None
        self.final_pages = 0  # leading pages whose summaries are complete
        self.queries: torch.Tensor | None = None  # device [B, Hq, M, D], post-RoPE
        self.query_pos: torch.Tensor | None = None  # host int64 [M]
        self._codes_stale = False  # fixed codes cut by a rollback below their prefix: make them again at a re-tier

    # ---- transformers layer API ------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states.new_empty(b, h, 0, d)
        self.values = value_states.new_empty(b, h, 0, d)
        self.core_pos = torch.empty(b, h, 0, dtype=torch.long)
        self.is_initialized = True

    @property
    def n_assoc(self) -> int:
        return self.assoc_pos.shape[-1] if self.assoc is not None else 0

    @property
    def active(self) -> int:
        """Tokens attention reads besides the new ones: core + association."""
        return self.n_core + self.n_assoc

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens to the core and return association (dequantised) + core.

        Under ``exact_reads``: every earlier position exactly, in position order, then the new tokens."""
        if self.exact_reads:
            return self._exact_update(key_states, value_states)
        self.store(key_states, value_states)
        core_k, core_v = self.keys[:, :, : self.n_core], self.values[:, :, : self.n_core]
        if self.n_assoc == 0:
            return core_k, core_v
        if self.read_codes and key_states.shape[2] == 1 and code_attention.supports(self.assoc):
            code_attention.hand_over(self)  # attention reads the codes; what is returned here goes unused
            return core_k, core_v
        # One buffer [association | core]: the codes are expanded straight into its front, the core copied behind.
        a = self.n_assoc
        b, h, c, d = core_k.shape
        out_k, out_v = core_k.new_empty(b, h, a + c, d), core_v.new_empty(b, h, a + c, d)
        if self.assoc.hidden is None:
            self.assoc.dequantize_into(out_k[:, :, :a], out_v[:, :, :a])
        else:  # fixed codes: every position of the prefix is coded; hand attention the association's rows only
            all_k, all_v = self.assoc.dequantize(core_k.dtype)
            out_k[:, :, :a] = _rows(all_k, self.assoc_pos)
            out_v[:, :, :a] = _rows(all_v, self.assoc_pos)
        out_k[:, :, a:].copy_(core_k)
        out_v[:, :, a:].copy_(core_v)
        return out_k, out_v

    def _exact_update(self, key_states: torch.Tensor, value_states: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens in the core; return the exact K/V of all ``[0, length)`` plus the new tokens."""
        if not self.is_initialized or self.length == 0:
            self.store(key_states, value_states)
            return self.keys[:, :, : self.n_core], self.values[:, :, : self.n_core]
        b, h = key_states.shape[:2]
        past_k, past_v = self._materialize(torch.ones(b, h, self.length, dtype=torch.bool))
        self.store(key_states, value_states)
        return torch.cat([past_k, key_states], dim=2), torch.cat([past_v, value_states], dim=2)

    def decode_attention(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of a handed-over one-token step, query [B, Hq, 1, D], over the packed tiers -> [B, 1, Hq, D]."""
        out = code_attention.code_attention(query[:, :, 0], self.keys, self.values, self.n_core, self.assoc, scale)
        return out.to(query.dtype).unsqueeze(1)

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append the new tokens to the core without reading anything back (a skipped attention block)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self._append_core(key_states, value_states, torch.arange(self.length, self.length + q))
        self.length += q

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.exact_reads:
            return self.length + query_length, 0
        return self.active + query_length, self.length - self.active

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: a negative count removes that many tokens from the end."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count, or use rollback(length)")
        if tokens_to_remove:
            self.truncate(self.length + tokens_to_remove)

    def reset(self) -> None:
        self.__init__(self.kv, self.layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep/reorder batch rows in every tier."""
        if not self.is_initialized:
            return
        dev, host = indices.to(self.device), indices.to("cpu")
        self.keys, self.values = self.keys[dev], self.values[dev]
        self.core_pos = self.core_pos[host]
        if self.assoc is not None:
            self.assoc = self._select_assoc(dev)
            self.assoc_pos = self.assoc_pos[host]
        if self.kmin is not None:
            self.kmin, self.kmax = self.kmin[dev], self.kmax[dev]
        if self.queries is not None:
            self.queries = self.queries[dev]
        self.archive.select_batch(host)

    def _select_assoc(self, dev: torch.Tensor) -> AssociationStore:
        a = self.assoc
        for quant in (a.keys, a.values):
            quant.codes, quant.scale, quant.zero = quant.codes[dev], quant.scale[dev], quant.zero[dev]
        if a.anchor_index is not None:
            a.anchor_k, a.anchor_v, a.anchor_index = a.anchor_k[dev], a.anchor_v[dev], a.anchor_index[dev]
        if a.hidden is not None:
            a.hidden = a.hidden[dev]
        return a

    # ---- core storage --------------------------------------------------------------------------------------------
    def _append_core(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        b, h, q, d = k.shape
        need = self.n_core + q
        if need > self.keys.shape[2]:
            capacity = need if self.n_core == 0 else need + max(64, need // 8)
            self.keys = self._grow(self.keys, capacity)
            self.values = self._grow(self.values, capacity)
            pos = torch.empty(b, h, capacity, dtype=torch.long)
            pos[:, :, : self.n_core] = self.core_pos[:, :, : self.n_core]
            self.core_pos = pos
        self.keys[:, :, self.n_core: need] = k
        self.values[:, :, self.n_core: need] = v
        self.core_pos[:, :, self.n_core: need] = positions
        self.n_core = need

    def _grow(self, buf: torch.Tensor, capacity: int) -> torch.Tensor:
        b, h, _, d = buf.shape
        out = buf.new_empty(b, h, capacity, d)
        out[:, :, : self.n_core] = buf[:, :, : self.n_core]
        return out

    def _set_core(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        self.keys, self.values = k.contiguous(), v.contiguous()
        self.core_pos = positions.clone()
        self.n_core = positions.shape[2]

    # ---- queries -------------------------------------------------------------------------------------------------
    def record_query(self, queries: torch.Tensor, positions: torch.Tensor, limit: int) -> None:
        """Keep the last ``limit`` recorded query vectors with their positions."""
        if self.queries is not None and self.queries.shape[0] == queries.shape[0]:
            queries = torch.cat([self.queries, queries], dim=2)
            positions = torch.cat([self.query_pos, positions])
        self.queries, self.query_pos = queries[:, :, -limit:], positions[-limit:]

    def take_queries(self) -> torch.Tensor | None:
        queries, self.queries, self.query_pos = self.queries, None, None
        return queries

    # ---- exact values ------------------------------------------------------------------------------------------
    def _archive_all(self, upto: int | None = None) -> None:
        """Archive positions ``[archive.length, upto)`` (default: every position); they are in the core of every
        head. Positions from ``upto`` on stay unarchived, so they must stay in the core (a question's own tokens,
        which a rollback removes anyway)."""
        start, end = self.archive.length, self.length if upto is None else min(upto, self.length)
        if start >= end:
            return
        positions = torch.arange(start, end)
        core_pos = self.core_pos[:, :, : self.n_core].contiguous()
        b, h, _ = core_pos.shape
        idx = torch.searchsorted(core_pos, positions.expand(b, h, -1).contiguous()).clamp(max=self.n_core - 1)
        if not torch.equal(core_pos.gather(2, idx), positions.expand(b, h, -1)):
            raise RuntimeError("tiered cache invariant broken: an unarchived token is missing from the core")
        d = self.keys.shape[-1]
        gather = _expand(idx, d, self.device)
        self.archive.append(self.keys[:, :, : self.n_core].gather(2, gather),
                            self.values[:, :, : self.n_core].gather(2, gather))

    @contextmanager
    def reading_all(self) -> Iterator[None]:
        """Within, every ``_materialize`` is served from one exact read of all positions: a re-tier that scores
        every token exactly then reads the archive once instead of once per step (summaries, votes, rebuild)."""
        if self._all is not None:  # inside ``serving``: the read is already here
            yield
            return
        b, h = self.core_pos.shape[:2]
        with self.serving(*self._materialize(torch.ones(b, h, self.length, dtype=torch.bool))):
            yield

    @contextmanager
    def serving(self, keys: torch.Tensor, values: torch.Tensor) -> Iterator[None]:
        """Within, every ``_materialize`` is served from ``keys``/``values`` [B, H, length, D]: the exact K/V of
        every position, in position order, read by the caller (a question's exact pass)."""
        if keys.shape[2] != self.length:
            raise ValueError(f"serving {keys.shape[2]} positions to a layer of {self.length}")
        self._all = (keys, values)
        try:
            yield
        finally:
            self._all = None

    def _materialize(self, wanted: torch.Tensor, with_filled: bool = False):
        """Full-length exact K/V [B, H, length, D]; only positions where ``wanted`` [B, H, length] is set are filled.

        ``with_filled`` also returns the host mask [B, H, length] of every position filled exactly (core tokens and
        whole archive blocks read), a superset of ``wanted``.
        """
        b, h, _ = wanted.shape
        d = self.keys.shape[-1]
        if self._all is not None:
            k, v = self._all
            return (k, v, torch.ones(b, h, self.length, dtype=torch.bool)) if with_filled else (k, v)
        if self.n_core == self.length and self._core_in_order():
            # Every token is in the core, in position order (a fresh prefill): the core is the answer, no copy.
            k, v = self.keys[:, :, : self.length], self.values[:, :, : self.length]
            filled = torch.ones(b, h, self.length, dtype=torch.bool)
            return (k, v, filled) if with_filled else (k, v)
        # One spare slot absorbs core entries beyond ``length`` (only present in the middle of a rollback).
        full_k = self.keys.new_empty(b, h, self.length + 1, d)
        full_v = self.values.new_empty(b, h, self.length + 1, d)
        in_core = torch.zeros(b, h, self.length + 1, dtype=torch.bool)
        if self.n_core:
            pos = self.core_pos[:, :, : self.n_core].clamp(max=self.length)
            in_core.scatter_(2, pos, True)
            _put_rows(full_k, pos, self.keys[:, :, : self.n_core])
            _put_rows(full_v, pos, self.values[:, :, : self.n_core])
        full_k, full_v, in_core = full_k[:, :, :-1], full_v[:, :, :-1], in_core[:, :, :-1]
        needed = (wanted & ~in_core).any(dim=1)  # [B, length]
        missing = needed.any(dim=0).nonzero().flatten()
        filled = in_core
        if len(missing):
            if int(missing.max()) >= self.archive.length:
                raise RuntimeError("tiered cache invariant broken: a non-core token is not archived")
            blocks = torch.unique(self.archive.block_of(missing)).tolist()
            spans = read_blocks_into(self.archive, blocks, full_k, full_v)
            # Only the rows that asked for a block count it as known, so that batch rows (documents of a stacked
            # batch) rank exactly as they would alone.
            starts, ends = torch.tensor([s for s, _ in spans]), torch.tensor([e for _, e in spans])
            position = torch.arange(self.length)
            which = torch.searchsorted(ends, position, right=True).clamp(max=len(spans) - 1)  # the read span at or after
            inside = (position >= starts[which]) & (position < ends[which])
            asked = torch.stack([needed[:, s:e].any(dim=1) for s, e in spans], dim=1)  # [B, spans]
            filled |= (asked[:, which] & inside).unsqueeze(1)
        return (full_k, full_v, filled) if with_filled else (full_k, full_v)

    def _core_in_order(self) -> bool:
        pos = self.core_pos[:, :, : self.n_core]
        return bool(torch.equal(pos, torch.arange(self.n_core).expand_as(pos)))

    # ---- summaries and scoring -----------------------------------------------------------------------------------
    def refresh_summaries(self, starts: list[int], page_ids: torch.Tensor) -> None:
        """Recompute min/max for the pages not final yet (the last page is always recomputed)."""
        pages = len(starts)
        first = min(self.final_pages, pages - 1)
        s0 = starts[first]
        wanted = torch.zeros(self.keys.shape[0], self.keys.shape[1], self.length, dtype=torch.bool)
        wanted[:, :, s0:] = True
        full_k, _ = self._materialize(wanted)
        lo, hi = page_minmax(full_k[:, :, s0:], page_ids[s0:] - first, pages - first)
        if self.kmin is None or first == 0:
            self.kmin, self.kmax = lo, hi
        else:
            self.kmin = torch.cat([self.kmin[:, :, :first], lo], dim=2)
            self.kmax = torch.cat([self.kmax[:, :, :first], hi], dim=2)
        self.final_pages = pages - 1

    def scores(self, queries: torch.Tensor | None, kv_heads: int, reduce: str) -> torch.Tensor:
        """Page relevance [B, H, pages] from grouped queries, or from the newest core keys when none were recorded."""
        return page_scores(self._grouped(queries, kv_heads), self.kmin, self.kmax, reduce)

    def vote_priority(self, queries: torch.Tensor | None, kv_heads: int, page_ids: torch.Tensor,
                      candidates: int, reduce: str) -> torch.Tensor:
        """Token priority [B, H, length] (float64; on the host, or where the keys are when every exact key is at hand)
        from the question's attention over the keys it can see.

        Known keys: the core (exact), the association tier (dequantised codes), and the ``candidates`` background
        tokens per head whose pages the summaries rank highest, promoted exactly from the archive (whole archive
        blocks are read, and every exact key read is used). Tokens with no vote are ordered by their page score below
        every voted token, so the summaries still decide among them.
        """
        b, h = self.core_pos.shape[:2]
        grouped = self._grouped(queries, kv_heads)
        per_page = None
        # Every exact key at hand and every token a candidate (the default, inside a question's exact read): the
        # priority is computed where the keys are and stays there, with no host round trip (on a GPU a layer's
        # re-tier was ~15 ms of transfers and synchronisations, bench/RESULTS.md issue 23). Same numbers either way.
        on_device = ALL_ON_DEVICE and self._all is not None and candidates >= self.length
        if on_device:
            full_k, known = self._all[0], torch.ones(b, h, 1, dtype=torch.bool)
        else:  # the summaries nominate which background tokens to read exactly
            per_page = page_scores(grouped, self.kmin, self.kmax, reduce)
            page_score = per_page.gather(2, page_ids.to(per_page.device).expand(b, h, -1)).double()
            full_k, known = self._known_keys(page_score, candidates)
        votes = token_votes(grouped, full_k, known.to(self.device), kernel=self.kv.vote_pool)
        if self.kv.vote_sharing:
            votes = votes + self.kv.vote_sharing * votes.amax(dim=1, keepdim=True)
        if per_page is None and votes.device.type == "cpu" and bool((votes > 0).all()):
            # every token voted (every key visible): the page scores would order nobody; on the host, where the
            # check costs no synchronisation, they are not computed (a fifth of a later question's re-tier)
            return votes.double()
        if per_page is None:
            per_page = page_scores(grouped, self.kmin, self.kmax, reduce)
        # Unvoted tokens: below every vote (votes are >= 0), ordered by page score.
        rank = _page_rank(per_page, page_ids.to(per_page.device))
        votes, rank = (votes.double(), rank.double()) if on_device else (votes.cpu().double(), rank.cpu().double())
        fallback = -2.0 + rank / max(1, self.length)
        return torch.where(votes > 0, votes.to(fallback.device), fallback)

    def _known_keys(self, page_score: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-length keys [B, H, length, D] where known, and which are known [B, H, length] (host): the core, the
        association tier (exact where an archive block was read anyway, else its dequantised codes), and the
        ``candidates`` background tokens per head whose pages score highest."""
        tier = self.membership()
        wanted = tier == 0
        if candidates > 0:
            wanted |= nominate(page_score, (tier == 2).to(page_score.device), candidates).cpu()
        full_k, _, filled = self._materialize(wanted, with_filled=True)
        known = filled
        if self.n_assoc:
            fresh = ~filled.gather(2, self.assoc_pos)  # association tokens with no exact key read
            if fresh.any():
                if self.assoc.hidden is not None:  # fixed codes: row t is position t
                    assoc_k = _rows(self.assoc.keys.dequantize(full_k.dtype), self.assoc_pos)
                elif self.assoc.anchor_index is None:
                    assoc_k = self.assoc.keys.dequantize(full_k.dtype)
                else:  # residuals to page anchors: only the store adds the anchors back
                    assoc_k = self.assoc.dequantize(full_k.dtype)[0]
                idx = _expand(self.assoc_pos, full_k.shape[-1], self.device)
                current = full_k.gather(2, idx)
                mixed = torch.where(fresh.to(self.device).unsqueeze(-1), assoc_k, current)
                full_k.scatter_(2, idx, mixed)
                known = filled.clone().scatter_(2, self.assoc_pos, True)
        return full_k, known

    def _grouped(self, queries: torch.Tensor | None, kv_heads: int) -> torch.Tensor:
        """Queries grouped per KV head [B, H, M, D]; without recorded queries the newest core keys stand in."""
        if queries is None:
            m = min(self.kv.query_tokens, self.n_core)
            return self.keys[:, :, self.n_core - m: self.n_core]
        return group_queries(queries, kv_heads)

    # ---- re-tiering ----------------------------------------------------------------------------------------------
    def rebuild(self, priority: torch.Tensor, core: int, assoc: int, page_ids: torch.Tensor,
                keep_from: int | None = None) -> None:
        """Core = the ``core`` highest-priority positions per head, association = the next ``assoc``, rest background.

        ``priority`` [B, H, length] (host); ties go to the earlier position. Everything is archived first, so no
        token is ever dropped. ``keep_from``: positions from here on are in the core (the caller's priority forces
        them: a question's own tokens); they are neither archived nor coded.
        """
        self._archive_all(keep_from)
        # with every exact K/V at hand the order and the gathers stay on the device; only the chosen positions come
        # back to the host (the same tiers either way)
        on_device = ALL_ON_DEVICE and self._all is not None
        length = priority.shape[-1]
        if assoc and core + assoc == length and self._fixed_codes_allowed():  # only the core is chosen
            b, h, _ = priority.shape
            core_idx = _top_mask(priority, core).view(b * h, length).nonzero()[:, 1].view(b, h, core)
            self._rebuild_fixed(core_idx, length if keep_from is None else min(keep_from, length), on_device)
            return
        order = torch.sort(-priority.to(self.device), dim=-1, stable=True).indices
        if not on_device:
            order = order.cpu()
        core_idx = _ascending(order[..., :core], length)
        self._codes_stale = False
        assoc_idx = _ascending(order[..., core: core + assoc], length)
        if on_device:
            full_k, full_v = self._all
        else:
            wanted = torch.zeros(priority.shape, dtype=torch.bool)
            wanted.scatter_(2, core_idx, True).scatter_(2, assoc_idx, True)
            full_k, full_v = self._materialize(wanted)
        self._set_core(_rows(full_k, core_idx), _rows(full_v, core_idx), core_idx.cpu())
        if assoc:
            assoc_pos = assoc_idx.cpu()
            if self.kv.differential:
                pages = page_ids[assoc_pos].to(self.device)
                keys = _rows(full_k, assoc_idx)
            else:
                # the keys' last quantisation group is padded by repeating the last token: read those rows here
                # rather than copying the whole tier once more to append them
                pages, pad = None, (-assoc) % self.kv.group_tokens
                keys = _rows(full_k, torch.cat([assoc_idx, assoc_idx[..., -1:].expand(-1, -1, pad)], dim=2))
            self.assoc = AssociationStore.build(keys, _rows(full_v, assoc_idx), self.kv.association_bits,
                                                self.kv.group_tokens, pages, self.kv.association_key_bits)
            self.assoc_pos = assoc_pos
        else:
            self.assoc, self.assoc_pos = None, None

    def _fixed_codes_allowed(self) -> bool:
        return FIXED_CODES and self.fixed_codes and self.device.type == "cpu" and not self.kv.differential

    def _rebuild_fixed(self, core_idx: torch.Tensor, codes_upto: int, on_device: bool) -> None:
        """The fixed-codes re-tier: core = ``core_idx`` [B, H, core] (ascending); the association is every other
        position, read from codes of ``[0, codes_upto)`` made now only if the layer has none for that prefix."""
        b, h, core = core_idx.shape
        coded = core - (self.length - codes_upto)  # core positions inside the coded prefix, the same in every head
        if coded < 0 or (core > coded and int(core_idx[..., coded:].min()) < codes_upto):
            raise RuntimeError("tiered cache invariant broken: a position past the fixed codes is not in the core")
        store = self.assoc
        remake = (store is None or store.hidden is None or self._codes_stale or store.length != codes_upto)
        if on_device:
            full_k, full_v = self._all
        else:
            wanted = torch.zeros(b, h, self.length, dtype=torch.bool).scatter_(2, core_idx, True)
            if remake:
                wanted[:, :, :codes_upto] = True
            full_k, full_v = self._materialize(wanted)
        self._set_core(_rows(full_k, core_idx), _rows(full_v, core_idx), core_idx.cpu())
        if remake:
            keys = full_k[:, :, :codes_upto]
            sinks = min(self.kv.sink_tokens, codes_upto - 1)
            if sinks > 0:
                # the attention sinks are in every core and their keys are outliers (the first token's is many
                # times any other's): stood in by their neighbour, they do not stretch their group's range
                keys = keys.clone()
                keys[:, :, :sinks] = keys[:, :, sinks: sinks + 1]
            store = AssociationStore.build(keys, full_v[:, :, :codes_upto].contiguous(),
                                           self.kv.association_bits, self.kv.group_tokens, None,
                                           self.kv.association_key_bits)
            self._codes_stale = False
        hidden = torch.zeros(b, h, codes_upto, dtype=torch.bool)
        hidden.scatter_(2, core_idx[..., :coded].cpu(), True)
        if coded == codes_upto:  # the core holds the whole prefix: no association
            self.assoc, self.assoc_pos = None, None
            return
        store.hidden = hidden.to(self.device)
        self.assoc = store
        self.assoc_pos = (~hidden).view(b * h, codes_upto).nonzero()[:, 1].view(b, h, codes_upto - coded)

    def membership(self) -> torch.Tensor:
        """Tier of each position per head [B, H, length] (host): 0 core, 1 association, 2 background."""
        b, h = self.core_pos.shape[:2]
        tier = torch.full((b, h, self.length), 2, dtype=torch.long)
        if self.n_assoc:
            tier.scatter_(2, self.assoc_pos, 1)
        tier.scatter_(2, self.core_pos[:, :, : self.n_core], 0)
        return tier

    def truncate(self, length: int, page_ids: torch.Tensor | None = None, final_pages: int = 0) -> None:
        """Remove positions ``>= length`` from every tier (rollback to a prefix).

        ``page_ids`` (of the positions left) matter only in differential mode when heads must be re-balanced;
        ``final_pages`` is how many leading page summaries stay valid.
        """
        if not self.is_initialized or length >= self.length:
            return
        length = max(length, 0)
        core_keep = (self.core_pos[:, :, : self.n_core] < length).sum(dim=-1)
        assoc_keep = (self.assoc_pos < length).sum(dim=-1) if self.n_assoc else torch.zeros_like(core_keep)
        self.archive.truncate(length)
        self.truncate_summaries(final_pages)
        if self.queries is not None:
            keep = self.query_pos < length
            self.queries, self.query_pos = self.queries[:, :, keep.to(self.device)], self.query_pos[keep]
        if len(torch.unique(core_keep)) == 1 and len(torch.unique(assoc_keep)) == 1:
            self.n_core = int(core_keep.flatten()[0])
            if self.n_assoc:
                self._truncate_assoc(int(assoc_keep.flatten()[0]), length)
            self.length = length
            return
        # Heads lost different numbers of tokens per tier: re-balance, keeping each token's tier where possible
        # (a head short of core tokens promotes its earliest association tokens, exactly, from the archive).
        tier = self.membership()[:, :, :length]
        self.length = length
        ids = page_ids if page_ids is not None else torch.zeros(length, dtype=torch.long)
        core = int(core_keep.max())
        # with no background (the association takes every other token) the two maxima may come from different heads
        # and add up to more than the positions left
        self.rebuild((2 - tier).double(), core, min(int(assoc_keep.max()), length - core), ids)

    def _truncate_assoc(self, keep: int, length: int) -> None:
        if keep == 0:
            self.assoc, self.assoc_pos = None, None
            return
        a = self.assoc
        rows = keep  # rows of the store that stay: its first ``keep`` tokens
        if a.hidden is not None:
            # fixed codes: row t is position t, so the store keeps positions [0, length); codes cut inside their
            # prefix are still codes of those tokens, but a group's scale saw the removed ones: the next re-tier
            # makes them again
            rows = min(a.length, length)
            self._codes_stale |= rows < a.length
            a.hidden = a.hidden[:, :, :rows]
        a.keys.length = rows
        a.values.length = rows
        a.values.codes, a.values.scale, a.values.zero = (a.values.codes[:, :, :rows], a.values.scale[:, :, :rows],
                                                         a.values.zero[:, :, :rows])
        if a.anchor_index is not None:
            a.anchor_index = a.anchor_index[:, :, :rows]
        self.assoc_pos = self.assoc_pos[:, :, :keep]

    def truncate_summaries(self, final_pages: int) -> None:
        self.final_pages = min(self.final_pages, final_pages)
        if self.kmin is not None:
            self.kmin, self.kmax = self.kmin[:, :, : self.final_pages], self.kmax[:, :, : self.final_pages]
            if self.final_pages == 0:
                self.kmin = self.kmax = None

    # ---- accounting ----------------------------------------------------------------------------------------------
    def token_bytes(self) -> int:
        """Bytes one token of this layer takes at full precision (all batch rows and KV heads, K and V)."""
        if not self.is_initialized:
            return 0
        b, h, _, d = self.keys.shape
        return 2 * b * h * d * self.keys.element_size()

    def device_bytes(self) -> int:
        """Core + association + summaries: what ``bytes_by_tier`` gives for the device, without the host archive."""
        return self.n_core * self.token_bytes() + (self.assoc.nbytes() if self.n_assoc else 0) + self._summary_bytes()

    def _summary_bytes(self) -> int:
        return 0 if self.kmin is None else 2 * self.kmin.numel() * self.kmin.element_size()

    def bytes_by_tier(self) -> dict[str, int]:
        host_index = self.n_core * 8 * (self.core_pos.shape[0] * self.core_pos.shape[1] if self.core_pos is not None
                                        else 0) + (self.assoc_pos.numel() * 8 if self.n_assoc else 0)
        return {
            "core": self.n_core * self.token_bytes(),
            "association": self.assoc.nbytes() if self.n_assoc else 0,
            "summaries": self._summary_bytes(),
            "background_host": self.archive.nbytes(),
            "index_host": host_index,
        }
