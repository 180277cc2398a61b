"""Paged device storage for the tiers of many decode streams at once.

Every live (document, question) stream keeps its own tiers: a core in model precision and an association tier of
packed codes. Streams have different lengths, and they come and go while others decode, so their tiers live in
fixed-size pages of one preallocated pool per tier (vLLM's idea, applied to two tiers): a stream owns a list of core
pages and a list of association pages, its page tables say where its tokens are, and freeing a stream returns its
pages for the next one. Nothing is padded to the longest stream and nothing is moved when a stream ends.

Layout, per layer, token-major (row = page * PAGE + offset in the page):

* core K and V ``[rows, Hkv, D]`` in the model's dtype; the stream's new tokens are written after its core;
* association key codes ``[rows, Hkv, D * bits / 8]`` (uint8) with per-channel fp16 scale and zero per group of
  ``group`` tokens ``[rows / group, Hkv, D]``; value codes ``[rows, Hkv, D * bits / 8]`` with per-token fp16 scale and
  zero per group of ``vgroup`` channels ``[rows, Hkv, D / vgroup]`` (the layouts of :mod:`runtime.kv.quant`).

Page 0 of each pool is scratch: unused table entries point at it, and idle batch rows write and read there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from docfuse.runtime.kv.association import AssociationStore
from docfuse.runtime.kv.config import KVConfig
from docfuse.runtime.kv.quant import VALUE_GROUP, Quantized

#: Tokens per page; the GPU kernel walks one page per tile (see runtime.gpu.paged_kernel).
PAGE = 128


def pages_for(tokens: int, page: int = PAGE) -> int:
    return -(-max(0, tokens) // page)


@dataclass(frozen=True)
class PoolShape:
    """What one page of each tier holds, for one model and one ``kv:`` block."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    key_bits: int
    value_bits: int
    group: int  # tokens per key scale group
    page: int = PAGE

    @classmethod
    def of(cls, config, kv: KVConfig, dtype: torch.dtype, page: int = PAGE) -> PoolShape:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        if page % kv.group_tokens:
            raise ValueError(f"kv.group_tokens ({kv.group_tokens}) must divide the engine's page of {page} tokens; "
                             "set group_tokens: 32")
        return cls(int(text.num_hidden_layers), kv_heads, head_dim, dtype,
                   kv.association_key_bits or kv.association_bits, kv.association_bits, kv.group_tokens, page)

    @property
    def vgroup(self) -> int:
        return VALUE_GROUP if self.head_dim % VALUE_GROUP == 0 else self.head_dim

    @property
    def core_page_bytes(self) -> int:
        """Device bytes of one core page over all layers (K and V)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * self.page * self.kv_heads * self.head_dim * item * 2

    @property
    def assoc_page_bytes(self) -> int:
        """Device bytes of one association page over all layers (codes, scales and zeros of K and V)."""
        d, h = self.head_dim, self.kv_heads
        codes = self.page * h * d * (self.key_bits + self.value_bits) // 8
        scales = (self.page // self.group) * h * d * 4 + self.page * h * (d // self.vgroup) * 4
        return self.layers * (codes + scales)


@dataclass
class SharedTiers:
    """A document's tiers shared by its questions' streams (``kv.questions: together``): the core's whole pages and
    every association page, read by each stream, written by none. ``refs`` counts the holders (the streams, and the
    open document while it still starts questions); the pages go back to the pool with the last."""

    core: list[int]
    assoc: list[int]
    n_core: int  # core tokens of the document, the last ``n_core % page`` of them copied into each stream's pages
    n_assoc: int
    refs: int = 1


@dataclass
class StreamPages:
    """Where one stream's tiers live: its pages and token counts (the same in every layer and KV head). A stream
    of shared tiers lists the document's pages first (``shared``) and its own after them."""

    core: list[int]
    assoc: list[int]
    n_core: int
    n_assoc: int
    shared: SharedTiers | None = None


