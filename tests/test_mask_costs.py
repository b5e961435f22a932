"""The cost counts of masked workloads against what the strategies do: every strategy x layout
x mask on 2-4 ranks runs (``cptune.strategies``) on a counting stand-in for ``Primitives``
that records each kernel call's positions and each exchange's bytes; the analytic counts
(``cptune.cost.analytic_cost``, ``cptune.model.computed_flops``) must equal what it recorded,
each seen pair counted by brute force over the positions."""

from __future__ import annotations

import numpy as np
import pytest
from test_masks import MASKS as PLAIN_AND_MASKED

from cptune import CPConfig, Workload
from cptune.calls import any_seen, attention_calls
from cptune.cost import analytic_cost
from cptune.feasibility import feasibility
from cptune.layout import SequenceLayout, runnable_layouts
from cptune.model import computed_flops
from cptune.strategies import Partial, run_backward, run_forward

#: test_masks.py's masks (the engines' matrix), and the two its engine tests leave to others
MASKS = {**PLAIN_AND_MASKED, "1 document": {"causal": True, "documents": [64]}, "joint text": {"text": 12}}
SPLITS = [(2, 1), (3, 1), (4, 1), (4, 2), (2, 2), (4, 4)]


class Counting:
    """``TrainingPrimitives`` on zero arrays of the right shapes: records every kernel call
    (its query and key positions, only where some query sees a key, as the engines decide)
    and the bytes each exchange of this rank sends."""

    def __init__(self, layout: SequenceLayout, rank: int) -> None:
        self.layout, self.mask = layout, layout.workload.mask
        self.group = layout.head_group_of(rank)
        self.wire = layout.workload.wire_dtype.itemsize
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []
        self.sent: dict[str, int] = {"all_to_all": 0, "all_gather": 0, "p2p": 0, "reduce_scatter": 0}
        self.streamed: list[int] = []  # the blocks kv_stream yielded, in order

    def _size(self, group: str) -> int:
        return self.layout.head_group if group == "heads" else self.layout.context_degree

    def attention(self, q, kv, q_pos, k_pos, into=None):
        if any_seen(q_pos, k_pos, self.mask):
            self.calls.append((q_pos, k_pos))
        return into if into is not None else Partial(np.zeros(q.shape), np.zeros(q.shape[:-1]))

    def attention_grad(self, q, kv, dout, saved, q_pos, k_pos, dq_into=None):
        return (np.zeros(q.shape) if dq_into is None else dq_into), np.zeros(kv.shape, np.float32)

    def all_to_all(self, x, group, split_axis, concat_axis, repeat=1, width=None):
        u = self._size(group)
        x = np.repeat(x, repeat, axis=split_axis)
        self.sent["all_to_all"] += (u - 1) * x.size // u * (width or self.wire)
        return np.concatenate(np.split(x, u, axis=split_axis), axis=concat_axis)

    def all_to_all_grad(self, x, group, split_axis, concat_axis, fold):
        out = self.all_to_all(x, group, split_axis, concat_axis, width=4 if fold > 1 else None)
        shape = list(out.shape)
        shape[concat_axis] //= fold
        return np.zeros(shape, np.float32)

    def all_gather(self, x, group, axis, order=None):
        c = self._size(group)
        self.sent["all_gather"] += (c - 1) * x.size * self.wire
        if order is None:
            return np.concatenate([x] * c, axis=axis)
        return np.concatenate([np.take(x, range(a, b), axis=axis) for _, a, b in order], axis=axis)

    def reduce_scatter(self, x, group, axis, order=None):
        c = self._size(group)
        shape = list(x.shape)
        shape[axis] //= c
        self.sent["reduce_scatter"] += (c - 1) * int(np.prod(shape)) * 4
        return np.zeros(shape, np.float32)

    def kv_stream(self, kv, group, steps=None):
        c = self._size(group)
        last = c - 1 if steps is None else min(steps, c - 1)
        for step in range(last + 1):
            if step < last:
                self.sent["p2p"] += kv.size * self.wire
            self.streamed.append((self.group - step) % c)
            yield (self.group - step) % c, kv

    def kv_grad_stream(self, kv, group, visit, steps=None):
        c = self._size(group)
        last = c - 1 if steps is None else min(steps, c - 1)
        share = None
        for member, block in self.kv_stream(kv, group, last):
            share = visit(member, block)
            if last:  # each gradient passed on, the last straight home
                self.sent["p2p"] += share.size * 4
        assert share is not None
        return np.zeros(kv.shape, np.float32)

    def narrow(self, x, axis, start, stop):
        return np.take(x, range(start, stop), axis=axis)

    def concat(self, parts, axis):
        return np.concatenate(parts, axis=axis)

    def pad(self, x, axis, size):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return np.pad(x, widths)


