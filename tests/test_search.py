"""The search over one workload: coverage, rounds, the race, resume, failures, feasibility."""

from collections import Counter

import pytest

from conftest import candidate, replay, stand_in_measuring
from cptune import CPConfig, Workload, enumerate_configs, feasibility
from cptune.estimate import verdicts
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


def clean_visits(store):
    """Clean stored visits per configuration."""
    return Counter(r.config for r in store.results() if r.clean)


@pytest.mark.slow
def test_small_space_gets_its_rounds_and_a_rerun_runs_nothing(store):
    first = search(store, rounds=2, race_rounds=0).run()
    assert {v.config for v in first} == set(CONFIGS)
    assert all(v.status == "ok" and not v.reused and v.median_ms > 0 for v in first)
    assert clean_visits(store) == dict.fromkeys(CONFIGS, 2)  # explored once, then one round
    assert len(store.results()) == len(first)  # every visit stored (disturbed ones too)
    assert search(store, rounds=2, race_rounds=0).run() == []  # everything known: nothing runs again
    again = search(store, rounds=2, race_rounds=0, remeasure=True)
    fresh = again.run()
    assert not any(v.reused for v in fresh)
    assert clean_visits(store) == dict.fromkeys(CONFIGS, 4)  # two fresh ones each, the old ones kept
    assert again.verdict is not None and again.verdict.leader.rounds == 4  # and combined


@pytest.mark.slow
def test_interrupted_search_resumes_with_what_is_missing(store):
    def stop_after_two(visit, seen=[]):  # noqa: B006 - state across calls on purpose
        seen.append(visit)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(store, rounds=1, race_rounds=0, on_visit=stop_after_two).run()
    kept = {r.config for r in store.results()}
    assert len(kept) == 2
    rest = search(store, rounds=1, race_rounds=0).run()
    assert {v.config for v in rest} == set(CONFIGS) - kept
    assert clean_visits(store) == dict.fromkeys(CONFIGS, 1)


@pytest.mark.slow
def test_failures_are_stored_and_the_search_goes_on(store, faulty_engine):
    engine = faulty_engine("raise")  # rank 1 raises: every multi-rank run fails
    visits = search(store, backend=engine, rounds=2, race_rounds=0).run()
    assert [v.status for v in visits if v.config == CPConfig("ring", 1)] == ["ok", "ok"]
    failed = [v for v in visits if v.config.ranks == 2]
    assert len(failed) == 3 and all(v.status == "error" and "rank 1" in v.error for v in failed)
    assert len({v.config for v in failed}) == 3  # a failure is not noise: never run again
    stored = {r.config: (r.status, r.error) for r in store.results() if r.status != "ok"}
    assert all(stored[v.config] == ("error", v.error) for v in failed)
    assert search(store, backend=engine, rounds=2, race_rounds=0).run() == []  # failures count as measured


@pytest.mark.slow
def test_a_pool_that_fails_to_launch_is_stored_as_launch_and_the_search_goes_on(store, faulty_engine):
    engine = faulty_engine("launch")  # rank 1 exits at start: no pool of two ranks starts
    visits = search(store, backend=engine, rounds=2, race_rounds=0).run()
    assert [v.status for v in visits if v.config == CPConfig("ring", 1)] == ["ok", "ok"]
    failed = [v for v in visits if v.config.ranks == 2]
    assert {v.status for v in failed} == {"launch"} and len(failed) == 3
    assert all("start-up" in v.error for v in failed)
    assert Counter(r.status for r in store.results()) == {"ok": 2, "launch": 3}


@pytest.mark.slow
def test_tpe_never_proposes_an_infeasible_point(store):
    """A budget below the space size uses TPE; every proposal is a feasible config."""
    workload = Workload(seq_len=48, heads=6, head_dim=8, kv_heads=3, dtype="fp32")
    configs = enumerate_configs(workload, 4)
    assert len(configs) > 4
    host = this_host()
    visits = WorkloadSearch(workload, configs, store, host, warmup=0, repeats=1, trials=4, rounds=1).run()
    explored = [v for v in visits if v.phase == "explore"]
    assert len(explored) == 4
    for o in explored:
        assert o.config in configs and feasibility(workload, o.config) == []


