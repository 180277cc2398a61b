"""Sessions: one prefill of a document, then many questions on it.

The document prefix is prefilled once, in chunks, into a ``DynamicCache`` or, given a ``kv`` config, a
``TieredCache`` that each question re-tiers from its own queries before it is answered (see runtime.kv). Each question prefills only its own
suffix, decodes greedily, and the cache is cropped back to the document prefix before the next question, so the
answers equal those of a fresh prefill per question.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from docfuse.runtime import metrics
from docfuse.runtime.kv import KVConfig, as_kv_config, make_cache, prepare_question, read_question
from docfuse.runtime.kv.code_attention import grouped_sdpa, reading_codes
from docfuse.runtime.kv.queries import record_queries
from docfuse.runtime.loading import TIGHT_PREFILL_CHUNK
from docfuse.runtime.prompt import ChatPrompt, DocumentPrefix, Truncate, truncate_prefix
from docfuse.runtime.pruning import Pruner, PruningConfig, find_head

@dataclass
class Progress:
    """Callbacks a caller (``docfuse ask`` on a terminal) installs with :data:`PROGRESS` to show a session's work as
    it happens: document tokens prefilled so far, and each new piece of answer text."""

    on_prefill: Callable[[int, int], None] | None = None  # (tokens done, tokens in all)
    on_text: Callable[[str], None] | None = None  # the answer's text added by its newest token


#: The progress callbacks of the current context (None: nothing to report). A ContextVar, so that only the caller
#: who set it (and the pipeline it runs in this thread) sees them.
PROGRESS: ContextVar[Progress | None] = ContextVar("docfuse_session_progress", default=None)

#: Room kept for a question when ``prefill_document`` is not told the questions.
DEFAULT_QUESTION_RESERVE = 64


class ContextTooLong(ValueError):
    """The prompt plus the answer's token budget exceed the model's context window."""

    def __init__(self, document_tokens: int, extra_tokens: int, limit: int) -> None:
        self.document_tokens = document_tokens
        self.extra_tokens = extra_tokens
        self.limit = limit
        super().__init__(
            f"document is {document_tokens} tokens and the question plus answer need {extra_tokens} more, "
            f"the model holds {limit}")


@dataclass(frozen=True)
class Sampling:
    """Temperature and nucleus (top-p) sampling; temperature 0 is greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def draw(self, logits: torch.Tensor, rng: torch.Generator | None) -> int:
        """One token id from ``logits`` (the last position's): the smallest set of most likely tokens whose
        probability reaches ``top_p`` (always the most likely one), renormalised, at ``temperature``."""
        probs = (logits.float().flatten().cpu() / self.temperature).softmax(-1)
        ordered, ids = probs.sort(descending=True)
        keep = (ordered.cumsum(-1) - ordered) < self.top_p  # a token is kept while the mass before it is short
        keep[0] = True
        ordered = ordered * keep
        return int(ids[torch.multinomial(ordered / ordered.sum(), 1, generator=rng)])


@dataclass
class Answer:
    """One question's answer and its measurements."""

    question: str
    text: str
    #: Tokens the model read for this question: the document prefix plus this question's suffix.
    prompt_tokens: int
    new_tokens: int
    #: Seconds to the first answer token; the first question after ``prefill`` includes the document prefill.
    ttft_s: float
    decode_tokens_per_s: float
    kv_device_bytes: int
    kv_host_bytes: int
    kv_full_bytes: int
    peak_memory_bytes: int
    skipped_fraction: float = 0.0
    finish_reason: str = "eos"  # eos | length | stop (a stop string or a repeat, see runtime.stopping)
    #: 0-based pages the answer's attention rests on (runtime.citations); None where not recorded.
    cited_pages: list[int] | None = None


