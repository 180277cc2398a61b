"""Sampling in decode.generate: temperature and top-p, seeded per question; greedy stays the default."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from docfuse.runtime.session import Sampling
from tests.test_decode_stage import pages_table, stage

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    tight = Sampling(temperature=1.0, top_p=1e-6)
    assert {tight.draw(LOGITS, torch.Generator().manual_seed(s)) for s in range(50)} == {0}  # only the best
    # p = 0.607, 0.223, 0.135, ...: the first two hold 0.83, so top-p 0.8 keeps two and 0.85 keeps three
    two = Sampling(temperature=1.0, top_p=0.8)
    assert {two.draw(LOGITS, torch.Generator().manual_seed(s)) for s in range(300)} == {0, 1}
    three = Sampling(temperature=1.0, top_p=0.85)
    assert {three.draw(LOGITS, torch.Generator().manual_seed(s)) for s in range(300)} == {0, 1, 2}
    wide = Sampling(temperature=1.0, top_p=1.0)
    assert {wide.draw(LOGITS, torch.Generator().manual_seed(s)) for s in range(2000)} == {0, 1, 2, 3, 4}


def test_a_seed_repeats_its_draws_and_a_low_temperature_is_nearly_greedy():
    s = Sampling(temperature=1.0, top_p=1.0, seed=3)
    first = [s.draw(LOGITS, g) for g in [torch.Generator().manual_seed(3)] for _ in range(20)]
    again = [s.draw(LOGITS, g) for g in [torch.Generator().manual_seed(3)] for _ in range(20)]
    assert first == again and len(set(first)) > 1
    cold = Sampling(temperature=0.05)
    assert {cold.draw(LOGITS, torch.Generator().manual_seed(k)) for k in range(100)} == {0}


@pytest.mark.parametrize("params, message", [
    ({"temperature": -0.5}, "greater than or equal to 0"),
    ({"top_p": 0.0}, "greater than 0"),
    ({"top_p": 1.5}, "less than or equal to 1"),
    ({"seed": -1}, "greater than or equal to 0"),
])
def test_bad_sampling_params_are_refused(params, message):
    with pytest.raises(ValidationError, match=message):
        stage("q", **params)


@pytest.mark.slow
def test_sampled_answers_repeat_per_seed_and_greedy_stays_the_default():
    table = pages_table([("note", 0, "# Note\n\nThe meeting moved to Thursday at 10:00 in room 4B. Bring the "
                                    "budget draft and the hiring plan. Lunch is provided by the office.")])
    questions = ["Summarise the note.", "What should people bring?"]

    def answers(**params):
        rows = stage(questions=questions, max_new_tokens=24, dtype="float32", device="cpu", **params).run(table)
        return [r["answer"] for r in rows.to_pylist()]

    greedy = answers()
    assert answers(temperature=0.0) == greedy
    assert answers(temperature=1.0, top_p=1e-6) == greedy  # the top-p set of one token is the greedy choice
    hot = answers(temperature=1.3, seed=7)
    assert answers(temperature=1.3, seed=7) == hot  # seeded per question: the same answers run after run
    assert any(answers(temperature=1.3, seed=s) != greedy for s in (1, 2, 3))
