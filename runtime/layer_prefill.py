"""Layer-major prefill: a whole document through one decoder layer at a time, tiering each layer as soon as it is full.

The usual chunked prefill runs every layer on chunk 1, then every layer on chunk 2, ...: exact, but the cache of
every layer grows to the full document before anything can be tiered, so peak memory holds the full-precision cache
(17 GB for an 8B model at 128K). Here the loop is turned round: layer 0 runs over all chunks, then layer 1, ... The
hidden states of the whole document wait in one buffer (overwritten in place, chunk by chunk), and only the layer
being computed holds its full K/V. Attention is still exact (each chunk sees every earlier token of its own layer),
so the logits equal the dense model's. Once a layer is done its K/V go to the archive (asynchronously, through an
:class:`~runtime.kv.background.ArchiveWriter`) and the layer is tiered from the queries of the document's last
tokens, which is where a question sits when the prompt ends with it.

Peak device memory: weights + the hidden-state buffer (``L x hidden``) + one layer's full K/V and a working copy +
the tiers of the layers already done, instead of weights + the full cache of every layer.

Llama-family decoders (``model.model.layers`` with ``self_attn.{q,k,v,o}_proj``, optional ``q_norm``/``k_norm``,
``input_layernorm``, ``post_attention_layernorm``, a SwiGLU ``mlp``) are supported. Each layer runs
:class:`~runtime.llama_block.LlamaBlock`, the one explicit block the decode step runs too, so nothing depends on
transformers' internal call signatures; what is the prefill's own is the attention hook, :class:`DocumentAttention`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from docfuse.runtime.kv.background import ArchiveWriter
from docfuse.runtime.kv.tiered import TieredCache
from docfuse.runtime.llama_block import LlamaBlock, causal_attention, rope

#: GIL hand-off interval (s) while helper threads run beside the layer loop (Python's default is 5 ms).
HANDOFF_S = 1e-4
#: Most tokens a layer-major call takes: each layer's attention is exact at any chunk. Calls of 65,536 tokens prefill
#: a 132K document 5% faster than calls of 8,192 on an H100 (16.9 against 17.8-18.0 s; the first call's square
#: attention runs on cuDNN's kernel, the rest on flash attention's, in 2 calls instead of 16) for 9.5 GB more at the
#: peak; one call over the whole document was slower (27-28 s, not explained yet), so a 128K ``prefill_chunk: auto``
#: stops here. The engine reserves what the chunk holds, and drops to 8,192 where its streams need the memory.
MAX_CHUNK = 65536


class DocumentAttention:
    """The layer-major prefill's attention hook for one layer (a :data:`~runtime.llama_block.Attention`).

    The chunks of the document come in order; each one's K/V (after RoPE at its positions) go into the layer's
    full-length ``keys``/``values`` buffers [B, Hkv, L, D], and its queries attend causally over every token of the
    layer so far. The queries of the last ``last`` positions are kept: they rank the tokens when the layer is tiered.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                 last: int) -> None:
        self.keys, self.values = keys, values
        self.cos, self.sin = cos, sin  # [1, 1, L, D]
        self.scale, self.last = scale, last
        self.filled = 0
        self.last_queries: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = self.filled
        e = s + q.shape[1]
        c, si = self.cos[:, :, s:e], self.sin[:, :, s:e]
        q = rope(q.transpose(1, 2), c, si)
        self.keys[:, :, s:e] = rope(k.transpose(1, 2), c, si)
        self.values[:, :, s:e] = v.transpose(1, 2)
        self.filled = e
        out = causal_attention(q, self.keys[:, :, :e], self.values[:, :, :e], self.scale)
        recent = q[:, :, -self.last:]
        kept = self.last_queries
        self.last_queries = recent if kept is None else torch.cat([kept, recent], dim=2)[:, :, -self.last:]
        return out.transpose(1, 2)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "model", model)
    if not all(hasattr(base, name) for name in ("layers", "rotary_emb", "norm")):
        raise ValueError(f"layer-major prefill needs a Llama-family decoder (model.model.layers, rotary_emb, norm); "
                         f"{type(model).__name__} has none: prefill it through the model in chunks instead")
    if not all(LlamaBlock.fits(layer) for layer in base.layers):
        raise ValueError(f"{type(model).__name__}'s decoder layers are not the Llama block (attention with q/k/v/o "
                         "projections, SwiGLU MLP with SiLU): prefill it through the model in chunks instead")
    return base


