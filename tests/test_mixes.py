"""Length mixes (cptune.mixes): read and refused in one line, costed from the cost model, the
static answer over a mix, and a plan per batch, fast and exact (against a MILP)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cptune.mixes import LengthMix, MixError, check_fits, mix_costs, read_mix
from cptune.workload import Workload

SHAPE = Workload(seq_len=1024, heads=32, kv_heads=8, head_dim=128, causal=True, mode="train").shape


@pytest.fixture(autouse=True)
def _no_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Described hardware only, answered by the prior: no database is read or made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CPTUNE_DB", raising=False)


def test_every_file_form_reads_the_same_mix(tmp_path: Path) -> None:
    lengths = [512, 2048, 512, 131072]
    (tmp_path / "lines.txt").write_text("# lengths\n512\n2048\n\n512\n131072\n")
    (tmp_path / "list.json").write_text(json.dumps(lengths))
    (tmp_path / "hist.json").write_text(json.dumps({"512": 2, "2048": 1, "131072": 1}))
    np.save(tmp_path / "array.npy", np.array(lengths, dtype=np.int32))
    for name in ("lines.txt", "list.json", "array.npy"):
        assert read_mix(tmp_path / name).lengths.tolist() == lengths, name
    assert read_mix(tmp_path / "hist.json").lengths.tolist() == sorted(lengths)
    assert LengthMix.from_histogram({512: 2, 2048: 1, 131072: 1}).histogram()[1].tolist() == [2, 1, 1]


@pytest.mark.parametrize(("content", "says"), [
    ("", "empty"), ("[]", "empty"), ("512\n0\n", "length 0 (sequence 2)"), ("512\n1.5\n", "line 2"),
    ("[512, 2.0]", "sequence 2: 2.0"), ('{"512": -1}', "count"), ("[512, true]", "sequence 2"),
    ("[NaN]", "NaN"), ('{"a": 1}', "key 'a'"), ("[99999999999999999999]", "longer than"),
])
def test_bad_text_is_refused_in_one_line(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "mix.txt"
    path.write_text(content)
    with pytest.raises(MixError, match="mix.txt") as caught:
        read_mix(path)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_arrays_that_are_not_integers_or_need_unpickling_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "floats.npy", np.array([1.0, 2.0]))
    np.save(tmp_path / "objects.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(MixError, match="whole numbers"):
        read_mix(tmp_path / "floats.npy")
    with pytest.raises(MixError, match="allow_pickle"):
        read_mix(tmp_path / "objects.npy")
    with pytest.raises(MixError, match="not a regular file"):
        read_mix(tmp_path)
    with pytest.raises(MixError, match="no such file"):
        read_mix(tmp_path / "absent.txt")


def test_a_sequence_no_configuration_holds_names_the_memory_it_needs() -> None:
    mix = LengthMix.of([1024, 1 << 20])
    check_fits(mix, SHAPE, 8, None)  # no limit: fits
    needs = r"1,048,576 tokens, needs at least .* GiB per rank .* over the 1.0 GiB"
    with pytest.raises(MixError, match=needs):
        check_fits(mix, SHAPE, 8, 2**30)
    with pytest.raises(MixError, match="needs at least"):
        mix_costs(SHAPE, LengthMix.of([1024, 1 << 25]), hardware="h100-sxm-8")


def test_costs_are_the_recommendation_at_each_length_and_between() -> None:
    from cptune.model import recommend

    mix = LengthMix.of([1000, 4000, 16000, 64000])
    costs = mix_costs(SHAPE, mix, ranks=4, hardware="h100-sxm-8")
    assert max(costs.sizes) == 4
    at = costs.times([4000])[:, 0]
    pick = recommend(SHAPE.at(4000), hardware="h100-sxm-8")
    for candidate in pick.candidates:
        if candidate.config.ranks <= 4:
            assert at[costs.configs.index(candidate.config)] == pytest.approx(candidate.latency_ms)
    between = costs.times([8000])[:, 0]
    assert np.all((between > at) & (between < costs.times([16000])[:, 0]))
    with pytest.raises(MixError, match="outside"):
        costs.times([100])


def test_a_group_beside_the_others_is_priced_with_all_the_hosts_ranks_busy(tmp_path: Path) -> None:
    from conftest import add_measurements, make_calibration, measurement
    from cptune.config import CPConfig
    from cptune.hardware import this_host
    from cptune.mixes import batch_policy
    from cptune.store import Store

    db = str(tmp_path / "host.db")
    with Store(db) as store:
        store.add_calibration(this_host(), make_calibration(4))
    shape = Workload(seq_len=1024, heads=4, head_dim=64, causal=True).shape
    local = CPConfig("ring", 1)
    add_measurements(db, measurement(shape.at(1024), local, 5.0))
    costs = mix_costs(shape, LengthMix.of([512, 1024, 2048]), 4, db=db)
    alone, shared = costs.times([512, 1024], shared=False), costs.times([512, 1024])
    row = costs.configs.index(local)
    assert alone[row, 1] == pytest.approx(5.0)  # its measurement, timed alone, answers alone only
    # make_calibration's rank computes at 20 GFLOP/s / sqrt(ranks busy): beside three others, half
    assert shared[row, 0] == pytest.approx(2 * alone[row, 0])
    assert shared[row, 1] != pytest.approx(5.0)  # the prior beside the others, not the measurement
    on_all = [i for i, c in enumerate(costs.configs) if c.ranks == 4]
    assert on_all and np.allclose(shared[on_all], alone[on_all])
    policy = batch_policy(costs)
    kept = costs.undominated.tolist()
    assert [c.ms for c in policy.curves] == [tuple(float(v) for v in costs.shared_ms[i]) for i in kept]


def test_the_static_answer_is_the_lowest_expected_time_over_the_mix() -> None:
    from cptune.mixes import recommend_mix

    mix = LengthMix.from_histogram({512: 60, 2048: 30, 8192: 8, 65536: 2})
    answer = recommend_mix(SHAPE, mix, hardware="h100-sxm-8")
    values, counts = mix.histogram()
    config, time = answer.ranked[0]
    ms = answer.costs.times(values, shared=False)[answer.costs.configs.index(config)]
    assert time.mean_ms == pytest.approx(float(ms @ counts) / counts.sum())
    assert time.p99_ms == pytest.approx(ms[-1]) and time.p90_ms == pytest.approx(ms[1])
    assert [t.mean_ms for _, t in answer.ranked] == sorted(t.mean_ms for _, t in answer.ranked)
    assert answer.plan.max_seq_len == 65536 and not answer.unheld
    # each length in its bucket's pick, which at a tuned length is that length's fastest
    assert answer.plan_time.mean_ms <= time.mean_ms * (1 + 1e-9)
    assert set(answer.to_dict()) >= {"config", "time", "ranked", "plan"}


def _random_batches(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [np.minimum(rng.lognormal(7.5, 1.3, int(rng.integers(3, 9))).astype(int) + 64, 65536).tolist()
            for _ in range(count)]


#: The fast solver's makespan over the MILP's that these tests allow (the benchmark reports the spread).
FAST_WITHIN = 1.10


def test_the_fast_plan_is_near_the_exact_one_and_both_fit_in_memory() -> None:
    from cptune.cost import peak_bytes
    from cptune.mixes import exact_batch_plan, one_group_plan, plan_batch

    limit = 3 * 2**30  # memory binds: the longest sequences need groups of several ranks
    batches = _random_batches(6, seed=5)
    costs = mix_costs(SHAPE, LengthMix.of([n for b in batches for n in b]), ranks=4, hardware="h100-sxm-8",
                      memory_limit=limit)
    assert costs.shared_max.min() < 65536
    for batch in batches:
        fast, exact = plan_batch(costs, batch), exact_batch_plan(costs, batch, time_limit_s=30)
        assert exact.optimal
        assert exact.makespan_ms <= fast.makespan_ms * (1 + 1e-6)
        assert fast.makespan_ms <= FAST_WITHIN * exact.makespan_ms
        with contextlib.suppress(MixError):  # unless no configuration of all ranks holds them all
            assert fast.makespan_ms <= one_group_plan(costs, batch).makespan_ms * (1 + 1e-9)
        for plan in (fast, exact):
            placed = sorted(s for g in plan.groups for s in g.sequences)
            assert placed == list(range(len(batch)))
            assert sum(g.config.ranks for g in plan.groups) <= 4
            assert plan.makespan_ms == pytest.approx(max(g.ms for g in plan.groups))
            for group in plan.groups:
                for s in group.sequences:
                    assert peak_bytes(SHAPE.at(batch[s]), group.config) <= limit
                    assert batch[s] >= group.config.ranks


def test_a_batch_plan_splits_the_ranks_into_groups_of_any_size() -> None:
    from cptune.mixes import one_group_plan, plan_batch

    batch = [20000, 16000, 12000, 9000, 3000]
    costs = mix_costs(SHAPE, LengthMix.of(batch), ranks=7, hardware="h100-sxm-8")
    plan = plan_batch(costs, batch)
    assert len(plan.groups) > 1 and plan.idle_ranks >= 0
    assert plan.makespan_ms < 0.9 * one_group_plan(costs, batch).makespan_ms  # 7 ranks cannot split in halves
    assert plan.to_dict()["makespan_ms"] == plan.makespan_ms
    pure = plan_batch(costs, batch, allowed=lambda c: c.strategy == "ulysses" or c.ranks == 1)
    assert all(g.config.strategy == "ulysses" or g.config.ranks == 1 for g in pure.groups)
    assert pure.makespan_ms >= plan.makespan_ms * (1 - 0.02)  # a narrower space: no better (but heuristics)
    with pytest.raises(MixError, match="between 1 and the 7"):
        plan_batch(costs, batch, ranks=8)


def test_an_order_sorted_before_is_reused_only_where_it_is_the_stable_sort() -> None:
    from cptune.mixes._batch import _sorts

    rng = np.random.default_rng(11)
    for _ in range(500):
        keys = rng.integers(0, 4, int(rng.integers(1, 20))).astype(float)
        keys[rng.random(keys.size) < 0.2] = np.inf  # sequences that fit none of a set's sizes
        stable = np.argsort(keys, kind="stable")
        assert _sorts(keys, stable)
        for other in (rng.permutation(keys.size), stable[::-1]):
            assert _sorts(keys, other) == np.array_equal(other, stable)


def test_the_compiled_placement_is_longest_first_onto_the_least_busy_group_ties_to_the_first() -> None:
    import heapq

    from cptune.mixes._compiled import place_longest_first

    rng = np.random.default_rng(3)
    for _ in range(200):
        count = rng.integers(1, 5, int(rng.integers(1, 5)))
        times = rng.integers(1, 6, (int(rng.integers(1, 40)), count.size)).astype(float)  # ties are common
        times[rng.random(times.shape) < 0.2] = np.inf  # a sequence no group of a class holds
        first = np.cumsum(count) - count
        # the reference: one heap of (time, group) per class, as a list of tuples orders them
        heaps = [[(0.0, g) for g in range(a, a + n)] for a, n in zip(first.tolist(), count.tolist(),
                                                                       strict=True)]
        expected, span = [], 0.0
        for row in times.tolist():
            ends = [heap[0][0] + t for heap, t in zip(heaps, row, strict=True)]
            k = ends.index(min(ends))
            expected.append(heapq.heapreplace(heaps[k], (ends[k], heaps[k][0][1]))[1])
            span = max(span, ends[k])
        heap_time, heap_group = np.zeros(int(count.sum())), np.arange(int(count.sum()))
        placed = np.empty(times.shape[0], dtype=np.int64)
        half = times.shape[0] // 2  # in two chunks, as the solver advances
        got = 0.0
        for start, stop in ((0, half), (half, times.shape[0])):
            got = place_longest_first(times, start, stop, heap_time, heap_group, first, count, placed, got)
        assert placed.tolist() == expected
        assert got == span


def test_the_local_search_takes_a_step_exactly_where_one_lowers_the_makespan() -> None:
    """Every move, swap and trade out of the slowest group, tried one by one on copies: the
    compiled looks find one where one lowers the makespan (a move before a swap, the best of
    its kind) and none where none does."""
    from cptune.mixes._batch import PAIRED, SWAP_GROUPS, _BySize, _problem, _Search

    batches = _random_batches(40, seed=8)
    costs = mix_costs(SHAPE, LengthMix.of([n for b in batches for n in b]), ranks=6, hardware="h100-sxm-8")
    rng = np.random.default_rng(8)
    kinds, trades = {"move": 0, "swap": 0}, 0
    for batch in batches:
        problem = _problem(costs, batch, 6)
        sizes = _BySize(problem).sizes
        groups = int(rng.integers(2, 5))
        size = rng.choice(sizes[sizes <= 6 // groups], groups)  # at most the 6 ranks
        group_of = rng.integers(0, size.size, len(batch))
        search = _Search(problem, size, group_of)
        times = search.times()
        k = int(np.argmax(times))
        current = float(times[k])

        def after(moves: list[tuple[int, int]], search: _Search = search) -> float:
            twin = search.copy()
            for s, j in moves:
                twin._move(s, j)
            return float(twin.times().max())

        mine = np.flatnonzero(group_of == k).tolist()
        others = [j for j in range(size.size) if j != k]
        moves = {(s, j): after([(s, j)]) for s in mine for j in others}
        order = np.argsort(-times)
        least_busy = [int(j) for j in order[::-1] if j != k and search.count[j] > 0][:SWAP_GROUPS]
        swaps = {(s, j, o): after([(s, j), (o, k)]) for s in mine for j in least_busy
                 for o in np.flatnonzero(group_of == j).tolist()}
        step = search._best_step(k, times)
        best_move = min(moves.values(), default=math.inf)
        if best_move < current * (1 - 1e-9):
            assert step is not None and step[2] == -1
            assert moves[step[:2]] == pytest.approx(best_move, rel=1e-12)
        elif min(swaps.values(), default=math.inf) < current * (1 - 1e-9):
            assert step is not None and step[2] >= 0
            assert swaps[step] == pytest.approx(min(swaps.values()), rel=1e-12)
        elif step is not None:  # at the same makespan: the squares fall
            assert after([step[:2]] + ([(step[2], k)] if step[2] >= 0 else [])) <= current * (1 + 1e-9)
        if step is not None:
            kinds["swap" if step[2] >= 0 else "move"] += 1
        # two for one and one for two, with the least busy groups of at most PAIRED sequences
        tried = [int(j) for j in np.argsort(times) if j != k][:SWAP_GROUPS]
        tried = [j for j in tried if 0 < search.count[j] <= PAIRED]
        best_trade = math.inf
        for j in tried:
            theirs = np.flatnonzero(group_of == j).tolist()
            two_for_one = [(a, [b]) for a in itertools.combinations(mine, 2) for b in theirs]
            one_for_two = [([a], b) for a in mine for b in itertools.combinations(theirs, 2)]
            for gives, takes in two_for_one + one_for_two:
                best_trade = min(best_trade, after([(s, j) for s in gives] + [(s, k) for s in takes]))
        made = search.copy().exchange()
        assert made == (len(mine) <= PAIRED and best_trade < current * (1 - 1e-9))
        trades += made
    assert kinds["move"] and kinds["swap"] and trades  # each kind was found somewhere


def test_the_solver_runs_where_no_cache_directory_is_writable() -> None:
    import os
    import subprocess
    import sys

    from cptune.mixes import plan_batch

    batch = [20000, 16000, 12000, 9000, 3000]
    here = plan_batch(mix_costs(SHAPE, LengthMix.of(batch), ranks=7, hardware="h100-sxm-8"), batch)
    code = ("from cptune.mixes import LengthMix, mix_costs, plan_batch\n"
            "from cptune.workload import Workload\n"
            "shape = Workload(seq_len=1024, heads=32, kv_heads=8, head_dim=128, causal=True,"
            " mode='train').shape\n"
            f"costs = mix_costs(shape, LengthMix.of({batch}), ranks=7, hardware='h100-sxm-8')\n"
            f"print(repr(plan_batch(costs, {batch}).makespan_ms))")
    # with only the locator for code inside zip files, Numba has no cache directory to write
    env = {**os.environ, "NUMBA_CACHE_LOCATOR_CLASSES": "ZipCacheLocator"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == here.makespan_ms


@pytest.mark.parametrize(("lengths", "says"), [([512, True], "sequence 2: True is not a whole number"),
                                               ([512, np.int32(9), 2.0], "sequence 3: 2.0 is not a whole"),
                                               ([512, 2**70, 2**71], f"length {2**70:,} is longer")])
def test_a_batch_of_lengths_that_are_not_whole_numbers_is_refused(lengths: list[Any], says: str) -> None:
    with pytest.raises(MixError, match=says):
        LengthMix.of(lengths)
    assert LengthMix.of([512, np.int32(9)]).lengths.tolist() == [512, 9]


FLAGS = ["recommend", "--hardware", "h100-sxm-8", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
         "--causal", "--mode", "train"]


def test_recommend_takes_a_mix_or_a_batch(cptune_here: Any, tmp_path: Path) -> None:
    (tmp_path / "mix.txt").write_text("512\n512\n2048\n8192\n65536\n")
    (tmp_path / "batch.json").write_text("[20000, 16000, 12000, 9000, 3000]")
    static = cptune_here(*FLAGS, "--lengths", tmp_path / "mix.txt", "--json")
    assert static.returncode == 0, static.stderr
    data = json.loads(static.stdout)
    assert data["ranked"][0]["mean_ms"] == data["time"]["mean_ms"] and data["plan"]["seq_lens"][-1] == 65536
    text = cptune_here(*FLAGS, "--lengths", tmp_path / "mix.txt")
    assert "pick:" in text.stdout and "bucketed plan:" in text.stdout and "cptune export" in text.stdout
    batch = cptune_here(*FLAGS, "--batch-lengths", tmp_path / "batch.json", "--ranks", "7", "--exact",
                        "--json")
    assert batch.returncode == 0, batch.stderr
    fast, exact = json.loads(batch.stdout)["plans"]
    assert exact["optimal"] and exact["makespan_ms"] <= fast["makespan_ms"] * (1 + 1e-6)
    assert sorted(s for g in fast["groups"] for s in g["sequences"]) == list(range(5))
    assert not (tmp_path / "cptune.db").exists()


@pytest.mark.parametrize(("words", "says"), [
    (["--exact", "--seq-len", "4"], "--exact solves a batch"),
    (["--lengths", "{bad}"], "line 1"),
    (["--batch-lengths", "{huge}"], "needs at least"),
    (["--lengths", "{mix}", "--nodes", "2"], "--nodes takes --seq-len"),
])
def test_bad_mixes_are_refused_in_one_line(cptune_here: Any, tmp_path: Path, words: list[str],
                                           says: str) -> None:
    from conftest import assert_refused

    (tmp_path / "mix.txt").write_text("512\n")
    (tmp_path / "bad.txt").write_text("a lot\n")
    (tmp_path / "huge.txt").write_text(f"{1 << 26}\n")
    files = {"mix": tmp_path / "mix.txt", "bad": tmp_path / "bad.txt", "huge": tmp_path / "huge.txt"}
    assert_refused(cptune_here(*FLAGS, *(w.format(**files) for w in words)), says)


def test_one_way_to_give_the_lengths(cptune_here: Any, tmp_path: Path) -> None:
    from conftest import assert_refused

    (tmp_path / "mix.txt").write_text("512\n")
    assert_refused(cptune_here(*FLAGS, "--seq-len", "4", "--lengths", tmp_path / "mix.txt"),
                   "--lengths: not allowed with argument --seq-len", prefix="cptune recommend: error: ")
    assert_refused(cptune_here(*FLAGS), "one of the arguments --seq-len --lengths --batch-lengths is "
                   "required", prefix="cptune recommend: error: ")
