"""Many documents in one decode batch, each keeping its own tiers.

Each document is prefilled and tiered on its own (batch 1, so one prefill's workspace at a time), then
:func:`stack_caches` lays their tiers side by side along the batch axis. Every row keeps the tokens its own question
ranked highest; only the sizes must agree, so that the kernel sees dense tensors and one CUDA graph serves the
batch. The background tier stays where it is: :class:`StackedArchive` reads the documents' own archives on demand,
so stacking copies no host data and a re-tier of the batch still promotes exact values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from docfuse.runtime.gpu.kernel_cache import KernelTieredCache
from docfuse.runtime.kv.association import AssociationStore
from docfuse.runtime.kv.background import ExactArchive
from docfuse.runtime.kv.layer import TieredLayer


class StackedArchive:
    """Read-side view over the archives of several batch-1 documents with identical block layouts."""

    def __init__(self, parts: Sequence[ExactArchive]) -> None:
        self.parts = list(parts)
        self.codec = self.parts[0].codec
        self.block_tokens = self.parts[0].block_tokens

    @property
    def length(self) -> int:
        return self.parts[0].length

    @property
    def blocks(self):
        return self.parts[0].blocks

    def block_of(self, positions: torch.Tensor) -> torch.Tensor:
        return self.parts[0].block_of(positions)

    def read(self, index: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        reads = [p.read(index) for p in self.parts]
        start, end = reads[0][0], reads[0][1]
        return start, end, torch.cat([r[2] for r in reads]), torch.cat([r[3] for r in reads])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for i, part in enumerate(self.parts):
            part.append(k[i: i + 1], v[i: i + 1])

    def truncate(self, length: int) -> None:
        for part in self.parts:
            part.truncate(length)

    def select_batch(self, indices: torch.Tensor) -> None:
        self.parts = [self.parts[int(i)] for i in indices.tolist()]

    def settle(self) -> None:
        for part in self.parts:
            part.settle()

    def nbytes(self) -> int:
        """Host bytes, counting an archive shared by several rows once."""
        return sum(p.nbytes() for p in {id(p): p for p in self.parts}.values())

    def raw_nbytes(self) -> int:
        return sum(p.raw_nbytes() for p in {id(p): p for p in self.parts}.values())


def _cat_assoc(stores: list[AssociationStore]) -> AssociationStore:
    if any(s.anchor_index is not None for s in stores):
        raise ValueError("differential association tiers cannot be stacked yet; set differential: false")
    k, v = stores[0].keys, stores[0].values
    keys = replace(k, codes=torch.cat([s.keys.codes for s in stores]), scale=torch.cat([s.keys.scale for s in stores]),
                   zero=torch.cat([s.keys.zero for s in stores]))
    values = replace(v, codes=torch.cat([s.values.codes for s in stores]),
                     scale=torch.cat([s.values.scale for s in stores]), zero=torch.cat([s.values.zero for s in stores]))
    return AssociationStore(keys, values)


def _stack_layer(parts: list[TieredLayer], out: TieredLayer) -> None:
    first = parts[0]
    for p in parts:
        if (p.length, p.n_core, p.n_assoc) != (first.length, first.n_core, first.n_assoc):
            raise ValueError(
                f"documents of different sizes cannot share a decode batch yet: layer {first.layer_idx} holds "
                f"{(p.length, p.n_core, p.n_assoc)} vs {(first.length, first.n_core, first.n_assoc)} "
                f"(length, core, association); batch documents of equal token counts, or decode them separately")
        if p.keys.shape[0] != 1:
            raise ValueError("stack_caches takes batch-1 caches (one document each)")
    n = first.n_core
    out.lazy_initialization(first.keys[:, :, :0], first.values[:, :, :0])
    out._set_core(torch.cat([p.keys[:, :, :n] for p in parts]), torch.cat([p.values[:, :, :n] for p in parts]),
                  torch.cat([p.core_pos[:, :, :n] for p in parts]))
    out.length = first.length
    if first.n_assoc:
        out.assoc = _cat_assoc([p.assoc for p in parts])
        out.assoc_pos = torch.cat([p.assoc_pos for p in parts])
    if first.kmin is not None:
        out.kmin = torch.cat([p.kmin for p in parts])
        out.kmax = torch.cat([p.kmax for p in parts])
    out.final_pages = min(p.final_pages for p in parts)
    out.archive = StackedArchive([p.archive for p in parts])


def stack_caches(caches: Sequence[KernelTieredCache], release: bool = True) -> KernelTieredCache:
    """One batched cache (row ``i`` = document ``i``) from tiered batch-1 caches of equal sizes.

    ``release`` frees each document's device tensors as soon as they are copied, so stacking never holds two
    copies of every document; pass the same cache several times (``release=False``) to replicate one document.
    """
    if not caches:
        raise ValueError("stack_caches needs at least one cache")
    first = caches[0]
    out = KernelTieredCache.__new__(KernelTieredCache)
    out.__dict__.update({k: v for k, v in first.__dict__.items() if k != "layers"})
    out.layers = [type(first.layers[i])(first.kv, i) for i in range(len(first.layers))]
    for i, layer in enumerate(out.layers):
        _stack_layer([c.layers[i] for c in caches], layer)
        if release:
            for c in caches:
                src = c.layers[i]
                src.keys = src.values = src.keys[:, :, :0]
                src.assoc, src.kmin, src.kmax = None, None, None
    out.peak_device = max(c.peak_device for c in caches)
    return out