@torch.no_grad()
def layer_major_prefill(model: torch.nn.Module, cache: TieredCache, input_ids: torch.Tensor | None = None,
                        inputs_embeds: torch.Tensor | None = None, chunk: int = 8192,
                        writer: ArchiveWriter | None = None, query_tokens: int | None = None,
                        overlap: bool = True, timeline: list[dict[str, float]] | None = None,
                        handoff_s: float | None = HANDOFF_S) -> torch.Tensor:
    """Prefill an empty :class:`TieredCache` with a document, layer by layer; returns the last position's logits.

    Args:
        model: a Llama-family causal LM.
        cache: an empty tiered cache for ``model``; it leaves tiered (as after ``retier``).
        input_ids / inputs_embeds: the document, ``[B, L]`` ids or ``[B, L, hidden]`` embeddings (not modified).
        chunk: tokens per attention/MLP call (bounds the activation memory, not the result).
        writer: moves each finished layer's exact K/V to the host archive in the background; ``None`` archives
            synchronously.
        query_tokens: how many of the last positions' queries rank the tokens (default: the cache's
            ``kv.query_tokens``).
        overlap: on CUDA, tier each finished layer on a side stream, from a helper thread, while the next layer
            computes (the tiering is mostly host-side work that would otherwise stall the GPU).
        timeline: if given, filled with one record per layer (seconds): ``compute`` (the layer's GPU time, CUDA
            only), ``tier`` (its tiering, host time), ``wait`` (how long the loop waited for the previous layer's
            tiering before going on) and ``archive_wait`` (how long its archive submission waited for staging
            buffers). A prefill whose ``wait`` adds up is bound by the host, not by the GPU.
        handoff_s: while the tiering thread or the archive workers run, how often (seconds) a thread holding the GIL
            must let a waiting one in (``sys.setswitchinterval``, restored afterwards; ``None`` leaves it alone).
            At Python's 5 ms the helpers keep the thread that launches the layer's kernels waiting and the GPU idles
            between them: at 128K on an H200 the GPU time of the layers went from 23.2 s to 18.4 s (16.7 s with no
            helpers at all), bench/RESULTS.md.

    Returns:
        logits ``[B, vocab]`` of the last position (the first generated token's distribution).
    """
    if cache.get_seq_length() != 0:
        raise ValueError("layer-major prefill fills an empty cache; feed further tokens (a question, an answer) "
                         "through the model as usual")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    base = _decoder(model)
    if input_ids is not None:
        hidden = base.embed_tokens(input_ids)
    else:
        hidden = inputs_embeds.clone()
    b, length, _ = hidden.shape
    if length == 0:
        raise ValueError("the document has no tokens")
    m = min(length, query_tokens or cache.kv.query_tokens)
    positions = torch.arange(length, device=hidden.device).unsqueeze(0)
    cos, sin = base.rotary_emb(hidden, position_ids=positions)  # [1, L, D], in the hidden dtype
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    host_positions = torch.arange(length).view(1, 1, -1).expand(b, 1, -1)
    overlap = overlap and hidden.is_cuda
    side = torch.cuda.Stream(hidden.device) if overlap else None
    tiering = ThreadPoolExecutor(1, thread_name_prefix="docfuse-tier") if overlap else None
    helpers = overlap or writer is not None
    try:
        with _quick_handoff(handoff_s if helpers else None):
            return _layers(model, base, cache, hidden, cos, sin, chunk, m, host_positions, writer, side, tiering,
                           timeline)
    finally:
        if tiering is not None:
            tiering.shutdown(wait=True)
        cache.pinned_budgets = None


_HANDOFF_LOCK = threading.Lock()
_handoff_users: list[float] = []  # the intervals asked for by prefills running now, in any thread
_handoff_saved = 0.0  # the interval before the first of them


@contextlib.contextmanager
def _quick_handoff(interval: float | None) -> Iterator[None]:
    """Shorten the GIL switch interval for the block (process-wide: Python has no per-thread priority).

    Prefills may overlap in several threads: the interval is the shortest any of them asked for, and the one from
    before the first comes back when the last one ends."""
    global _handoff_saved
    if interval is None:
        yield
        return
    if interval <= 0:
        raise ValueError(f"handoff_s must be a positive number of seconds (or None), got {interval}")
    with _HANDOFF_LOCK:
        if not _handoff_users:
            _handoff_saved = sys.getswitchinterval()
        _handoff_users.append(interval)
        sys.setswitchinterval(min(_handoff_saved, *_handoff_users))
    try:
        yield
    finally:
        with _HANDOFF_LOCK:
            _handoff_users.remove(interval)
            sys.setswitchinterval(min(_handoff_saved, *_handoff_users) if _handoff_users else _handoff_saved)


