"""The cost model as a scikit-learn estimator, what it learns, and how picks are scored (no MPI)."""

import inspect
import itertools
from dataclasses import replace

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import GroupKFold, cross_validate
from sklearn.utils.validation import check_is_fitted

from cptune.calibration import Calibration, CollectiveFit, ComputeRate, group_sizes
from cptune.config import CPConfig
from cptune.engines import ENGINES
from cptune.errors import CPTuneError
from cptune.feasibility import enumerate_configs
from cptune.hardware import Hardware
from cptune.measurement import Measurement
from cptune.model import CalibratedProfile, Case, CostModel, GroupScore, compare, evaluate, training_set
from cptune.model._cost_model import MIN_SAMPLES, features
from cptune.model._evaluation import (  # the internals the scores are made of; the method names fit prints
    FIXED_RULE,
    MODEL,
    PRIOR,
    RECOMMENDED,
    correction_decision,
    cross_validate_groups,
    fixed_rule,
    score_group,
)
from cptune.store import Store
from cptune.workload import Workload


def host(name: str) -> Hardware:
    return Hardware(host=name, cpu_model="test cpu", cpu_count=4, gpu_model=None, gpu_count=0,
                    interconnect="shared memory (one host)", mpi_library="MPICH 5")


def calibration(max_ranks: int = 4, latency: float = 50e-6, bandwidth: float = 0.3e9,
                rate: float = 50e9) -> Calibration:
    """Every collective at ``latency`` + bytes / ``bandwidth``; attention at ``rate`` /
    sqrt(ranks) per rank (ranks contend), for head_dim 64 and 128."""
    fits = tuple(
        CollectiveFit(kind=kind, ranks=n, group=g, latency_s=latency, bandwidth=bandwidth,
                      bus_bandwidth=bandwidth, sizes=(1024,), times_s=(latency,))
        for n in range(2, max_ranks + 1) for g in group_sizes(n) for kind in ENGINES["mpi"].collectives
    )
    compute = tuple(
        ComputeRate(ranks=n, heads=4, seq_q=512, seq_k=2048, head_dim=d,
                    seconds=4 * 4 * 512 * 2048 * d / (rate / n**0.5))
        for n in range(1, max_ranks + 1) for d in (64, 128)
    )
    return Calibration("mpi", fits, compute, "2025-01-01T00:00:00+00:00")


PROFILE = CalibratedProfile(host("fitted"), calibration())
OTHER = CalibratedProfile(host("never-fitted"), calibration(bandwidth=1e9, rate=80e9))
TRAIN_LENGTHS = (1024, 1536, 2048, 3072, 4096)
#: The synthetic truth: the prior times a factor per strategy, growing a little with ranks.
FACTOR = {"ring": 1.3, "ulysses": 0.8, "allgather_kv": 1.0}


def truth(case: Case) -> float:
    return case.prior().total_s * FACTOR[case.config.strategy] * (1 + 0.05 * np.log2(case.config.ranks))


def cases_at(seq_len: int, profile=PROFILE) -> list[Case]:
    workload = Workload(seq_len=seq_len, heads=8, head_dim=64)
    return [Case(workload, config, profile) for config in enumerate_configs(workload, 4)]


@pytest.fixture(scope="module")
def train():
    cases = [case for seq_len in TRAIN_LENGTHS for case in cases_at(seq_len)]
    return cases, np.array([truth(case) for case in cases])


@pytest.fixture(scope="module")
def fitted(train):
    return CostModel().fit(*train)


def small() -> CostModel:
    """A quicker model for tests that fit many times."""
    return CostModel(n_estimators=40, learning_rate=0.2)


# --------------------------------------------------------------------------- scikit-learn conventions


def test_get_params_returns_the_init_parameters_and_clone_copies_them():
    names = [p for p in inspect.signature(CostModel.__init__).parameters if p != "self"]
    model = CostModel(n_estimators=17, max_depth=2, interval=(0.2, 0.8), prior_band=3.0)
    params = model.get_params()
    assert sorted(params) == sorted(names)
    assert params["n_estimators"] == 17 and params["interval"] == (0.2, 0.8) and params["prior_band"] == 3.0
    copy = clone(model)
    assert copy is not model and copy.get_params() == params
    model.set_params(max_depth=5)
    assert model.max_depth == 5 and copy.max_depth == 2


def test_clone_of_a_fitted_model_is_unfitted(fitted):
    copy = clone(fitted)
    with pytest.raises(NotFittedError):
        check_is_fitted(copy)


def test_fit_returns_self_and_sets_only_underscore_attributes(train):
    model = small()
    before = set(vars(model))
    assert model.fit(*train) is model
    check_is_fitted(model)
    added = set(vars(model)) - before
    assert {"correction_", "fingerprints_", "prior_interval_", "n_samples_"} <= added
    assert all(name.endswith("_") and not name.startswith("_") for name in added)
    assert model.n_samples_ == len(train[0]) and model.fingerprints_ == frozenset({PROFILE.fingerprint})


