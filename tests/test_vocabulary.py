"""The vocabulary: Workload and CPConfig validation, feasibility reasons, enumerate_configs."""

import dataclasses
import itertools
import re

import numpy as np
import pytest

from cptune import STRATEGIES, AttentionShape, CPConfig, InfeasibleConfigError, Workload, analytic_cost
from cptune.feasibility import check_feasible, enumerate_configs, feasibility, kv_replication

BASE = dict(seq_len=64, heads=8, head_dim=16)


def mentions(text, *words):
    """True when every word/number appears in ``text`` as a whole token."""
    return all(re.search(rf"(?<![\w.]){re.escape(str(w))}(?![\w])", text) for w in words)


# --------------------------------------------------------------------------- Workload


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(seq_len=0), "seq_len"),
        (dict(seq_len=-5), "seq_len"),
        (dict(heads=-1), "heads"),
        (dict(head_dim=1.5), "head_dim"),
        (dict(head_dim="16"), "head_dim"),
        (dict(batch=True), "batch"),
        (dict(seq_len=True), "seq_len"),
        (dict(kv_heads=False), "kv_heads"),
        (dict(kv_heads=0), "kv_heads"),
        (dict(kv_heads=3), "kv_heads"),  # 8 heads cannot share 3 KV heads
        (dict(heads=6, kv_heads=4), "kv_heads"),
        (dict(dtype="fp8"), "dtype"),
        (dict(dtype="float32"), "dtype"),
        (dict(causal=1), "causal"),
        (dict(causal="yes"), "causal"),
        (dict(causal=None), "causal"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else x,
)
def test_workload_rejects_bad_field_naming_it(changes, field):
    with pytest.raises(ValueError) as raised:
        Workload(**{**BASE, **changes})
    # the field is named as a whole word (so "heads" does not count as "kv_heads")
    assert re.search(rf"(?<![\w]){field}(?![\w])", str(raised.value)), str(raised.value)


def test_workload_kv_heads_none_resolves_to_heads():
    w = Workload(64, 12, 16)
    assert w.kv_heads == 12
    assert w.group_size == 1
    assert Workload(64, 12, 16, kv_heads=None) == w
    assert Workload(64, 12, 16, kv_heads=12) == w


def test_workload_defaults_and_resolved_types():
    w = Workload(np.int64(64), np.int32(8), 16, kv_heads=np.int64(2), causal=np.bool_(True))
    assert (w.batch, w.dtype, w.kv_heads, w.group_size) == (1, "bf16", 2, 4)
    assert type(w.seq_len) is int and type(w.heads) is int and type(w.kv_heads) is int
    assert w.causal is True
    assert Workload(64, 8, 16).causal is False


