"""Capture the (post-RoPE) query vectors of the tokens a model is processing, to score pages for a question.

The attention modules of Llama-family models compute queries internally and do not expose them, so a forward
pre-hook recomputes ``q_proj`` (plus ``q_norm`` where the model has one) and RoPE for the last few tokens only;
that costs a sliver of the forward pass and needs no change to the model.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from docfuse.runtime.kv.code_attention import grouped_sdpa
from docfuse.runtime.llama_block import rope


class QuerySink(Protocol):
    """What a cache offers to receive queries (TieredCache and SnapKVCache do)."""

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def record_query(self, layer_idx: int, queries: torch.Tensor, positions: torch.Tensor) -> None: ...


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx") and hasattr(m, "head_dim")]


def _hook(cache: QuerySink, limit: int):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        b, t, _ = hidden.shape
        m = min(limit, t)
        with torch.no_grad():
            q = module.q_proj(hidden[:, -m:]).view(b, m, -1, module.head_dim)
            if hasattr(module, "q_norm"):
                q = module.q_norm(q)
            q = q.transpose(1, 2)
            c, s = cos[:, -m:].unsqueeze(1), sin[:, -m:].unsqueeze(1)
            q = rope(q, c, s)
        start = cache.get_seq_length(module.layer_idx) + t - m
        cache.record_query(module.layer_idx, q.detach(), torch.arange(start, start + m))

    return hook


@contextmanager
def record_queries(model: torch.nn.Module, cache: QuerySink, tokens: int = 64) -> Iterator[None]:
    """While active, every forward pass hands the queries of its last ``tokens`` tokens to ``cache``, per layer."""
    modules = _attention_modules(model)
    if not modules:
        raise ValueError("model has no Llama-style attention modules (q_proj, layer_idx, head_dim) to record from")
    handles = [m.register_forward_pre_hook(_hook(cache, tokens), with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the cache argument of ``model.forward``: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _last_logits_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """Forward arguments for a question pass over ``cache`` that needs only the last position's logits."""
    kwargs: dict[str, Any] = {cache_kwarg(model): cache}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    return kwargs


def prepare_question(model: torch.nn.Module, cache: Any, question_ids: torch.Tensor) -> None:
    """Re-tier ``cache`` (already holding the document) for a question, leaving its length unchanged.

    Runs the question once to record its queries, rolls the cache back to the document, then re-tiers from those
    queries. The caller then feeds the question again (e.g. ``generate`` on document + question ids), this time
    attending to the re-tiered cache; the document is never prefilled twice.
    """
    prefix = cache.get_seq_length()
    kwargs = _last_logits_kwargs(model, cache)  # only the queries matter here
    tokens = getattr(getattr(cache, "kv", None), "query_tokens", 64)
    with torch.no_grad(), record_queries(model, cache, tokens=tokens), grouped_sdpa(model, causal=True):
        model(input_ids=question_ids, use_cache=True, **kwargs)
    queries = cache.take_queries()
    cache.rollback(prefix)
    cache.retier(queries=queries)


def read_question(model: torch.nn.Module, cache: Any, question_ids: torch.Tensor, retier: bool = True
                  ) -> torch.Tensor:
    """Append the question to ``cache`` (a TieredCache holding the document), read at full precision, then re-tier
    for it; returns the logits of its last position (the first answer token's).

    One pass over the question: under ``cache.exact_view()`` it attends to every document token exactly while its
    queries are recorded, so its hidden states, queries and first token are those of a full cache. Each layer is
    re-tiered as soon as it has read, from that same read; the question's own tokens stay in the core, and the
    answer's later tokens read the tiers.

    ``retier=False``: the pass only reads, its queries stay recorded in the layers, and the caller re-tiers later
    with :func:`retier_after_read` (the same tiers, bit for bit). Where the exact K/V are device slices (a
    ``DeviceArchive``, or a core that holds every position) reading them twice costs nothing, and the first answer
    token exists before the re-tier runs: the GPU engine emits it first.
    """
    prefix = cache.get_seq_length()
    kwargs = _last_logits_kwargs(model, cache)
    positions = torch.arange(prefix, prefix + question_ids.shape[1], device=question_ids.device).unsqueeze(0)
    # each layer re-tiers inside the pass, from the exact read its attention just made (one archive read, not two)
    with torch.no_grad(), cache.exact_view(retier_from=prefix if retier else None), \
            record_queries(model, cache, tokens=cache.kv.query_tokens), grouped_sdpa(model, causal=True):
        out = model(input_ids=question_ids, position_ids=positions, use_cache=True, **kwargs)
    return out.logits[0, -1]