def test_an_unfitted_model_refuses_to_predict():
    model = CostModel()
    with pytest.raises(NotFittedError):
        check_is_fitted(model)
    with pytest.raises((NotFittedError, AttributeError)):
        model.predict(cases_at(1024)[:2])


def test_fit_refuses_non_positive_or_mismatched_latencies():
    cases = cases_at(1024)[:3]
    with pytest.raises(ValueError, match="positive latency"):
        CostModel().fit(cases, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="positive latency"):
        CostModel().fit(cases, [1.0, 1.0])


def test_cross_validate_runs_on_a_list_of_cases(train):
    cases, y = train
    groups = [case.workload.seq_len for case in cases]
    scores = cross_validate(small(), cases, y, groups=groups, cv=GroupKFold(n_splits=3),
                            return_estimator=True)
    assert len(scores["test_score"]) == 3
    assert np.all(np.isfinite(scores["test_score"]))
    assert all(isinstance(e, CostModel) and e.correction_ is not None for e in scores["estimator"])


def test_features_are_finite_and_one_row_per_case(train):
    cases, _ = train
    table = features(cases, [case.prior() for case in cases])
    assert table.shape[0] == len(cases) and np.all(np.isfinite(table))


# --------------------------------------------------------------------------- learning


def test_learns_the_correction_on_the_training_lengths(fitted, train):
    cases, y = train
    prior = np.array([case.prior().total_s for case in cases])
    assert np.max(np.abs(prior / y - 1)) > 0.25  # the prior alone is far off
    assert np.max(np.abs(fitted.predict(cases) / y - 1)) < 0.10
    assert all(fitted.corrects(case) for case in cases)


def test_ranks_configs_right_on_a_longer_held_out_length(fitted):
    held_out = cases_at(2 * max(TRAIN_LENGTHS))
    true = np.array([truth(case) for case in held_out])
    predicted = fitted.predict(held_out)
    prior = np.array([case.prior().total_s for case in held_out])
    # the prior alone picks another configuration: the correction is what gets this right
    assert int(np.argmin(prior)) != int(np.argmin(true))
    assert int(np.argmin(predicted)) == int(np.argmin(true))
    assert np.max(np.abs(predicted / true - 1)) < 0.10
    # every pair whose truth differs by more than 3% is ordered as the truth orders it
    for i, j in itertools.combinations(range(len(held_out)), 2):
        if abs(true[i] / true[j] - 1) > 0.03:
            assert (predicted[i] < predicted[j]) == (true[i] < true[j]), (
                held_out[i].config.label, held_out[i].config.ranks,
                held_out[j].config.label, held_out[j].config.ranks,
            )


def level_truth(case: Case) -> float:
    """The prior times a factor of the configuration and the mask together: a level no
    feature spells, so only a configuration's own measurements of this shape reveal it."""
    config = case.config
    salt = config.ranks * 7 + config.head_group * 3 + len(config.strategy) + case.workload.causal
    return case.prior().total_s * (0.6 + 0.1 * (salt % 9))


def test_a_measured_shape_is_predicted_at_a_new_length_by_its_own_level():
    """Measured at 1024..4096, each configuration of a shape is predicted at 8192, by its
    level alone (``shape_weight=1``), as the prior times the mean factor its own measurements
    showed (the prior carries the length); the boosted correction alone only approximates
    it. A shape measured on another hardware, or with another mask, lends it nothing."""
    cases = [Case(replace(c.workload, causal=causal), c.config, c.profile)
             for seq_len in TRAIN_LENGTHS for c in cases_at(seq_len) for causal in (False, True)]
    measured = np.array([level_truth(case) for case in cases])
    held_out = cases_at(8192)
    true = np.array([level_truth(case) for case in held_out])
    by_level = CostModel(shape_weight=1.0).fit(cases, measured)
    np.testing.assert_allclose(by_level.predict(held_out), true, rtol=1e-9)
    np.testing.assert_allclose(by_level.out_of_fold_, measured, rtol=1e-9)  # other lengths say the same
    boosted = CostModel(shape_weight=0.0).fit(cases, measured)
    assert np.max(np.abs(boosted.predict(held_out) / true - 1)) > 0.01
    elsewhere = [Case(c.workload, c.config, OTHER) for c in held_out]
    np.testing.assert_array_equal(by_level.predict(elsewhere), [c.prior().total_s for c in elsewhere])