@pytest.mark.slow
def test_tpe_is_warm_started_from_other_lengths(store):
    host = this_host()
    shorter = Workload(seq_len=48, heads=4, head_dim=16, dtype="fp32")
    WorkloadSearch(shorter, enumerate_configs(shorter, 2), store, host, warmup=0, repeats=1, rounds=1,
                   race_rounds=0).run()
    (best,) = verdicts(store.results()).values()  # the fastest over its combined visits
    visits = search(store, trials=1, rounds=1).run()
    assert [v.config for v in visits] == [best.leader.config]


# --------------------------------------------------------------------------- guided order


def test_win_probability_reads_the_interval_as_its_quantiles():
    from cptune.search import win_probability

    c = candidate(CPConfig("ring", 2), 10.0, 8.0, 15.0)
    assert win_probability(c, 8.0) == pytest.approx(0.1)  # the low edge is the 10% quantile
    assert win_probability(c, 15.0) == pytest.approx(0.9)
    assert win_probability(c, 10.0) == pytest.approx(0.5)
    assert win_probability(c, 4.0) < 0.01 < win_probability(c, 9.0) < 0.5
    no_spread_below = candidate(CPConfig("ring", 2), 10.0, 10.0, 15.0)
    assert win_probability(no_spread_below, 9.99) == 0.0


def test_guided_order_takes_the_best_predicted_first_and_stops_when_none_can_win():
    local, ring, ag, uly = CONFIGS  # ring x1, ring x2, allgather_kv x2, ulysses x2
    predictions = {
        local: candidate(local, 40.0, 30.0, 50.0),
        ring: candidate(ring, 20.0, 16.0, 26.0),
        ag: candidate(ag, 22.0, 19.0, 30.0),
        uly: candidate(uly, 60.0, 50.0, 80.0),
    }
    truth = {local: 41.0, ring: 21.0, ag: 18.5, uly: 55.0}
    order, sampler, asked = replay(truth, predictions)
    # ring first (lowest estimate); ag's interval reaches below 21 ms, so it runs; then local
    # (low edge 30 ms) and ulysses (50 ms) cannot plausibly beat 18.5 ms: stop
    assert order == [ring, ag]
    stop = sampler.early_stop
    assert stop is not None and stop.leader == ag and stop.leader_ms == 18.5
    assert (stop.tried, stop.unmeasured, stop.likeliest) == (2, 2, local)
    assert stop.probability < 0.1 and "stopped after 2 of 4 configurations" in stop.describe()
    assert "a 10% chance" in stop.describe()
    _, bolder, _ = replay(truth, predictions, stop_probability=0.3)
    assert "stopped after 2 of 4 configurations" in bolder.early_stop.describe()
    assert "a 30% chance" in bolder.early_stop.describe()  # the threshold it ran with
    assert all(ring not in pending for pending in asked[1:])  # never asked again once tried


def test_guided_search_runs_everything_when_each_remaining_config_may_still_win():
    predictions = {c: candidate(c, 20.0 + i, 5.0, 60.0) for i, c in enumerate(CONFIGS)}  # wide bands
    truth = {c: 30.0 - i for i, c in enumerate(CONFIGS)}
    order, sampler, _ = replay(truth, predictions)
    assert order == list(CONFIGS) and sampler.early_stop is None


@pytest.mark.slow
def test_guided_search_without_a_calibration_falls_back_to_every_configuration(store):
    s = search(store, order="guided", rounds=1, race_rounds=0)
    outcomes = s.run()
    assert {o.config for o in outcomes} == set(CONFIGS)
    assert s.unguided is not None and "no calibration" in s.unguided and s.early_stop is None


