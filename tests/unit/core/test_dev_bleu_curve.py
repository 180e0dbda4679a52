"""benchmarks/dev_bleu_curve.py draws the README's dev-BLEU-against-wall-time figure. A train stage
stopped and resumed spans several workflow invocations; the figure's time is the time they ran,
without the gaps between them (hand-counted tables below). Finding those invocations in an MLflow
store (the train run's parent_run.N tags) is not tested here: it was checked by hand on the
Multi30k run's store (2 invocations, 175.0 min)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

from dev_bleu_curve import active_minutes  # noqa: E402

MIN = 60_000  # ms


@pytest.mark.parametrize("t, expected", [
    (0, 0.0),            # the first invocation's start
    (10 * MIN, 10.0),    # inside the first
    (40 * MIN, 30.0),    # the first ran 0..30: the stop at 30 and the resume at 60 left out
    (60 * MIN, 30.0),    # the resume
    (75 * MIN, 45.0),    # 30 + 15 into the second
    (200 * MIN, 30.0 + 50.0 + 20.0),  # second 60..110 (50), third open since 180
])
def test_gaps_between_invocations_are_left_out(t, expected):
    spans = [(0, 30 * MIN), (60 * MIN, 110 * MIN), (180 * MIN, None)]
    assert active_minutes(t, spans) == pytest.approx(expected)


def test_an_unended_invocation_counts_until_the_next_one_starts():
    # A driver killed without ending its run (end None) ran at most until the resume started.
    spans = [(0, None), (50 * MIN, None)]
    assert active_minutes(70 * MIN, spans) == pytest.approx(50.0 + 20.0)
    assert active_minutes(20 * MIN, spans) == pytest.approx(20.0)


def test_one_invocation_is_minutes_since_its_start():
    assert active_minutes(90 * MIN + 30_000, [(0, None)]) == pytest.approx(90.5)