def retier_after_read(cache: Any, prefix: int) -> None:
    """Re-tier ``cache`` for the question that ``read_question(..., retier=False)`` has just read over a document of
    ``prefix`` tokens, from the queries that pass recorded: what the pass would have done layer by layer."""
    with torch.no_grad():
        cache.retier(cache.take_queries(), keep_from=prefix, exact=True)


@dataclass
class QuestionRead:
    """One question read exactly over the document with the others (``kv.questions: together``): the first answer
    token's logits, each layer's K/V of the question's own tokens (put back behind the shared tiers by
    ``TieredCache.append_read`` when its answer starts) and the seconds of the pass that read them all and re-tiered
    (when its first token existed)."""

    ids: tuple[int, ...]
    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    read_s: float = 0.0

    def __len__(self) -> int:
        return len(self.ids)


def question_mask(prefix: int, lengths: Sequence[int], device: torch.device | str,
                  eager_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A [1, 1, T, prefix + T] mask for questions laid end to end after a document of ``prefix`` tokens: each question
    attends to the whole document and causally to its own tokens, never to another question's (True = attends; an
    additive mask of ``eager_dtype`` for eager attention)."""
    total = sum(lengths)
    mask = torch.zeros(total, prefix + total, dtype=torch.bool, device=device)
    mask[:, :prefix] = True
    start = 0
    for n in lengths:
        mask[start: start + n, prefix + start: prefix + start + n] = torch.ones(n, n, dtype=torch.bool,
                                                                                device=device).tril()
        start += n
    if eager_dtype is not None:
        return torch.zeros(mask.shape, dtype=eager_dtype, device=device).masked_fill_(~mask, float("-inf"))[None, None]
    return mask[None, None]


def read_questions(model: torch.nn.Module, cache: Any, questions: Sequence[Sequence[int]]) -> list[QuestionRead]:
    """Read every question exactly over the document (as :func:`read_question` reads one) in one pass, re-tier the
    document once for all of them inside that pass, keep each one's first-token logits and its own K/V, and roll
    the questions back: the cache then holds the document, tiered for every question.

    The questions go through the model end to end, each at the positions it would have alone and masked from the
    others (:func:`question_mask`), so each one's logits, K/V and queries are those of its own exact read; each layer
    re-tiers from every question's last ``query_tokens`` queries as soon as it has read (one read of the archive for
    the whole document, as for one question). The answers' later tokens read tiers chosen for all the questions at
    once (``kv.questions: together``)."""
    started = time.perf_counter()
    prefix = cache.get_seq_length()
    device = next(model.parameters()).device
    asked = [tuple(int(i) for i in q) for q in questions]
    lengths = [len(q) for q in asked]
    if not asked or min(lengths) == 0:
        raise ValueError("every question needs at least one token")
    total = sum(lengths)
    ids = torch.tensor([[i for q in asked for i in q]], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(prefix, prefix + n) for n in lengths]).to(device).unsqueeze(0)
    eager = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
    mask = question_mask(prefix, lengths, device, model.dtype if eager else None)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    limit = cache.kv.query_tokens

    def own_queries(queries: torch.Tensor) -> torch.Tensor:  # each question's last ``query_tokens`` queries
        return torch.cat([queries[:, :, max(e - n, e - limit): e] for e, n in zip(ends, lengths)], dim=2)

    kwargs = {cache_kwarg(model): cache}
    cache.record_limit = total
    try:
        with torch.no_grad(), cache.exact_view(retier_from=prefix, select_queries=own_queries), \
                record_queries(model, cache, tokens=total), grouped_sdpa(model):
            out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **kwargs)
    finally:
        cache.record_limit = None
    logits = out.logits[0, torch.tensor(ends, device=out.logits.device) - 1]
    # the questions' tokens are the newest positions, so the core's last ``total`` rows, in order
    own = [(layer.keys[:, :, layer.n_core - total: layer.n_core].clone(),
            layer.values[:, :, layer.n_core - total: layer.n_core].clone()) for layer in cache.layers]
    cache.rollback(prefix)
    logits.max().item()  # the pass is done when its time is taken
    read_s = time.perf_counter() - started
    return [QuestionRead(q, logits[j], [k[:, :, e - n: e] for k, _ in own], [v[:, :, e - n: e] for _, v in own],
                         read_s) for j, (q, n, e) in enumerate(zip(asked, lengths, ends))]