@pytest.mark.slow
def test_guided_search_orders_by_the_stored_model(store):
    from conftest import make_calibration
    from cptune.model import predict_for

    host = this_host()
    store.add_calibration(host, make_calibration(2))
    expected_first = min(predict_for(store, host.fingerprint, WORKLOAD, CONFIGS), key=lambda c: c.latency_ms)
    s = search(store, order="guided", rounds=1)
    visits = s.run()
    assert s.unguided is None
    assert visits[0].config == expected_first.config
    assert len(store.results()) == len(visits)  # every visit it ran is stored
    explored = [v.config for v in visits if v.phase == "explore"]
    assert {v.config for v in visits} == set(explored)  # the rounds and the race visit only what ran
    if s.early_stop is None:
        assert len(explored) == len(CONFIGS)
    else:
        assert s.early_stop.tried == len(explored) < len(CONFIGS)


# --------------------------------------------------------------------------- the dashboard's study


@pytest.mark.slow
def test_a_search_keeps_its_runs_as_an_optuna_study(store):
    import optuna

    from cptune.search import study_name

    first = search(store, study_storage=store.optuna_storage(), race_rounds=0).run()
    url = store.engine.url.render_as_string(hide_password=False)
    study = optuna.load_study(study_name=study_name(WORKLOAD, this_host()), storage=url)
    rows = {r.id: r for r in store.results()}
    assert len(study.trials) == len(first) == len(rows) >= 2 * len(CONFIGS)  # the rounds' visits too
    for trial in study.trials:
        row = rows[trial.user_attrs["measurement_id"]]
        assert trial.params == row.config.to_dict()
        assert trial.value == row.median_ms and trial.user_attrs["status"] == "ok"
    search(store, study_storage=store.optuna_storage(), race_rounds=0).run()  # nothing new: nothing added
    assert len(optuna.load_study(study_name=study.study_name, storage=url).trials) == len(rows)
    search(store, study_storage=store.optuna_storage(), race_rounds=0, remeasure=True).run()
    trials = optuna.load_study(study_name=study.study_name, storage=url).trials
    assert len(store.results()) > len(rows)
    assert sorted(t.user_attrs["measurement_id"] for t in trials) == [r.id for r in store.results()]


def test_the_command_line_offers_every_order():
    from cptune.cli import build_parser
    from cptune.space import ORDERS

    search = build_parser()._subparsers._group_actions[0].choices["search"]
    order = next(action for action in search._actions if action.dest == "order")
    assert tuple(order.choices) == ORDERS


@pytest.mark.slow
def test_a_study_that_cannot_be_written_is_one_store_error_and_the_run_is_kept(store):
    import optuna

    from cptune.store import StoreError

    class Refusing(optuna.storages.InMemoryStorage):
        def create_new_trial(self, study_id, template_trial=None):
            raise optuna.exceptions.StorageInternalError("database is locked")

    with pytest.raises(StoreError, match="every measurement is stored"):
        search(store, study_storage=Refusing(), configs=CONFIGS[:1]).run()
    assert [r.config for r in store.results()] == CONFIGS[:1]


# --------------------------------------------------------------------------- rounds and the race


class Runs:
    """Stands in for ``measure``: the latency of ``config``'s n-th run (from 0) is
    ``latency(config, n)``, and ``disturbed(config, n)`` says why it was disturbed (or None)."""

    def __init__(self, latency, disturbed=lambda config, n: None):
        self.latency, self.disturbed, self.calls = latency, disturbed, []

    def __call__(self, workload, config, **_):
        import dataclasses

        from conftest import measurement
        from cptune.measurement import oversubscribed

        n = self.calls.count(config)
        self.calls.append(config)
        return dataclasses.replace(measurement(workload, config, self.latency(config, n)),
                                   disturbed=self.disturbed(config, n),
                                   oversubscribed=oversubscribed(config.ranks))


@pytest.fixture
def runs(monkeypatch):
    """Install a ``Runs`` as the search's ``measure``; returns a function that makes it."""

    def install(latency, disturbed=lambda config, n: None):
        fake = Runs(latency, disturbed)
        stand_in_measuring(monkeypatch, fake)
        return fake

    return install


