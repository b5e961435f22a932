"""The Optuna search over one workload: coverage, resume, failures, feasibility."""

import pytest

from cptune import CPConfig, Workload, enumerate_configs, feasibility
from cptune.hardware import this_host
from cptune.search import WorkloadSearch
from cptune.store import Store

WORKLOAD = Workload(seq_len=96, heads=4, head_dim=16, dtype="fp32")
CONFIGS = enumerate_configs(WORKLOAD, 2)  # ring x1, ring x2, allgather_kv x2, ulysses x2


@pytest.fixture
def store(tmp_path):
    with Store(str(tmp_path / "search.db")) as opened:
        yield opened


def search(store, **options):
    options = {"warmup": 0, "repeats": 2, **options}
    return WorkloadSearch(WORKLOAD, options.pop("configs", CONFIGS), store, this_host(), **options)


def test_small_space_is_covered_once_and_resumes(store):
    first = search(store).run()
    assert sorted(o.config.label + str(o.config.ranks) for o in first) == sorted(
        c.label + str(c.ranks) for c in CONFIGS)
    assert all(o.status == "ok" and not o.reused and o.median_ms > 0 for o in first)
    assert len(store.results()) == len(CONFIGS)
    assert search(store).run() == []  # everything known: nothing runs again
    again = search(store, remeasure=True).run()
    assert len(again) == len(CONFIGS) and not any(o.reused for o in again)
    assert len(store.results()) == 2 * len(CONFIGS)


def test_interrupted_search_resumes_with_what_is_missing(store):
    def stop_after_two(outcome, seen=[]):  # noqa: B006 - state across calls on purpose
        seen.append(outcome)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(store, on_trial=stop_after_two).run()
    kept = {r.config for r in store.results()}
    assert len(kept) == 2
    rest = search(store).run()
    assert {o.config for o in rest} == set(CONFIGS) - kept
    assert len(store.results()) == len(CONFIGS)


def test_failures_are_stored_and_the_search_goes_on(store, faulty_engine):
    engine = faulty_engine("raise")  # rank 1 raises: every multi-rank run fails
    outcomes = search(store, backend=engine).run()
    by_ranks = {o.config: o for o in outcomes}
    assert by_ranks[CPConfig("ring", 1)].status == "ok"
    failed = [o for o in outcomes if o.config.ranks == 2]
    assert len(failed) == 3 and all(o.status == "error" and "rank 1" in o.error for o in failed)
    stored = {r.config: (r.status, r.error) for r in store.results()}
    assert all(stored[o.config] == ("error", o.error) for o in failed)
    assert search(store).run() == []  # failures count as measured too


def test_tpe_never_proposes_an_infeasible_point(store):
    """A budget below the space size uses TPE; every proposal is a feasible config."""
    workload = Workload(seq_len=48, heads=6, head_dim=8, kv_heads=3, dtype="fp32")
    configs = enumerate_configs(workload, 4)
    assert len(configs) > 4
    host = this_host()
    outcomes = WorkloadSearch(workload, configs, store, host, warmup=0, repeats=1, trials=4).run()
    assert len(outcomes) == 4
    for o in outcomes:
        assert o.config in configs and feasibility(workload, o.config) == []


def test_tpe_is_warm_started_from_other_lengths(store):
    host = this_host()
    shorter = Workload(seq_len=48, heads=4, head_dim=16, dtype="fp32")
    WorkloadSearch(shorter, enumerate_configs(shorter, 2), store, host, warmup=0, repeats=1).run()
    best = min((r for r in store.results() if r.status == "ok"), key=lambda r: r.median_ms).config
    outcomes = search(store, trials=1).run()
    assert [o.config for o in outcomes] == [best]


# --------------------------------------------------------------------------- guided order


def candidate(config, ms, low, high):
    from cptune.model import Candidate

    return Candidate(config, ms, low, high, "model")


def test_win_probability_reads_the_interval_as_its_quantiles():
    from cptune.search import win_probability

    c = candidate(CPConfig("ring", 2), 10.0, 8.0, 15.0)
    assert win_probability(c, 8.0) == pytest.approx(0.1)  # the low edge is the 10% quantile
    assert win_probability(c, 15.0) == pytest.approx(0.9)
    assert win_probability(c, 10.0) == pytest.approx(0.5)
    assert win_probability(c, 4.0) < 0.01 < win_probability(c, 9.0) < 0.5
    no_spread_below = candidate(CPConfig("ring", 2), 10.0, 10.0, 15.0)
    assert win_probability(no_spread_below, 9.99) == 0.0


def _replay(configs, truth, predictions, stop_probability=0.1):
    """Run ``GuidedSampler`` over ``configs`` valued at ``truth`` (ms) with fixed predictions."""
    import optuna

    from cptune.search import GuidedSampler, _suggest, _tree

    asked = []

    def predict(pending):
        asked.append(list(pending))
        return [predictions[c] for c in pending]

    sampler = GuidedSampler(configs, predict, stop_probability)
    tree, order = _tree(configs), []

    def objective(trial):
        config = _suggest(trial, tree)
        order.append(config)
        return truth[config]

    optuna.create_study(sampler=sampler).optimize(objective, n_trials=len(configs))
    return order, sampler, asked