def test_the_default_correction_averages_a_shapes_level_and_boosting():
    """Where a shape was measured at other lengths, the default estimate is the geometric
    mean of the level's and boosting's (held out and not: one booster, seeded, fitted on
    the same data); a shape never measured gets boosting's alone. A weight outside [0, 1]
    is refused."""
    cases = [Case(replace(c.workload, causal=causal), c.config, c.profile)
             for seq_len in TRAIN_LENGTHS for c in cases_at(seq_len) for causal in (False, True)]
    measured = np.array([level_truth(case) for case in cases])
    averaged, by_level, boosted = (CostModel(shape_weight=w).fit(cases, measured) for w in (0.5, 1.0, 0.0))
    assert CostModel().shape_weight == 0.5
    held_out = cases_at(8192)
    np.testing.assert_allclose(averaged.predict(held_out),
                               np.sqrt(by_level.predict(held_out) * boosted.predict(held_out)), rtol=1e-9)
    np.testing.assert_allclose(averaged.out_of_fold_, np.sqrt(by_level.out_of_fold_ * boosted.out_of_fold_),
                               rtol=1e-9)
    assert np.max(np.abs(by_level.out_of_fold_ / boosted.out_of_fold_ - 1)) > 0.01  # the two differ
    never = [Case(replace(c.workload, heads=24), c.config, c.profile) for c in held_out]
    np.testing.assert_allclose(averaged.predict(never), boosted.predict(never), rtol=1e-12)
    with pytest.raises(ValueError, match="shape_weight"):
        CostModel(shape_weight=1.5).fit(cases, measured)


def test_a_shapes_level_leaves_its_own_length_out_of_fold():
    """Out of fold, a case's level comes from its shape's other lengths only: with the
    factor doubling at one length, that length's own case is predicted from the others."""
    cases = [case for seq_len in TRAIN_LENGTHS for case in cases_at(seq_len)]
    odd = TRAIN_LENGTHS[2]
    measured = np.array([case.prior().total_s * (2.0 if case.workload.seq_len == odd else 1.0)
                         for case in cases])
    model = CostModel(shape_weight=1.0).fit(cases, measured)
    prior = np.array([case.prior().total_s for case in cases])
    at_odd = np.array([case.workload.seq_len == odd for case in cases])
    np.testing.assert_allclose(model.out_of_fold_[at_odd], prior[at_odd], rtol=1e-9)
    np.testing.assert_allclose(model.out_of_fold_[~at_odd], prior[~at_odd] * 2 ** 0.25, rtol=1e-9)


def test_hardware_not_fitted_on_gets_the_pure_prior(fitted):
    elsewhere = cases_at(2048, OTHER)
    assert OTHER.fingerprint != PROFILE.fingerprint
    assert not any(fitted.corrects(case) for case in elsewhere)
    estimate, low, high = fitted.predict_interval(elsewhere)
    prior = np.array([case.prior().total_s for case in elsewhere])
    np.testing.assert_array_equal(estimate, prior)
    # the prior-only band is at least prior_band wide each way
    assert np.all(low <= prior / 2.0 * (1 + 1e-12)) and np.all(high >= prior * 2.0 * (1 - 1e-12))


def test_below_min_samples_there_is_no_correction(train):
    cases, y = train
    model = CostModel().fit(cases[: MIN_SAMPLES - 1], y[: MIN_SAMPLES - 1])
    assert model.correction_ is None and model.n_samples_ == MIN_SAMPLES - 1
    assert not model.corrects(cases[0])
    prior = np.array([case.prior().total_s for case in cases[:5]])
    np.testing.assert_array_equal(model.predict(cases[:5]), prior)
    enough = CostModel(n_estimators=5).fit(cases[:MIN_SAMPLES], y[:MIN_SAMPLES])
    assert enough.correction_ is not None and enough.corrects(cases[0])


def test_prior_interval_widens_to_the_prior_error_seen_in_fitting():
    cases = cases_at(1024)[:4]
    # measured 5x the prior: the prior-only interval must reach at least 5x up
    model = CostModel().fit(cases, [5 * case.prior().total_s for case in cases])
    assert model.prior_interval_[0] <= 0.5 and model.prior_interval_[1] >= 5.0 * (1 - 1e-9)


def noisy(lengths, sigma: float, seed: int = 7) -> tuple[list[Case], np.ndarray]:
    """Cases at ``lengths`` measured at the synthetic truth times lognormal noise of ``sigma``."""
    rng = np.random.default_rng(seed)
    cases = [case for seq_len in lengths for case in cases_at(seq_len)]
    return cases, np.array([truth(case) for case in cases]) * np.exp(rng.normal(0, sigma, len(cases)))