LOCAL, RING, AG, ULY = CONFIGS  # ring x1, ring x2, allgather_kv x2, ulysses x2
JITTER = (1.0, 1.03, 0.98, 1.02, 0.97, 1.01, 0.99, 1.04, 0.96, 1.0)  # a visit's noise, by visit number


def by_round(store):
    """round_id -> configurations visited in it, in the order they ran."""
    rounds = {}
    for r in store.results():
        rounds.setdefault(r.round_id, []).append(r.config)
    return rounds


def test_rounds_visit_every_candidate_in_a_fresh_random_order_and_store_their_round(store, runs, tmp_path):
    runs(lambda config, n: 10.0 * (1 + CONFIGS.index(config)) * JITTER[n])  # 10, 20, 30, 40 ms apart
    s = search(store, rounds=5, race_rounds=0, seed=3)
    visits = s.run()
    rounds = by_round(store)
    assert len(rounds) == 5 and all(sorted(map(str, c)) == sorted(map(str, CONFIGS)) for c in rounds.values())
    assert all(round_id.startswith(f"{s.session}:") for round_id in rounds)
    assert [v.round_id for v in visits] == [r.round_id for r in store.results()]
    explored = {v.round_id for v in visits if v.phase == "explore"}
    assert len(explored) == 1  # the exploration ran back to back: one round
    orders = [tuple(configs) for round_id, configs in rounds.items() if round_id not in explored]
    assert len(orders) == 4 and len(set(orders)) > 1  # shuffled afresh each round
    # the same seed gives the same orders; the rounds are what a seed decides
    with Store(str(tmp_path / "again.db")) as other:
        WorkloadSearch(WORKLOAD, CONFIGS, other, this_host(), rounds=5, race_rounds=0, seed=3).run()
        seeded_again = by_round(other)
    assert [tuple(c) for round_id, c in seeded_again.items() if not round_id.endswith(":0")] == orders


def test_the_race_ends_as_soon_as_the_leader_is_separated(store, runs):
    fake = runs(lambda config, n: (10.0 if config == RING else 20.0) * JITTER[n])
    s = search(store, configs=[RING, AG], rounds=2, race_rounds=6, seed=0)
    visits = s.run()
    assert [v.phase for v in visits] == ["explore", "explore", "round", "round"]  # no race needed
    assert len(fake.calls) == 4
    assert s.verdict.winner == RING and s.verdict.leader.rounds == 2
    assert s.verdict.describe().startswith(f"{RING.describe()}, faster than {AG.describe()} by ")
    assert search(store, configs=[RING, AG], rounds=2, race_rounds=6).run() == []  # finished: nothing runs


def test_a_near_miss_on_two_slow_visits_races_until_a_paired_comparison_decides(store, runs):
    """AG runs 1.1x RING's time, but a slow phase of the host slows its first two visits
    1.3x: two visits separate it (1.43x), so it races the leader until they share the
    rounds a paired comparison needs; a configuration twice as slow never races."""
    slow = ULY
    runs(lambda config, n: {RING: 10.0, AG: 11.0 * (1.3 if n < 2 else 1.0), slow: 20.0}[config] * JITTER[n])
    s = search(store, configs=[RING, AG, slow], rounds=2, race_rounds=3, seed=0)
    visits = s.run()
    race = [v for v in visits if v.phase == "race"]
    assert {v.config for v in race} == {RING, AG}
    ag = next(c for c in s.verdict.comparisons if c.other == AG)
    assert ag.paired_rounds >= 3 and ag.ratio < 1.3  # decided on paired rounds, no longer by the slow two
    assert Counter(r.config for r in store.results())[slow] == 2


