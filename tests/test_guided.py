"""The guided search's stop rule: the model's interval widened by its error on this
workload's trials, and the chance that ANY unmeasured configuration beats the leader."""

from __future__ import annotations

import math

import pytest

from conftest import candidate, replay
from cptune.config import CPConfig
from cptune.search import any_wins, win_probability

RING2, RING4, ULY2, ULY4, AG2, AG4 = (CPConfig("ring", 2), CPConfig("ring", 4), CPConfig("ulysses", 2, 2),
                                     CPConfig("ulysses", 4, 4), CPConfig("allgather_kv", 2),
                                     CPConfig("allgather_kv", 4))


def test_the_workload_spread_widens_both_sides_of_the_interval():
    c = candidate(RING2, 10.0, 8.0, 15.0)
    assert win_probability(c, 8.0, workload_spread=0.0) == pytest.approx(0.1)
    widened = win_probability(c, 8.0, workload_spread=0.3)
    sigma = math.hypot(math.log(10 / 8) / 1.2815515655446004, 0.3)  # the 10% edge's, then the workload's
    assert widened == pytest.approx(0.5 * math.erfc(math.log(10 / 8) / sigma / math.sqrt(2)))
    assert 0.1 < widened < 0.5
    assert win_probability(c, 20.0, workload_spread=0.3) < win_probability(c, 20.0)  # above: less sure too
    # an interval with no room below is no longer certain once the model has missed here
    edge = candidate(RING2, 10.0, 10.0, 15.0)
    assert win_probability(edge, 9.0) == 0.0 < win_probability(edge, 9.0, workload_spread=0.2)


def test_any_wins_is_the_chance_that_at_least_one_does():
    assert any_wins([]) == 0.0
    assert any_wins([0.05]) == pytest.approx(0.05)
    assert any_wins([0.05] * 4) == pytest.approx(1 - 0.95**4)
    assert any_wins([0.05] * 4) > 0.1 > max([0.05] * 4)


def test_many_unlikely_candidates_together_keep_the_search_going():
    # after ring x2 (10 ms) each of the five left has a 3.8% chance of beating it: the
    # likeliest alone (the rule before) stopped there; together they keep the search going
    # until two are left (the model is exact on those it measures: no widening here)
    truth = {RING2: 10.0, RING4: 15.0, ULY2: 15.0, ULY4: 15.0, AG2: 15.0, AG4: 9.0}
    predictions = {c: candidate(c, 10.0, 7.0, 14.0) if c == RING2 else candidate(c, 15.0, 11.2, 22.0)
                   for c in truth}
    single = win_probability(predictions[RING4], 10.0)
    assert single == pytest.approx(0.038, abs=0.001)
    assert any_wins([single] * 3) > 0.1 > any_wins([single] * 2)
    order, sampler, _ = replay(truth, predictions)
    assert order == [RING2, RING4, ULY2, ULY4] and sampler.workload_spread == 0.0
    stop = sampler.early_stop
    assert stop is not None and stop.unmeasured == 2 and stop.likeliest == AG2
    assert stop.probability == pytest.approx(single) and stop.chance == pytest.approx(any_wins([single] * 2))


def test_the_models_errors_on_this_workload_widen_the_stop_rule():
    # the model predicts every configuration 40% too slow here: after two trials that show
    # it, the four left are no longer ruled out, and the fastest (ulysses x4) is found
    truth = {RING2: 10.0, RING4: 10.5, ULY2: 11.0, ULY4: 7.5, AG2: 12.0, AG4: 12.5}
    predictions = {
        RING2: candidate(RING2, 10.0 / 0.6, 14.0, 20.0), RING4: candidate(RING4, 10.5 / 0.6, 14.7, 21.0),
        ULY2: candidate(ULY2, 20.0, 16.8, 24.0), ULY4: candidate(ULY4, 21.0, 17.6, 25.2),
        AG2: candidate(AG2, 22.0, 18.5, 26.4), AG4: candidate(AG4, 23.0, 19.3, 27.6),
    }
    order, sampler, _ = replay(truth, predictions)
    assert order[:2] == [RING2, RING4]
    assert sampler.errors[:2] == pytest.approx([math.log(0.6)] * 2)
    assert ULY4 in order and sampler.workload_spread > 0.3
    # the same trials with the model's own interval only (no error seen yet) rule all four out
    assert any_wins([win_probability(predictions[c], 10.0) for c in (ULY2, ULY4, AG2, AG4)]) < 0.1


def test_a_model_right_here_still_stops_early_and_says_why():
    truth = {RING2: 10.0, RING4: 20.0, ULY2: 21.0, ULY4: 22.0, AG2: 23.0, AG4: 24.0}
    predictions = {c: candidate(c, ms * 1.01, ms * 0.9, ms * 1.3) for c, ms in truth.items()}
    order, sampler, _ = replay(truth, predictions)
    assert order == [RING2]
    stop = sampler.early_stop
    assert stop is not None and stop.leader == RING2 and stop.tried == 1 and stop.unmeasured == 5
    assert stop.chance < 0.1 and stop.probability <= stop.chance
    assert stop.workload_spread == pytest.approx(math.log(1.01))  # one trial, 1% faster than predicted
    assert "the 5 unmeasured together less than a 10% chance" in stop.describe()