def test_interval_is_centred_and_covers_held_out_lengths_as_advertised():
    # each length held out in turn: the 10-90% band must hold about 80% of what was not seen,
    # and never sit with the estimate on (or past) one edge
    cases, measured = noisy(TRAIN_LENGTHS + (6144, 8192), sigma=0.1)
    lengths = np.array([case.workload.seq_len for case in cases])
    inside = []
    for seq_len in sorted(set(lengths)):
        test = lengths == seq_len
        model = CostModel().fit([c for c, t in zip(cases, test, strict=True) if not t], measured[~test])
        estimate, low, high = model.predict_interval([c for c, t in zip(cases, test, strict=True) if t])
        assert np.all(low < estimate) and np.all(estimate < high)
        inside += list((low <= measured[test]) & (measured[test] <= high))
    assert 0.7 <= np.mean(inside) <= 0.95


def test_interval_edges_never_cross_even_from_few_noisy_samples():
    cases, measured = noisy(TRAIN_LENGTHS[:2], sigma=0.5, seed=3)
    model = CostModel(min_samples_leaf=1).fit(cases, measured)
    estimate, low, high = model.predict_interval(cases_at(3072) + cases_at(12288))
    assert np.all(low <= estimate) and np.all(estimate <= high)
    below, above = model.correction_interval_
    assert below <= 0.0 <= above and above - below > 0.2  # half-sigma noise is not a thin band


def test_without_learn_correction_the_model_is_the_prior_alone(train):
    cases, y = train
    model = CostModel(learn_correction=False).fit(*train)
    assert model.correction_ is None and model.out_of_fold_ is None and not model.corrects(cases[0])
    np.testing.assert_array_equal(model.predict(cases), [case.prior().total_s for case in cases])


def test_out_of_fold_predictions_are_held_out(fitted, train):
    cases, y = train
    assert fitted.out_of_fold_ is not None and fitted.out_of_fold_.shape == y.shape
    # held out, the correction is worse than in sample but still far better than the prior
    in_sample = np.abs(fitted.predict(cases) / y - 1)
    held_out = np.abs(fitted.out_of_fold_ / y - 1)
    prior = np.abs(np.array([case.prior().total_s for case in cases]) / y - 1)
    assert np.mean(held_out) > np.mean(in_sample) and np.mean(held_out) < np.mean(prior) / 2


def test_predict_interval_brackets_the_estimate(fitted):
    cases = cases_at(1536) + cases_at(8192) + cases_at(2048, OTHER)
    estimate, low, high = fitted.predict_interval(cases)
    assert estimate.shape == low.shape == high.shape == (len(cases),)
    assert np.all(low > 0) and np.all(low <= estimate) and np.all(estimate <= high)
    np.testing.assert_array_equal(fitted.predict(cases), estimate)


# --------------------------------------------------------------------------- evaluation


def _case(seq_len: int, config: CPConfig) -> Case:
    return Case(Workload(seq_len=seq_len, heads=8, head_dim=64), config, PROFILE)


def test_score_group_by_hand():
    a, b, c = CPConfig("ring", 2), CPConfig("ulysses", 2), CPConfig("allgather_kv", 2)
    cases = [_case(1024, a), _case(1024, b), _case(1024, c), _case(2048, a), _case(2048, b)]
    measured = np.array([1.0, 2.0, 4.0, 10.0, 8.0])
    predicted = np.array([1.5, 1.0, 5.0, 9.0, 9.5])
    # decision 1024: pick b (predicted 1.0), measured 2.0, best 1.0 -> regret 2.0, a miss
    # decision 2048: pick a (predicted 9.0), measured 10.0, best 8.0 -> regret 1.25, a miss
    band = (predicted * 0.8, predicted * 1.2)
    score = score_group("seq_len 1024", cases, measured, predicted, band)
    # 1.0 not in 1.2-1.8, 2.0 not in 0.8-1.2; 4.0 in 4.0-6.0, 10.0 in 7.2-10.8, 8.0 in 7.6-11.4
    assert score.coverage == pytest.approx(3 / 5)
    assert isinstance(score, GroupScore)
    assert score.held_out == "seq_len 1024" and score.decisions == 2 and score.samples == 5
    assert score.top1 == 0.0
    assert score.regret == pytest.approx((2.0 + 1.25) / 2)
    assert score.worst_regret == pytest.approx(2.0)
    errors = [0.5 / 1.0, 1.0 / 2.0, 1.0 / 4.0, 1.0 / 10.0, 1.5 / 8.0]
    assert score.mape == pytest.approx(100 * np.mean(errors))
    # spearman only for decisions with more than two configurations: 1024's ranks
    # predicted (2, 1, 3) vs measured (1, 2, 3) -> 1 - 6 * 2 / (3 * 8) = 0.5
    assert score.spearman == pytest.approx(0.5)
    # without a verdict nothing is known tied: ties as ties is the plain regret
    assert (score.tie_regret, score.worst_tie_regret) == (score.regret, score.worst_regret)


