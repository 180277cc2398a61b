"""The decode engine: many documents and questions answered at once, each question a stream over its own tiers.

``Session`` answers one question of one document at a time. The engine takes a list of documents with their
questions and keeps every stream it can fit decoding together:

1. **Prefill** one document at a time (the document that is *open*), into a batch-1 :class:`TieredCache`:
   token-major (the fastest: one pass of the whole document where the card has room, then tiered once), or
   layer-major from ``layer_major_from`` tokens (peak memory never holds the full cache of every layer). On CUDA the
   run chooses: token-major for every document when the longest one's full cache and one pass's activations fit
   beside the pages every stream of the run needs (a lone 128K document on an 80 GB card), else layer-major from
   64K tokens.
2. **Start a question**: read it exactly and re-tier the document for it (``read_question``, as ``Session`` does),
   copy the tiers into pages of the pool (:mod:`runtime.engine.pool`), roll the cache back to the document. The
   question is now a live stream; its first answer token came out of the read. The next question of the open
   document starts from the same prefill. Where the document's exact K/V are in device memory the re-tier runs
   after the read has given the first token (it then holds back the second token, not the first).
3. **Decode** every live stream together: one batched step per token (:mod:`runtime.engine.step`), captured as a
   CUDA graph per batch-size bucket. Each stream stops at its own end-of-sequence or ``max_new_tokens``; its pages
   go back to the pool, and a waiting question takes its place (continuous batching).

With ``kv.questions: together`` a document's questions are all read (exactly) when it opens, its tiers are chosen
once for all of them and copied into pages once, and each question's stream reads those shared pages plus its own
(the core's partial last page, its question, its answer): a review checklist of eight questions holds one copy of
the document's tiers, not eight, and re-tiers once, not eight times.

Admission is by pages: a question starts only when the pool has the pages its tiers need (counted before it is
read), so nothing runs out of memory and nothing is dropped; a document whose single stream could never fit gets an
error that names the settings to lower. The greedy tokens equal ``Session``'s for the same (document, question).

Not yet here (they fall back to ``Session``, see :func:`engine_unsupported`): decode-time re-tiering
(``retier_every``), pruning, the differential association encoding and ``method: evict``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from docfuse.runtime import metrics
from docfuse.runtime.engine.pool import PagePool, PoolShape, SharedTiers, StreamPages, pages_for
from docfuse.runtime.engine.step import BatchStep, step_supported
from docfuse.runtime.kv import (KVConfig, QuestionRead, TieredCache, as_kv_config, prepare_question, read_question,
                                read_questions, retier_after_read)
from docfuse.runtime.kv.background import DeviceArchive
from docfuse.runtime.kv.config import resolve_budget
from docfuse.runtime import layer_prefill
from docfuse.runtime.loading import TIGHT_PREFILL_CHUNK, prefill_chunk_for

log = logging.getLogger("docfuse.engine")
#: The stats of the most recent :meth:`Engine.run` in this process (benchmarks read it through the pipeline).
LAST_STATS: dict[str, Any] = {}
#: Batch sizes a step is built (and on CUDA captured) for; the live streams run in the smallest that holds them.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GB = 1 << 30
#: Documents of at least this many tokens prefill layer by layer when the card has no room for their full cache
#: beside the run's streams (or on the CPU).
LAYER_MAJOR_FROM = 65536
#: Share of the device memory left beside the run's streams that an open document's exact archive may take.
ARCHIVE_ROOM_SHARE = 0.8
#: Most streams one program of the cascade kernel serves (their query heads are the rows of one tile); a document
#: with more questions takes more programs over the same pages.
MAX_MEMBERS = 16


@dataclass
class Document:
    """One document to answer: its prefix ids (or fused embedding rows), and each question's suffix ids."""

    prefix: Sequence[int]
    questions: Sequence[Sequence[int]]
    max_new_tokens: int = 128
    embeds: torch.Tensor | None = None
    #: the document's name, kept with its KV store entry (``docfuse kv-store list``)
    source: str = ""


