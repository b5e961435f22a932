"""SequenceLayout (padding, zigzag, groups) and analytic_cost, checked by brute force."""

import math
import re
from fractions import Fraction

import numpy as np
import pytest

from cptune import CPConfig, Workload, analytic_cost, feasibility
from cptune.cost import COLLECTIVES
from cptune.engines import ENGINES
from cptune.layout import SequenceLayout
from cptune.model import computed_flops
from cptune.reference import make_inputs

# Every (ranks, head_group) with head_group | ranks, up to 8 ranks.
SPLITS = [(n, u) for n in range(1, 9) for u in range(1, n + 1) if n % u == 0]
SEQ_LENS = [8, 13, 37, 64, 101]


def split_id(split):
    return f"n{split[0]}u{split[1]}"


def layout_for(seq_len, causal, n, u):
    # The layout only reads seq_len and causal; 8 heads/d8 keep every u <= 8 valid.
    return SequenceLayout(Workload(seq_len, 8, 8, causal=causal), CPConfig("ring", n, u))


def group_ranks(layout, g):
    u = layout.head_group
    return range(g * u, (g + 1) * u)


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("split", SPLITS, ids=split_id)
def test_rank_positions_partition_padded_sequence(split, causal):
    n, u = split
    for seq_len in SEQ_LENS:
        layout = layout_for(seq_len, causal, n, u)
        pieces = [layout.rank_positions(r) for r in range(n)]
        assert all(len(p) == layout.padded_len // n for p in pieces)
        everything = np.concatenate(pieces)
        assert len(everything) == layout.padded_len
        assert np.array_equal(np.sort(everything), np.arange(layout.padded_len))
        # the gather order holds every position once, in increasing order
        assert np.array_equal(layout.gathered_positions, np.arange(layout.padded_len))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("split", SPLITS, ids=split_id)
def test_padded_len_is_smallest_multiple_of_granularity(split, causal):
    n, u = split
    c = n // u
    granularity = math.lcm(n, 2 * c) if causal and c > 1 else n
    for seq_len in SEQ_LENS + [n, n + 1, 2 * n - 1]:
        layout = layout_for(seq_len, causal, n, u)
        padded = layout.padded_len
        assert padded >= seq_len
        assert padded % granularity == 0
        assert padded - granularity < seq_len  # nothing smaller would do
        assert padded % n == 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("split", SPLITS, ids=split_id)
def test_block_positions_concatenate_rank_positions(split, causal):
    n, u = split
    c = n // u
    for seq_len in SEQ_LENS:
        layout = layout_for(seq_len, causal, n, u)
        for g in range(c):
            expected = np.concatenate([layout.rank_positions(r) for r in group_ranks(layout, g)])
            assert np.array_equal(layout.block_positions(g), expected)
            block = layout.block_positions(g)
            assert np.array_equal(layout.real_query_positions(g), block[block < seq_len])
        gathered = [layout.block_positions(m)[start:stop] for m, start, stop in layout.gather_order]
        assert np.array_equal(np.concatenate(gathered), layout.gathered_positions)


@pytest.mark.parametrize("split", [s for s in SPLITS if s[0] // s[1] > 1], ids=split_id)
def test_zigzag_blocks_hold_mirrored_chunks(split):
    n, u = split
    c = n // u
    for seq_len in SEQ_LENS:
        layout = layout_for(seq_len, True, n, u)
        assert layout.zigzag
        chunk = layout.padded_len // (2 * c)
        for g in range(c):
            expected = np.concatenate([
                np.arange(g * chunk, (g + 1) * chunk),
                np.arange((2 * c - 1 - g) * chunk, (2 * c - g) * chunk),
            ])
            assert np.array_equal(layout.block_positions(g), expected)


@pytest.mark.parametrize("split", SPLITS, ids=split_id)
def test_non_causal_or_single_block_is_contiguous(split):
    n, u = split
    c = n // u
    for causal in (False, True):
        layout = layout_for(37, causal, n, u)
        if causal and c > 1:
            continue
        assert not layout.zigzag
        size = layout.padded_len // c
        for g in range(c):
            assert np.array_equal(layout.block_positions(g), np.arange(g * size, (g + 1) * size))


def causal_pairs(queries, seq_len):
    """Visible (query, key) pairs counted directly from the mask."""
    keys = np.arange(seq_len)
    queries = queries[queries < seq_len]
    return int((keys[None, :] <= queries[:, None]).sum())


@pytest.mark.parametrize("split", [s for s in SPLITS if s[0] // s[1] > 1], ids=split_id)
def test_zigzag_balances_causal_work(split):
    n, u = split
    c = n // u
    # seq_len a multiple of the granularity: no padding, so blocks are exactly balanced
    seq_len = 3 * math.lcm(n, 2 * c)
    layout = layout_for(seq_len, True, n, u)
    assert layout.padded_len == seq_len
    work = [causal_pairs(layout.block_positions(g), seq_len) for g in range(c)]
    assert len(set(work)) == 1, work
    assert sum(work) == seq_len * (seq_len + 1) // 2
    # a contiguous split would be badly unbalanced: the zigzag is doing something
    size = seq_len // c
    contiguous = [causal_pairs(np.arange(g * size, (g + 1) * size), seq_len) for g in range(c)]
    assert max(contiguous) > max(work)


def test_zigzag_with_padding_only_lightens_the_block_holding_the_last_chunk():
    # 1001 tokens on 8 ranks pad to 1008: the 7 padding tokens sit in the last chunk,
    # which block 0 holds; every other block keeps the full, equal share.
    layout = layout_for(1001, True, 8, 1)
    assert layout.padded_len == 1008
    work = [causal_pairs(layout.block_positions(g), 1001) for g in range(8)]
    assert len(set(work[1:])) == 1
    assert work[0] < work[1]
    assert sum(work) == 1001 * 1002 // 2


@pytest.mark.parametrize("split", SPLITS, ids=split_id)
def test_head_and_context_groups_are_consistent(split):
    n, u = split
    c = n // u
    layout = layout_for(64, True, n, u)
    head_groups = {tuple(layout.head_group_ranks(r)) for r in range(n)}
    context_groups = {tuple(layout.context_group_ranks(r)) for r in range(n)}
    assert len(head_groups) == c and all(len(grp) == u for grp in head_groups)
    assert len(context_groups) == u and all(len(grp) == c for grp in context_groups)
    # each family of groups partitions the ranks
    assert sorted(r for grp in head_groups for r in grp) == list(range(n))
    assert sorted(r for grp in context_groups for r in grp) == list(range(n))
    for r in range(n):
        heads, context = layout.head_group_ranks(r), layout.context_group_ranks(r)
        assert r in heads and r in context
        assert set(heads) & set(context) == {r}
        assert layout.head_group_of(r) == heads[0] // u
        # the g-th member of the context group sits in head group g
        assert [layout.head_group_of(q) for q in context] == list(range(c))
        # all members of a head group share one context block
        assert {layout.head_group_of(q) for q in heads} == {layout.head_group_of(r)}


# --------------------------------------------------------------------------- FLOPs


FLOP_WORKLOADS = [
    dict(seq_len=37, heads=8, head_dim=8, batch=2),
    dict(seq_len=64, heads=8, head_dim=4, kv_heads=2),
    dict(seq_len=13, heads=4, head_dim=16, kv_heads=1, batch=3),
]


def brute_force_flops(workload, config):
    layout = SequenceLayout(workload, config)
    u, c = config.head_group, config.context_degree
    keys = np.arange(workload.seq_len)
    busiest = 0
    for g in range(c):
        queries = np.concatenate([layout.rank_positions(g * u + j) for j in range(u)])
        queries = queries[queries < workload.seq_len]  # padding queries are dropped
        visible = np.ones((queries.size, keys.size), dtype=bool)
        if workload.causal:
            visible &= keys[None, :] <= queries[:, None]
        busiest = max(busiest, int(visible.sum()))
    return 4 * workload.batch * workload.head_dim * (workload.heads // u) * busiest


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", FLOP_WORKLOADS, ids=lambda s: f"s{s['seq_len']}h{s['heads']}")
def test_flops_match_brute_force(shape, causal, strategy):
    workload = Workload(**shape, causal=causal)
    checked = 0
    for n, u in SPLITS:
        config = CPConfig("ulysses" if u == n and n > 1 else strategy, n, u)
        if feasibility(workload, config):
            continue
        cost = analytic_cost(workload, config)
        assert cost.flops == brute_force_flops(workload, config), config
        assert cost.padded_seq_len == SequenceLayout(workload, config).padded_len
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flops_on_one_rank_are_the_whole_attention(causal):
    s, h, d, b = 50, 4, 8, 2
    cost = analytic_cost(Workload(s, h, d, batch=b, causal=causal), CPConfig("ring", 1))
    pairs = s * (s + 1) // 2 if causal else s * s
    assert cost.flops == 4 * b * d * h * pairs


def test_flops_shrink_with_ranks_but_not_below_an_even_share():
    workload = Workload(4096, 8, 64, causal=True)
    total = analytic_cost(workload, CPConfig("ring", 1)).flops
    for config in [CPConfig("ring", 8), CPConfig("ulysses", 8), CPConfig("ring", 8, 2)]:
        flops = analytic_cost(workload, config).flops
        assert total / 8 <= flops <= total / 8 * 1.01, config


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_work_is_the_useful_work_plus_the_numpy_kernels_masked_corners(causal):
    """A fused kernel's work is the useful FLOPs; the numpy kernel's is at least that, more
    only under a causal mask, by at most half a row block per query."""
    checked = 0
    for shape in FLOP_WORKLOADS:
        workload = Workload(**shape, causal=causal)
        for n, u in SPLITS:
            for strategy in ("ring", "allgather_kv"):
                config = CPConfig("ulysses" if u == n and n > 1 else strategy, n, u)
                if feasibility(workload, config):
                    continue
                useful = analytic_cost(workload, config).flops
                assert computed_flops(workload, config, "fused") == useful
                numpy_work = computed_flops(workload, config, "numpy")
                assert numpy_work == useful if not causal else useful < numpy_work, config
                checked += 1
    assert checked >= 16


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv"])
def test_numpy_kernel_work_is_what_its_plan_computes_on_the_strategys_calls(strategy):
    """Against the kernel's own plan on the position arrays each rank's calls use: its
    block's queries over all keys gathered (AllGather-KV, Ulysses) or over each block (Ring)."""
    from cptune.engines.mpi import _kernels as kernels

    def planned(q_pos, k_pos, workload):
        return sum((j - i) * sum(b - a for a, b, _ in segments)
                   for _, _, plan in kernels._chunks(q_pos, k_pos, workload.mask)
                   for i, j, segments in plan)

    workload = Workload(seq_len=5000, heads=4, head_dim=8, kv_heads=2, causal=True)
    for n, u in [(1, 1), (2, 1), (4, 1), (4, 2), (3, 3)]:
        config = CPConfig("ulysses" if u == n and n > 1 else strategy, n, u)
        layout = SequenceLayout(workload, config)
        blocks = [layout.block_positions(g) for g in range(config.context_degree)]
        calls = blocks if strategy == "ring" else [layout.gathered_positions]
        pairs = max(sum(planned(q_pos, keys, workload) for keys in calls) for q_pos in blocks)
        assert computed_flops(workload, config, "numpy") == 4 * 8 * (4 // u) * pairs, config


def test_kernel_work_of_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be one of"):
        computed_flops(Workload(64, 2, 8), CPConfig("ring", 1), "cudnn")


# --------------------------------------------------------------------------- bytes


def per_rank_input_bytes(workload, n):
    """Bytes of Q, K, V and O one rank holds before Ulysses, from the real array shapes of
    the padded sequence."""
    assert not workload.causal  # padding to a multiple of n only (no zigzag granularity)
    padded = -(-workload.seq_len // n) * n
    shaped = Workload(padded, workload.heads, workload.head_dim, kv_heads=workload.kv_heads,
                      batch=workload.batch, dtype=workload.dtype)
    q, k, v = make_inputs(shaped)
    return Fraction(q.nbytes, n), Fraction(k.nbytes + v.nbytes, n), Fraction(q.nbytes, n)


BYTE_CASES = [
    (dict(seq_len=64, heads=8, head_dim=16, batch=2), 4, 4),
    (dict(seq_len=64, heads=8, head_dim=16), 8, 2),
    (dict(seq_len=50, heads=8, head_dim=16, kv_heads=2), 4, 4),  # GQA, replicated x2, padded
    (dict(seq_len=64, heads=8, head_dim=16, kv_heads=2), 8, 8),  # replicated x4
    (dict(seq_len=64, heads=8, head_dim=16, kv_heads=4), 8, 2),  # KV heads split evenly
    (dict(seq_len=37, heads=6, head_dim=8, kv_heads=1, dtype="fp32"), 6, 3),  # MQA x3
    (dict(seq_len=64, heads=12, head_dim=8, kv_heads=4), 6, 2),
]


@pytest.mark.parametrize("shape, n, u", BYTE_CASES, ids=lambda x: str(x) if isinstance(x, int) else None)
def test_all_to_all_bytes_from_shapes(shape, n, u):
    workload = Workload(**shape)
    q_bytes, kv_bytes, o_bytes = per_rank_input_bytes(workload, n)
    replication = 1 if workload.kv_heads % u == 0 else u // workload.kv_heads
    strategies = ["ulysses"] if u == n else ["ring", "allgather_kv"]
    for strategy in strategies:
        config = CPConfig(strategy, n, u)
        assert feasibility(workload, config) == []
        cost = analytic_cost(workload, config)
        expected = Fraction(u - 1, u) * (q_bytes + replication * kv_bytes + o_bytes)
        assert cost.kv_replication == replication
        assert cost.bytes_sent["all_to_all"] == expected
        assert cost.comm_steps["all_to_all"] == 3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(seq_len=64, heads=8, head_dim=16),
        dict(seq_len=45, heads=8, head_dim=8, kv_heads=2, batch=2),
        dict(seq_len=100, heads=4, head_dim=8, kv_heads=1, dtype="fp32"),
    ],
    ids=["mha", "gqa", "mqa"],
)
def test_ring_and_allgather_move_the_same_kv(shape, causal):
    workload = Workload(**shape, causal=causal)
    w = workload.wire_dtype.itemsize
    for n, u in SPLITS:
        c = n // u
        if c == 1:
            continue
        ring_config, gather_config = CPConfig("ring", n, u), CPConfig("allgather_kv", n, u)
        if feasibility(workload, ring_config):
            continue
        ring, gather = analytic_cost(workload, ring_config), analytic_cost(workload, gather_config)
        assert ring.bytes_sent["p2p"] == gather.bytes_sent["all_gather"] > 0
        assert ring.bytes_sent["all_gather"] == 0 and gather.bytes_sent["p2p"] == 0
        assert ring.bytes_sent["all_to_all"] == gather.bytes_sent["all_to_all"]
        assert ring.comm_steps["p2p"] == c - 1 and ring.comm_steps["all_gather"] == 0
        assert gather.comm_steps["all_gather"] == 1 and gather.comm_steps["p2p"] == 0
        # independently: each rank's K/V for its block (after Ulysses) reaches c - 1 others
        layout = SequenceLayout(workload, ring_config)
        block_tokens = layout.block_positions(0).size
        kv_heads_after = max(workload.kv_heads, u) // u if u > 1 else workload.kv_heads
        kv_block = 2 * workload.batch * block_tokens * kv_heads_after * workload.head_dim * w
        assert gather.bytes_sent["all_gather"] == (c - 1) * kv_block
        # without point-to-point (onnx, tensorrt) the stream is c broadcasts of one block each
        for engine in ("onnx", "tensorrt"):
            broadcast = analytic_cost(workload, ring_config, ENGINES[engine].stream)
            assert broadcast.bytes_sent["broadcast"] == c * kv_block
            assert broadcast.comm_steps["broadcast"] == c
            assert broadcast.bytes_sent["p2p"] == broadcast.comm_steps["p2p"] == 0
            assert broadcast.bytes_sent["all_to_all"] == ring.bytes_sent["all_to_all"]
        assert ring.bytes_sent["broadcast"] == 0  # the default engine (mpi) sends p2p
        assert analytic_cost(workload, gather_config, "broadcast") == gather  # only the Ring differs


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_no_head_group_means_no_all_to_all(strategy, n):
    cost = analytic_cost(Workload(64, 8, 16, kv_heads=2), CPConfig(strategy, n))
    assert cost.bytes_sent["all_to_all"] == 0
    assert cost.comm_steps["all_to_all"] == 0
    assert cost.kv_replication == 1
    assert sum(cost.bytes_sent.values()) > 0


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv", "ulysses"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_rank_sends_nothing(strategy, causal):
    cost = analytic_cost(Workload(37, 8, 16, kv_heads=2, causal=causal), CPConfig(strategy, 1))
    assert set(cost.bytes_sent) == set(COLLECTIVES)
    assert all(v == 0 for v in cost.bytes_sent.values())
    assert all(v == 0 for v in cost.comm_steps.values())
    assert cost.padded_seq_len == 37
    assert cost.peak_bytes > 0


def test_pure_ulysses_sends_only_all_to_all():
    cost = analytic_cost(Workload(64, 8, 16), CPConfig("ulysses", 8))
    assert cost.bytes_sent["all_to_all"] > 0
    assert cost.bytes_sent["all_gather"] == cost.bytes_sent["p2p"] == 0


@pytest.mark.parametrize(
    "config", [CPConfig("ring", 4), CPConfig("allgather_kv", 4, 2), CPConfig("ulysses", 4),
               CPConfig("ring", 8, 2), CPConfig("ring", 1)],
    ids=lambda c: f"{c.label}-{c.ranks}",
)
def test_fp32_doubles_bf16_bytes(config):
    shape = dict(seq_len=61, heads=8, head_dim=16, kv_heads=2, batch=2, causal=True)
    bf16 = analytic_cost(Workload(**shape, dtype="bf16"), config)
    fp16 = analytic_cost(Workload(**shape, dtype="fp16"), config)
    fp32 = analytic_cost(Workload(**shape, dtype="fp32"), config)
    for kind in COLLECTIVES:
        assert fp32.bytes_sent[kind] == 2 * bf16.bytes_sent[kind]
        assert fp16.bytes_sent[kind] == bf16.bytes_sent[kind]
    assert fp32.comm_steps == bf16.comm_steps
    assert fp32.flops == bf16.flops
    assert fp32.peak_bytes > bf16.peak_bytes


# --------------------------------------------------------------------------- peak memory


def test_peak_bytes_positive_for_every_feasible_config():
    from cptune.feasibility import enumerate_configs

    for workload in [Workload(8, 4, 4), Workload(64, 8, 16, kv_heads=2, causal=True)]:
        for config in enumerate_configs(workload, 8):
            assert analytic_cost(workload, config).peak_bytes > 0, config


@pytest.mark.parametrize("u", [1, 2])
@pytest.mark.parametrize("n", [16, 32, 64])
def test_allgather_kv_needs_more_memory_than_ring_at_large_c(n, u):
    workload = Workload(2**16, 16, 128, kv_heads=4, causal=True)
    ring = analytic_cost(workload, CPConfig("ring", n, u))
    gather = analytic_cost(workload, CPConfig("allgather_kv", n, u))
    assert gather.peak_bytes >= ring.peak_bytes
    # and the gap grows with the context degree: AllGather-KV holds all c K/V blocks
    assert gather.peak_bytes > ring.peak_bytes


def test_ring_memory_keeps_falling_with_ranks():
    workload = Workload(2**16, 16, 128, causal=True)
    peaks = [analytic_cost(workload, CPConfig("ring", n)).peak_bytes for n in (1, 4, 16, 64)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    gather_gap = [
        analytic_cost(workload, CPConfig("allgather_kv", n)).peak_bytes
        - analytic_cost(workload, CPConfig("ring", n)).peak_bytes
        for n in (4, 16, 64)
    ]
    assert gather_gap == sorted(gather_gap)


@pytest.mark.parametrize("causal", [False, True])
def test_costing_a_huge_length_allocates_nothing(causal):
    # 10^10 tokens: position arrays would need 74.5 GiB; the counts are arithmetic
    seq_len = 10**10
    cost = analytic_cost(Workload(seq_len, heads=8, head_dim=64, causal=causal), CPConfig("ring", 4))
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    assert cost.padded_seq_len == seq_len
    whole = 4 * 8 * 64 * pairs  # one rank's FLOPs; the busiest of 4 does a quarter, give or take 1%
    assert whole <= 4 * cost.flops <= whole * 101 // 100


def test_the_busiest_block_is_found_among_a_few_blocks():
    """``busiest_block_pairs`` reads at most eight blocks; it equals the most pairs of any
    block, counted block by block, for every split of short and padded sequences."""
    from cptune.cost import _visible_pairs, busiest_block_pairs

    for seq_len in [*range(1, 130), 255, 257, 1023, 4097]:
        for causal in (True, False):
            workload = Workload(seq_len=seq_len, heads=4, head_dim=8, causal=causal)
            for ranks in range(1, min(seq_len, 36) + 1):
                for u in (1, 2, 4):
                    if ranks % u:
                        continue
                    config = CPConfig("ring", ranks, u) if u < ranks else CPConfig("ulysses", ranks)
                    layout = SequenceLayout(workload, config)
                    every = max(_visible_pairs(layout, g) for g in range(config.context_degree))
                    assert busiest_block_pairs(layout) == every, (seq_len, causal, ranks, u)


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("config", [CPConfig("ulysses", 4), CPConfig("allgather_kv", 4), CPConfig("ring", 4),
                                    CPConfig("ring", 4, 2)], ids=lambda c: c.label)
def test_a_training_step_counts_the_backward_beside_the_forward(config):
    forward = Workload(4096, 8, 64, kv_heads=2, dtype="bf16", causal=True)
    cost, trained = analytic_cost(forward, config), analytic_cost(forward.in_mode("train"), config)
    assert trained.backward_flops == 2.5 * cost.flops and trained.flops == cost.flops + trained.backward_flops
    assert trained.peak_bytes > cost.peak_bytes
    s, u, c, b, d, w = 4096, config.head_group, config.context_degree, 1, 64, 2
    kv_heads = 2 * (u // 2 if u > 2 else 1)  # KV heads sent: replicated for a head group above 2
    grad_block = 2 * b * (s // c) * (kv_heads // u if u > 1 else 2) * d * 4  # fp32 dK/dV of one block
    kv_block = grad_block // 4 * w
    extra = {kind: trained.bytes_sent[kind] - cost.bytes_sent[kind] for kind in COLLECTIVES}
    if config.strategy == "ulysses":  # dO in and dQ out as Q; dK/dV out in fp32 (two copies summed)
        assert extra["all_to_all"] == (u - 1) * b * (s // 4) * (2 * 8 * w + 2 * kv_heads * 4) * d // u
        assert trained.comm_steps["all_to_all"] == 6
    elif config.strategy == "allgather_kv":  # K/V gathered again, fp32 gradients reduce-scattered
        assert extra["all_gather"] == cost.bytes_sent["all_gather"] == (c - 1) * kv_block
        assert extra["reduce_scatter"] == (c - 1) * grad_block and trained.comm_steps["reduce_scatter"] == 1
    else:  # the blocks again, and each block's gradient home: c - 1 and c steps
        assert extra["p2p"] == (c - 1) * kv_block + c * grad_block
        assert trained.comm_steps["p2p"] == cost.comm_steps["p2p"] + 2 * c - 1


def test_recommend_and_export_answer_for_a_training_step_where_the_backward_speed_is_known(
        cptune_here, tmp_path):
    """A training step costs more than its forward on a description that gives the backward's
    speed, and the plan says it was tuned for training; a description without that figure is
    refused in one line, with no plan written; export-graph writes inference graphs only."""
    import json

    from conftest import assert_refused

    layer = ["--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--causal"]
    at_32k = ["recommend", "--seq-len", "32768", *layer, "--json"]
    train = json.loads(cptune_here(*at_32k, "--mode", "train", "--hardware", "h100-sxm-8").stdout)
    forward = json.loads(cptune_here(*at_32k, "--hardware", "h100-sxm-8").stdout)
    assert train["workload"]["mode"] == "train" and train["latency_ms"] > 2.5 * forward["latency_ms"]
    plan = tmp_path / "p.json"
    exported = cptune_here("export", "--seq-lens", "4096,8192", *layer, "--mode", "train", "--hardware",
                           "h100-sxm-8", "--out", plan)
    assert exported.returncode == 0, exported.stderr
    assert json.loads(plan.read_text())["shape"]["mode"] == "train"
    from cptune.hardware import builtin_descriptions

    text = builtin_descriptions()["a100-sxm-8"].read_text()
    (no_backward := tmp_path / "a100-no-backward.toml").write_text(
        re.sub(r"\nbackward_speed = [^\n]*\n", "\n", text))  # every shipped one gives it now
    assert_refused(cptune_here(*at_32k, "--mode", "train", "--hardware", no_backward),
                   "gives no attention backward speed", "[device] backward_speed")
    refused = cptune_here("export", "--seq-lens", "4096", *layer, "--mode", "train",
                          "--hardware", no_backward, "--out", tmp_path / "q.json")
    assert_refused(refused, "gives no attention backward speed")
    assert not (tmp_path / "q.json").exists()
    graphs = cptune_here("export-graph", "--seq-len", "64", "--heads", "4", "--head-dim", "8", "--mode",
                         "train", "--strategy", "ring", "--ranks", "2", "--out", tmp_path / "g")  # inference
    assert_refused(graphs, "unrecognized arguments: --mode train", prefix="cptune export-graph: error: ")
    assert not (tmp_path / "g").exists()