def test_a_near_miss_separated_on_enough_shared_rounds_is_not_raced(store, runs):
    runs(lambda config, n: (10.0 if config == RING else 13.0) * JITTER[n])
    s = search(store, configs=[RING, AG], rounds=3, race_rounds=3, seed=0)
    visits = s.run()
    assert [v.phase for v in visits] == ["explore"] * 2 + ["round"] * 4  # separated on 3 shared rounds
    assert s.verdict.winner == RING and s.verdict.comparisons[0].paired_rounds == 3


def test_a_second_sitting_confirms_a_narrow_winner_and_a_rerun_runs_nothing(store, runs):
    runs(lambda config, n: (10.0 if config == RING else 13.0) * JITTER[n])
    s = search(store, configs=[RING, AG], rounds=3, race_rounds=3, seed=0)
    s.run()
    first = s.session
    assert s.verdict.winner == RING and s.unconfirmed() == [RING, AG]  # 1.3x apart: within NEAR_MISS_RATIO
    visits = s.confirm()
    assert [v.phase for v in visits] == ["confirm"] * 6  # three rounds of the two, nothing more
    assert s.session != first and all(v.round_id.startswith(f"{s.session}:") for v in visits)
    assert s.verdict.winner == RING and s.verdict.leader.rounds == 6 and s.unconfirmed() == []
    again = search(store, configs=[RING, AG], rounds=3, race_rounds=3)
    assert again.run() == [] and again.unconfirmed() == [] and again.confirm() == []  # stored: confirmed


def test_a_winner_the_second_sitting_contradicts_becomes_a_tie(store, runs):
    """The host changed state between the sittings: AG, 1.3x RING's time in the first,
    runs in 0.8x of it in the second. Pooled, neither is faster."""
    runs(lambda config, n: (10.0 if config == RING else (13.0 if n < 3 else 8.0)) * JITTER[n])
    s = search(store, configs=[RING, AG], rounds=3, race_rounds=3, seed=0)
    s.run()
    assert s.verdict.winner == RING
    s.confirm()
    assert s.verdict.winner is None and "tied within the noise of this hardware" in s.verdict.describe()
    assert clean_visits(store) == {RING: 6, AG: 6}  # the cap, rounds + race_rounds: no race after it


def test_a_second_sitting_runs_all_its_rounds_whatever_the_first_shows(store, runs):
    """AG's first visit of the second sitting is 3x slow and makes the two look tied after
    one round; the sitting still runs its three, and the combined verdict stands."""
    runs(lambda config, n: (10.0 if config == RING else (39.0 if n == 3 else 13.0)) * JITTER[n])
    s = search(store, configs=[RING, AG], rounds=3, race_rounds=3, seed=0)
    s.run()
    visits = s.confirm()
    assert Counter(v.config for v in visits if v.phase == "confirm") == {RING: 3, AG: 3}
    assert s.verdict.winner == RING and s.unconfirmed() == []


def test_the_race_never_runs_a_round_without_its_leader(store, runs):
    """RING leads and has used its cap; AG, tied with it, has not: a round of AG alone
    would compare nothing with the leader, so none runs."""
    runs(lambda config, n: 10.0 * (JITTER[n] if config == RING else 2 - JITTER[n]))
    search(store, configs=[RING], rounds=5, race_rounds=0).run()
    s = search(store, configs=[RING, AG], rounds=2, race_rounds=3, seed=0)
    visits = s.run()
    assert clean_visits(store)[RING] == 5 and s.verdict.winner is None
    assert {v.config for v in visits if v.phase == "race"} == set()  # AG alone never races


def test_a_winner_that_fails_in_the_second_sitting_ends_it(store, runs, monkeypatch):
    """RING crashes in its first round of the second sitting: AG alone confirms nothing."""
    from cptune.errors import EngineError

    fake = runs(lambda config, n: (10.0 if config == RING else 13.0) * JITTER[n])

    def crashing(workload, config, **options):
        if config == RING and fake.calls.count(RING) == 3:
            fake.calls.append(RING)
            raise EngineError("crash", "rank 1 exited with signal 11")
        return fake(workload, config, **options)

    stand_in_measuring(monkeypatch, crashing)
    s = search(store, configs=[RING, AG], rounds=3, race_rounds=3, seed=0)
    s.run()
    visits = s.confirm()
    assert sorted((v.config == RING, v.status) for v in visits) == [(False, "ok"), (True, "crash")]
    assert s.unconfirmed() == []


