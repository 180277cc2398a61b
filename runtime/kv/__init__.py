"""Tiered KV cache: exact core, low-bit association and LZ4 background tiers, re-tiered per question.

Each re-tier ranks tokens by the question's attention over the keys the device holds (``votes.py``); background pages
take part when their key summaries (``summaries.py``) nominate them, so nothing is decompressed to rank a page.

Typical use (one prefill, many questions)::

    cache = TieredCache(model.config, {"core_tokens": 0.1, "association_tokens": 0.25})
    model(input_ids=document_ids, cache=cache)            # prefill, exact (chunks allowed)
    prefix = cache.get_seq_length()
    for question_ids in questions:
        logits = read_question(model, cache, question_ids)  # the question, read exactly; then re-tier for it
        ...                                                # decode greedily from logits on the re-tiered cache
        cache.rollback(prefix)                            # drop question + answer, keep the document

``make_cache(config, None)`` gives a plain DynamicCache (``kv: null``).
"""

from docfuse.runtime.kv.config import KVConfig
from docfuse.runtime.kv.eviction import SnapKVCache
from docfuse.runtime.kv.queries import (QuestionRead, prepare_question, read_question, read_questions, record_queries,
                                        retier_after_read)
from docfuse.runtime.kv.tiered import RetierOnSchedule, TieredCache, as_kv_config, make_cache

__all__ = ["KVConfig", "QuestionRead", "RetierOnSchedule", "SnapKVCache", "TieredCache", "as_kv_config",
           "make_cache", "prepare_question", "read_question", "read_questions", "record_queries",
           "retier_after_read"]