@dataclass
class StreamOutput:
    """One (document, question) answer: its tokens and measurements, or the error that stopped it."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "eos"  # eos | length | stop | error
    prompt_tokens: int = 0
    #: Seconds of the stream's own work to its first token: the document's prefill (first question only) and the
    #: question's read, as ``Session`` counts it; time spent queued behind other streams is not in it.
    ttft_s: float = 0.0
    #: Seconds from the start of :meth:`Engine.run` to the first token, queueing included.
    first_token_at_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    kv_device_bytes: int = 0
    kv_host_bytes: int = 0
    kv_full_bytes: int = 0
    peak_memory_bytes: int = 0
    error: str | None = None


def engine_unsupported(model: Any, kv: KVConfig | dict | None, pruning: Any = None,
                       temperature: float = 0.0) -> str | None:
    """Why the engine cannot serve this model, ``kv:`` block and decoding (``None``: it can); ``Session`` serves
    those."""
    if kv is None:
        return "kv: null (the engine serves the tiered cache)"
    kv = as_kv_config(kv)
    if kv.method != "tiered":
        return f"kv.method: {kv.method}"
    if kv.retier_every is not None:
        return "kv.retier_every (decode-time re-tiers)"
    if kv.differential:
        return "kv.differential"
    if pruning is not None:
        return "pruning"
    if temperature > 0:
        return "temperature > 0 (the engine decodes greedily)"
    if not step_supported(model):
        return f"{type(model).__name__}'s blocks are not the Llama block the engine's step writes out"
    return None


@dataclass
class _Stream:
    doc: int
    question: int
    pages: StreamPages
    token: int  # the next token to feed
    position: int
    core: int  # core tokens before ``token`` is written
    max_new: int
    out: StreamOutput
    decode_started: float = 0.0
    steps: int = 0


@dataclass
class _Open:
    """The document being started: its prefilled cache and the questions still to start."""

    index: int
    cache: TieredCache
    prefix: int
    prefill_s: float
    next_question: int = 0
    #: ``kv.questions: together``: every question's exact read (one pass, which also re-tiered), and the shared
    #: tiers' pages once the first stream needs them
    reads: list[QuestionRead] | None = None
    shared: SharedTiers | None = None


class Engine:
    """Answers documents' questions with every stream that fits decoding together.

    Args:
        model: a Llama-family causal LM (:func:`engine_unsupported` says which it cannot serve).
        kv: the tiered cache's ``kv:`` block.
        stop_ids: end-of-sequence token ids.
        pool_bytes: device bytes for the page pool; ``None`` sizes it from free device memory (CUDA) after the
            prefill workspace of the longest document, or 1 GiB elsewhere.
        max_streams: most streams decoding at once (the largest bucket used).
        graphs: capture each bucket's step as a CUDA graph (default: on CUDA).
        prefill_chunk: tokens per forward of the document prefill (None or ``auto``: 512 on the CPU; on CUDA
            131,072, one pass for a document the engine prefills token by token, unless that pass's activations would
            take pages the run's streams need: then 8,192; a layer-major prefill takes at most
            ``layer_prefill.MAX_CHUNK`` (65,536) a call, and 8,192 under the same rule).
        layer_major_from: documents of at least this many tokens prefill layer by layer (``kv.prefill: layers``
            always does). ``None``: chosen per run from free device memory on CUDA (token-major for every document
            when the longest fits in one pass beside the run's streams, else from ``LAYER_MAJOR_FROM``), and
            ``LAYER_MAJOR_FROM`` elsewhere.
        memory_fraction: share of free device memory the pool may take when it is sized automatically.
        archive: where the open document's exact K/V wait while its questions start: ``device``
            (:class:`~runtime.kv.background.DeviceArchive`: each question's exact read and re-tier are slices),
            ``host`` (LZ4 in host memory, as ``Session`` keeps it: less device memory, slower questions), ``auto``:
            the device on CUDA when the document's full K/V take at most an eighth of the card, or fit (with a
            margin) beside the pool every stream of the run needs, else the host.
        stop_when: called with a stream's answer tokens after each new one; True ends the stream
            (``runtime.stopping.Stopper.should_stop``: stop strings, repeats), as in ``Session``.
        kv_store: a :class:`runtime.kv_store.KVStore`: a document the engine prefills token by token is loaded
            from it when the same model, prefix, dtype and chunk prefilled it before (by the engine or by
            ``Session``: the entry is the same exact state), and stored after its prefill otherwise. A layer-major
            prefill tiers as it goes: that state is neither stored nor loaded.
    """

    def __init__(self, model: Any, kv: KVConfig | dict, stop_ids: set[int], *, pool_bytes: int | None = None,
                 max_streams: int = 64, graphs: bool | None = None, prefill_chunk: int | None = None,
                 layer_major_from: int | None = None, memory_fraction: float = 0.9,
                 archive: Literal["auto", "device", "host"] = "auto",
                 stop_when: Callable[[list[int]], bool] | None = None, kv_store: Any = None) -> None:
        why = engine_unsupported(model, kv)
        if why:
            raise ValueError(f"the engine does not serve {why}; decode through runtime.session.Session")
        self.model, self.kv, self.stop_ids = model, as_kv_config(kv), set(stop_ids)
        self.device = next(model.parameters()).device
        self.shape = PoolShape.of(model.config, self.kv, model.dtype)
        self.pool_bytes, self.memory_fraction = pool_bytes, memory_fraction
        self.buckets = tuple(b for b in BUCKETS if b < max_streams) + (max_streams,)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.layer_major_from = layer_major_from
        #: the documents of this run from this many tokens prefill layer by layer (``_make_pool`` sets it per run)
        self._layer_from = LAYER_MAJOR_FROM if layer_major_from is None else layer_major_from
        self._auto_chunk = prefill_chunk in (None, "auto")
        #: tokens per prefill forward of this run (``_make_pool`` may lower an automatic one)
        self.prefill_chunk = self._chunk_setting = prefill_chunk_for(prefill_chunk, self.device)
        self.limit = int(model.config.max_position_embeddings)
        self.archive = archive
        self.stop_when = stop_when
        self.kv_store = kv_store
        self._writer: Any = None
        #: device bytes an open document's exact K/V may take beside the pool (set per run by ``_make_pool``)
        self._archive_room = 0
        self.pool: PagePool | None = None
        self.steps: dict[int, BatchStep] = {}
        #: What the last run did: steps, the largest number of live streams, bucket use, step seconds.
        self.stats: dict[str, Any] = {}

    # ---- sizing ------------------------------------------------------------------------------------------------
    def stream_tokens(self, prefix: int, question: int) -> tuple[int, int]:
        """Core and association tokens of a stream after its question's re-tier (an upper bound; exact for the
        budgets of :meth:`TieredCache.budgets`, which keep the question's own tokens in the core)."""
        length = prefix + question
        kv = self.kv
        core = length if kv.core_tokens == "auto" else resolve_budget(kv.core_tokens, length)
        forced = min(length, kv.sink_tokens + max(kv.recent_tokens, question))
        core = min(length, max(core, forced))
        assoc = min(length - core, resolve_budget(kv.association_tokens, length))
        return core, assoc

    def stream_pages(self, prefix: int, question: int, max_new: int) -> tuple[int, int]:
        core, assoc = self.stream_tokens(prefix, question)
        return pages_for(core + max_new, self.shape.page), pages_for(assoc, self.shape.page)

    @property
    def together(self) -> bool:
        return self.kv.questions == "together"

    def shared_tokens(self, doc: Document) -> tuple[int, int]:
        """``kv.questions: together``: core and association tokens of a document's shared tiers. They are chosen in
        the pass that reads all its questions (``read_questions``), so at the length of the document plus every
        question, with the questions in the core; the core then loses the questions when they are rolled back."""
        asked = sum(len(q) for q in doc.questions)
        core, assoc = self.stream_tokens(len(doc.prefix) + asked, asked)
        return core - asked, assoc

    def start_pages(self, doc: Document, question: int, shared_loaded: bool = False) -> tuple[int, int]:
        """Pages that starting question ``question`` of ``doc`` takes from the pool now: its whole tiers, or with
        shared tiers its own pages (plus the shared ones when they are not loaded yet)."""
        q = len(doc.questions[question])
        if not self.together:
            return self.stream_pages(len(doc.prefix), q, doc.max_new_tokens)
        core, assoc = self.shared_tokens(doc)
        page = self.shape.page
        own = pages_for(core % page + q + doc.max_new_tokens, page)
        return (own, 0) if shared_loaded else (core // page + own, pages_for(assoc, page))

    def document_pages(self, doc: Document) -> tuple[int, int]:
        """Pages every question of ``doc`` holds when all of them are live at once."""
        pages = [self.start_pages(doc, q, shared_loaded=self.together and q > 0) for q in range(len(doc.questions))]
        return sum(c for c, _ in pages), sum(a for _, a in pages)

    def prefill_reserve(self, tokens: int, archive: bool | None = None) -> int:
        """Device bytes a document of ``tokens`` needs outside the pool while it is open: its cache (the full one
        for a token-major prefill, the tiers and one layer's full K/V for a layer-major one), the activations of
        one chunk, and an exact archive on the device if it gets one."""
        s, config = self.shape, self.model.config
        item = torch.empty((), dtype=s.dtype).element_size()
        full = self._full_bytes(tokens)
        core, assoc = self.stream_tokens(tokens, 0)
        tiers = (pages_for(core, s.page) * s.core_page_bytes + pages_for(assoc, s.page) * s.assoc_page_bytes)
        hidden = int(config.hidden_size)
        layers = self._layer_major(tokens)
        chunk = min(tokens, self.prefill_chunk)
        if layers:  # fill_cache gives a layer-major prefill at most this many a call
            chunk = min(chunk, layer_prefill.MAX_CHUNK)
        inter = int(getattr(config, "intermediate_size", 4 * hidden))
        # SDPA's fused kernels never hold the chunk x document scores; the MLP's and projections' rows do count. In
        # the model's dtype for a token-major pass (8B at 131,072 tokens measured ~120 KB a token; this gives 135);
        # twice that for a layer-major call, which measured ~170 KB a token at 65,536 (H100, fourteenth session)
        per_token = (3 * inter + 6 * hidden) * item * (2 if layers else 1)
        activations = chunk * per_token + int(config.vocab_size) * 4 * 2
        archived = self._device_archive(tokens) if archive is None else archive
        if layers:
            cache = tiers + 2 * full // s.layers + tokens * hidden * item * 2 + (full if archived else 0)
            return int(1.2 * (cache + activations)) + (256 << 20)
        if archived:
            # the archive takes each layer's exact K/V as the first re-tier replaces that layer's full core by its
            # tiers, after the prefill's activations are gone: at most the tiers and two layers' K/V beyond it
            activations = max(activations, tiers + 2 * full // s.layers)
        return int(1.2 * (full + activations)) + (256 << 20)

    def _full_bytes(self, tokens: int) -> int:
        s = self.shape
        return s.layers * tokens * s.kv_heads * s.head_dim * 2 * torch.empty((), dtype=s.dtype).element_size()

    def _device_archive(self, tokens: int) -> bool:
        if self.archive != "auto":
            return self.archive == "device"
        if self.device.type != "cuda":
            return False
        full = self._full_bytes(tokens)
        return full <= torch.cuda.get_device_properties(self.device).total_memory // 8 or full <= self._archive_room

    def _layer_major(self, tokens: int) -> bool:
        return self.kv.prefill == "layers" or tokens >= self._layer_from

    def _make_pool(self, docs: Sequence[Document]) -> PagePool:
        s = self.shape
        # per document: the pages of all its streams at once, and how many streams that is
        need = [(self.document_pages(d), len(d.questions)) for d in docs if d.questions]
        core_bytes = sum(c * s.core_page_bytes for (c, _), _n in need) or s.core_page_bytes
        assoc_bytes = sum(a * s.assoc_page_bytes for (_, a), _n in need)
        share = core_bytes / (core_bytes + assoc_bytes)
        # the bytes of as many documents' streams as the largest bucket runs at once, largest first
        per_doc = sorted(((c * s.core_page_bytes + a * s.assoc_page_bytes, n) for (c, a), n in need), reverse=True)
        per_stream, streams = [], 0
        for nbytes_doc, n in per_doc:
            if streams >= max(self.buckets):
                break
            per_stream.append(nbytes_doc)
            streams += n
        self._archive_room = 0  # no room beyond the static rule unless this run's free memory says so
        self._layer_from = LAYER_MAJOR_FROM if self.layer_major_from is None else self.layer_major_from
        nbytes = self.pool_bytes
        self.prefill_chunk = self._chunk_setting
        if nbytes is None:
            nbytes = self._auto_pool_bytes(max((len(d.prefix) for d in docs), default=0), sum(per_stream))
        # never more than every stream at once needs (plus a page of each tier for rounding): a small batch keeps
        # the rest of the card free
        nbytes = min(nbytes, sum(per_stream) + 2 * (s.core_page_bytes + s.assoc_page_bytes))
        nbytes = max(nbytes, s.core_page_bytes + s.assoc_page_bytes)
        return PagePool.sized(s, nbytes, share, self.device)

    def _auto_pool_bytes(self, longest: int, streams_bytes: int) -> int:
        """Device bytes for the pool when none were given: on CUDA its share of free memory after the prefill of the
        ``longest`` document. Where that leaves the pool short of ``streams_bytes`` (what the largest bucket's
        streams hold), the prefill gives way in this order: every document token-major in one pass (with an
        automatic ``layer_major_from``, and only while a long document's exact K/V can stay on the card);
        layer-major from ``LAYER_MAJOR_FROM`` tokens; an automatic chunk of 8,192 tokens instead of one pass."""
        if self.device.type != "cuda":
            return GB
        if self.layer_major_from is None:
            self._layer_from = longest + 1  # token-major for every document of the run, if the card has room
            nbytes = self._cuda_pool_bytes(longest, streams_bytes)
            # a long document's exact K/V must also stay on the card: packing 17 GB into the host archive at its
            # re-tier would cost far more than a layer-major prefill saves
            if longest < LAYER_MAJOR_FROM or (nbytes >= streams_bytes and self._device_archive(longest)):
                return self._tight_chunk(longest, streams_bytes, nbytes)
            self._layer_from = LAYER_MAJOR_FROM
        return self._tight_chunk(longest, streams_bytes, self._cuda_pool_bytes(longest, streams_bytes))

    def _tight_chunk(self, longest: int, streams_bytes: int, nbytes: int) -> int:
        """An automatic prefill chunk drops from one pass to 8,192 tokens when one pass would leave the pool short
        of ``streams_bytes``; the pool's bytes then."""
        if self._auto_chunk and nbytes < streams_bytes and self.prefill_chunk > TIGHT_PREFILL_CHUNK:
            # one pass's activations would take pages the run's streams need: prefill in chunks instead
            self.prefill_chunk = TIGHT_PREFILL_CHUNK
            nbytes = self._cuda_pool_bytes(longest, streams_bytes)
        return nbytes

    def _cuda_pool_bytes(self, longest: int, streams_bytes: int) -> int:
        """The page pool's share of the card's free memory, after the open document's prefill (and sets the room
        its exact K/V may take beside the pool)."""
        # what the driver has free plus what torch's allocator holds cached but unused (an earlier pool)
        free = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) \
            - torch.cuda.memory_allocated(self.device)
        logits = max(self.buckets) * int(self.model.config.vocab_size) * 4 * 4
        # an open document's exact K/V may also wait on the device (its questions then start from slices, not from
        # the host) when they fit beside everything this run's streams need: one 128K document on an 80 GB card,
        # not 32 of them
        spare = free - logits - self.prefill_reserve(longest, archive=False) - streams_bytes
        self._archive_room = int(spare * ARCHIVE_ROOM_SHARE)
        return int((free - self.prefill_reserve(longest) - logits) * self.memory_fraction)

    # ---- the run -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, docs: Sequence[Document]) -> list[list[StreamOutput]]:
        """Answer every question of every document; outputs in the order given (one list per document)."""
        started = time.perf_counter()
        outputs = [[StreamOutput(prompt_tokens=len(d.prefix) + len(q)) for q in d.questions] for d in docs]
        metrics.reset_peak_memory(self.device)
        self.pool = pool = self._make_pool(docs)
        # the largest page table a stream needs (with shared tiers: the shared whole pages and its own)
        widths = [self.start_pages(d, j) for d in docs for j in range(len(d.questions))]
        core_width = max((w[0] for w in widths), default=1)
        assoc_width = max((w[1] for w in widths), default=1)
        self.steps = {}
        self.stats = {"steps": 0, "max_live": 0, "max_live_documents": 0, "step_s": 0.0, "capture_s": 0.0,
                      "deferred_retier_s": 0.0, "buckets": {}, "pool_bytes": pool.nbytes(),
                      "prefill_chunk": self.prefill_chunk, "layer_major_from": self._layer_from,
                      "core_pages": pool.core_total, "assoc_pages": pool.assoc_total}
        # kv.questions: together: a document's streams read its shared pages in one program (the cascade kernel)
        members = min(MAX_MEMBERS, max((len(d.questions) for d in docs), default=1)) if self.together else 1
        queue = deque(i for i, d in enumerate(docs) if d.questions)
        live: list[_Stream] = []
        opened: _Open | None = None
        rebind = True  # the live streams changed since the step's inputs were written
        while queue or opened is not None or live:
            # ---- admission: open the next document, start its questions while their pages are free ----
            while len(live) < max(self.buckets):
                if opened is None:
                    if not queue:
                        break
                    i = queue[0]
                    doc = docs[i]
                    longest = max(range(len(doc.questions)), key=lambda j: len(doc.questions[j]))
                    first = self.start_pages(doc, longest)
                    too_long = self._too_long(doc)
                    if too_long:
                        queue.popleft()
                        self._fail(outputs[i], "context_too_long", too_long)
                        continue
                    if not pool.fits_ever(*first):
                        queue.popleft()
                        self._fail(outputs[i], "kv_too_large", self._too_large(doc, first))
                        continue
                    if live and not pool.fits_now(*first):
                        break  # decode on; pages come back as streams finish
                    queue.popleft()
                    opened = self._open(i, doc, outputs[i])
                    if opened is None:
                        continue
                doc = docs[opened.index]
                q = opened.next_question
                need = self.start_pages(doc, q, shared_loaded=opened.shared is not None)
                if not pool.fits_now(*need):
                    if not live:  # cannot happen when fits_ever held: every page is free
                        raise RuntimeError("the pool is empty and still cannot hold a stream it was sized for")
                    break
                stream = self._start(opened, doc, q, outputs[opened.index][q], started)
                if stream is not None:
                    live.append(stream)
                    rebind = True
                opened.next_question += 1
                if opened.next_question == len(doc.questions):
                    if opened.shared is not None:
                        pool.release(opened.shared)  # the open document's hold; its streams keep theirs
                    opened = None  # the document's cache goes; its streams hold their tiers
            if not live:
                continue
            # ---- one step for every live stream ----
            size = next(b for b in self.buckets if b >= len(live))
            step = self.steps.get(size)
            if step is None:
                step = self.steps[size] = BatchStep(self.model, pool, size, core_width, assoc_width, self.graphs,
                                                    members=members)
            if rebind:  # the bucket follows the live count, so an unchanged set keeps its step and its inputs
                step.bind([(st.pages, st.token, st.position, st.core) for st in live])
                rebind = False
                c0 = time.perf_counter()
                step.capture()  # a bucket's first use takes its graph here, outside the steps' time
                self.stats["capture_s"] += time.perf_counter() - c0
            t0 = time.perf_counter()
            tokens = step.run()[: len(live), 0].tolist()  # waits for the device
            seconds = time.perf_counter() - t0
            self.stats["step_s"] += seconds
            self.stats["steps"] += 1
            self.stats["max_live"] = max(self.stats["max_live"], len(live))
            self.stats["max_live_documents"] = max(self.stats["max_live_documents"], len({st.doc for st in live}))
            per = self.stats["buckets"].setdefault(size, {"steps": 0, "seconds": 0.0, "live": 0, "tier_bytes": 0})
            per["steps"] += 1
            per["seconds"] += seconds
            per["live"] += len(live)
            per["tier_bytes"] += sum(self._tier_bytes(st) for st in live)
            done = []
            for st, token in zip(live, tokens):
                if not st.steps:  # its decode starts with its first step, not when it was admitted
                    st.decode_started = t0
                st.steps += 1
                st.core += 1
                st.position += 1
                st.token = token
                if not self._take(st, token):
                    done.append(st)
            for st in done:
                live.remove(st)
                self._finish(st)
                rebind = True
        peak = metrics.peak_memory_bytes(self.device)
        for doc_out in outputs:
            for out in doc_out:
                if out.error is None:
                    out.peak_memory_bytes = peak
        self.stats["wall_s"] = time.perf_counter() - started
        self.stats["tokens"] = sum(len(o.tokens) for d in outputs for o in d)
        LAST_STATS.clear()
        LAST_STATS.update(self.stats)
        return outputs

    def _slices_only(self, cache: TieredCache) -> bool:
        """Whether every exact K/V of ``cache`` is in device memory (its archive a ``DeviceArchive``, or nothing
        archived yet): a second exact read is then slices, so a question's re-tier may follow its first token
        (``read_question(..., retier=False)``) instead of holding it back. Host archives keep the one read."""
        return all(getattr(layer.archive, "on_device", False) or layer.archive.length == 0 for layer in cache.layers)

    def _tier_bytes(self, st: _Stream) -> int:
        """Device bytes one step reads for a stream: its core (with the answer so far) and association tokens."""
        s = self.shape
        return ((st.core + 1) * s.core_page_bytes + st.pages.n_assoc * s.assoc_page_bytes) // s.page

    # ---- pieces of the run -------------------------------------------------------------------------------------
    def _open(self, index: int, doc: Document, outputs: list[StreamOutput]) -> _Open | None:
        """Prefill a document into a fresh tiered cache; on failure every question of it gets the error."""
        from docfuse.runtime.session import fill_cache

        tokens = len(doc.prefix)
        layers = self._layer_major(tokens)
        if layers and self.device.type == "cuda" and self._writer is None:
            from docfuse.runtime.kv.background import ArchiveWriter

            self._writer = ArchiveWriter()
        # a host archive adopts a stored entry's blocks; a DeviceArchive fills itself at the first re-tier
        host_archive = not self._device_archive(tokens)
        t0 = metrics.now(self.device)
        store_key = cache = None
        if self.kv_store is not None and not layers and self.kv.method == "tiered" and tokens:
            from docfuse.runtime.kv_store import fill_tiered, tiered_layers

            store_key = self.kv_store.key(self.model, list(doc.prefix), embeds=doc.embeds,
                                          chunk_size=self.prefill_chunk, kind="tiered")
        try:
            if store_key is not None:  # every token exact in the core, as a token-major prefill leaves it
                cache = self.kv_store.restore(store_key, lambda blocks: fill_tiered(
                    self._fresh_cache(tokens), blocks, self.device, adopt=host_archive), blobs=True)
            loaded = cache is not None
            if loaded:
                self.stats["kv_store_hits"] = self.stats.get("kv_store_hits", 0) + 1
            else:
                cache = self._fresh_cache(tokens)
                fill_cache(self.model, cache, list(doc.prefix), self.prefill_chunk, doc.embeds, layers=layers,
                           writer=self._writer)
            prefill_s = metrics.now(self.device) - t0
            # after the clock, as in Session: storing is not the first answer's wait
            if not loaded and store_key is not None and self.kv_store.keep(
                    store_key, tiered_layers(cache), source=doc.source, tokens=tokens,
                    adopt_into=cache if host_archive else None):
                self.stats["kv_store_saves"] = self.stats.get("kv_store_saves", 0) + 1
            # kv.questions: together: every question read exactly in one pass that re-tiers for all of them
            reads = read_questions(self.model, cache, doc.questions) if self.together else None
        except torch.OutOfMemoryError as exc:
            del cache
            torch.cuda.empty_cache()
            self._fail(outputs, "out_of_memory",
                       f"prefilling {len(doc.prefix)} tokens ran out of device memory ({str(exc).splitlines()[0]}); "
                       "set kv.prefill: layers, lower answer.prefill_chunk, or truncate the document")
            return None
        log.info("document %d: %d tokens prefilled in %.1f s%s", index, len(doc.prefix), prefill_s,
                 f", {len(reads)} questions read in {reads[0].read_s:.1f} s" if reads else "")
        return _Open(index, cache, cache.get_seq_length(), prefill_s, reads=reads)

    def _fresh_cache(self, tokens: int) -> TieredCache:
        """An empty tiered cache for a document of ``tokens``: compact association tiers for the page pool, the
        exact K/V kept on the device when they fit there (``archive``)."""
        cache = TieredCache(self.model.config, self.kv)
        for layer in cache.layers:
            layer.fixed_codes = False  # the page pool takes compact association tiers
        if self._device_archive(tokens):
            for layer in cache.layers:
                layer.archive = DeviceArchive()
        return cache

    def _start(self, opened: _Open, doc: Document, q: int, out: StreamOutput, started: float) -> _Stream | None:
        """Read question ``q`` of the open document, move its tiers into pages; ``None`` when it ends at once."""
        if opened.reads is not None:
            return self._start_shared(opened, doc, q, out, started)
        cache, model = opened.cache, self.model
        question = torch.tensor([list(doc.questions[q])], dtype=torch.long, device=self.device)
        t0 = metrics.now(self.device)
        # exact K/V in device memory: the first token comes from the exact read, the re-tier follows it
        deferred = self.kv.question == "exact" and self._slices_only(cache)
        if self.kv.question == "exact":
            logits = read_question(model, cache, question, retier=not deferred)
        else:
            from docfuse.runtime.session import forward_tokens

            prepare_question(model, cache, question)
            logits = forward_tokens(model, cache, list(doc.questions[q]))
        token = int(logits.argmax())
        now = time.perf_counter()
        out.ttft_s = now - t0 + (opened.prefill_s if q == 0 else 0.0)
        out.first_token_at_s = now - started
        if deferred:
            retier_after_read(cache, opened.prefix)
            self.stats["deferred_retier_s"] += metrics.now(self.device) - now
        acc = cache.accounting()
        out.kv_device_bytes, out.kv_host_bytes, out.kv_full_bytes = (acc["kv_device_bytes"], acc["kv_host_bytes"],
                                                                     acc["kv_full_bytes"])
        length = cache.get_seq_length()
        stream = _Stream(opened.index, q, StreamPages([], [], 0, 0), token, length, cache.layers[0].n_core,
                         doc.max_new_tokens, out)
        live = self._take(stream, token, first=True)
        if live:
            stream.pages = self.pool.load(cache, doc.max_new_tokens)
        cache.rollback(opened.prefix)
        return stream if live else None

    def _start_shared(self, opened: _Open, doc: Document, q: int, out: StreamOutput, started: float
                      ) -> _Stream | None:
        """Start question ``q`` from its read and the document's shared tiers (``kv.questions: together``)."""
        read, cache = opened.reads[q], opened.cache
        token = int(read.logits.argmax())
        now = time.perf_counter()
        # the pass that read it with the others and re-tiered (and, for the first question, the document's prefill)
        out.ttft_s = read.read_s + (opened.prefill_s if q == 0 else 0.0)
        out.first_token_at_s = now - started
        acc = cache.accounting()
        own = len(read) * sum(layer.token_bytes() for layer in cache.layers)  # its question, in the core
        out.kv_device_bytes, out.kv_host_bytes, out.kv_full_bytes = (acc["kv_device_bytes"] + own,
                                                                     acc["kv_host_bytes"], acc["kv_full_bytes"] + own)
        stream = _Stream(opened.index, q, StreamPages([], [], 0, 0), token, opened.prefix + len(read),
                         cache.layers[0].n_core + len(read), doc.max_new_tokens, out)
        if not self._take(stream, token, first=True):
            return None
        if opened.shared is None:
            have, counted = (cache.layers[0].n_core, cache.layers[0].n_assoc), self.shared_tokens(doc)
            if have[0] > counted[0] or have[1] > counted[1]:  # admission counted pages from shared_tokens
                raise RuntimeError(f"the shared tiers hold {have} (core, association) tokens where {counted} were "
                                   "counted: shared_tokens no longer follows read_questions' re-tier")
            opened.shared = self.pool.load_shared(cache)
        stream.pages = self.pool.attach(opened.shared, cache, read, doc.max_new_tokens)
        return stream

    def _take(self, st: _Stream, token: int, first: bool = False) -> bool:
        """Book ``token`` for the stream as ``Session`` does; whether the stream decodes on."""
        if token in self.stop_ids:
            st.out.finish_reason = "eos"
            return False
        st.out.tokens.append(token)
        if self.stop_when is not None and self.stop_when(st.out.tokens):
            st.out.finish_reason = "stop"
            return False
        if len(st.out.tokens) >= st.max_new:
            st.out.finish_reason = "length"
            return False
        return True

    def _finish(self, st: _Stream) -> None:
        seconds = time.perf_counter() - st.decode_started
        st.out.decode_tokens_per_s = st.steps / seconds if st.steps and seconds > 0 else 0.0
        self.pool.release(st.pages)

    def _too_long(self, doc: Document) -> str | None:
        reserve = max((len(q) for q in doc.questions), default=0) + doc.max_new_tokens
        if len(doc.prefix) + reserve <= self.limit:
            return None
        return (f"document is {len(doc.prefix)} tokens and the question plus answer need {reserve} more, the model "
                f"holds {self.limit}; set truncate: head (--set answer.truncate=head) or use a model with a longer "
                "context")

    def _fail(self, outputs: list[StreamOutput], kind: str, message: str) -> None:
        for out in outputs:
            out.error, out.finish_reason = f"{kind}: {message}", "error"

    def _too_large(self, doc: Document, need: tuple[int, int]) -> str:
        s, pool = self.shape, self.pool
        want = need[0] * s.core_page_bytes + need[1] * s.assoc_page_bytes
        return (f"a question on this {len(doc.prefix)}-token document needs {want / 2**20:.1f} MiB of device tiers "
                f"({need[0]} core and {need[1]} association pages) and the engine's pool holds "
                f"{pool.nbytes() / 2**20:.1f} MiB ({pool.core_total} and {pool.assoc_total}); lower kv.core_tokens, "
                "kv.association_tokens or kv.association_bits, or truncate the document (answer.truncate: head)")