@pytest.mark.parametrize("latency, options", [
    (lambda config, n: (10.0 if config == RING else 20.0) * JITTER[n], {}),  # 2x: no doubt to confirm
    (lambda config, n: 10.0 * (JITTER[n] if config == RING else 2 - JITTER[n]), {}),  # a tie: no winner
    (lambda config, n: (10.0 if config == RING else 13.0) * JITTER[n], {"confirm_rounds": 0}),  # asked none
])
def test_no_second_sitting_without_a_narrow_winner_or_when_asked_for_none(store, runs, latency, options):
    fake = runs(latency)
    s = search(store, configs=[RING, AG], rounds=3, race_rounds=3, **options)
    s.run()
    calls = len(fake.calls)
    assert s.unconfirmed() == [] and s.confirm() == [] and len(fake.calls) == calls


def test_configurations_tied_in_the_noise_are_raced_to_the_cap_and_called_a_tie(store, runs):
    # RING and AG: the same latency, with noise in opposite directions, so never separated
    slow = ULY
    runs(lambda config, n: 50.0 * JITTER[n] if config == slow else
         10.0 * (JITTER[n] if config == RING else 2 - JITTER[n]))
    s = search(store, configs=[RING, AG, slow], rounds=2, race_rounds=3, seed=0)
    visits = s.run()
    race = [v for v in visits if v.phase == "race"]
    assert {v.config for v in race} == {RING, AG}  # the slow one is out of the race
    assert Counter(r.config for r in store.results()) == {RING: 5, AG: 5, slow: 2}  # the cap: 2 + 3
    assert all(len(c) == len(set(c)) for c in by_round(store).values())  # each once a round
    assert s.verdict.winner is None and set(s.verdict.tied) == ({RING, AG} - {s.verdict.leader.config})
    assert "tied within the noise of this hardware" in s.verdict.describe()
    assert search(store, configs=[RING, AG, slow], rounds=2, race_rounds=3).run() == []


def test_a_resumed_race_continues_where_it_stopped(store, runs):
    runs(lambda config, n: 10.0 * (JITTER[n] if config == RING else 2 - JITTER[n]))

    def stop_in_the_race(visit):
        if visit.phase == "race":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(store, configs=[RING, AG], rounds=2, race_rounds=4, on_visit=stop_in_the_race).run()
    before = Counter(r.config for r in store.results())
    assert sum(before.values()) == 5  # explored, a round, one race visit
    rest = search(store, configs=[RING, AG], rounds=2, race_rounds=4).run()
    # rounds of both until one has the cap (2 + 4); the other's missing visit would have run
    # alone, comparing nothing with the leader
    assert all(v.phase == "race" for v in rest) and len(rest) == 6
    assert sorted(Counter(r.config for r in store.results()).values()) == [5, 6]


def test_disturbed_visits_are_kept_marked_count_for_nothing_and_are_run_again(store, runs, monkeypatch):
    pauses = []
    monkeypatch.setattr("cptune.search._workload.time.sleep", pauses.append)
    runs(lambda config, n: (10.0 if config == RING else 20.0) * JITTER[n],
         disturbed=lambda config, n: "load 3.0 on 2 cores" if (config, n) in {(AG, 0), (AG, 1)} else None)
    s = search(store, configs=[RING, AG], rounds=2, race_rounds=0, seed=0)
    visits = s.run()
    ag = [v for v in visits if v.config == AG]
    assert [v.disturbed is not None for v in ag] == [True, True, False, False]
    assert len({v.round_id for v in ag}) == 4  # each time in the next round
    marked = [r for r in store.results() if r.disturbed]
    assert [(r.config, r.disturbed) for r in marked] == [(AG, "load 3.0 on 2 cores")] * 2
    assert s.verdict.winner == RING
    ag_estimate = next(c for c in s.verdict.comparisons if c.other == AG)
    assert ag_estimate.ratio == pytest.approx(2.0, rel=0.05)  # the disturbed ones did not count
    assert pauses == [s.settle_s, s.settle_s]  # a pause before each round that re-ran a disturbed one
    assert s.never_clean == ()