class PagePool:
    """The preallocated pages of both tiers for every layer, and their free lists.

    Args:
        shape: what a page holds (:meth:`PoolShape.of`).
        core_pages / assoc_pages: usable pages of each tier (page 0 of each, scratch, comes on top).
        device: where the pool lives.
    """

    def __init__(self, shape: PoolShape, core_pages: int, assoc_pages: int, device: torch.device | str) -> None:
        s = self.shape = shape
        self.device = torch.device(device)
        p, h, d = s.page, s.kv_heads, s.head_dim
        rows_c, rows_a = (core_pages + 1) * p, (assoc_pages + 1) * p
        zeros = lambda *size, dtype: torch.zeros(*size, dtype=dtype, device=self.device)  # noqa: E731
        self.core_k = zeros(s.layers, rows_c, h, d, dtype=s.dtype)
        self.core_v = zeros(s.layers, rows_c, h, d, dtype=s.dtype)
        self.key_codes = zeros(s.layers, rows_a, h, d * s.key_bits // 8, dtype=torch.uint8)
        self.key_scale = zeros(s.layers, rows_a // s.group, h, d, dtype=torch.float16)
        self.key_zero = zeros(s.layers, rows_a // s.group, h, d, dtype=torch.float16)
        self.value_codes = zeros(s.layers, rows_a, h, d * s.value_bits // 8, dtype=torch.uint8)
        self.value_scale = zeros(s.layers, rows_a, h, d // s.vgroup, dtype=torch.float16)
        self.value_zero = zeros(s.layers, rows_a, h, d // s.vgroup, dtype=torch.float16)
        self.core_total, self.assoc_total = core_pages, assoc_pages
        self.free_core = list(range(core_pages, 0, -1))  # pop() hands out low pages first
        self.free_assoc = list(range(assoc_pages, 0, -1))

    @classmethod
    def sized(cls, shape: PoolShape, nbytes: int, core_share: float, device: torch.device | str) -> PagePool:
        """A pool of about ``nbytes``, ``core_share`` of it (by bytes) for core pages."""
        core = max(1, int(nbytes * core_share) // shape.core_page_bytes)
        assoc = max(1, int(nbytes * (1 - core_share)) // shape.assoc_page_bytes)
        return cls(shape, core, assoc, device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.core_k, self.core_v, self.key_codes, self.key_scale,
                                                           self.key_zero, self.value_codes, self.value_scale,
                                                           self.value_zero))

    # ---- pages -------------------------------------------------------------------------------------------------
    def fits_ever(self, core_pages: int, assoc_pages: int) -> bool:
        """Whether a stream of this many pages fits the pool when nothing else is live."""
        return core_pages <= self.core_total and assoc_pages <= self.assoc_total

    def fits_now(self, core_pages: int, assoc_pages: int) -> bool:
        return core_pages <= len(self.free_core) and assoc_pages <= len(self.free_assoc)

    def allocate(self, core_pages: int, assoc_pages: int) -> tuple[list[int], list[int]]:
        if not self.fits_now(core_pages, assoc_pages):
            raise MemoryError(f"the pool has {len(self.free_core)} core and {len(self.free_assoc)} association pages "
                              f"free, {core_pages} and {assoc_pages} were asked for")
        return ([self.free_core.pop() for _ in range(core_pages)],
                [self.free_assoc.pop() for _ in range(assoc_pages)])

    def release(self, stream: StreamPages | SharedTiers) -> None:
        """Give a stream's pages back; shared tiers (or a stream's share of them) go when their last holder does."""
        if isinstance(stream, SharedTiers):
            stream.refs -= 1
            if stream.refs == 0:
                self.free_core.extend(reversed(stream.core))
                self.free_assoc.extend(reversed(stream.assoc))
            return
        if stream.shared is not None:
            self.free_core.extend(reversed(stream.core[len(stream.shared.core):]))
            self.release(stream.shared)
            stream.shared = None
        else:
            self.free_core.extend(reversed(stream.core))
            self.free_assoc.extend(reversed(stream.assoc))
        stream.core, stream.assoc = [], []

    # ---- moving tiers in ---------------------------------------------------------------------------------------
    def rows(self, pages: Sequence[int], count: int, per_page: int | None = None) -> torch.Tensor:
        """Pool rows of a stream's first ``count`` tokens (or scale groups, ``per_page`` of them a page)."""
        per = per_page or self.shape.page
        t = torch.arange(count)
        table = torch.tensor(list(pages) or [0], dtype=torch.long)
        return (table[t // per] * per + t % per).to(self.device)

    def load(self, cache, core_extra: int) -> StreamPages:
        """Copy a re-tiered batch-1 :class:`~runtime.kv.tiered.TieredCache` into freshly allocated pages, with room for
        ``core_extra`` more core tokens (the answer's). The cache is left as it was."""
        first = cache.layers[0]
        n_core, n_assoc = first.n_core, first.n_assoc
        s = self.shape
        core, assoc = self.allocate(pages_for(n_core + core_extra, s.page), pages_for(n_assoc, s.page))
        stream = StreamPages(core, assoc, n_core, n_assoc)
        # pool rows of the stream's tokens (and key scale groups): the same in every layer, computed once
        core_rows = self.rows(core, n_core)
        padded = first.assoc.keys.codes.shape[2] if n_assoc else 0
        assoc_rows = (self.rows(assoc, padded), self.rows(assoc, padded // s.group, s.page // s.group),
                      self.rows(assoc, n_assoc)) if n_assoc else None
        for i, layer in enumerate(cache.layers):
            problem = self._mismatch(layer, n_core, n_assoc, padded)
            if problem:
                self.release(stream)
                raise ValueError(problem)
            self.core_k[i].index_copy_(0, core_rows, layer.keys[0, :, :n_core].transpose(0, 1).to(s.dtype))
            self.core_v[i].index_copy_(0, core_rows, layer.values[0, :, :n_core].transpose(0, 1).to(s.dtype))
            if n_assoc:
                self._load_assoc(i, layer.assoc, *assoc_rows)
        return stream

    def load_shared(self, cache) -> SharedTiers:
        """Copy a document's re-tiered tiers into pages its questions' streams share: the core's whole pages (its
        last partial page goes into each stream's own pages, :meth:`attach`) and the association tier. The caller
        holds the first reference."""
        first = cache.layers[0]
        n_core, n_assoc = first.n_core, first.n_assoc
        s = self.shape
        whole = n_core // s.page * s.page
        core, assoc = self.allocate(whole // s.page, pages_for(n_assoc, s.page))
        shared = SharedTiers(core, assoc, n_core, n_assoc)
        core_rows = self.rows(core, whole)
        padded = first.assoc.keys.codes.shape[2] if n_assoc else 0
        assoc_rows = (self.rows(assoc, padded), self.rows(assoc, padded // s.group, s.page // s.group),
                      self.rows(assoc, n_assoc)) if n_assoc else None
        for i, layer in enumerate(cache.layers):
            problem = self._mismatch(layer, n_core, n_assoc, padded)
            if problem:
                self.release(shared)
                raise ValueError(problem)
            self.core_k[i].index_copy_(0, core_rows, layer.keys[0, :, :whole].transpose(0, 1).to(s.dtype))
            self.core_v[i].index_copy_(0, core_rows, layer.values[0, :, :whole].transpose(0, 1).to(s.dtype))
            if n_assoc:
                self._load_assoc(i, layer.assoc, *assoc_rows)
        return shared

    def private_pages(self, shared_core: int, question: int, core_extra: int) -> int:
        """Core pages a stream of shared tiers owns: the document core's partial last page, its question, its answer."""
        return pages_for(shared_core % self.shape.page + question + core_extra, self.shape.page)

    def attach(self, shared: SharedTiers, cache, read, core_extra: int) -> StreamPages:
        """A stream over ``shared`` for one question (a :class:`~runtime.kv.queries.QuestionRead`): its own pages
        hold the document core's partial last page (from ``cache``, which still holds the shared tiers), the
        question's K/V and room for ``core_extra`` answer tokens."""
        s = self.shape
        whole = shared.n_core // s.page * s.page
        own, _ = self.allocate(self.private_pages(shared.n_core, len(read), core_extra), 0)
        shared.refs += 1
        n_core = shared.n_core + len(read)
        stream = StreamPages(shared.core + own, shared.assoc, n_core, shared.n_assoc, shared)
        rows = self.rows(own, n_core - whole)
        for i, layer in enumerate(cache.layers):
            if layer.n_core != shared.n_core:
                self.release(stream)
                raise ValueError("the cache no longer holds the shared tiers (re-tiered or rolled back since)")
            k = torch.cat([layer.keys[0, :, whole: shared.n_core], read.keys[i][0].to(layer.keys.dtype)], dim=1)
            v = torch.cat([layer.values[0, :, whole: shared.n_core], read.values[i][0].to(layer.values.dtype)], dim=1)
            self.core_k[i].index_copy_(0, rows, k.transpose(0, 1).to(s.dtype))
            self.core_v[i].index_copy_(0, rows, v.transpose(0, 1).to(s.dtype))
        return stream

    def _mismatch(self, layer, n_core: int, n_assoc: int, padded: int) -> str | None:
        """Why a layer's tiers cannot go into this stream's pages (None: they can)."""
        if (layer.n_core, layer.n_assoc) != (n_core, n_assoc) or layer.keys.shape[0] != 1:
            return "every layer of a stream must hold the same tier sizes, one batch row"
        if not n_assoc:
            return None
        s, store = self.shape, layer.assoc
        k, v = store.keys, store.values
        if store.hidden is not None:
            return "the association tier holds fixed codes (TieredLayer.fixed_codes must be off for the engine)"
        if store.anchor_index is not None or (k.bits, v.bits, k.group, v.group) != (s.key_bits, s.value_bits,
                                                                                    s.group, s.vgroup):
            return "the association tier does not match the pool's encoding (bits, groups, not differential)"
        if k.codes.shape[2] != padded:
            return "every layer of a stream must pad its key codes alike"
        return None

    def _load_assoc(self, i: int, store: AssociationStore, key_rows: torch.Tensor, group_rows: torch.Tensor,
                    value_rows: torch.Tensor) -> None:
        k, v = store.keys, store.values
        self.key_codes[i].index_copy_(0, key_rows, k.codes[0].transpose(0, 1))
        self.key_scale[i].index_copy_(0, group_rows, k.scale[0, :, :, 0].transpose(0, 1))
        self.key_zero[i].index_copy_(0, group_rows, k.zero[0, :, :, 0].transpose(0, 1))
        self.value_codes[i].index_copy_(0, value_rows, v.codes[0, :, : v.length].transpose(0, 1))
        self.value_scale[i].index_copy_(0, value_rows, v.scale[0, :, : v.length, :, 0].transpose(0, 1))
        self.value_zero[i].index_copy_(0, value_rows, v.zero[0, :, : v.length, :, 0].transpose(0, 1))

    # ---- reading a stream back (the reference path, tests) -----------------------------------------------------
    def core_of(self, i: int, stream: StreamPages, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s first ``count`` core tokens of ``stream`` as ``[1, Hkv, count, D]`` K and V."""
        rows = self.rows(stream.core, count)
        return (self.core_k[i].index_select(0, rows).transpose(0, 1).unsqueeze(0),
                self.core_v[i].index_select(0, rows).transpose(0, 1).unsqueeze(0))

    def assoc_of(self, i: int, stream: StreamPages) -> AssociationStore | None:
        """Layer ``i``'s association tier of ``stream`` as an :class:`AssociationStore` (batch 1), or None."""
        n = stream.n_assoc
        if not n:
            return None
        s = self.shape
        padded = pages_for(n, s.group) * s.group
        key_rows = self.rows(stream.assoc, padded)
        group_rows = self.rows(stream.assoc, padded // s.group, s.page // s.group)
        value_rows = self.rows(stream.assoc, n)

        def take(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return pool[i].index_select(0, rows).transpose(0, 1).unsqueeze(0)  # [1, Hkv, rows, ...]

        keys = Quantized(take(self.key_codes, key_rows), take(self.key_scale, group_rows).unsqueeze(3),
                         take(self.key_zero, group_rows).unsqueeze(3), s.key_bits, n, True, s.group)
        values = Quantized(take(self.value_codes, value_rows), take(self.value_scale, value_rows).unsqueeze(-1),
                           take(self.value_zero, value_rows).unsqueeze(-1), s.value_bits, n, False, s.vgroup)
        return AssociationStore(keys, values)