def test_score_group_counts_a_pick_tied_with_the_best_as_regret_one():
    a, b, c = CPConfig("ring", 2), CPConfig("ulysses", 2), CPConfig("allgather_kv", 2)
    cases = [_case(1024, a), _case(1024, b), _case(1024, c), _case(2048, a), _case(2048, b)]
    measured = np.array([1.0, 1.02, 4.0, 10.0, 8.0])
    predicted = np.array([1.5, 1.0, 5.0, 9.0, 9.5])
    # 1024: the pick b is tied with the best a (verdict: a leads, b tied) -> 1.0, plainly 1.02;
    # 2048: the pick a is separated from the best b -> 1.25 either way
    tied = np.array([True, True, False, False, True])
    score = score_group("x", cases, measured, predicted, tied=tied)
    assert score.regret == pytest.approx((1.02 + 1.25) / 2) and score.worst_regret == pytest.approx(1.25)
    assert score.tie_regret == pytest.approx((1.0 + 1.25) / 2)
    assert score.worst_tie_regret == pytest.approx(1.25)
    assert score.top1 == 0.0  # a tie is not a hit: top-1 stays plain


def test_score_group_perfect_picks():
    a, b = CPConfig("ring", 2), CPConfig("ulysses", 2)
    cases = [_case(1024, a), _case(1024, b), _case(2048, a), _case(2048, b)]
    measured = np.array([1.0, 2.0, 3.0, 2.5])
    score = score_group("x", cases, measured, measured * 1.1)
    assert score.top1 == 1.0 and score.regret == 1.0 and score.worst_regret == 1.0
    assert score.mape == pytest.approx(10.0)
    assert np.isnan(score.spearman)  # no decision has three configurations
    assert np.isnan(score.coverage)  # no interval given
    preference = score_group("x", cases, measured, np.array([1.0, 0.0, 1.0, 0.0]), latencies=False)
    assert preference.regret == pytest.approx((2.0 + 1.0) / 2) and np.isnan(preference.mape)


def test_fixed_rule_picks_the_config_fastest_most_often_in_training():
    a, b, c = CPConfig("ring", 2), CPConfig("ulysses", 2), CPConfig("allgather_kv", 2)
    lengths = (1024, 2048, 4096)
    cases = [_case(n, config) for n in lengths for config in (a, b, c)]
    # b wins at 1024 and 2048, a at 4096: holding out 4096, the rule picks b there (regret 3/1)
    measured = np.array([2.0, 1.0, 3.0, 4.0, 2.0, 5.0, 1.0, 3.0, 2.0])
    evaluation = fixed_rule(cases, measured, by="seq_len")
    assert evaluation.method == FIXED_RULE
    scores = {g.held_out: g for g in evaluation.groups}
    assert scores["seq_len 4096"].regret == pytest.approx(3.0) and scores["seq_len 4096"].top1 == 0.0
    # holding out 1024: b won 2048, a won 4096 - a tie broken by fewer ranks, then by label (b's "ulysses"
    # sorts after a's "ring"): the rule picks a at 1024, measured 2.0 against the best 1.0
    assert scores["seq_len 1024"].regret == pytest.approx(2.0)
    assert np.isnan(evaluation.overall.mape) and np.isnan(evaluation.overall.coverage)
    assert evaluation.overall.decisions == 3


def test_compare_scores_the_model_the_prior_and_the_rule_alike(train):
    cases, y = train
    model, prior, advised, rule = compare(cases, y, by="seq_len", model=small())
    methods = (model.method, prior.method, advised.method, rule.method)
    assert methods == (MODEL, PRIOR, RECOMMENDED, FIXED_RULE)
    assert [g.held_out for g in model.groups] == [g.held_out for g in prior.groups] == [
        g.held_out for g in advised.groups] == [g.held_out for g in rule.groups]
    # the correction helps on every training fold, so recommend's pick is the corrected model's
    assert advised.overall.mape < prior.overall.mape / 2
    # the synthetic truth is the prior times a factor per strategy: the correction must help
    assert model.overall.mape < prior.overall.mape / 2
    assert model.overall.regret <= prior.overall.regret
    assert 0.0 <= model.overall.coverage <= 1.0 and prior.overall.coverage == 1.0  # a 2x band at least


def flipping(cases: list[Case]) -> np.ndarray:
    """The prior times a factor of each configuration whose sign flips from one length to the
    next (and from one configuration to the next): nothing a correction learns from some
    lengths carries to another."""
    lengths = sorted({case.workload.seq_len for case in cases})
    configs = sorted({case.config for case in cases}, key=lambda c: (c.strategy, c.ranks, c.head_group))
    signs = [(-1) ** (lengths.index(case.workload.seq_len) + configs.index(case.config)) for case in cases]
    prior = np.array([case.prior().total_s for case in cases])
    return prior * np.exp(0.3 * np.array(signs))


