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