def context_limit(model: Any) -> int:
    """The most positions the model handles (``config.max_position_embeddings``)."""
    return int(model.config.max_position_embeddings)


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids: the tokenizer's eos, ``<|im_end|>`` where the vocabulary has it, the generation config's."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def cache_kwarg(model: Any) -> str:
    """The forward argument that takes the KV cache: ``cache`` from transformers 5.2x, ``past_key_values`` before.

    Passing the other name would not fail: it would vanish into ``**kwargs`` and silently run without the cache.
    """
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def crop_cache(cache: Any, length: int) -> None:
    """Roll the cache back to its first ``length`` tokens (transformers 5 ``crop`` takes minus the tokens to drop)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a {cache.get_seq_length()}-token cache to {length} tokens")
    if extra:
        cache.crop(-extra)


class Session:
    """A model, a tokenizer and the KV cache of one document."""

    def __init__(self, model: Any, tokenizer: Any, prompt: ChatPrompt | None = None,
                 max_context: int | None = None, kv: KVConfig | dict | None = None,
                 pruning: PruningConfig | dict | None = None, stop: Any = None, cite: bool = False,
                 sampling: Sampling | None = None, kv_store: Any = None) -> None:
        """``max_context`` lowers the context window below the model's (to bound memory, or in tests).

        ``kv``: None for a plain full cache, else the tiered cache's budgets (a KVConfig or its dict).
        ``pruning``: None for dense decoding, else the decision head's threshold and safe mode (runtime.pruning);
        a model without a calibrated head decodes dense and says so once.
        ``stop``: None to stop only at end-of-sequence, else stop strings and the repetition stop
        (runtime.stopping.StopConfig or its dict).
        ``sampling``: None (or temperature 0) for greedy decoding, else temperature and top-p sampling, seeded
        per question so the same question over the same document gives the same answer run after run.
        ``cite``: fill each answer's ``cited_pages`` from its attention over the document (runtime.citations; a
        full cache only: the tiered cache leaves it None).
        ``kv_store``: a :class:`runtime.kv_store.KVStore`: a document prefilled before (same model, prefix, dtype
        and chunk size) is loaded from it instead of prefilled, and a new one is stored (a full cache only).
        """
        self.kv = as_kv_config(kv) if kv is not None else None
        self.model = model
        self.tokenizer = tokenizer
        self.prompt = prompt or ChatPrompt(tokenizer)
        self.device = next(model.parameters()).device
        self.limit = min(context_limit(model), max_context or context_limit(model))
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.stopper = None
        if stop is not None:
            from docfuse.runtime.stopping import StopConfig, Stopper

            config = stop if isinstance(stop, StopConfig) else StopConfig.model_validate(stop)
            self.stopper = Stopper(config, tokenizer)
        self._cache_kwarg = cache_kwarg(model)
        self.cache: Any = None
        self.prefix_length = 0
        self.prefix_ids: list[int] = []
        self.cite = cite
        self.kv_store = kv_store
        #: Whether the last ``prefill`` loaded the document's cache from ``kv_store`` instead of computing it.
        self.loaded_from_store = False
        self.sampling = sampling if sampling is not None and sampling.temperature > 0 else None
        self._citer: Any = None  # runtime.citations.Citer of the prefilled document, made at its first citation
        #: How many document prefills this session ran (one per document, however many questions).
        self.document_prefills = 0
        self.document_prefill_s = 0.0
        self._charge_prefill = False
        self._writer: Any = None  # runtime.kv.background.ArchiveWriter, made on the first layer-major prefill on CUDA
        #: ``kv.questions: together``: the questions read for the current tiers (``read_questions``), by suffix ids
        self._reads: dict[tuple[int, ...], Any] = {}
        self.pruning = PruningConfig.model_validate(pruning) if isinstance(pruning, dict) else pruning
        self.pruner: Pruner | None = None
        if self.pruning is not None:
            head = find_head(model, self.pruning.head)
            if head is not None:
                self.pruner = Pruner.for_model(model, head, self.pruning.threshold)

    def fit_document(self, document: str, *, questions: Sequence[str] = (), max_new_tokens: int = 128,
                     truncate: Truncate = "none") -> DocumentPrefix:
        """The document's prefix tokens, shortened per ``truncate`` so every question and its answer fit.

        Raises ``ContextTooLong`` when they do not fit and ``truncate`` is ``none``.
        """
        prefix = self.prompt.prefix(document)
        suffix = max((len(self.prompt.suffix(q)) for q in questions), default=DEFAULT_QUESTION_RESERVE)
        reserve = suffix + max_new_tokens
        if len(prefix) + reserve <= self.limit:
            return prefix
        if truncate == "none" or self.limit - reserve <= prefix.body_start:
            raise ContextTooLong(len(prefix), reserve, self.limit)
        return truncate_prefix(prefix, self.limit - reserve, truncate, self.prompt.elision())

    @torch.inference_mode()
    def prefill(self, document_ids: Sequence[int] | DocumentPrefix, chunk_size: int = 512,
                embeds: torch.Tensor | None = None, source: str = "") -> float:
        """Prefill the document prefix into a fresh cache, ``chunk_size`` tokens per forward; returns seconds.

        Chunks bound the attention scores' memory (chunk x context) while reusing the cache between chunks.
        ``embeds`` ([len(ids), hidden]) replaces the ids' own embeddings: a fused stream (fusion.gate).
        ``source``: the document's name, kept with its entry in ``kv_store`` (``docfuse kv-store list``).
        """
        ids = list(document_ids.ids if isinstance(document_ids, DocumentPrefix) else document_ids)
        if embeds is not None and embeds.shape[0] != len(ids):
            raise ValueError(f"embeds has {embeds.shape[0]} rows for {len(ids)} ids; give one row per position")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if len(ids) >= self.limit:
            raise ContextTooLong(len(ids), 1, self.limit)
        metrics.reset_peak_memory(self.device)
        started = metrics.now(self.device)
        store_key = None
        self.loaded_from_store = False
        kind = self._store_kind()
        if kind is not None and ids:
            from docfuse.runtime.kv_store import fill_dynamic, fill_tiered

            store_key = self.kv_store.key(self.model, ids, embeds=embeds, chunk_size=chunk_size, kind=kind)

            def fill(layers: list) -> Any:
                if kind == "full":
                    return fill_dynamic(self.model.config, layers, self.device)
                return fill_tiered(make_cache(self.model.config, self.kv), layers, self.device)

            loaded = self.kv_store.restore(store_key, fill, blobs=kind == "tiered")
            if loaded is not None:  # the same prefill ran before: its exact state, bit for bit
                self.cache = loaded
                self.loaded_from_store = True
                return self._prefilled(ids, started)
        layers = self.kv is not None and self.kv.prefill == "layers"
        if layers and ids and self.device.type == "cuda" and self._writer is None:
            from docfuse.runtime.kv.background import ArchiveWriter

            self._writer = ArchiveWriter()
        try:
            self._fill(ids, chunk_size, embeds, layers)
        except torch.OutOfMemoryError as exc:
            if chunk_size <= TIGHT_PREFILL_CHUNK or layers:
                raise
            # a long pass (prefill_chunk: auto is 131,072 on CUDA) did not fit beside what the device holds: the
            # same document in 8,192-token passes needs a fraction of the activations
            warnings.warn(f"prefilling {len(ids)} tokens in passes of {chunk_size} ran out of device memory "
                          f"({str(exc).splitlines()[0]}); prefilling in passes of {TIGHT_PREFILL_CHUNK} instead (set "
                          "answer.prefill_chunk to choose)", stacklevel=2)
            chunk_size = TIGHT_PREFILL_CHUNK
            self.cache = None  # what the failed pass left, then the allocator's cached blocks with it
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._fill(ids, chunk_size, embeds, layers)
            if store_key is not None:  # the state is that of the smaller passes: keyed as such
                store_key = self.kv_store.key(self.model, ids, embeds=embeds, chunk_size=chunk_size, kind=kind)
        self.document_prefills += 1
        seconds = self._prefilled(ids, started)
        if store_key is not None:  # after the clock: storing is not the first answer's wait
            from docfuse.runtime.kv_store import cache_layers, tiered_layers

            # a tiered entry becomes the archive now, as on a later run's load
            self.kv_store.keep(store_key, cache_layers(self.cache) if kind == "full" else tiered_layers(self.cache),
                               source=source, tokens=len(ids), adopt_into=self.cache if kind == "tiered" else None)
        return seconds

    def _fill(self, ids: list[int], chunk_size: int, embeds: torch.Tensor | None, layers: bool) -> None:
        """A fresh cache holding the document (the previous document's cache is dropped first)."""
        self.cache = None
        self.cache = make_cache(self.model.config, self.kv) if self.kv is not None else DynamicCache(config=self.model.config)
        fill_cache(self.model, self.cache, ids, chunk_size, embeds, layers=layers, writer=self._writer)

    def _store_kind(self) -> str | None:
        """Which cache ``kv_store`` keeps for this session: ``full`` (no ``kv:``), ``tiered`` (a tiered cache
        prefilled token-major, exact until its first re-tier), or ``None`` (no store; a layer-major prefill tiers as
        it goes, eviction drops tokens: neither state is stored)."""
        if self.kv_store is None:
            return None
        if self.kv is None:
            return "full"
        return "tiered" if self.kv.method == "tiered" and self.kv.prefill == "tokens" else None

    def _prefilled(self, ids: list[int], started: float) -> float:
        self.prefix_length = self.cache.get_seq_length()
        self.prefix_ids = ids
        self._citer = None
        self._reads = {}
        self.document_prefill_s = metrics.now(self.device) - started
        self._charge_prefill = True
        return self.document_prefill_s

    @property
    def together(self) -> bool:
        """Whether the questions of one prefill share one re-tier (``kv.questions: together``)."""
        return self.kv is not None and self.kv.method == "tiered" and self.kv.questions == "together"

    @torch.inference_mode()
    def read_questions(self, questions: Sequence[str]) -> None:
        """``kv.questions: together``: read every question exactly, then re-tier the document once for all of them;
        ``ask`` then answers each from the shared tiers. Nothing to do for other caches (``ask`` re-tiers per
        question there). Asking a question that was not read here re-tiers for that question alone."""
        if not self.together:
            return
        if self.cache is None:
            raise RuntimeError("no document prefilled; call session.prefill(document_ids) first")
        from docfuse.runtime.kv import read_questions

        suffixes = list(dict.fromkeys(tuple(self.prompt.suffix(q)) for q in questions))
        crop_cache(self.cache, self.prefix_length)
        self._reads = {r.ids: r for r in read_questions(self.model, self.cache, suffixes)}

    @torch.inference_mode()
    def ask(self, question: str, max_new_tokens: int = 128, *, safe_mode: bool | None = None,
            threshold: float | None = None) -> Answer:
        """Answer ``question`` from the prefilled document by greedy decoding, then restore the cache.

        ``safe_mode`` / ``threshold`` override the session's pruning for this request only (safe mode = dense).

        ``ttft_s`` of the first question after ``prefill`` includes the document prefill time (that is what a
        user waits for); later questions count only their own suffix prefill. Raises ``ContextTooLong`` when the
        prompt plus ``max_new_tokens`` exceed the model's context.
        """
        if self.cache is None:
            raise RuntimeError("no document prefilled; call session.prefill(document_ids) first")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        suffix = self.prompt.suffix(question)
        if self.prefix_length + len(suffix) + max_new_tokens > self.limit:
            raise ContextTooLong(self.prefix_length, len(suffix) + max_new_tokens, self.limit)
        if not self._charge_prefill:
            metrics.reset_peak_memory(self.device)
        prune = self.pruner is not None and not (self.pruning.safe_mode if safe_mode is None else safe_mode)
        if prune:
            self.pruner.threshold = self.pruning.threshold if threshold is None else threshold
            prune = self.pruner.threshold > 0
        try:
            return self._answer(question, suffix, max_new_tokens, prune)
        finally:
            if self.pruner is not None:
                self.pruner.mode = "off"
            crop_cache(self.cache, self.prefix_length)

    def _answer(self, question: str, suffix: list[int], max_new_tokens: int, prune: bool = False) -> Answer:
        started = metrics.now(self.device)
        tiered = hasattr(self.cache, "retier")
        kv = getattr(self.cache, "kv", None) if tiered else None
        first: torch.Tensor | None = None  # the first answer token's logits, when re-tiering already read the question
        question_ids = torch.tensor([suffix], dtype=torch.long, device=self.device)
        # Re-tier for this question from its own queries; counted in its time to first token.
        if self.together:
            if tuple(suffix) not in self._reads:  # asked without read_questions: the shared tiers are its own
                self.read_questions([question])
            read = self._reads[tuple(suffix)]
            self.cache.append_read(read)
            first = read.logits
            started -= read.read_s  # the pass that read it (with the others) and re-tiered came before
        elif kv is not None and kv.question == "exact":
            first = read_question(self.model, self.cache, question_ids)
        elif tiered:
            prepare_question(self.model, self.cache, question_ids)
        recording = codes = contextlib.nullcontext()
        if kv is not None and kv.retier_every:
            # Decode-time re-tiers rank tokens by the newest queries (the question's, then the answer's own).
            recording = record_queries(self.model, self.cache, tokens=kv.query_tokens)
        if kv is not None and kv.decode == "codes":
            # One-token steps attend to the association tier's packed codes directly (runtime.kv.code_attention).
            codes = reading_codes(self.model, self.cache)
        with recording, codes:
            return self._decode(question, suffix, max_new_tokens, prune, tiered, started, first)

    def _decode(self, question: str, suffix: list[int], max_new_tokens: int, prune: bool, tiered: bool,
                started: float, first: torch.Tensor | None = None) -> Answer:
        # a fresh generator per question: answers repeat run after run
        rng = torch.Generator().manual_seed(self.sampling.seed) if self.sampling is not None else None
        token = self._pick(self._forward(suffix) if first is None else first, rng)
        ttft = time.perf_counter() - started  # argmax().item() waited for the device
        if tiered and hasattr(self.cache, "start_decode"):
            self.cache.start_decode()
        if self._charge_prefill:
            ttft += self.document_prefill_s
            self._charge_prefill = False
        generated: list[int] = []
        steps, finish = 0, "eos"
        if prune:  # decode steps only: the document and the question's suffix were prefilled dense
            self.pruner.reset_counts()
            self.pruner.mode = "decode"
        decode_started = time.perf_counter()
        progress = PROGRESS.get()
        shown = ""
        while token not in self.stop_ids:
            generated.append(token)
            if progress is not None and progress.on_text is not None:
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if text.startswith(shown) and len(text) > len(shown):
                    progress.on_text(text[len(shown):])
                    shown = text
            if self.stopper is not None and self.stopper.should_stop(generated):
                finish = "stop"
                break
            if len(generated) >= max_new_tokens:
                finish = "length"
                break
            token = self._pick(self._forward([token]), rng)
            steps += 1
            if tiered:
                self.cache.maybe_retier()
        decode_s = time.perf_counter() - decode_started
        seq = self.cache.get_seq_length()
        if tiered:
            acc = self.cache.accounting()
            kv_device, kv_host, kv_full = acc["kv_device_bytes"], acc["kv_host_bytes"], acc["kv_full_bytes"]
        else:
            kv_device, kv_host = metrics.kv_bytes(self.cache), 0
            kv_full = metrics.full_kv_bytes(self.model.config, seq, self.model.dtype)
        peak = metrics.peak_memory_bytes(self.device)
        cited = None  # after the accounting: the citation pass crops the cache
        if self.cite and not tiered and generated:
            from docfuse.runtime.citations import Citer

            if prune:
                self.pruner.mode = "off"  # the citation pass reads every block
            if self._citer is None:
                self._citer = Citer(self.model, self.tokenizer, self.prompt, self.prefix_ids)
            cited = self._citer.cite(self.cache, suffix, generated)
        return Answer(
            question=question,
            text=self._text(generated),
            prompt_tokens=self.prefix_length + len(suffix),
            new_tokens=len(generated),
            ttft_s=ttft,
            decode_tokens_per_s=steps / decode_s if steps and decode_s > 0 else 0.0,
            kv_device_bytes=kv_device,
            kv_host_bytes=kv_host,
            kv_full_bytes=kv_full,
            peak_memory_bytes=peak,
            skipped_fraction=self.pruner.skipped_fraction if prune else 0.0,
            finish_reason=finish,
            cited_pages=cited,
        )

    def _pick(self, logits: torch.Tensor, rng: torch.Generator | None) -> int:
        """The next token: the most likely (greedy), or a draw from the top-p share at the temperature."""
        if self.sampling is None:
            return int(logits.argmax())
        return self.sampling.draw(logits, rng)

    def _text(self, generated: list[int]) -> str:
        """The answer's text: cut at a stop string or before a repeat when ``stop`` is set."""
        if self.stopper is None:
            return self.tokenizer.decode(generated, skip_special_tokens=True).strip()
        return self.stopper.text(generated)

    def _forward(self, ids: Sequence[int], embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``ids`` (or their ``embeds`` rows) through the model on top of the cache; the last position's logits."""
        return forward_tokens(self.model, self.cache, ids, embeds)


def _inputs(model: Any, ids: Sequence[int], embeds: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's input for ``ids`` as one batch row: their ids, or their ``embeds`` rows when given."""
    device = next(model.parameters()).device
    if embeds is None:
        return {"input_ids": torch.tensor([list(ids)], dtype=torch.long, device=device)}
    return {"inputs_embeds": embeds.to(device, model.dtype).unsqueeze(0)}


def forward_tokens(model: Any, cache: Any, ids: Sequence[int], embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``ids`` (or their ``embeds`` rows) through ``model`` on top of ``cache``; the last position's logits."""
    past = cache.get_seq_length()
    device = next(model.parameters()).device
    positions = torch.arange(past, past + len(ids), device=device).unsqueeze(0)
    # several tokens over a cache (a prefill chunk, a question): grouped K/V heads read in place on the CPU, no mask
    # built on a GPU (flash attention applies the causal diagonal itself: code_attention.unpadded_causal); one token
    # on the CPU: docfuse's attention too (in bf16, two matmuls instead of SDPA's slower kernel there)
    with grouped_sdpa(model, causal=True) if len(ids) > 1 or device.type == "cpu" else contextlib.nullcontext():
        out = model(**_inputs(model, ids, embeds), position_ids=positions, use_cache=True, logits_to_keep=1,
                    **{cache_kwarg(model): cache})
    return out.logits[0, -1]


@torch.inference_mode()
def fill_cache(model: Any, cache: Any, ids: Sequence[int], chunk_size: int, embeds: torch.Tensor | None = None,
               layers: bool = False, writer: Any = None) -> None:
    """Prefill an empty ``cache`` with a document: ``chunk_size`` tokens per forward, or with ``layers`` one layer
    over the whole document at a time (runtime.layer_prefill; ``writer`` archives each layer in the background)."""
    if layers and ids:
        from docfuse.runtime.layer_prefill import MAX_CHUNK, layer_major_prefill

        layer_major_prefill(model, cache, chunk=min(chunk_size, MAX_CHUNK), writer=writer,
                            **_inputs(model, ids, embeds))
        return
    progress = PROGRESS.get()
    for start in range(0, len(ids), chunk_size):
        rows = None if embeds is None else embeds[start:start + chunk_size]
        forward_tokens(model, cache, ids[start:start + chunk_size], rows)
        if progress is not None and progress.on_prefill is not None:
            progress.on_prefill(min(len(ids), start + chunk_size), len(ids))
