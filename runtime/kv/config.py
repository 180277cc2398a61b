"""KVConfig: the decode stage's ``kv:`` block, validated once so a bad budget fails before any model runs."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

Budget = int | float | Literal["auto"]

#: Share of free device memory that ``core_tokens: auto`` may spend on the core tier.
AUTO_CORE_FRACTION = 0.5


class KVConfig(BaseModel):
    """Budgets and encodings of the tiered KV cache.

    Budgets are per layer and KV head: an int is a token count, a float in (0, 1] a fraction of the cached length
    at re-tier time. The core budget includes the sink and recent tokens (it is raised to cover them).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    core_tokens: Budget = 0.10
    #: 1.0 (the default): every token outside the core stays on the device as codes, and the background tier
    #: holds only the exact archive. Chosen by fidelity through the pipeline (bench/RESULTS.md, issue 29): at 0.25 the
    #: answer's later tokens could not see 65% of the document and lost 2 of 22 planted facts on the tuning half that
    #: the full cache answered; at 1.0 none. Device share ~0.40 of a full cache instead of ~0.20.
    association_tokens: int | float = 1.0
    #: Bits of the association codes. Default 8, set by fidelity (issue 29, bench/RESULTS.md): with 4-bit keys the
    #: tuning half (165 questions, H100) lost 5 of 68 planted facts the full cache answered; 8-bit keys with 4-bit
    #: values lost none there but changed the demo's fee (data/sample.pdf: "42,500" for "4,250"); 8-bit keys and
    #: values lost 2 of 68 there, answered the demo as the full cache does, and have the smallest teacher-forced logit
    #: error. In float32, held against the float32 full cache (third pass), 8/8 lost none of the planted facts on
    #: either half, exact agreement 0.970 tune / 0.987 check; 8/4 lost none too, at 0.939 / 0.922. Fidelity first,
    #: so 8/8. Device share ~0.63 of a full bf16 cache (8/4: ~0.51, 4/4: ~0.40). The engine's paged kernel reads 4-
    #: and 8-bit codes; the batch-1 kernel of bench_gpu_128k (runtime.gpu.attention_kernel) reads 4-bit codes only.
    association_bits: Literal[2, 4, 8] = 8
    #: Bits of the association *keys* when they differ from the values' (``None``: ``association_bits``). Keys set
    #: the softmax weight of every token outside the core, so their error counts most: ``association_bits: 4`` with
    #: ``association_key_bits: 8`` (share ~0.51) kept every planted fact of the tuning half; 4/8 lost 4 of 68.
    association_key_bits: Literal[2, 4, 8] | None = None
    sink_tokens: int = 4
    recent_tokens: int = 64
    page_tokens: int = 64
    group_tokens: int = 32
    differential: bool = False
    background: Literal["lz4"] | None = "lz4"
    #: Re-tier every N decode steps, ranked by the newest queries (the question's, then the answer's own), so the
    #: tokens the answer is copying from move into the core; ``None``: only each question re-tiers. Each costs one
    #: re-tier (about 2 s at 8K tokens on 2 CPU cores): see bench/RESULTS.md, issue 3.
    retier_every: int | None = None
    query_tokens: int = 64
    #: ``tokens``: rank single tokens by the question's attention over the keys the device holds, plus background
    #: pages the summaries nominate (runtime.kv.votes); ``pages``: rank whole pages by their summaries alone.
    scoring: Literal["tokens", "pages"] = "tokens"
    #: Background tokens per head whose pages the summaries nominate for exact scoring at a re-tier (count or fraction).
    #: 1.0 (the default) scores every token from its exact key, read from the host archive once per layer: the tiers
    #: then do not depend on what the last question left, and a layer-major prefill tiers exactly as a token-major one
    #: (bench/RESULTS.md, issue 29). Lower values read less of the archive and rank the rest by page summaries.
    candidate_tokens: int | float = 1.0
    #: Width of the average pool that spreads each token's vote to its neighbours (odd; 1 = no pooling): a needle's
    #: value sits beside the words the question attends to, and the answer copies it through heads that the question
    #: barely used. 15 lost no case of the needle benchmark where 7 lost one (bench/RESULTS.md, issue 3).
    vote_pool: int = 15
    #: Share of the best vote any KV head of the layer gives a token, added to every head's own vote: a fact that one
    #: head finds for the question is kept in the others too, for the answer copies it through heads that did not
    #: attend to it while reading the question. 0 ranks every head alone.
    vote_sharing: float = 0.0
    #: How a one-token decode step reads the association tier: ``codes`` attends to the packed codes directly
    #: (runtime.kv.code_attention; models on SDPA), ``dequantise`` expands them to model precision first and runs the
    #: model's own attention. Both compute the same attention (to float rounding); ``codes`` is faster on CPUs.
    decode: Literal["codes", "dequantise"] = "codes"
    #: ``tokens``: the usual chunked prefill (every layer per chunk; the full cache exists until the first re-tier).
    #: ``layers``: layer-major prefill (runtime.layer_prefill): one layer over the whole document at a time, tiered
    #: as soon as it is full, so peak memory never holds the full-precision cache of every layer. Same logits.
    #: On an H200 with an 8B model it is also faster at 128K (TTFT 0.87x), but slower on short documents, where the
    #: per-layer tiering has too little compute to hide behind (4.2x at 8K, 1.6x at 32K; bench/RESULTS.md, issue 6).
    prefill: Literal["tokens", "layers"] = "tokens"
    #: How a question's own tokens read the document. ``exact``: every document token at full precision (read back
    #: from the host archive one layer at a time), so the question's hidden states, the queries that rank the tiers
    #: and the first answer token are the full cache's, whatever the earlier questions left in the tiers; only the
    #: answer's later tokens read the tiers. ``tiered``: the question reads only the device tiers (less host-to-device
    #: traffic, the behaviour before issue 29; it lost second questions: bench/RESULTS.md, issue 29).
    question: Literal["exact", "tiered"] = "exact"
    #: How the questions asked of one prefill share its tiers. ``each``: every question re-tiers the document for
    #: itself (its own core and association). ``together``: the questions are read first (each exactly, as above, so
    #: every first answer token is the same), then the document is re-tiered once from all their queries and every
    #: question's answer reads those shared tiers plus its own tokens. One re-tier per document instead of one per
    #: question, and on the GPU engine one copy of the document's tiers for all its questions (a review checklist of
    #: eight questions holds one document's tiers, not eight); each question's share of the core is smaller.
    #: Needs ``question: exact``.
    questions: Literal["each", "together"] = "each"
    #: ``tiered``: the three tiers above. ``evict``: SnapKV-style eviction, a baseline for comparison: the first
    #: question's attention keeps ``core_tokens`` tokens per head (pooled over ``vote_pool``, observed over
    #: ``query_tokens``) and the rest is dropped for good, for every later question too.
    method: Literal["tiered", "evict"] = "tiered"

    @field_validator("association_bits", "association_key_bits", mode="before")
    @classmethod
    def _bits(cls, value: object, info) -> object:
        if value is None and info.field_name == "association_key_bits":
            return value
        if value not in (2, 4, 8) or isinstance(value, bool):
            raise ValueError(f"{info.field_name} must be 2, 4 or 8, got {value!r}; set {info.field_name}: 4")
        return value

    @field_validator("core_tokens", "association_tokens", "candidate_tokens", mode="before")
    @classmethod
    def _budget(cls, value: object, info) -> object:
        name = info.field_name
        if value == "auto" and name == "core_tokens":
            return value
        if isinstance(value, str):  # a CLI override arrives as text: "256", "0.1"
            try:
                value = int(value) if value.strip().lstrip("-").isdigit() else float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = "a token count, a fraction in (0, 1]" + (" or auto" if name == "core_tokens" else "")
            raise ValueError(f"{name} must be {hint}, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}; use 0 to disable the tier")
        if isinstance(value, float) and not value.is_integer() and value > 1:
            raise ValueError(f"{name} as a fraction must be in (0, 1], got {value}; write a token count as an int")
        if isinstance(value, float) and value > 1:
            return int(value)
        return value

    @field_validator("sink_tokens", "recent_tokens")
    @classmethod
    def _non_negative(cls, value: int, info) -> int:
        if value < 0:
            raise ValueError(f"{info.field_name} must not be negative, got {value}")
        return value

    @field_validator("page_tokens", "group_tokens", "query_tokens")
    @classmethod
    def _positive(cls, value: int, info) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name} must be at least 1, got {value}")
        return value

    @field_validator("vote_pool")
    @classmethod
    def _pool(cls, value: int) -> int:
        if value < 1 or value % 2 == 0:
            raise ValueError(f"vote_pool must be a positive odd number of tokens, got {value}; e.g. vote_pool: 7")
        return value

    @field_validator("vote_sharing")
    @classmethod
    def _sharing(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"vote_sharing must be in [0, 1], got {value}")
        return value

    @field_validator("retier_every")
    @classmethod
    def _every(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"retier_every must be a positive number of decode steps or null, got {value}")
        return value

    @model_validator(mode="after")
    def _evict_budget(self) -> "KVConfig":
        if self.method == "evict" and self.core_tokens == "auto":
            raise ValueError("method: evict keeps core_tokens tokens; give a count or a fraction, not auto")
        if self.questions == "together" and self.question != "exact":
            raise ValueError("kv.questions: together reads every question exactly before the shared re-tier; set "
                             "kv.question: exact (the default) or kv.questions: each")
        if self.questions == "together" and self.retier_every is not None:
            raise ValueError("kv.questions: together shares one re-tier among the questions; decode-time re-tiers "
                             "(kv.retier_every) would change it under the others: drop retier_every or set "
                             "kv.questions: each")
        return self


def resolve_budget(budget: int | float, length: int) -> int:
    """Token count of a budget for ``length`` cached tokens (a float is a fraction; rounded down, capped)."""
    if isinstance(budget, float):
        return min(length, int(budget * length))
    return min(length, int(budget))


def free_device_bytes(device: str | object) -> int:
    """Free memory of ``device``: CUDA's free bytes, else the host's available physical memory."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 30


def auto_core_tokens(device: str | object, bytes_per_token: int, length: int) -> int:
    """``core_tokens: auto``: as many tokens as half the free device memory holds, at most ``length``."""
    if bytes_per_token <= 0:
        return length
    return min(length, int(free_device_bytes(device) * AUTO_CORE_FRACTION) // bytes_per_token)
