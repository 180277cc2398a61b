"""The engine on a GPU with the embedded model: every stream answers as it would alone (skips without CUDA).

Float32, so that the engine's paged kernel and ``Session``'s decode attention compute the same products; a mix of
short and long documents, one to three questions each, answers that stop early and answers that run to the limit.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_decode_stage import FILLER, pages_table, stage

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's GPU path needs a CUDA device")]

KV = {"core_tokens": 0.1, "association_tokens": 0.25, "association_bits": 4, "association_key_bits": 8}
QUESTIONS = ["What is the pass key?", "What color is the sky?", "Who wrote the note?"]


def table():
    return pages_table([
        ("sky", 0, "# Weather\n\nThe sky is blue today. It rained yesterday. The note was written by Ada."),
        ("key", 0, FILLER * 6 + "The pass key is 71432. Remember it. " + FILLER * 6 + "Signed, Grace."),
        ("long", 0, FILLER * 60 + "The pass key is 90210. " + FILLER * 60 + "This note was written by Alan."),
        ("mid", 0, FILLER * 25 + "The sky over the harbour is grey. " + FILLER * 20),
    ])


def answers(mode: str, kv, max_new: int = 24) -> list[dict]:
    decode = stage(questions=QUESTIONS, max_new_tokens=max_new, kv=kv, engine=mode, dtype="float32", device="cuda")
    decode.setup()
    assert (decode.engine is not None) == (mode == "on")
    return decode.run(table()).to_pylist()


def test_every_stream_answers_as_the_session_does_on_the_gpu():
    alone, together = answers("off", KV), answers("on", KV)
    assert [r["answer"] for r in together] == [r["answer"] for r in alone]
    assert all(r["error"] is None for r in together)
    from docfuse.runtime.engine.engine import LAST_STATS

    assert LAST_STATS["max_live"] >= 8 and LAST_STATS["tokens"] > 0


def test_with_every_token_in_the_core_the_engine_answers_as_the_full_cache():
    full = answers("off", None)
    everything = answers("on", {"core_tokens": 1.0, "association_tokens": 0})
    assert [r["answer"] for r in everything] == [r["answer"] for r in full]


def test_graph_decode_of_many_streams_in_bfloat16_mostly_agrees():
    """bf16: the kernel rounds dequantised keys and weights to bf16 where the CPU path does not; report, and require
    most answers to agree."""
    def run(mode):
        decode = stage(questions=QUESTIONS, max_new_tokens=24, kv=KV, engine=mode, dtype="bfloat16", device="cuda")
        decode.setup()
        return [r["answer"] for r in decode.run(table()).to_pylist()]
    alone, together = run("off"), run("on")
    same = sum(a == b for a, b in zip(alone, together))
    print(f"bf16: {same} of {len(alone)} answers equal")
    assert same >= len(alone) * 3 // 4


def test_questions_together_answer_on_the_gpu_as_the_session_does_in_that_mode():
    """kv.questions: together: the engine's streams over one shared copy of each document's tiers answer as
    Session does when it reads the questions first and re-tiers once."""
    kv = {**KV, "questions": "together"}
    alone, together = answers("off", kv), answers("on", kv)
    assert [r["answer"] for r in together] == [r["answer"] for r in alone]
    assert all(r["error"] is None for r in together)