def _layers(model, base, cache, hidden, cos, sin, chunk, m, host_positions, writer, side, tiering, timeline
            ) -> torch.Tensor:
    """The layer loop of :func:`layer_major_prefill`; returns the last position's logits."""
    b, length, _ = hidden.shape
    pending: Future | None = None
    events = []
    for index, layer in enumerate(base.layers[: len(cache.layers)]):
        record: dict[str, float] = {}
        if timeline is not None:
            timeline.append(record)
            if hidden.is_cuda:
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
        block = LlamaBlock(layer)
        keys = hidden.new_empty(b, block.kv_heads, length, block.head_dim)
        values = hidden.new_empty(b, block.kv_heads, length, block.head_dim)
        attend = DocumentAttention(keys, values, cos, sin, block.scaling, m)
        for s in range(0, length, chunk):
            x, delta = block.forward(hidden[:, s: s + chunk], None, attend)
            hidden[:, s: s + chunk] = x + delta
        last_queries = attend.last_queries
        if events:
            events[-1][1].record()
        if side is None:
            _tier(cache, index, keys, values, host_positions, writer, last_queries, record)
        else:  # tier this layer on a side stream and thread while the next layer computes
            ready = torch.cuda.Event()
            ready.record()
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()  # one layer in flight at most: memory stays bounded
            record["wait"] = time.perf_counter() - t0
            pending = tiering.submit(_tier_beside, cache, index, keys, values, host_positions, writer, last_queries,
                                     ready, side, torch.cuda.current_stream(), record)
        del keys, values, attend
    if pending is not None:
        pending.result()
        torch.cuda.current_stream().wait_stream(side)
    if events:
        torch.cuda.synchronize()
        for record, (start, end) in zip(timeline, events):
            record["compute"] = start.elapsed_time(end) / 1e3
    cache.pinned_budgets = None
    cache.retiered_at = length
    cache.retiers += 1
    cache.peak_device = max(cache.peak_device, cache.device_bytes())
    return model.lm_head(base.norm(hidden[:, -1:]))[:, -1]


def _pin_budgets(cache: TieredCache, index: int, length: int) -> None:
    """Fix the tier sizes once the first layer is in (``core_tokens: auto`` reads free memory, which changes)."""
    if index == 0:
        cache.pinned_budgets = None
        cache.pinned_budgets = cache.budgets(length)


def _tier(cache: TieredCache, index: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
          writer: ArchiveWriter | None, queries: torch.Tensor, record: dict[str, float]) -> None:
    """Adopt, archive and tier the finished layer ``index``; its host time (and archive waits) go to ``record``."""
    t0 = time.perf_counter()
    waited = writer.wait_s if writer is not None else 0.0
    _adopt(cache, index, keys, values, positions, writer)
    _pin_budgets(cache, index, keys.shape[2])
    cache.retier_layer(index, queries)
    record["tier"] = time.perf_counter() - t0
    record["archive_wait"] = (writer.wait_s if writer is not None else 0.0) - waited


def _tier_beside(cache: TieredCache, index: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 writer: ArchiveWriter | None, queries: torch.Tensor, ready: torch.cuda.Event,
                 side: torch.cuda.Stream, main: torch.cuda.Stream, record: dict[str, float]) -> None:
    """Adopt and tier layer ``index`` on the ``side`` stream once ``ready`` (its last chunk) has run."""
    with torch.cuda.stream(side):
        side.wait_event(ready)
        _tier(cache, index, keys, values, positions, writer, queries, record)
        layer = cache.layers[index]
        # The tiers were allocated on the side stream and are read on the main one from now on: tell the allocator,
        # so that their memory is not handed out again while main-stream work may still read it.
        tensors = [layer.keys, layer.values, layer.kmin, layer.kmax]
        if layer.assoc is not None:
            for quant in (layer.assoc.keys, layer.assoc.values):
                tensors += [quant.codes, quant.scale, quant.zero]
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(main)
    side.synchronize()


def _adopt(cache: TieredCache, index: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
           writer: ArchiveWriter | None) -> None:
    """Give layer ``index`` the whole document in its core (as a finished dense prefill would) and archive it."""
    layer = cache.layers[index]
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    h = keys.shape[1]
    layer._set_core(keys, values, positions.expand(-1, h, -1).contiguous())
    layer.length = keys.shape[2]
    cache.peak_device = max(cache.peak_device, cache.device_bytes())
    if writer is not None:
        writer.submit(layer.archive, keys, values)