def test_constant_load_ends_after_a_bounded_number_of_runs(store, runs, monkeypatch):
    monkeypatch.setattr("cptune.search._workload.time.sleep", lambda seconds: None)
    fake = runs(lambda config, n: 10.0, disturbed=lambda config, n: "always loaded")
    s = search(store, configs=[RING, AG], rounds=2, race_rounds=1)
    assert s.run() and Counter(fake.calls) == {RING: 2 * 3, AG: 2 * 3}  # twice the cap of 3
    assert set(s.never_clean) == {RING, AG} and s.verdict is None
    assert search(store, configs=[RING, AG], rounds=2, race_rounds=1).run() == []


def test_remeasure_gives_fresh_visits_and_combines_them_with_the_stored_ones(store, runs):
    runs(lambda config, n: (10.0 if config == RING else 20.0) * JITTER[n])
    search(store, configs=[RING, AG], rounds=2).run()
    again = search(store, configs=[RING, AG], rounds=3, remeasure=True)
    assert again.known() == {}  # nothing stored decides what it runs
    fresh = again.run()
    assert Counter(v.config for v in fresh) == {RING: 3, AG: 3}  # its own rounds, from scratch
    assert again.verdict.leader.rounds == 5  # the verdict combines every clean visit stored
    assert search(store, configs=[RING, AG], rounds=3).run() == []


def test_only_runs_like_the_search_own_count(store, runs):
    import dataclasses

    from conftest import measurement

    host = this_host()
    store.add_measurement(host, dataclasses.replace(measurement(WORKLOAD, RING, 1.0), engine="tensorrt"))
    store.add_measurement(host, dataclasses.replace(measurement(WORKLOAD, RING, 1.0), oversubscribed=True))
    fake = runs(lambda config, n: 10.0 * JITTER[n])
    s = search(store, configs=[RING], rounds=2)
    assert s.known() == {}
    s.run()
    assert fake.calls == [RING, RING] and s.verdict.leader.median_ms > 5  # the two odd runs stay out


def test_an_oversubscribed_search_races_its_oversubscribed_configurations(store, runs, monkeypatch):
    monkeypatch.setattr("cptune.search._workload.oversubscribed", lambda ranks, per_node=None: ranks > 1)
    monkeypatch.setattr("cptune.search._ledger.oversubscribed", lambda ranks, per_node=None: ranks > 1)
    monkeypatch.setattr("cptune.measurement.available_cores", lambda: 1)
    runs(lambda config, n: (10.0 if config == RING else 20.0) * JITTER[n])
    s = search(store, configs=[LOCAL, RING], rounds=2)
    s.run()
    assert all(r.oversubscribed == (r.config == RING) for r in store.results())
    assert s.verdict.winner == RING  # the user asked for it: judged with the rest


def test_progress_covers_every_phase(store, runs):
    runs(lambda config, n: 10.0 * (JITTER[n] if config == RING else 2 - JITTER[n]))
    seen = []
    search(store, configs=[RING, AG], rounds=2, race_rounds=1, on_visit=seen.append).run()
    assert [v.phase for v in seen] == ["explore"] * 2 + ["round"] * 2 + ["race"] * 2
    assert [v.left for v in seen] == [3, 2, 1, 0, 1, 0]  # planned visits still to come