@pytest.mark.parametrize("dtype, itemsize", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
def test_workload_wire_dtype_width(dtype, itemsize):
    assert Workload(**BASE, dtype=dtype).wire_dtype.itemsize == itemsize


def test_workload_is_immutable():
    w = Workload(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.seq_len = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.kv_heads = 2
    assert w.seq_len == 64 and w.kv_heads == 8


def test_workload_is_hashable_and_equal_by_value():
    a = Workload(64, 8, 16, kv_heads=2, causal=True)
    b = Workload(64, 8, 16, kv_heads=2, batch=1, dtype="bf16", causal=True)
    c = Workload(64, 8, 16, kv_heads=2, causal=False)
    assert a == b and hash(a) == hash(b)
    assert a != c
    table = {a: "first", c: "second"}
    assert table[b] == "first"
    assert len({a, b, c}) == 2


def test_workload_to_dict_round_trips():
    w = Workload(37, 12, 8, kv_heads=4, batch=3, dtype="fp32", causal=True)
    assert Workload(**w.to_dict()) == w


# --------------------------------------------------------------------------- CPConfig


def test_cpconfig_defaults():
    assert CPConfig("ulysses", 4) == CPConfig("ulysses", 4, 4)
    assert hash(CPConfig("ulysses", 4)) == hash(CPConfig("ulysses", 4, 4))
    assert CPConfig("ring", 8).head_group == 1
    assert CPConfig("allgather_kv", 8).head_group == 1
    assert CPConfig("ring", 8) == CPConfig("ring", 8, 1)
    assert CPConfig("ring", 8, 2).context_degree == 4


def test_cpconfig_distinguishes_fields():
    assert CPConfig("ring", 4) != CPConfig("allgather_kv", 4)
    assert CPConfig("ring", 4, 2) != CPConfig("ring", 4, 1)
    assert CPConfig("ring", 4) != CPConfig("ring", 2)
    table = {CPConfig("ring", 4, 2): 1, CPConfig("allgather_kv", 4, 2): 2}
    assert table[CPConfig("ring", 4, 2)] == 1
    assert len({CPConfig("ulysses", 4), CPConfig("ulysses", 4, 4), CPConfig("ring", 4)}) == 2


def test_cpconfig_is_immutable():
    config = CPConfig("ring", 4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ranks = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.head_group = 4
    assert (config.ranks, config.head_group) == (4, 2)


@pytest.mark.parametrize(
    "args, field",
    [
        (("tree", 4), "strategy"),
        (("Ring", 4), "strategy"),
        (("ring", 0), "ranks"),
        (("ring", -2), "ranks"),
        (("ring", True), "ranks"),
        (("ring", 2.0), "ranks"),
        (("ring", 4, 0), "head_group"),
        (("ring", 4, 1.5), "head_group"),
        (("ulysses", 0), "ranks"),
    ],
)
def test_cpconfig_rejects_bad_fields(args, field):
    with pytest.raises(ValueError) as raised:
        CPConfig(*args)
    assert field in str(raised.value)


# --------------------------------------------------------------------------- feasibility


@pytest.mark.parametrize(
    "workload, config, keyword, numbers",
    [
        # ranks % head_group
        (Workload(64, 8, 8), CPConfig("ring", 6, 4), "divide", (4, 6)),
        (Workload(64, 6, 8), CPConfig("allgather_kv", 8, 3), "divide", (3, 8)),
        # pure Ulysses must use all ranks as one head group
        (Workload(64, 8, 8), CPConfig("ulysses", 4, 2), "pure Ulysses", (4, 2)),
        (Workload(64, 8, 8), CPConfig("ulysses", 8, 1), "pure Ulysses", (8, 1)),
        # heads % u
        (Workload(64, 6, 8), CPConfig("ring", 4, 4), "Ulysses limit", (6, 4)),
        (Workload(64, 3, 8), CPConfig("ulysses", 2), "Ulysses limit", (3, 2)),
        # GQA: kv_heads and u divide neither way
        (Workload(64, 6, 16, kv_heads=3), CPConfig("ring", 2, 2), "KV heads", (3, 2)),
        (Workload(64, 12, 16, kv_heads=4), CPConfig("ulysses", 6), "KV heads", (4, 6)),
        # seq_len < ranks
        (Workload(3, 4, 8), CPConfig("ring", 4), "seq_len", (3, 4)),
        (Workload(5, 8, 8), CPConfig("ulysses", 8), "seq_len", (5, 8)),
    ],
    ids=[
        "ranks%u-6/4", "ranks%u-8/3", "pure-ulysses-4/2", "pure-ulysses-8/1",
        "heads%u-6/4", "heads%u-3/2", "gqa-3kv-u2", "gqa-4kv-u6", "seq<ranks-3/4", "seq<ranks-5/8",
    ],
)
def test_feasibility_reason_categories(workload, config, keyword, numbers):
    reasons = feasibility(workload, config)
    assert len(reasons) == 1, reasons
    assert keyword in reasons[0]
    assert mentions(reasons[0], *numbers), reasons[0]
    with pytest.raises(InfeasibleConfigError) as raised:
        check_feasible(workload, config)
    assert raised.value.reasons == reasons
    assert isinstance(raised.value, ValueError)


def test_feasibility_lists_every_reason_at_once():
    # 6 % 4 ranks, pure Ulysses with u != n, 6 heads % 4, seq_len 2 < 6 ranks
    reasons = feasibility(Workload(2, 6, 8), CPConfig("ulysses", 6, 4))
    assert len(reasons) == 4
    assert any("Ulysses limit" in r for r in reasons)
    assert any("seq_len 2" in r for r in reasons)


def test_feasibility_memory_limit():
    workload = Workload(2**17, 32, 128, kv_heads=8, causal=True)
    config = CPConfig("ring", 1)
    need = analytic_cost(workload, config).peak_bytes
    assert need > 2**30  # large enough that the GiB figures in the message mean something
    assert feasibility(workload, config, memory_limit=need) == []
    limit = need - 2**28
    reasons = feasibility(workload, config, memory_limit=limit)
    assert len(reasons) == 1
    assert f"{need / 2**30:.1f} GiB" in reasons[0]
    assert f"{limit / 2**30:.1f} GiB" in reasons[0]
    # more ranks bring the per-rank need under the same limit
    assert feasibility(workload, CPConfig("ring", 8), memory_limit=limit) == []


@pytest.mark.parametrize(
    "workload, config",
    [
        (Workload(64, 8, 8), CPConfig("ring", 1)),
        (Workload(64, 8, 8), CPConfig("ulysses", 8)),
        (Workload(64, 8, 8), CPConfig("ring", 8, 4)),
        (Workload(64, 8, 8), CPConfig("allgather_kv", 6, 2)),
        (Workload(4, 8, 8), CPConfig("allgather_kv", 4)),  # seq_len == ranks
        (Workload(64, 8, 8, kv_heads=2), CPConfig("ulysses", 4)),
        (Workload(64, 8, 8, kv_heads=4), CPConfig("ring", 4, 2)),
        (Workload(64, 6, 8, kv_heads=1), CPConfig("ulysses", 6)),
        (Workload(64, 6, 16, kv_heads=3), CPConfig("ulysses", 3)),
        (Workload(64, 6, 16, kv_heads=3), CPConfig("ring", 6, 6)),
    ],
)
def test_feasible_pairs_give_no_reasons(workload, config):
    assert feasibility(workload, config) == []
    check_feasible(workload, config)  # does not raise


@pytest.mark.parametrize(
    "heads, kv_heads, u, replication",
    [
        (8, 2, 4, 2),  # GQA: 2 KV heads replicated over a group of 4
        (8, 1, 4, 4),  # MQA
        (8, 1, 8, 8),
        (8, 2, 2, 1),  # KV heads split evenly
        (8, 4, 2, 1),
        (8, 8, 8, 1),
        (8, 2, 1, 1),
    ],
)
def test_gqa_replication(heads, kv_heads, u, replication):
    workload = Workload(64, heads, 16, kv_heads=kv_heads)
    assert feasibility(workload, CPConfig("ulysses", u)) == []
    assert kv_replication(workload, u) == replication
    if u > 1:
        assert analytic_cost(workload, CPConfig("ulysses", u)).kv_replication == replication
    # every rank of the group receives whole KV heads
    assert (kv_heads * replication) % u == 0


# --------------------------------------------------------------------------- enumerate_configs

ENUM_WORKLOADS = [
    Workload(64, 8, 16),
    Workload(64, 12, 16, kv_heads=4, causal=True),
    Workload(64, 6, 16, kv_heads=3),
    Workload(64, 3, 8),
    Workload(5, 8, 8),  # seq_len caps the rank count
    Workload(64, 8, 16, kv_heads=1),
]


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def brute_force(workload, max_ranks, strategies=STRATEGIES, memory_limit=None):
    """Every feasible (strategy, n, u, padded heads or not), minus the documented duplicates: one
    rank is listed once (as "ring" when allowed, else the first strategy), and a context strategy
    whose head group spans all ranks (> 1) is pure Ulysses, listed only as "ulysses"."""
    one_rank = "ring" if "ring" in strategies else strategies[0]
    found = set()
    for s in strategies:
        for n in range(1, max_ranks + 1):
            for u, pad in itertools.product(_divisors(n), (False, True)):
                config = CPConfig(s, n, u, pad_heads=pad)
                if feasibility(workload, config, memory_limit):
                    continue
                if n == 1 and s != one_rank:
                    continue
                if n > 1 and s != "ulysses" and u == n:
                    continue
                found.add(config)
    return found


@pytest.mark.parametrize("workload", ENUM_WORKLOADS, ids=lambda w: w.describe())
@pytest.mark.parametrize("max_ranks", [1, 4, 8])
def test_enumerate_matches_brute_force(workload, max_ranks):
    configs = list(enumerate_configs(workload, max_ranks))
    assert len(configs) == len(set(configs)), "duplicates"
    assert set(configs) == brute_force(workload, max_ranks)


@pytest.mark.parametrize(
    "strategies",
    [("ring",), ("allgather_kv",), ("ulysses",), ("allgather_kv", "ulysses"), ("ulysses", "ring")],
)
def test_enumerate_strategies_filter_matches_brute_force(strategies):
    workload = Workload(64, 8, 16, kv_heads=2, causal=True)
    configs = list(enumerate_configs(workload, 8, strategies))
    assert configs and {c.strategy for c in configs} <= set(strategies)
    assert len(configs) == len(set(configs))
    assert set(configs) == brute_force(workload, 8, strategies)
    one_rank = [c for c in configs if c.ranks == 1]
    assert one_rank == [CPConfig("ring" if "ring" in strategies else strategies[0], 1)]


def test_enumerate_with_memory_limit_matches_brute_force():
    workload = Workload(2**14, 8, 64, causal=True)
    need_1 = analytic_cost(workload, CPConfig("ring", 1)).peak_bytes
    limit = need_1 // 3
    configs = list(enumerate_configs(workload, 8, memory_limit=limit))
    assert configs and all(c.ranks > 1 for c in configs)
    assert all(analytic_cost(workload, c).peak_bytes <= limit for c in configs)
    assert set(configs) == brute_force(workload, 8, memory_limit=limit)


@pytest.mark.parametrize("workload", ENUM_WORKLOADS, ids=lambda w: w.describe())
def test_enumerate_invariants(workload):
    max_ranks = 8
    configs = list(enumerate_configs(workload, max_ranks))
    assert all(feasibility(workload, c) == [] for c in configs)
    assert len(configs) == len(set(configs))
    assert all(1 <= c.ranks <= max_ranks for c in configs)
    assert all(c.ranks <= workload.seq_len for c in configs)
    assert [c for c in configs if c.ranks == 1] == [CPConfig("ring", 1)]
    assert not [
        c for c in configs
        if c.strategy in ("ring", "allgather_kv") and c.ranks > 1 and c.head_group == c.ranks
    ]
    assert all(c.head_group == c.ranks for c in configs if c.strategy == "ulysses")


def test_enumerate_pads_the_heads_where_a_head_group_does_not_divide_them():
    configs = list(enumerate_configs(Workload(64, 3, 8), 4))
    assert {(c.ranks, c.pad_heads) for c in configs if c.strategy == "ulysses"} == {(2, True), (3, False)}
    # a head group of 2 only padded (3 heads -> 4), none of 4 (more than the 3 heads)
    assert {(c.head_group, c.pad_heads) for c in configs} == {(1, False), (2, True), (3, False)}
    # the context strategies still reach every rank count
    assert {c.ranks for c in configs if c.strategy == "ring"} == {1, 2, 3, 4}
    assert {c.ranks for c in configs if c.strategy == "allgather_kv"} == {2, 3, 4}


def test_enumerate_small_example_exactly():
    configs = list(enumerate_configs(Workload(64, 4, 8), 4))
    assert set(configs) == {
        CPConfig("ring", 1),
        CPConfig("ring", 2), CPConfig("allgather_kv", 2), CPConfig("ulysses", 2),
        CPConfig("ring", 3), CPConfig("allgather_kv", 3), CPConfig("ulysses", 3, pad_heads=True),
        CPConfig("ring", 4), CPConfig("allgather_kv", 4), CPConfig("ulysses", 4),
        CPConfig("ring", 4, 2), CPConfig("allgather_kv", 4, 2),
    }
    assert len(configs) == 12


def test_enumerate_repeated_strategy_names_yield_no_duplicates():
    # The CLI passes `--strategies ring,ring` through unchanged; the docstring promises
    # each distinct computation once.
    configs = list(enumerate_configs(Workload(64, 4, 8), 4, ("ring", "ring")))
    assert len(configs) == len(set(configs)), configs


@pytest.mark.parametrize(
    "max_ranks, strategies",
    [(0, STRATEGIES), (-1, STRATEGIES), (4, ("ring", "tree")), (4, ("Ulysses",))],
)
def test_enumerate_rejects_bad_arguments(max_ranks, strategies):
    with pytest.raises(ValueError):
        list(enumerate_configs(Workload(64, 4, 8), max_ranks, strategies))


@pytest.mark.parametrize("size, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                        (3 * 2**20, "3.0 MiB"), (5 * 2**40, "5120.0 GiB")])
def test_format_bytes(size, text):
    from cptune.feasibility import format_bytes

    assert format_bytes(size) == text


def test_small_memory_limits_read_in_small_units():
    workload = Workload(seq_len=64, heads=4, head_dim=8)
    (reason,) = feasibility(workload, CPConfig("ring", 2), memory_limit=100)
    assert "100 B" in reason and "KiB" in reason


def test_enumerate_checks_arguments_at_once():
    workload = Workload(seq_len=64, heads=4, head_dim=8)
    with pytest.raises(ValueError, match="strategies"):
        enumerate_configs(workload, 4, ())
    with pytest.raises(ValueError, match="strategies"):
        enumerate_configs(workload, 4, ("ring", "zigzag"))


def test_attention_shape_is_a_workload_without_its_length():
    w = Workload(seq_len=4096, heads=16, head_dim=128, kv_heads=4, dtype="fp16", causal=True)
    shape = w.shape
    assert shape == AttentionShape(16, 4, 128, 1, "fp16", True)
    assert shape.at(4096) == w and shape.at(100).seq_len == 100
    assert shape.describe() == "16/4kv heads x d128, batch 1, fp16 causal"
    assert w.describe() == f"seq 4096 x {shape.describe()}"
    with pytest.raises(ValueError, match="kv_heads"):
        AttentionShape(16, 3, 128, 1, "bf16", False)


def test_one_rank_is_local_attention_whatever_the_strategy():
    for strategy in STRATEGIES:
        assert CPConfig(strategy, 1).label == "local"
        assert CPConfig(strategy, 1).describe() == "local attention on 1 rank"
    assert CPConfig("ring", 2).label == "ring" and CPConfig("ulysses", 4, 2).label == "ulysses"


# --------------------------------------------------------------------------- split_configs


def _kind_of(workload, config):
    """Why ``config`` cannot run, by the first of ``feasibility``'s reasons (brute force)."""
    first = feasibility(workload, config)[0] if feasibility(workload, config) else "memory"
    return ("heads" if first.startswith("Ulysses limit") else "kv_heads" if "KV heads" in first
            else "seq_len" if first.startswith("seq_len") else "memory")


SPLIT_WORKLOADS = [*ENUM_WORKLOADS, Workload(100, 64, 16, kv_heads=8), Workload(37, 720, 8, kv_heads=48)]


@pytest.mark.parametrize("workload", SPLIT_WORKLOADS, ids=lambda w: w.describe())
@pytest.mark.parametrize("strategies", [STRATEGIES, ("ring",), ("ulysses",), ("ulysses", "allgather_kv")])
@pytest.mark.parametrize(("lo", "hi"), [(1, 8), (1, 130), (3, 97), (64, 64)])
def test_split_builds_what_can_run_and_counts_the_rest_as_listing_every_combination_does(
        workload, strategies, lo, hi):
    """Issue 57: the cost follows the configurations that can run. Past the listed ones, those that
    cannot are counted in closed form, never built: the same configurations can run, in the same
    order, and every one that cannot is listed or counted under its first reason."""
    from collections import Counter

    from cptune.feasibility import candidate_configs, split_configs

    limit = analytic_cost(workload, CPConfig("ring", 1)).peak_bytes // 3
    for memory_limit in (None, lambda n: limit):
        every = candidate_configs(hi, strategies, min_ranks=lo, heads=workload.heads)
        reasons = {c: feasibility(workload, c, None if memory_limit is None else limit) for c in every}
        cannot = [c for c in every if reasons[c]]
        for listed in (0, 3, 1000):
            split = split_configs(workload, range(lo, hi + 1), strategies, memory_limit, listed=listed)
            assert list(split.feasible) == [c for c in every if not reasons[c]]
            assert list(split.infeasible) == cannot[:len(split.infeasible)]
            assert all(split.infeasible[c] == reasons[c] for c in split.infeasible)
            assert len(split.infeasible) == min(listed, len(cannot))
            rest = cannot[len(split.infeasible):]
            counted = Counter()
            for excluded in split.excluded:
                assert excluded.first in rest and excluded.reason == reasons[excluded.first][0]
                counted[_kind_of(workload, excluded.first)] += excluded.count
            assert counted == Counter(_kind_of(workload, c) for c in rest)


def test_enumerating_a_trillion_ranks_answers_at_once_or_refuses_in_one_line():
    """Issue 54: enumerate_configs(w, max_ranks=10**12) hung with memory growing. Only rank counts
    that hold a token each are looked at, and only head groups that split the heads are built."""
    import tracemalloc

    from cptune.feasibility import MAX_CONFIGS

    tracemalloc.start()
    configs = enumerate_configs(Workload(4096, 64, 128, kv_heads=8), 10**12)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert max(c.ranks for c in configs) == 4096 and len(configs) < MAX_CONFIGS
    assert peak < 64 * 2**20
    refused = r"^1\.\.1,000,000,000,000 ranks give .* more than the 250,000 cptune weighs at once: name fewer"
    with pytest.raises(ValueError, match=refused):
        enumerate_configs(Workload(10**9, 64, 128, kv_heads=8), 10**12)
    ulysses_only = enumerate_configs(Workload(10**9, 64, 128, kv_heads=8), 10**12, ("ulysses",))
    assert [c.ranks for c in ulysses_only if not c.pad_heads] == [1, 2, 4, 8, 16, 32, 64]
    # padded head groups: whole groups of 8 query heads per KV head, none above the 64 heads
    padded = [c.ranks for c in ulysses_only if c.pad_heads]
    assert 9 in padded and 12 not in padded and max(padded) < 64 and all(64 % n for n in padded)