def run_counting(workload: Workload, config: CPConfig) -> tuple[SequenceLayout, list[Counting]]:
    """Every rank of ``config`` run forward (and backward, in training) on ``Counting``."""
    layout = SequenceLayout(workload, config)
    ranks = []
    for rank in range(config.ranks):
        ops = Counting(layout, rank)
        tokens = len(layout.rank_positions(rank))
        q = np.zeros((workload.batch, workload.heads, tokens, workload.head_dim))
        kv = np.zeros((2, workload.batch, workload.kv_heads, tokens, workload.head_dim))
        out, saved = run_forward(ops, layout, rank, q, kv)
        if workload.training:
            run_backward(ops, layout, rank, saved, np.zeros(out.shape))
        ranks.append(ops)
    return layout, ranks


def seen_pairs(q_pos, k_pos, mask) -> int:
    return int(mask.visible(q_pos[:, None], k_pos[None, :]).sum())


def fused_pairs(q_pos, k_pos, mask) -> int:
    """Pairs the fused calls compute, each call checked to see some pair (no call on an
    empty block; under a plain causal mask ``attention_calls`` lets padding queries, whose
    rows are dropped, take a call of their own): a causal call its triangle, the others their
    whole rectangle."""
    total = 0
    for call in attention_calls(q_pos, k_pos, mask):
        rows, keys = q_pos[call.rows], k_pos[call.keys]
        padding_only = mask.plain and rows.min() >= mask.seq_len
        assert padding_only or mask.visible(rows[:, None], keys[None, :]).any(), call
        total += len(rows) * (len(rows) + 1) // 2 if call.causal else len(rows) * len(keys)
    return total


def numpy_pairs(q_pos, k_pos, workload) -> int:
    """Pairs the mpi engine's numpy kernel computes: its own plan on each key chunk it reads."""
    from cptune.engines.mpi import _kernels as kernels

    return sum((j - i) * sum(b - a for a, b, _ in segments)
               for _, _, plan in kernels._chunks(q_pos, k_pos, workload.mask) for i, j, segments in plan)


def configurations(workload: Workload):
    for n, u in SPLITS:
        strategies = ["ulysses"] if u == n else ["ring", "allgather_kv"]
        for strategy in strategies:
            base = CPConfig(strategy, n, u)
            for layout in runnable_layouts(workload, base) if base.context_degree > 1 else [None]:
                config = base.with_layout(layout) if layout else base
                if not feasibility(workload, config):
                    yield config