def test_what_is_known_combines_every_clean_visit_rather_than_taking_the_newest(store):
    from conftest import measurement

    host = this_host()
    for ms in (10.0, 40.0):  # the newest alone would say 40 ms
        store.add_measurement(host, measurement(WORKLOAD, RING, ms), round_id=f"r{ms}")
    store.add_failure(host, WORKLOAD, AG, "wrong_output", "off by 1%", "mpi")
    store.add_failure(host, WORKLOAD, ULY, "timeout", "took too long", "mpi")  # its one retry is due
    assert search(store).known() == {RING: ("ok", pytest.approx(20.0), None),
                                     AG: ("wrong_output", None, "off by 1%")}


def test_a_search_ends_even_when_its_new_runs_are_not_counted(store, monkeypatch):
    """Rows the search does not count (here: stored as run with another oversubscription than
    a run gets now) add nothing to its tally; its own count of runs still ends it."""
    import dataclasses

    runs = Runs(lambda config, n: 10.0)

    def drifting(workload, config, **options):
        m = runs(workload, config, **options)
        return m if len(runs.calls) == 1 else dataclasses.replace(m, oversubscribed=not m.oversubscribed)

    stand_in_measuring(monkeypatch, drifting)
    s = search(store, configs=[RING], rounds=2, race_rounds=1)
    s.run()
    assert runs.calls == [RING] * s.max_attempts


# --------------------------------------------------------------------------- failures retried, left out


def failing(runs, monkeypatch, fails):
    """``runs`` at 10 ms (AG 20 ms), except the runs ``fails(config, n)`` names (by the
    configuration's n-th run, from 0), which raise an ``EngineError`` of that kind."""
    from cptune.errors import EngineError

    fake = runs(lambda config, n: (20.0 if config == AG else 10.0) * JITTER[n])

    def measure(workload, config, **options):
        kind = fails(config, fake.calls.count(config))
        if kind is None:
            return fake(workload, config, **options)
        fake.calls.append(config)
        raise EngineError(kind, f"a rank crashed while running {config.describe()}: rank 1 died.\nmore")

    stand_in_measuring(monkeypatch, measure)
    return fake


def test_a_crashed_configuration_is_retried_once_by_the_next_search_and_named_until_then(store, runs,
                                                                                      monkeypatch):
    fake = failing(runs, monkeypatch, lambda config, n: "crash" if config == AG and n == 0 else None)
    first = search(store, configs=[RING, AG], rounds=2, race_rounds=0)
    first.run()
    assert fake.calls.count(AG) == 1  # not again in the search it crashed in
    assert first.verdict.leader.config == RING and not first.verdict.comparisons
    (left,) = first.left_out
    assert left.config == AG and left.status == "crash" and left.retried
    assert f"its latest run failed (crash: a rank crashed while running {AG.describe()}" in left.reason
    assert "the next search of this space runs it once more" in left.reason
    assert left.command == ("cptune measure --seq-len 96 --heads 4 --head-dim 16 --dtype fp32 "
                            f"--strategies {AG.strategy} --ranks 2 --head-group 1")
    assert f"{AG.describe()} left out of the verdict" in left.describe() and left.command in left.describe()
    second = search(store, configs=[RING, AG], rounds=2, race_rounds=0)
    visits = second.run()
    assert [v.status for v in visits if v.config == AG] == ["ok", "ok"]  # retried, then its round
    assert second.left_out == () and {c.other for c in second.verdict.comparisons} == {AG}


def test_a_configuration_that_crashes_again_or_computes_wrong_is_not_run_again(store, runs, monkeypatch):
    fake = failing(runs, monkeypatch, lambda config, n: "crash" if config == AG else
                   "wrong_output" if config == RING else None)
    configs = [LOCAL, RING, AG]
    for _ in range(3):
        s = search(store, configs=configs, rounds=1, race_rounds=0)
        s.run()
    assert fake.calls.count(AG) == 2 and fake.calls.count(RING) == 1  # one retry of a crash; none of wrong
    left = {entry.config: entry for entry in s.left_out}
    assert set(left) == {RING, AG} and not any(entry.retried for entry in left.values())
    assert "it failed again when retried" in left[AG].reason
    assert "a failure of kind wrong_output is the configuration's, not the host's" in left[RING].reason
