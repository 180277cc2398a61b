"""One greedy decode step for a batch of streams over the page pool, and its CUDA graph.

A :class:`BatchStep` owns the static inputs of a batch of ``size`` rows: the token each row feeds, its position, its
core and association page tables and its counts, all on the device. :meth:`BatchStep.bind` writes the live streams
into them (rows past the live ones idle on the scratch page); :meth:`BatchStep.run` decodes one token for every row.
The step is written out block by block (:class:`~runtime.llama_block.LlamaBlock` with the fused kernels of
:mod:`runtime.gpu.fused_ops`), and everything that changes from one token to the next (the write row, the counts,
the positions) advances on the device, so on CUDA the step is captured once per batch size and replayed.

Attention per layer: the paged Triton kernel (:mod:`runtime.gpu.paged_kernel`) on CUDA where it covers the shape;
elsewhere, row by row through :func:`runtime.kv.code_attention.code_attention`, the function ``Session`` decodes
with on the CPU (it reads the host's copy of the counts, so that path runs eagerly, not in a graph).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from docfuse.runtime.engine.pool import PagePool, StreamPages
from docfuse.runtime.gpu import fused_ops
from docfuse.runtime.gpu.decode_step import FUSED, llama_decoder
from docfuse.runtime.gpu.paged_kernel import (HAS_TRITON, cascade_decode_attention, identity_rows,
                                              paged_decode_attention, paged_kernel_supports, paged_splits)
from docfuse.runtime.kv.code_attention import code_attention
from docfuse.runtime.llama_block import LlamaBlock, norm_eps


#: Whether the step knows the model (the Llama block, q/k norms included): the same test as the batch-1 step's.
step_supported = llama_decoder


class PagedAttention:
    """The step's attention hook for one layer: RoPE per row, the new K/V into each row's next core slot, then
    attention over the row's association and core pages."""

    def __init__(self, step: BatchStep, layer: int, cos: torch.Tensor, sin: torch.Tensor, scale: float) -> None:
        self.step, self.layer, self.cos, self.sin, self.scale = step, layer, cos, sin, scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st, pool, i = self.step, self.step.pool, self.layer
        q = fused_ops.rope_write_rows(q[:, 0], k[:, 0], v[:, 0], self.cos, self.sin, pool.core_k[i], pool.core_v[i],
                                      st.write_rows)
        if st.kernel and st.members > 1:
            out = cascade_decode_attention(q, pool, i, st.shared_tables, st.group_rows, st.own_tables, self.scale,
                                           st.splits, rows=st.identity)
        elif st.kernel:
            out = paged_decode_attention(q, pool, i, st.core_table, st.n_core, st.assoc_table, st.n_assoc,
                                         self.scale, st.splits, rows=st.identity)
        else:
            out = st.reference_attention(q, i, self.scale)
        return out.unsqueeze(1)