@pytest.mark.parametrize("name", MASKS)
def test_each_rank_s_calls_do_the_work_the_counts_say(name):
    workload = Workload(64, 4, 8, kv_heads=2, **MASKS[name])
    mask, checked = workload.mask, 0
    for config in configurations(workload):
        layout, ranks = run_counting(workload, config)
        per_head = 4 * workload.batch * workload.head_dim * (workload.heads // config.head_group)
        useful = [sum(seen_pairs(q, k, mask) for q, k in ops.calls) for ops in ranks]
        fused = [sum(fused_pairs(q, k, mask) for q, k in ops.calls) for ops in ranks]
        numpy = [sum(numpy_pairs(q, k, workload) for q, k in ops.calls) for ops in ranks]
        for ops in ranks:  # each seen pair of a rank's real queries exactly once
            real = layout.real_query_positions(ops.group)
            assert sum(seen_pairs(q[q < workload.seq_len], k, mask) for q, k in ops.calls) == \
                int(mask.row_counts(real).sum()), config.label
        cost = analytic_cost(workload, config)
        assert cost.flops == per_head * max(useful), config.label
        assert computed_flops(workload, config, "fused") == per_head * max(fused), config.label
        assert computed_flops(workload, config, "numpy") == per_head * max(numpy), config.label
        if config.strategy == "ring" and config.context_degree > 1:
            assert cost.kernels["attention"] == max(len(ops.calls) for ops in ranks), config.label
        for kind in ("all_to_all", "all_gather", "p2p"):
            assert cost.bytes_sent[kind] == max(ops.sent[kind] for ops in ranks), (config.label, kind)
        assert cost.comm_steps["p2p"] == max((len(ops.streamed) - 1 for ops in ranks if ops.streamed),
                                             default=0), config.label
        checked += 1
    assert checked >= 12


@pytest.mark.parametrize("name", ["causal", "window", "3 documents", "documents, window, sinks"])
def test_a_training_step_s_exchanges_are_counted_as_the_backward_sends_them(name):
    workload = Workload(64, 4, 8, kv_heads=2, mode="train", **MASKS[name])
    for config in configurations(workload):
        _, ranks = run_counting(workload, config)
        cost = analytic_cost(workload, config)
        for kind in ("all_to_all", "all_gather", "p2p", "reduce_scatter"):
            assert cost.bytes_sent[kind] == max(ops.sent[kind] for ops in ranks), (config.label, kind)


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_padded_heads_are_counted_as_the_strategies_move_and_compute_them(mode):
    """Padded heads (``CPConfig.pad_heads``) cost what the strategies' code moves and attends:
    the zero heads' share of every exchange and of each rank's work, MHA, GQA and MQA, pure
    Ulysses and hybrids."""
    from cptune.layout import heads_as_run

    padded = [(6, 6, CPConfig("ulysses", 4, pad_heads=True)), (6, 1, CPConfig("ulysses", 4, pad_heads=True)),
              (6, 3, CPConfig("ulysses", 4, pad_heads=True)), (3, 3, CPConfig("ring", 4, 2, pad_heads=True)),
              (3, 1, CPConfig("allgather_kv", 4, 2, pad_heads=True))]
    for heads, kv_heads, config in padded:
        workload = Workload(64, heads, 8, kv_heads=kv_heads, causal=True, mode=mode)
        assert not feasibility(workload, config)
        _, ranks = run_counting(workload, config)
        cost = analytic_cost(workload, config)
        for kind in ("all_to_all", "all_gather", "p2p", "reduce_scatter"):
            assert cost.bytes_sent[kind] == max(ops.sent[kind] for ops in ranks), (config.label, kind)
        if mode == "forward":
            run_heads = heads_as_run(workload, config).heads // config.head_group
            useful = max(sum(seen_pairs(q, k, workload.mask) for q, k in ops.calls) for ops in ranks)
            assert cost.flops == 4 * workload.head_dim * run_heads * useful, config.label


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_a_ring_with_a_window_streams_only_the_steps_in_reach(ranks):
    """A window inside one block: one step back (a halo of the window's width), not round the
    ring; every step streamed is one some block's queries see, and the last rank's block
    passes nowhere it is not seen."""
    workload = Workload(96, 4, 8, causal=True, window=[9, 0])
    config = CPConfig("ring", ranks, 1)
    layout, counted = run_counting(workload, config)
    assert layout.reach == 1
    for ops in counted:
        assert ops.streamed == [ops.group, (ops.group - 1) % ranks]
    cost = analytic_cost(workload, config)
    halo = 2 * workload.kv_heads * 9 * workload.head_dim * workload.wire_dtype.itemsize
    assert cost.comm_steps["p2p"] == 1 and cost.bytes_sent["p2p"] == halo
    plain = analytic_cost(Workload(96, 4, 8, causal=True), config)
    assert plain.comm_steps["p2p"] == ranks - 1 and cost.bytes_sent["p2p"] < plain.bytes_sent["p2p"]
    # block 0's queries see nothing of the last block: its step makes no kernel call
    assert len(counted[0].calls) == 1 and all(len(ops.calls) == 2 for ops in counted[1:])


def test_documents_kept_whole_exchange_nothing_and_many_documents_mean_many_calls():
    few = Workload(1024, 4, 8, causal=True, documents=[512, 512])
    many = Workload(1024, 4, 8, causal=True, documents=[64] * 16)
    whole = CPConfig("allgather_kv", 2, 1, "doc_whole")
    cost = analytic_cost(many, whole)
    assert cost.bytes_sent["all_gather"] == 0 and cost.comm_steps["all_gather"] == 0
    assert cost.flops == 4 * 8 * 4 * 8 * (64 * 65 // 2)  # 8 documents a block, each its triangle
    from cptune._position_work import blocks_work, busiest

    config = CPConfig("ring", 2, 1, "contiguous")
    assert busiest(blocks_work(many, config)).fused_calls > busiest(blocks_work(few, config)).fused_calls


def test_recommend_and_export_answer_masked_workloads_on_described_hardware():
    """A packed layer, a window and joint text on a described H100 node: a pick with its
    layout inside its interval, and the mask's work priced (the packed layer's pick faster
    than the plain causal layer's by more than half, the window's faster - its tiles' many
    small calls each pay the kernel's fixed cost -, the Ring's halo cheaper than its whole
    ring)."""
    from cptune.model import recommend
    from cptune.plans.export import export_plan

    shape = {"heads": 32, "head_dim": 128, "kv_heads": 8, "dtype": "bf16", "causal": True}
    plain = recommend(Workload(32768, **shape), ranks=8, hardware="h100-sxm-8")
    packed = recommend(Workload(32768, documents=[2048] * 16, **shape), ranks=8, hardware="h100-sxm-8")
    window = recommend(Workload(32768, window=[1024, 0], **shape), ranks=8, hardware="h100-sxm-8")
    joint = recommend(Workload(4608, 24, 128, dtype="bf16", text=512), ranks=8, hardware="h100-sxm-8")
    for r in (packed, window, joint):
        assert r.interval_ms[0] <= r.latency_ms <= r.interval_ms[1]
    assert packed.latency_ms < plain.latency_ms / 2 and window.latency_ms < plain.latency_ms
    ring = CPConfig("ring", 8, 1, "contiguous")
    halo = analytic_cost(Workload(32768, window=[1024, 0], **shape), ring)
    whole = analytic_cost(Workload(32768, **shape), ring)
    assert halo.bytes_sent["p2p"] * 4 <= whole.bytes_sent["p2p"]
    plan = export_plan([Workload(32768, documents=2048, **shape)], ranks=8, hardware="h100-sxm-8")
    assert plan.buckets[0].config == packed.config


def test_the_calibrated_prior_prices_a_masked_step_by_its_plan():
    """On a calibrated host (the test calibration): the packed layer's compute follows its
    numpy plan's work, and a Ring whose window reaches one block back exposes one halo
    transfer, not the whole ring's."""
    from test_prior import profile

    from cptune.model import prior_time

    host = profile()
    plain, packed = Workload(4096, 4, 64, causal=True), Workload(4096, 4, 64, causal=True, documents=512)
    for config in (CPConfig("ring", 2), CPConfig("allgather_kv", 2), CPConfig("ulysses", 2, 2)):
        ratio = prior_time(packed, config, host).compute_s / prior_time(plain, config, host).compute_s
        work = computed_flops(packed, config, "numpy") / computed_flops(plain, config, "numpy")
        assert ratio == pytest.approx(work, rel=0.35) and ratio < 0.3, config.label
    window = Workload(4096, 4, 64, causal=True, window=[256, 0])
    ring = CPConfig("ring", 4)
    assert analytic_cost(window, ring).comm_steps["p2p"] == 1
    assert prior_time(window, ring, host).total_s < prior_time(plain, ring, host).total_s