def test_correction_decision_rejects_a_correction_that_does_not_carry_across_lengths():
    # whatever the correction learns from the other lengths points the wrong way at the one
    # held out, so held out it is worse than the prior alone and recommend must not apply it
    cases = [case for seq_len in TRAIN_LENGTHS for case in cases_at(seq_len)]
    measured = flipping(cases)
    verdict = correction_decision(CostModel().fit(cases, measured), cases, measured)
    assert not verdict.applied and "worse than the prior alone" in verdict.reason
    assert verdict.correction is not None and verdict.prior is not None
    assert verdict.correction.workload_error > verdict.prior.workload_error


def test_correction_decision_keeps_a_correction_that_helps(fitted, train):
    verdict = correction_decision(fitted, *train)
    assert verdict.applied and verdict.correction is not None and verdict.prior is not None
    assert verdict.correction.mape < verdict.prior.mape and verdict.correction.regret <= verdict.prior.regret
    assert verdict.to_dict()["applied"] is True
    assert set(verdict.to_dict()["correction"]) == {"regret", "tie_regret", "mape", "workload_error"}
    unfitted = correction_decision(CostModel().fit(train[0][:3], train[1][:3]), train[0][:3], train[1][:3])
    assert not unfitted.applied and "fewer than" in unfitted.reason


def test_cross_validate_groups_refuses_a_single_group():
    cases = cases_at(1024)
    latencies = np.array([truth(case) for case in cases])
    with pytest.raises(CPTuneError, match="at least two groups"):
        cross_validate_groups(cases, latencies, by="seq_len")
    with pytest.raises(CPTuneError, match="at least two groups"):
        cross_validate_groups(cases, latencies, by="hardware")
    with pytest.raises(ValueError, match="by must be one of"):
        cross_validate_groups(cases, latencies, by="ranks")


def test_cross_validate_groups_scores_each_held_out_length(train):
    cases, y = train
    cases, y = cases[: 3 * len(cases_at(1024))], y[: 3 * len(cases_at(1024))]  # three lengths
    evaluation = cross_validate_groups(cases, y, by="seq_len", model=small())
    assert evaluation.by == "seq_len"
    assert [g.held_out for g in evaluation.groups] == [f"seq_len {n}" for n in TRAIN_LENGTHS[:3]]
    per_length = len(cases_at(1024))
    for group in evaluation.groups:
        assert group.decisions == 1 and group.samples == per_length
        assert 1.0 <= group.regret <= group.worst_regret and 0.0 <= group.top1 <= 1.0
        assert np.isfinite(group.mape) and group.mape >= 0
    assert evaluation.median_regret >= 1.0 and evaluation.worst_regret >= evaluation.median_regret


def test_cross_validate_groups_by_hardware(train):
    cases, y = train
    mixed = cases[:20] + cases_at(2048, OTHER)
    latencies = np.concatenate([y[:20], [truth(case) for case in cases_at(2048, OTHER)]])
    evaluation = cross_validate_groups(mixed, latencies, by="hardware", model=small())
    assert sorted(g.held_out for g in evaluation.groups) == sorted(
        f"hardware {p.fingerprint}" for p in (PROFILE, OTHER)
    )
    assert sum(g.samples for g in evaluation.groups) == len(mixed)


# --------------------------------------------------------------------------- from a store


def _measurement(case: Case, ms: float) -> Measurement:
    return Measurement(
        workload=case.workload, config=case.config, median_ms=ms, p10_ms=ms, p90_ms=ms, compute_ms=ms,
        comm_ms=0.0, peak_bytes=1, max_error=0.0, engine="mpi", host={}, warmup=0, repeats=1,
        samples_ms=[ms],
    )


def test_training_set_combines_every_clean_visit_of_calibrated_hardware(tmp_path):
    db = str(tmp_path / "t.db")
    ring, ulysses = cases_at(1024)[1], cases_at(1024)[-1]
    with Store(db) as store:
        store.add_calibration(PROFILE.hardware, PROFILE.calibration)
        store.add_measurement(PROFILE.hardware, _measurement(ring, 5.0), round_id="r1")
        store.add_measurement(PROFILE.hardware, _measurement(ring, 4.0), round_id="r2")  # newest, not alone
        disturbed = replace(_measurement(ring, 0.5), disturbed="load 3.0 from other processes")
        store.add_measurement(PROFILE.hardware, disturbed, round_id="r3")  # counts for nothing
        store.add_measurement(PROFILE.hardware, _measurement(ulysses, 3.0), round_id="r1")
        store.add_failure(PROFILE.hardware, ring.workload, CPConfig("ring", 3), "timeout", "hung", "mpi")
        store.add_measurement(OTHER.hardware, _measurement(ring, 1.0))  # no calibration
        data = training_set(store)
        ids = {r.median_ms: r.id for r in store.results()}
    latency = {c.config: lat for c, lat in zip(data.cases, data.latencies_s, strict=True)}
    assert set(latency) == {ring.config, ulysses.config}
    assert latency[ring.config] == pytest.approx(np.sqrt(5.0 * 4.0) * 1e-3)  # geometric mean of the two
    assert latency[ulysses.config] == pytest.approx(3.0e-3)
    by_config = {e.config: e for e in data.estimates}
    assert by_config[ring.config].ids == (ids[5.0], ids[4.0]) and by_config[ring.config].rounds == 2
    assert [r.id for r in data.results if r.config == ring.config] == [ids[4.0]]  # the newest clean visit
    assert all(c.profile.fingerprint == PROFILE.fingerprint for c in data.cases)
    assert data.profiles[PROFILE.fingerprint].calibration == PROFILE.calibration
    assert data.uncalibrated == frozenset({OTHER.fingerprint})