def test_guided_order_takes_the_best_predicted_first_and_stops_when_none_can_win():
    local, ring, ag, uly = CONFIGS  # ring x1, ring x2, allgather_kv x2, ulysses x2
    predictions = {
        local: candidate(local, 40.0, 30.0, 50.0),
        ring: candidate(ring, 20.0, 16.0, 26.0),
        ag: candidate(ag, 22.0, 19.0, 30.0),
        uly: candidate(uly, 60.0, 50.0, 80.0),
    }
    truth = {local: 41.0, ring: 21.0, ag: 18.5, uly: 55.0}
    order, sampler, asked = _replay(list(CONFIGS), truth, predictions)
    # ring first (lowest estimate); ag's interval reaches below 21 ms, so it runs; then local
    # (low edge 30 ms) and ulysses (50 ms) cannot plausibly beat 18.5 ms: stop
    assert order == [ring, ag]
    stop = sampler.early_stop
    assert stop is not None and stop.leader == ag and stop.leader_ms == 18.5
    assert (stop.tried, stop.unmeasured, stop.likeliest) == (2, 2, local)
    assert stop.probability < 0.1 and "stopped after 2 of 4 configurations" in stop.describe()
    assert "a 10% chance" in stop.describe()
    _, bolder, _ = _replay(list(CONFIGS), truth, predictions, stop_probability=0.3)
    assert "stopped after 2 of 4 configurations" in bolder.early_stop.describe()
    assert "a 30% chance" in bolder.early_stop.describe()  # the threshold it ran with
    assert all(ring not in pending for pending in asked[1:])  # never asked again once tried


def test_guided_search_runs_everything_when_each_remaining_config_may_still_win():
    predictions = {c: candidate(c, 20.0 + i, 5.0, 60.0) for i, c in enumerate(CONFIGS)}  # wide bands
    truth = {c: 30.0 - i for i, c in enumerate(CONFIGS)}
    order, sampler, _ = _replay(list(CONFIGS), truth, predictions)
    assert order == list(CONFIGS) and sampler.early_stop is None


def test_guided_search_without_a_calibration_falls_back_to_every_configuration(store):
    s = search(store, order="guided")
    outcomes = s.run()
    assert {o.config for o in outcomes} == set(CONFIGS)
    assert s.unguided is not None and "no calibration" in s.unguided and s.early_stop is None


def test_guided_search_orders_by_the_stored_model(store):
    from conftest import make_calibration
    from cptune.model import predict_for

    host = this_host()
    store.add_calibration(host, make_calibration(2))
    expected_first = min(predict_for(store, host.fingerprint, WORKLOAD, CONFIGS), key=lambda c: c.latency_ms)
    s = search(store, order="guided")
    outcomes = s.run()
    assert s.unguided is None
    assert outcomes[0].config == expected_first.config
    assert len(store.results()) == len(outcomes)  # every trial it ran is stored
    if s.early_stop is None:
        assert len(outcomes) == len(CONFIGS)
    else:
        assert s.early_stop.tried == len(outcomes) < len(CONFIGS)


# --------------------------------------------------------------------------- the dashboard's study


def test_a_search_keeps_its_runs_as_an_optuna_study(store):
    import optuna

    from cptune.search import study_name

    first = search(store, study_storage=store.optuna_storage()).run()
    url = store.engine.url.render_as_string(hide_password=False)
    study = optuna.load_study(study_name=study_name(WORKLOAD, this_host()), storage=url)
    rows = {r.id: r for r in store.results()}
    assert len(study.trials) == len(first) == len(rows)
    for trial in study.trials:
        row = rows[trial.user_attrs["measurement_id"]]
        assert trial.params == row.config.to_dict()
        assert trial.value == row.median_ms and trial.user_attrs["status"] == "ok"
    search(store, study_storage=store.optuna_storage()).run()  # nothing new: nothing added
    assert len(optuna.load_study(study_name=study.study_name, storage=url).trials) == len(rows)
    search(store, study_storage=store.optuna_storage(), remeasure=True).run()
    assert len(optuna.load_study(study_name=study.study_name, storage=url).trials) == 2 * len(rows)


def test_the_command_line_offers_every_order():
    from cptune.cli import SEARCH_ORDERS
    from cptune.search import ORDERS

    assert SEARCH_ORDERS == ORDERS


def test_a_study_that_cannot_be_written_is_one_store_error_and_the_run_is_kept(store):
    import optuna

    from cptune.store import StoreError

    class Refusing(optuna.storages.InMemoryStorage):
        def create_new_trial(self, study_id, template_trial=None):
            raise optuna.exceptions.StorageInternalError("database is locked")

    with pytest.raises(StoreError, match="every measurement is stored"):
        search(store, study_storage=Refusing(), configs=CONFIGS[:1]).run()
    assert [r.config for r in store.results()] == CONFIGS[:1]