class BatchStep:
    """Static inputs and the step for up to ``size`` streams.

    Args:
        model: a decoder that :func:`step_supported` accepts.
        pool: the page pool the streams live in.
        size: batch rows (a bucket: the engine keeps one step per bucket it uses).
        core_width / assoc_width: page-table width, the most pages any stream has in each tier.
        graph: capture the step as a CUDA graph on the first run (CUDA and the kernel only).
        members: the most streams that share one document's tiers (``kv.questions: together``: its questions). Above
            1 the kernel reads each shared page once for all the streams on it (:func:`cascade_decode_attention`),
            where the plain kernel reads it once per stream.
    """

    def __init__(self, model: Any, pool: PagePool, size: int, core_width: int, assoc_width: int,
                 graph: bool = False, members: int = 1) -> None:
        self.model, self.pool, self.size = model, pool, size
        dev = pool.device
        s = pool.shape
        self.core_table = torch.zeros(size, max(1, core_width), dtype=torch.int32, device=dev)
        self.assoc_table = torch.zeros(size, max(1, assoc_width), dtype=torch.int32, device=dev)
        self.n_core = torch.zeros(size, dtype=torch.int32, device=dev)  # core tokens once this step's is written
        self.n_assoc = torch.zeros(size, dtype=torch.int32, device=dev)
        self.write_rows = torch.zeros(size, dtype=torch.long, device=dev)
        self.tok = torch.zeros(size, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(size, 1, dtype=torch.long, device=dev)
        self.identity = identity_rows(size, dev)  # each row its own table row (the kernel's member table)
        # the kernel runs where Triton does: on CUDA, or anywhere under its interpreter (how CI tests it)
        self.kernel = (HAS_TRITON and (dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
                       and paged_kernel_supports(s.head_dim, s.key_bits, s.value_bits, s.page, s.group, s.vgroup))
        self.members = max(1, members) if self.kernel else 1
        tables = -(-size // self.members)  # table rows with work when every document fills its members
        self.splits = paged_splits(tables * s.kv_heads, max(core_width, assoc_width)) if self.kernel else 1
        if self.members > 1:
            i32 = dict(dtype=torch.int32, device=dev)
            self.shared_tables = (torch.zeros(size, max(1, core_width), **i32), torch.zeros(size, **i32),
                                  torch.zeros(size, max(1, assoc_width), **i32), torch.zeros(size, **i32))
            self.group_rows = torch.full((size, self.members), -1, **i32)
            self.own_tables = (torch.zeros(size, max(1, core_width), **i32), torch.zeros(size, **i32),
                               torch.zeros(size, 1, **i32), torch.zeros(size, **i32))
            # how the counts advance on the device: a table row of one stream follows that stream's core count
            # (``follow``); a shared one keeps its document's whole pages (``fixed``); a stream on shared pages
            # counts its own tokens past them (``past``)
            self.follow = torch.zeros(size, dtype=torch.long, device=dev)
            self.single = torch.zeros(size, dtype=torch.bool, device=dev)
            self.fixed = torch.zeros(size, **i32)
            self.past = torch.zeros(size, **i32)
            self.on_shared = torch.zeros(size, dtype=torch.bool, device=dev)
        self.want_graph = graph and self.kernel
        self.graph: torch.cuda.CUDAGraph | None = None
        self.rows: list[StreamPages | None] = [None] * size
        self.host_core = [0] * size  # the host's copy of n_core before the step (reference path)
        self.logits: torch.Tensor | None = None

    # ---- inputs ----------------------------------------------------------------------------------------------
    def bind(self, streams: Sequence[tuple[StreamPages, int, int, int]]) -> None:
        """Write the live streams into rows ``0..len-1``: (pages, token to feed, its position, core tokens before
        it). Rows after them idle: scratch page, one core token, no association."""
        if len(streams) > self.size:
            raise ValueError(f"{len(streams)} streams for a step of {self.size} rows")
        ct = torch.zeros_like(self.core_table, device="cpu")
        at = torch.zeros_like(self.assoc_table, device="cpu")
        nc = torch.zeros(self.size, dtype=torch.int32)
        na = torch.zeros(self.size, dtype=torch.int32)
        tok = torch.zeros(self.size, 1, dtype=torch.long)
        pos = torch.zeros(self.size, 1, dtype=torch.long)
        self.rows = [None] * self.size
        for r, (pages, token, position, core) in enumerate(streams):
            if len(pages.core) > ct.shape[1] or len(pages.assoc) > at.shape[1]:
                raise ValueError("a stream has more pages than the step's tables are wide")
            ct[r, : len(pages.core)] = torch.tensor(pages.core, dtype=torch.int32)
            if pages.assoc:
                at[r, : len(pages.assoc)] = torch.tensor(pages.assoc, dtype=torch.int32)
            nc[r], na[r], tok[r, 0], pos[r, 0] = core, pages.n_assoc, token, position
            self.rows[r] = pages
        self.host_core = nc.tolist()
        for dst, src in ((self.core_table, ct), (self.assoc_table, at), (self.n_core, nc), (self.n_assoc, na),
                         (self.tok, tok), (self.pos, pos)):
            dst.copy_(src)
        if self.members > 1:
            self._bind_groups(ct, at, na)
        self._counts()

    def _bind_groups(self, ct: torch.Tensor, at: torch.Tensor, na: torch.Tensor) -> None:
        """Table rows for the cascade: one per document's shared tiers (up to ``members`` streams each, more
        streams take another row over the same pages), one per stream without them (idle rows included)."""
        page = self.pool.shape.page
        size = self.size
        gct, gat = torch.zeros_like(ct), torch.zeros_like(at)
        gna, fixed, past = (torch.zeros(size, dtype=torch.int32) for _ in range(3))
        members = torch.full((size, self.members), -1, dtype=torch.int32)
        follow = torch.zeros(size, dtype=torch.long)
        single = torch.zeros(size, dtype=torch.bool)
        oct_ = torch.zeros_like(self.own_tables[0], device="cpu")
        on_shared = torch.zeros(size, dtype=torch.bool)
        groups: dict[int, list[int]] = {}  # id(shared tiers) -> table rows serving them
        filled = [0] * size  # members written into each table row
        n = 0
        for r, pages in enumerate(self.rows):
            shared = pages.shared if pages is not None else None
            if shared is None:  # its own table row, all its pages (idle rows: the scratch page)
                gct[n], gat[n], gna[n] = ct[r], at[r], na[r]
                members[n, 0], follow[n], single[n] = r, r, True
                n += 1
                continue
            rows = groups.setdefault(id(shared), [])
            if not rows or filled[rows[-1]] == self.members:
                whole = len(shared.core)
                if whole:
                    gct[n, :whole] = torch.tensor(shared.core, dtype=torch.int32)
                if shared.assoc:
                    gat[n, : len(shared.assoc)] = torch.tensor(shared.assoc, dtype=torch.int32)
                gna[n], fixed[n] = shared.n_assoc, whole * page
                rows.append(n)
                n += 1
            g = rows[-1]
            members[g, filled[g]] = r
            filled[g] += 1
            own = pages.core[len(shared.core):]
            if own:
                oct_[r, : len(own)] = torch.tensor(own, dtype=torch.int32)
            past[r], on_shared[r] = len(shared.core) * page, True
        for dst, src in ((self.shared_tables[0], gct), (self.shared_tables[2], gat), (self.shared_tables[3], gna),
                         (self.group_rows, members), (self.follow, follow), (self.single, single),
                         (self.fixed, fixed), (self.own_tables[0], oct_), (self.past, past),
                         (self.on_shared, on_shared)):
            dst.copy_(src)

    def _counts(self) -> None:
        """The cascade's counts from the rows' core counts (on the device: the step advances them each token)."""
        if self.members > 1:
            self.shared_tables[1].copy_(torch.where(self.single, self.n_core[self.follow], self.fixed))
            self.own_tables[1].copy_(torch.where(self.on_shared, self.n_core - self.past, 0))

    # ---- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _advance(self) -> None:
        page = self.pool.shape.page
        index = (self.n_core // page).long().clamp_(max=self.core_table.shape[1] - 1).unsqueeze(1)
        self.write_rows.copy_(self.core_table.gather(1, index).squeeze(1).long() * page + (self.n_core % page).long())
        self.n_core += 1
        self._counts()
        base = self.model.model
        x = base.embed_tokens(self.tok)  # [B, 1, hidden]
        cos, sin = base.rotary_emb(x, position_ids=self.pos)  # [B, 1, D]
        cos, sin = cos[:, 0], sin[:, 0]
        delta = None
        for i, layer in enumerate(base.layers):
            block = LlamaBlock(layer, FUSED)
            x, delta = block.forward(x, delta, PagedAttention(self, i, cos, sin, block.scaling))
        h, _ = fused_ops.add_rms_norm(x, delta, base.norm.weight, norm_eps(base.norm))
        self.logits = self.model.lm_head(h)[:, -1]
        self.tok.copy_(self.logits.argmax(-1, keepdim=True))
        self.pos += 1

    def capture(self) -> None:
        """Capture the step's CUDA graph now, from the bound inputs (nothing where no graph is taken). The engine
        calls it before it times a bucket's first step: a capture costs a warm-up step and the recording, a one-off
        that is not decode time."""
        if self.want_graph and self.graph is None:
            self._capture()

    def run(self) -> torch.Tensor:
        """Decode one token for every row; returns the ``[size, 1]`` tokens (overwritten by the next run)."""
        self.capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._advance()
        self.host_core = [c + 1 for c in self.host_core]
        return self.tok

    def _capture(self) -> None:
        """Warm up once on a side stream, put the inputs back, capture the step."""
        saved = [t.clone() for t in (self.tok, self.pos, self.n_core)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._advance()
        torch.cuda.current_stream().wait_stream(stream)
        for dst, src in zip((self.tok, self.pos, self.n_core), saved):
            dst.copy_(src)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._advance()
        for dst, src in zip((self.tok, self.pos, self.n_core), saved):  # capture does not run, but be sure
            dst.copy_(src)
        self.graph = graph

    def reference_attention(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """Row by row over the rows' tiers, through the CPU decode attention (host counts; not capturable)."""
        out = torch.zeros_like(q)
        for r, pages in enumerate(self.rows):
            if pages is None:
                continue
            count = self.host_core[r] + 1
            k, v = self.pool.core_of(layer, pages, count)
            out[r] = code_attention(q[r: r + 1], k, v, count, self.pool.assoc_of(layer, pages), scale)[0].to(q.dtype)
        return out