def test_evaluate_cross_validates_a_database(tmp_path):
    db = str(tmp_path / "e.db")
    with Store(db) as store:
        store.add_calibration(PROFILE.hardware, PROFILE.calibration)
        for seq_len in TRAIN_LENGTHS[:2]:
            for case in cases_at(seq_len):
                store.add_measurement(PROFILE.hardware, _measurement(case, truth(case) * 1e3))
    evaluation = evaluate(db, by="seq_len", model=small())
    assert [g.held_out for g in evaluation.groups] == [f"seq_len {n}" for n in TRAIN_LENGTHS[:2]]
    assert all(g.samples == len(cases_at(1024)) for g in evaluation.groups)


def test_evaluate_says_what_is_missing(tmp_path):
    with pytest.raises(CPTuneError, match="cptune search"):
        evaluate(str(tmp_path / "empty.db"))
    db = str(tmp_path / "uncalibrated.db")
    with Store(db) as store:
        store.add_measurement(PROFILE.hardware, _measurement(cases_at(1024)[0], 2.0))
    with pytest.raises(CPTuneError, match="cptune calibrate"):
        evaluate(db)


def test_tied_with_leader_follows_the_measured_verdict_of_each_workload(tmp_path):
    ring, ulysses, local = cases_at(1024)[1], cases_at(1024)[-1], cases_at(1024)[0]
    # three interleaved rounds: ring and ulysses trade places (a tie), local is far behind in each
    rounds = {ring: (4.0, 4.2, 4.1), ulysses: (4.2, 4.0, 4.15), local: (9.0, 9.3, 9.1)}
    with Store(str(tmp_path / "v.db")) as store:
        store.add_calibration(PROFILE.hardware, PROFILE.calibration)
        for case, figures in rounds.items():
            for i, ms in enumerate(figures):
                store.add_measurement(PROFILE.hardware, _measurement(case, ms), round_id=f"r{i}")
        data = training_set(store)
    tied = dict(zip((c.config for c in data.cases), data.tied_with_leader(), strict=True))
    assert tied == {ring.config: True, ulysses.config: True, local.config: False}
    # a pick of ulysses (the slower of the tied two) costs nothing with ties as ties
    pick_ulysses = np.array([{ulysses.config: 0.0}.get(c.config, 1.0) for c in data.cases])
    score = score_group("x", data.cases, data.latencies_s, pick_ulysses, tied=data.tied_with_leader())
    assert score.regret > 1.0 and score.tie_regret == 1.0


def _swap_picks(cases, measured: np.ndarray, decisions: int) -> np.ndarray:
    """``measured`` as predictions, except that in the first ``decisions`` workloads the fastest
    is predicted a hair slower than the second fastest: those picks miss, every number is close."""
    predicted = measured.copy()
    for workload in sorted({c.workload for c in cases}, key=lambda w: w.seq_len)[:decisions]:
        members = [i for i, c in enumerate(cases) if c.workload == workload]
        best, second = sorted(members, key=lambda i: measured[i])[:2]
        predicted[best] = measured[second] * 1.01
    return predicted


def test_correction_decision_ignores_an_error_every_configuration_of_a_workload_shares(train):
    """Predictions off by one factor per workload rank its configurations as well as exact
    ones: the verdict judges the numbers by their errors within each decision, so a
    correction that gets the order right is kept however far its level is off."""
    cases, measured = train
    model = CostModel().fit(cases, measured)
    lengths = sorted({case.workload.seq_len for case in cases})
    shared = np.array([3.0 ** lengths.index(case.workload.seq_len) for case in cases])
    model.out_of_fold_ = measured * shared
    verdict = correction_decision(model, cases, measured)
    assert verdict.correction.mape > verdict.prior.mape  # far off in level...
    assert verdict.correction.workload_error == pytest.approx(0.0, abs=1e-9)  # ...yet relative to one
    assert verdict.prior.workload_error > 1.0  # another exact, where the prior's numbers are not
    assert verdict.applied, verdict.reason


