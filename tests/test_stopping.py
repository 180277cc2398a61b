"""Answers end at a stop string or when they start repeating (runtime.stopping), the same in Session and the engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from docfuse.runtime.engine import Document, Engine
from docfuse.runtime.stopping import StopConfig, Stopper
from tests.test_engine_decode import KV, alone, ids
from tests.test_decode_step import tiny

VOCAB = {0: "The", 1: " fee", 2: " is", 3: " 4,250", 4: ".", 5: "\n", 6: "Question", 7: ":", 8: " What", 9: "<|im_start|>"}


class Words:
    """A tokenizer stand-in: each id is a fixed piece of text; id 9 is special."""

    def decode(self, tokens, skip_special_tokens=False):
        return "".join(VOCAB[t] for t in tokens if not (skip_special_tokens and t == 9))


def test_a_new_question_turn_ends_the_answer_and_is_cut_off() -> None:
    stop = Stopper(StopConfig(), Words())
    answer = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [stop.should_stop(answer[:n]) for n in range(1, 9)] == [False] * 7 + [True]
    assert stop.text(answer + [8]) == "The fee is 4,250."
    assert stop.text([0, 1, 2, 3, 9, 0]) == "The fee is 4,250"  # a special tag as a stop string


def test_a_repeat_ends_the_answer_before_the_repeated_part() -> None:
    stop = Stopper(StopConfig(repeat_tokens=3), Words())
    looping = [0, 1, 2, 3, 4, 0, 1, 2]
    assert not stop.should_stop(looping[:7]) and stop.should_stop(looping)
    assert stop.text(looping) == "The fee is 4,250."
    assert not Stopper(StopConfig(repeat_tokens=None, strings=[]), Words()).should_stop(looping)


def test_bad_stop_settings_are_refused() -> None:
    with pytest.raises(ValidationError):
        StopConfig(repeat_tokens=1)
    with pytest.raises(ValidationError):
        StopConfig(colour="red")


def test_stop_false_turns_the_rules_off_where_set_null_would_bring_the_default_back() -> None:
    from docfuse.pipelines import Pipeline
    from docfuse.stages.decode import DecodeGenerate

    def stop_of(value):
        pipeline = Pipeline.from_yaml("pdf_qa")
        pipeline.set("answer.stop", value)  # what --set answer.stop=VALUE does
        return DecodeGenerate(**pipeline.stages["answer"].params).params.stop

    assert stop_of(False) is None  # off: answers end only at end-of-sequence
    assert stop_of(None) == {}  # null drops the key: the default block, every rule on
    assert stop_of(True) == StopConfig().model_dump(mode="json")
    assert DecodeGenerate(stop=None).params.stop is None  # null written in a pipeline's own YAML is off too


def test_the_engine_stops_where_the_same_rule_stops_the_session_loop() -> None:
    """A stream ends at the first token a rule catches, as Session's loop does; earlier tokens are untouched."""
    model = tiny(seed=3)
    docs = [Document(ids(300, 1), [ids(9, 11), ids(14, 12)], max_new_tokens=24),
            Document(ids(200, 2), [ids(12, 21)], max_new_tokens=24)]
    full = [[alone(model, KV, list(d.prefix), list(q), d.max_new_tokens, set()) for q in d.questions] for d in docs]
    rule = lambda tokens: len(tokens) >= 3 and tokens[-1] == tokens[-3]  # noqa: E731  a cheap stand-in rule
    expected = []
    for answers in full:
        row = []
        for a in answers:
            cut = next((n for n in range(1, len(a) + 1) if rule(a[:n])), len(a))
            row.append(a[:cut])
        expected.append(row)
    got = Engine(model, KV, set(), stop_when=rule).run(docs)
    assert [[o.tokens for o in d] for d in got] == expected
    assert any(o.finish_reason == "stop" for d in got for o in d) or all(len(e) == 24 for r in expected for e in r)