@pytest.mark.parametrize("misses, applied", [(1, True), (5, False)])
def test_correction_decision_rejects_only_regret_worse_beyond_the_decisions_noise(train, misses, applied):
    # the truth is the prior x 1.5, and every configuration but the prior's pick slower by up
    # to 60% more: the prior picks every decision right, its numbers and their order are off;
    # the correction's numbers are close, but it misses the pick in ``misses`` of the 5 decisions
    cases, _ = train
    prior = np.array([case.prior().total_s for case in cases])
    slower = np.random.default_rng(12).uniform(1.0, 1.6, len(cases))
    for members in [[i for i, c in enumerate(cases) if c.workload == w] for w in {c.workload for c in cases}]:
        slower[min(members, key=lambda i: prior[i])] = 1.0
    measured = prior * 1.5 * slower
    model = CostModel().fit(cases, measured)
    model.out_of_fold_ = _swap_picks(cases, measured, misses)
    verdict = correction_decision(model, cases, measured)
    assert verdict.correction is not None and verdict.prior is not None
    assert verdict.prior.tie_regret == 1.0 and verdict.correction.mape < verdict.prior.mape
    assert verdict.correction.tie_regret > 1.01  # one miss of five already: a flat 1% rule would refuse it
    assert verdict.applied is applied, verdict.reason


def test_fit_advised_keeps_the_averaged_correction_where_it_helps_and_the_prior_where_it_does_not():
    """Each configuration's level shows at every length: the averaged correction orders the
    held-out lengths better than the prior and is kept. Where nothing learned carries across
    lengths (``flipping``), the prior alone is kept, and its predictions are the prior's."""
    from cptune.model import fit_advised

    cases = [Case(replace(c.workload, causal=causal), c.config, c.profile)
             for seq_len in TRAIN_LENGTHS for c in cases_at(seq_len) for causal in (False, True)]
    measured = np.array([level_truth(case) for case in cases])
    model, verdict = fit_advised(cases, measured)
    assert model.learn_correction and model.shape_weight == 0.5 and verdict.applied, verdict.reason
    model, verdict = fit_advised(cases, flipping(cases))
    assert not model.learn_correction and not verdict.applied, verdict.reason
    np.testing.assert_allclose(model.predict(cases_at(8192)), [c.prior().total_s for c in cases_at(8192)])


@pytest.mark.parametrize("spread, applied", [(0.05, True), (0.3, False)])
def test_correction_decision_refuses_an_order_only_when_worse_beyond_its_noise(train, spread, applied):
    """The prior is 5% off the truth, scattered; the correction's numbers scatter about as much
    (a hair more within each workload: a tie, kept) or six times as much (refused). Every
    configuration is tied with its workload's leader, so regret speaks for neither and only
    the order within workloads is judged."""
    cases, _ = train
    prior = np.array([case.prior().total_s for case in cases])
    measured = prior * np.exp(np.random.default_rng(0).normal(0, 0.05, len(cases)))
    model = CostModel().fit(cases, measured)
    model.out_of_fold_ = measured * np.exp(np.random.default_rng(100).normal(0, spread, len(cases)))
    verdict = correction_decision(model, cases, measured, tied=np.ones(len(cases), dtype=bool))
    assert verdict.correction.tie_regret == verdict.prior.tie_regret == 1.0
    assert verdict.correction.workload_error > verdict.prior.workload_error  # a point estimate says worse
    assert verdict.applied is applied, verdict.reason


def test_the_model_learns_from_training_steps_where_the_calibration_timed_the_backward(tmp_path):
    """A training step's measurements are cases beside the forward's (its mode a feature and
    part of its shape); on a host whose calibration predates the backward's timing they are
    left for recommend to compare as measured, not fitted."""
    from conftest import add_measurements, make_calibration, measurement
    from cptune.hardware import this_host

    forward = Workload(seq_len=1024, heads=4, head_dim=32)
    train = forward.in_mode("train")
    config = CPConfig("ring", 2)
    db = str(tmp_path / "t.db")
    add_measurements(db, measurement(forward, config, 2.0), measurement(train, config, 7.0))
    for calibration, fitted in ((make_calibration(2), {forward, train}),
                                (replace(make_calibration(2), backward=()), {forward})):
        with Store(db) as store:
            store.add_calibration(this_host(), calibration)
            data = training_set(store)
        assert {case.workload for case in data.cases} == fitted
        assert {e.workload for e in data.unfitted} == {forward, train} - fitted
    cases = [Case(w, config, CalibratedProfile(this_host(), make_calibration(2))) for w in (forward, train)]
    table = features(cases, [case.prior() for case in cases])
    assert table[0].tolist() != table[1].tolist()
