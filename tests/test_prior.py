"""The physical prior and the calibration it stands on, with hand-chosen rates (no MPI)."""

import dataclasses
import json
import math

import numpy as np
import pytest

from cptune._position_work import blocks_work, kv_steps
from cptune.calibration import (
    MESSAGE_SIZES,
    Calibration,
    CollectiveFit,
    ComputeRate,
    StepCost,
    fit_latency_bandwidth,
    group_sizes,
)
from cptune.calls import any_seen
from cptune.config import CPConfig
from cptune.cost import BACKWARD_FLOPS_RATIO, analytic_cost
from cptune.engines import ENGINES
from cptune.feasibility import enumerate_configs
from cptune.hardware import Hardware, load_description
from cptune.layout import SequenceLayout, rank_groups
from cptune.model import (
    STRUCTURE,
    CalibratedProfile,
    DescribedProfile,
    computed_flops,
    prior_ties,
    prior_time,
)
from cptune.model._prior import _busiest_block, key_elements
from cptune.model._profiles import UnpredictedModeError
from cptune.model._ties import FigureSwing, Tie, decide, figure_swings, prior_range
from cptune.workload import Workload

HOST = Hardware(host="prior-test", cpu_model="test cpu", cpu_count=4, gpu_model=None, gpu_count=0,
                interconnect="shared memory (one host)", mpi_library="MPICH 5")
#: (latency s, bandwidth B/s) per collective kind: distinct, so a mixed-up kind shows.
LINKS = {"all_to_all": (30e-6, 2e9), "all_gather": (20e-6, 3e9), "p2p": (10e-6, 4e9)}
#: Attention FLOP/s per rank by head_dim (the same for every rank count unless scaled).
RATES = {64: 8e9, 128: 12e9}
SHAPE = {"heads": 4, "seq_q": 512, "seq_k": 2048}


def rate_entry(ranks: int, head_dim: int, flops_per_s: float) -> ComputeRate:
    """A ComputeRate whose flops_per_s is ``flops_per_s`` (seconds chosen to match)."""
    flops = 4 * SHAPE["heads"] * SHAPE["seq_q"] * SHAPE["seq_k"] * head_dim
    return ComputeRate(ranks=ranks, **SHAPE, head_dim=head_dim, seconds=flops / flops_per_s)


def make_calibration(max_ranks: int = 4, links=None, rates=None, rank_scale: float = 1.0) -> Calibration:
    """Every group size of every rank count up to ``max_ranks``, with the same fit per kind;
    a rank count's compute rate is RATES / ranks ** rank_scale."""
    links, rates = links or LINKS, rates or RATES
    fits = tuple(
        CollectiveFit(kind=kind, ranks=n, group=g, latency_s=links[kind][0], bandwidth=links[kind][1],
                      bus_bandwidth=links[kind][1], sizes=(1024, 4096), times_s=(1e-5, 2e-5))
        for n in range(2, max_ranks + 1) for g in group_sizes(n) for kind in ENGINES["mpi"].collectives
    )
    compute = tuple(rate_entry(n, d, r / n**rank_scale)
                    for n in range(1, max_ranks + 1) for d, r in rates.items())
    return Calibration(engine="mpi", collectives=fits, compute=compute,
                       measured_at="2025-01-02T03:04:05+00:00")


def profile(**kwargs) -> CalibratedProfile:
    return CalibratedProfile(HOST, make_calibration(**kwargs))


W = Workload(seq_len=2048, heads=8, head_dim=64)


# --------------------------------------------------------------------------- compute


def test_compute_rate_reports_the_chosen_flop_rate():
    assert rate_entry(2, 64, 5e9).flops_per_s == pytest.approx(5e9, rel=1e-12)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_compute_term_is_flops_over_the_rate(head_dim):
    p = profile(rank_scale=0.5)  # rates differ per rank count, so the right count must be used
    workload = Workload(seq_len=1536, heads=8, head_dim=head_dim, kv_heads=2, causal=True)
    configs = enumerate_configs(workload, 4)
    assert len(configs) > 5
    for config in configs:
        expected_rate = RATES[head_dim] / config.ranks**0.5
        flops = computed_flops(workload, config, "numpy")  # the mpi kernel, its masked corners too
        assert prior_time(workload, config, p).compute_s == pytest.approx(flops / expected_rate, rel=1e-9)


def test_compute_counts_the_work_the_calibrated_kernel_executes():
    """A short causal sequence: the numpy kernel computes its row blocks up to their last
    query (half as many pairs again as the visible ones), a fused kernel only the visible
    ones; the prior charges each engine's calibration for its own kernel's work."""
    workload = Workload(seq_len=1024, heads=8, head_dim=64, causal=True)
    config = CPConfig("ring", 1)
    numpy_host = profile()
    fused_host = CalibratedProfile(HOST, dataclasses.replace(make_calibration(), engine="tensorrt"))
    assert (numpy_host.attention_kernel, fused_host.attention_kernel) == ("numpy", "fused")
    useful = analytic_cost(workload, config).flops
    assert computed_flops(workload, config, "numpy") == pytest.approx(1.5 * useful, rel=2e-3)
    assert prior_time(workload, config, fused_host).compute_s == pytest.approx(useful / RATES[64], rel=1e-9)
    assert prior_time(workload, config, numpy_host).compute_s == pytest.approx(
        computed_flops(workload, config, "numpy") / RATES[64], rel=1e-9)


def test_a_causal_calibration_rate_is_of_the_work_its_kernel_executed():
    """The calibrated causal shape (queries on the last diagonal block) wastes a few masked
    pairs in the numpy kernel: its rate counts them, so it carries over to shapes that waste
    more; a fused kernel's rate counts the visible pairs only."""
    rate = ComputeRate(ranks=1, heads=4, seq_q=512, seq_k=2048, head_dim=64, seconds=0.01, causal=True)
    assert rate.computed_flops("fused") == rate.flops
    assert rate.flops < rate.computed_flops("numpy") < 1.1 * rate.flops
    full = dataclasses.replace(rate, causal=False)
    assert full.computed_flops("numpy") == full.flops
    calibration = Calibration(engine="mpi", collectives=(), compute=(rate,), measured_at="2025-01-02")
    assert calibration.attention_rate(1, 64, True) == pytest.approx(rate.computed_flops("numpy") / 0.01)


def test_one_rank_is_compute_only():
    t = prior_time(W, CPConfig("ring", 1), profile())
    assert t.compute_s > 0
    assert (t.all_to_all_s, t.all_gather_s, t.ring_exposed_s) == (0.0, 0.0, 0.0)
    assert t.total_s == t.compute_s and t.comm_s == 0.0


# --------------------------------------------------------------------------- ring overlap


def test_ring_hides_a_transfer_shorter_than_each_step_of_compute():
    fast = {**LINKS, "p2p": (1e-9, 1e15)}
    t = prior_time(W, CPConfig("ring", 4), profile(links=fast))
    assert t.ring_exposed_s == pytest.approx(0.0, abs=1e-12 * t.compute_s)
    assert t.total_s == pytest.approx(t.compute_s, rel=1e-12)


def test_ring_exposes_the_part_of_a_slow_transfer_compute_cannot_hide():
    slow_latency, slow_bandwidth = 1e-3, 1e6
    slow = {**LINKS, "p2p": (slow_latency, slow_bandwidth)}
    config = CPConfig("ring", 4)
    t = prior_time(W, config, profile(links=slow))
    cost = analytic_cost(W, config)
    steps = cost.comm_steps["p2p"]
    assert steps == 3
    step = slow_latency + cost.bytes_sent["p2p"] / steps / slow_bandwidth
    block = t.compute_s / 4
    assert step > block  # the premise: communication-bound
    assert t.ring_exposed_s > 0
    assert t.ring_exposed_s == pytest.approx(steps * (step - block), rel=1e-9)
    assert (t.all_to_all_s, t.all_gather_s) == (0.0, 0.0)


def test_a_broadcast_ring_also_exposes_its_first_step():
    """Without point-to-point the Ring broadcasts each of its c blocks; the broadcast of the
    rank's own block has no attention to hide behind, the other c - 1 overlap as with p2p.
    The calibration says how its engine streams: a TensorRT calibration (broadcast fits, no
    p2p) feeds the prior as it is (it used to raise "the calibration has no p2p
    measurements" unless the caller also named the engine)."""
    latency, bandwidth = 1e-4, 1e8
    links = {**LINKS, "broadcast": (latency, bandwidth)}
    fits = tuple(
        CollectiveFit(kind=kind, ranks=n, group=g, latency_s=links[kind][0], bandwidth=links[kind][1],
                      bus_bandwidth=links[kind][1], sizes=(1024, 4096), times_s=(1e-5, 2e-5))
        for n in range(2, 5) for g in group_sizes(n) for kind in ENGINES["tensorrt"].collectives
    )
    base = make_calibration()
    calibration = Calibration(engine="tensorrt", collectives=fits, compute=base.compute,
                              measured_at=base.measured_at)
    config = CPConfig("ring", 4)
    t = prior_time(W, config, CalibratedProfile(HOST, calibration))
    assert not [f for f in calibration.collectives if f.kind == "p2p"]
    assert prior_time(W, CPConfig("ring", 2), CalibratedProfile(HOST, calibration)).ring_exposed_s > 0
    cost = analytic_cost(W, config, "broadcast")
    assert cost.comm_steps["broadcast"] == 4
    step = latency + cost.bytes_sent["broadcast"] / 4 / bandwidth
    block = t.compute_s / 4
    assert t.ring_exposed_s == pytest.approx(step + 3 * max(block, step) - 3 * block, rel=1e-9)
    assert t.ring_exposed_s >= step * (1 - 1e-9)  # at least the own block's broadcast


def test_ring_exposure_shrinks_as_compute_grows_per_step():
    """Same link; a longer sequence has more compute per byte, so less of the Ring is exposed."""
    slow = {**LINKS, "p2p": (1e-4, 5e6)}
    p = profile(links=slow)
    short = prior_time(Workload(seq_len=512, heads=8, head_dim=64), CPConfig("ring", 4), p)
    long = prior_time(Workload(seq_len=16384, heads=8, head_dim=64), CPConfig("ring", 4), p)
    assert short.ring_exposed_s > 0
    assert long.ring_exposed_s / long.total_s < short.ring_exposed_s / short.total_s
    assert long.ring_exposed_s == pytest.approx(0.0, abs=1e-12 * long.compute_s)


# --------------------------------------------------------------------------- all-to-all, all-gather


def test_all_to_all_is_three_calls_plus_bytes_over_bandwidth_and_grows_with_bytes():
    latency, bandwidth = LINKS["all_to_all"]
    p = profile()
    terms = []
    for seq_len in (1024, 2048, 4096, 8192):
        workload = Workload(seq_len=seq_len, heads=8, head_dim=64)
        config = CPConfig("ulysses", 4)
        nbytes = analytic_cost(workload, config).bytes_sent["all_to_all"]
        t = prior_time(workload, config, p)
        assert t.all_to_all_s == pytest.approx(3 * latency + nbytes / bandwidth, rel=1e-12)
        terms.append(t.all_to_all_s)
    assert terms == sorted(terms) and len(set(terms)) == 4
    # the bandwidth part doubles with the bytes
    assert terms[2] - 3 * latency == pytest.approx(2 * (terms[1] - 3 * latency), rel=1e-9)


def test_pure_ulysses_has_no_all_gather_or_ring_term():
    t = prior_time(W, CPConfig("ulysses", 4), profile())
    assert t.all_to_all_s > 0
    assert t.all_gather_s == 0.0 and t.ring_exposed_s == 0.0
    assert t.total_s == pytest.approx(t.compute_s + t.all_to_all_s, rel=1e-12)


def test_allgather_kv_pays_one_all_gather_call_and_no_other_collective():
    latency, bandwidth = LINKS["all_gather"]
    config = CPConfig("allgather_kv", 4)
    t = prior_time(W, config, profile())
    nbytes = analytic_cost(W, config).bytes_sent["all_gather"]
    assert nbytes > 0
    assert t.all_gather_s == pytest.approx(latency + nbytes / bandwidth, rel=1e-12)
    assert t.all_to_all_s == 0.0 and t.ring_exposed_s == 0.0


def test_hybrid_pays_both_its_collectives():
    t = prior_time(W, CPConfig("allgather_kv", 4, 2), profile())
    assert t.all_to_all_s > 0 and t.all_gather_s > 0 and t.ring_exposed_s == 0.0


# --------------------------------------------------------------------------- described hardware


class Recording:
    """A Profile that records which collective each term asked about, and its answer."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    fingerprint = property(lambda self: self.inner.fingerprint)
    max_ranks = property(lambda self: self.inner.max_ranks)

    def memory_limit(self, ranks):
        return self.inner.memory_limit(ranks)

    def memory_time(self, step, nbytes, workload, ranks):
        return self.inner.memory_time(step, nbytes, workload, ranks)

    def ring_call_s(self, workload, ranks):
        return self.inner.ring_call_s(workload, ranks)

    def key_preparation_s(self, *args):
        return self.inner.key_preparation_s(*args)

    def exchange_wait_s(self, *args):
        return self.inner.exchange_wait_s(*args)

    charges_ring_steps = property(lambda self: self.inner.charges_ring_steps)
    launch_s = property(lambda self: self.inner.launch_s)
    attention_call_s = property(lambda self: self.inner.attention_call_s)
    overlap_slowdown = property(lambda self: self.inner.overlap_slowdown)
    attention_kernel = property(lambda self: self.inner.attention_kernel)
    stream = property(lambda self: self.inner.stream)
    position_calls = property(lambda self: self.inner.position_calls)

    def describe(self):
        return self.inner.describe()

    def attention_rate(self, workload, ranks, *rest):
        return self.inner.attention_rate(workload, ranks, *rest)

    def collective_time(self, kind, ranks, groups, nbytes, calls):
        answer = self.inner.collective_time(kind, ranks, groups, nbytes, calls)
        self.calls.append((kind, groups, nbytes, calls, answer))
        return answer


@pytest.fixture(scope="module")
def two_nodes():
    return load_description("h100-sxm-2x8-ib")


def per_byte(description, key: str) -> float:
    return 1 / description.figure(key)


def test_a_ring_across_two_nodes_streams_at_the_network_flow_rate(two_nodes):
    nvlink = two_nodes.figure("links.node.bandwidth_gbps.default")
    nic = two_nodes.figure("links.network.bandwidth_gbps.default")
    assert nic < nvlink  # the premise of the shipped file
    workload = Workload(seq_len=16384, heads=16, head_dim=128)

    across = Recording(DescribedProfile(two_nodes))
    prior_time(workload, CPConfig("ring", 16), across)
    ((kind, groups, nbytes, calls, seconds),) = across.calls
    assert kind == "p2p" and tuple(groups) == (tuple(range(16)),) and calls == 1
    # ranks 7 -> 8 and 15 -> 0 cross the network, one flow each: the step runs at one NIC's rate
    latency = two_nodes.figure("links.network.latency_us")
    assert seconds == pytest.approx(latency + nbytes / nic, rel=1e-9)

    inside = Recording(DescribedProfile(two_nodes))
    prior_time(workload, CPConfig("ring", 8), inside)
    ((_, groups, nbytes8, _, seconds8),) = inside.calls
    assert tuple(groups) == (tuple(range(8)),)
    assert seconds8 == pytest.approx(two_nodes.figure("links.node.latency_us") + nbytes8 / nvlink, rel=1e-9)


def test_a_ulysses_head_group_of_eight_stays_on_nvlink(two_nodes):
    nvlink = two_nodes.figure("links.node.bandwidth_gbps.default")
    nic = two_nodes.figure("links.network.bandwidth_gbps.default")
    workload = Workload(seq_len=16384, heads=16, head_dim=128)
    config = CPConfig("ring", 16, 8)  # 8-way Ulysses inside each node x 2-way Ring across
    recording = Recording(DescribedProfile(two_nodes))
    t = prior_time(workload, config, recording)
    calls = {kind: (tuple(groups), nbytes, answer) for kind, groups, nbytes, _, answer in recording.calls}
    assert calls["all_to_all"][0] == (tuple(range(8)), tuple(range(8, 16)))
    assert calls["p2p"][0] == tuple((j, j + 8) for j in range(8))
    nbytes = analytic_cost(workload, config).bytes_sent["all_to_all"]
    latency = two_nodes.figure("links.node.latency_us")
    assert t.all_to_all_s == pytest.approx(3 * latency + nbytes / nvlink, rel=1e-12)
    # pure 16-way Ulysses spans both nodes: 8 of each rank's 15 peers are across the network
    pure = Recording(DescribedProfile(two_nodes))
    prior_time(workload, CPConfig("ulysses", 16), pure)
    _, _, nbytes16, calls16, seconds = pure.calls[0]
    expected = nbytes16 * (7 / 15 / nvlink + 8 / 15 / nic)
    network_latency = two_nodes.figure("links.network.latency_us")
    assert seconds == pytest.approx(calls16 * network_latency + expected, rel=1e-9)


def test_described_compute_runs_gemms_then_one_exponential_per_pair():
    h100 = load_description("h100-sxm-8")
    matmul, exponentials = h100.figure("device.matmul_tflops.bf16"), h100.figure("device.softmax_tops")
    workload = Workload(seq_len=8192, heads=24, head_dim=128, dtype="bf16")
    config = CPConfig("ulysses", 8)
    t = prior_time(workload, config, DescribedProfile(h100))
    flops = analytic_cost(workload, config).flops
    pairs = flops / (4 * 128)
    call = h100.figure("device.attention_call_us")  # one call: Ulysses attends once
    assert t.compute_s == pytest.approx(flops / matmul + pairs / exponentials + call, rel=1e-12)


def test_every_attention_call_costs_at_least_its_fixed_cost():
    """One token still pays for the call (issue 33 item 9: 55 ns predicted for seq_len 1),
    and the Ring pays it once per block it attends to (issue 32's per-call mechanism)."""
    h100 = load_description("h100-sxm-8")
    call = h100.figure("device.attention_call_us")
    profile = DescribedProfile(h100)
    one_token = Workload(seq_len=1, heads=8, head_dim=64)
    assert prior_time(one_token, CPConfig("ring", 1), profile).total_s >= call
    tiny = Workload(seq_len=64, heads=8, head_dim=64)
    assert prior_time(tiny, CPConfig("ring", 8), profile).compute_s >= 8 * call
    no_floor = DescribedProfile(h100.with_figure("device.attention_call_us", 1e-12))
    assert (prior_time(tiny, CPConfig("ring", 8), profile).compute_s
            - prior_time(tiny, CPConfig("ring", 8), no_floor).compute_s) == pytest.approx(8 * call, rel=1e-6)


def test_the_structural_error_ties_what_the_figures_alone_would_settle():
    h100 = DescribedProfile(load_description("h100-sxm-8"))
    workload = Workload(seq_len=16896, heads=24, head_dim=128)
    pick, other = CPConfig("ulysses", 8), CPConfig("allgather_kv", 8)
    assert prior_time(workload, pick, h100).total_s < prior_time(workload, other, h100).total_s
    assert prior_ties(workload, pick, [other], h100, structural=0.0) == ()
    ties = prior_ties(workload, pick, [other], h100)
    assert [(t.other, t.figure, t.end) for t in ties] == [(other, STRUCTURE, "")]
    # the Ring on 8 ranks spends far longer than the pick: no error of this size reaches it
    assert prior_ties(workload, pick, [CPConfig("ring", 1)], h100) == ()


def test_small_head_dims_compute_slower_per_flop():
    """32 heads x 32 and 8 heads x 128 do the same FLOPs; the smaller head_dim pays 4x the
    exponentials per FLOP (issue 12, mechanism 2)."""
    profile = DescribedProfile(load_description("a100-sxm-8"))
    narrow = Workload(seq_len=131072, heads=32, head_dim=32, batch=2, causal=True)
    wide = Workload(seq_len=131072, heads=8, head_dim=128, batch=2, causal=True)
    config = CPConfig("ulysses", 8)
    assert analytic_cost(narrow, config).flops == analytic_cost(wide, config).flops
    ratio = prior_time(narrow, config, profile).compute_s / prior_time(wide, config, profile).compute_s
    assert 1.2 < ratio < 2


def test_ring_steps_pay_merges_and_the_slowdown_beside_their_transfer_and_hide_launches():
    a100 = load_description("a100-sxm-8")
    workload = Workload(seq_len=32768, heads=32, head_dim=32, batch=2, causal=True)
    config = CPConfig("ring", 8)
    # an engine merging block by block (ring-flash-attn's count; a calibration prices it per element)
    blockwise = analytic_cost(workload, config)
    assert blockwise.kernels["merge"] == 7 * 6
    assert blockwise.memory_bytes["merge"] == 7 * 2 * (32768 // 8) * 32 * 32 * (9 * 4 + 2)
    # what a described GPU's plan deploys (cptune.torch): the first block's output copied to
    # float32, 7 merges of two passes over 16-bit outputs, the result cast back to bf16
    cost = analytic_cost(workload, config, position_calls=True)
    assert cost.kernels == {"attention": 8, "permute": 0, "replicate": 0, "merge": 1 + 7 * 8 + 1,
                            "stream": 7 * 2}
    rows = 2 * (32768 // 8) * 32  # the rank's block, every head
    assert cost.memory_bytes["merge"] == rows * (6 * 32 + 7 * (18 * 32 + 68) + 6 * 32)
    assert cost.memory_bytes["requery"] == 7 * 2 * (32768 // 8) * 32 * 32 * 2
    quiet = a100.with_figure("device.launch_us", 1e-9).with_figure("device.overlap_slowdown", 1e-12)
    t_quiet = prior_time(workload, config, DescribedProfile(quiet))
    t = prior_time(workload, config, DescribedProfile(a100))
    # every kernel is launched inside a Ring step, while the device works on the block in hand
    assert t.overhead_s == 0.0
    ring_memory = cost.memory_bytes["merge"] + cost.memory_bytes["requery"]
    assert t.memory_s == pytest.approx(ring_memory / a100.figure("device.memory_gbps"))
    assert t_quiet.ring_exposed_s == pytest.approx(0.0, abs=1e-9 * t.total_s)  # NVLink hides the stream
    step_bytes = cost.bytes_sent["p2p"] / 7
    transfer = DescribedProfile(a100).collective_time("p2p", 8, (tuple(range(8)),), step_bytes, 1)
    block = t.compute_s / 8
    assert transfer < block
    slowdown = a100.figure("device.overlap_slowdown")
    assert t.ring_exposed_s == pytest.approx(7 * slowdown * transfer, rel=1e-6)
    assert t.total_s > t_quiet.total_s
    # a host slower at launching than the device is at computing sets the pace of each step
    slow_host = DescribedProfile(a100.with_figure("device.launch_us", 1e-3))
    t_host = prior_time(workload, config, slow_host)
    per_step = (8 + (1 + 7 * 8 + 1) + 7 * 2 - 1) / 7 * 1e-3
    ring = 7 * per_step + max(block, 1e-3)
    assert t_host.total_s == pytest.approx(ring, rel=1e-9)
    assert t_host.ring_exposed_s > 0.5 * t_host.total_s


@dataclasses.dataclass(frozen=True)
class FreeMerges(DescribedProfile):
    """A described GPU whose merges move no traffic: what the prior was before it counted them."""

    def memory_time(self, step, nbytes, workload, ranks):
        return 0.0 if step == "merge" else super().memory_time(step, nbytes, workload, ranks)


def test_the_engines_merge_passes_cost_the_pick_the_traffic_they_move_at_memory_bandwidth():
    """On a described GPU, whose plans deploy cptune.torch, the prior counts the merges the
    torch engine's attention makes (issue 59; ``tests/test_torch_engine.py`` checks the count op
    by op): each is device-memory traffic at the description's memory_gbps, launched inside the
    Ring's steps. 32K causal tokens of 4 heads on 8 H100s: the pick, 4-way Ulysses x 2-way Ring,
    merges one other block into its 16K rows (16-bit outputs: two passes), having copied its own
    block's output to float32, and its result leaves in the pack of Ulysses' exchange back,
    reading float32: that is what its cost rises by. The pure Ring merges 7 blocks of 4K rows
    of 4 heads; causal AllGather-KV copies its query chunks' first calls in and merges their
    diagonals."""
    h100 = load_description("h100-sxm-8")
    gbps = h100.figure("device.memory_gbps")
    workload = Workload(seq_len=32768, heads=4, head_dim=128, causal=True)  # bf16, batch 1
    priced, free = DescribedProfile(h100), FreeMerges(h100)
    configs = [c for c in enumerate_configs(workload, 8) if c.ranks == 8]
    pick = min(configs, key=lambda c: prior_time(workload, c, priced).total_s)
    assert pick == CPConfig("ring", 8, 4)  # u4 x ring2
    d = 128
    merge, to_fp32 = 18 * d + 68, 6 * d  # per row of a head: 2 passes and the log-sum-exp; the copy
    expected = {
        pick: 16384 * 1 * (to_fp32 + merge + 2 * d),  # cast back inside the pack: 4 bytes read, not 2
        CPConfig("allgather_kv", 8): 4096 * 4 * ((6 * d + 8) + merge + 6 * d),  # cast: a pass of its own
        CPConfig("ulysses", 4): 0,  # one call over every row: the kernel's own output
    }
    for config, merged in expected.items():
        assert analytic_cost(workload, config, position_calls=True).memory_bytes["merge"] == merged
        added = prior_time(workload, config, priced).total_s - prior_time(workload, config, free).total_s
        assert added == pytest.approx(merged / gbps, rel=1e-9, abs=1e-15), config.label
    # the pure Ring: 7 merges; its small steps are paced by their launches, which hide them
    ring = CPConfig("ring", 8)
    assert analytic_cost(workload, ring, position_calls=True).memory_bytes["merge"] == \
        4096 * 4 * (to_fp32 + 7 * merge + 6 * d)
    assert prior_time(workload, ring, priced).total_s == prior_time(workload, ring, free).total_s


def test_ulysses_pays_its_permutes_and_gqa_replication_through_memory():
    l20 = load_description("l20-pcie-8")
    workload = Workload(seq_len=8192, heads=32, head_dim=128, kv_heads=2)
    config = CPConfig("ulysses", 8)  # 2 KV heads over 8 ranks: replicated 4x
    cost = analytic_cost(workload, config)
    assert cost.kv_replication == 4
    rank_tokens = 8192 // 8
    assert cost.memory_bytes["permute"] == 4 * rank_tokens * (2 * 32 + 2 * 8) * 128 * 2
    assert cost.memory_bytes["replicate"] == 2 * rank_tokens * (2 + 8) * 128 * 2
    assert cost.kernels == {"attention": 1, "permute": 6, "replicate": 1, "merge": 0, "stream": 0}
    t = prior_time(workload, config, DescribedProfile(l20))
    moved = cost.memory_bytes["permute"] + cost.memory_bytes["replicate"]
    assert t.memory_s == pytest.approx(moved / l20.figure("device.memory_gbps"))
    assert t.ring_exposed_s == 0.0


def test_pcie_all_to_all_is_limited_by_the_tier_it_crosses_and_its_share():
    """On the L20 server two ranks share a switch, four a socket; traffic leaving the socket
    crosses the socket link, whose all-to-all rate is the slowest (issue 12, mechanism 4)."""
    l20 = load_description("l20-pcie-8")
    profile = DescribedProfile(l20)
    nbytes = 1e8

    def seconds(u):
        heads, _ = rank_groups(CPConfig("ulysses", 8) if u == 8 else CPConfig("ring", 8, u))
        return profile.collective_time("all_to_all", 8, heads, nbytes, 1)

    switch_latency = l20.figure("links.domains[0].latency_us")
    switch_bandwidth = l20.figure("links.domains[0].bandwidth_gbps.default")
    assert seconds(2) == pytest.approx(switch_latency + nbytes / switch_bandwidth)
    assert seconds(2) < seconds(4) < seconds(8)
    # 8 ranks: each sends 4/7 of its bytes across the socket link; the 4 ranks of a socket share it
    socket_link = l20.figure("links.domains[1].uplink_gbps.default")
    assert seconds(8) >= 4 * (4 / 7) * nbytes / socket_link
    # the Ring's stream over the same ranks: a send/recv per rank, two of them across the socket
    # link at its send/recv rate, so the whole step waits for those
    ring = profile.collective_time("p2p", 8, (tuple(range(8)),), nbytes, 1)
    assert ring == pytest.approx(l20.figure("links.node.latency_us")
                                 + nbytes / l20.bandwidth(l20.node_link, "p2p"), rel=1e-6)


def test_a_subset_of_a_node_takes_the_ranks_that_share_a_switch_first():
    l20 = load_description("l20-pcie-8")
    heads, context = rank_groups(CPConfig("ring", 4, 2))
    assert tuple(heads) == ((0, 1), (2, 3)) and tuple(context) == ((0, 2), (1, 3))
    assert l20.link(heads[0]).name == "PCIe Gen4 switch"
    assert l20.link(range(4)).name == "CPU socket (root complex)"
    assert l20.link(range(8)) is l20.node_link


def test_described_profile_without_a_dtype_rate_says_which_key_to_add():
    description = dataclasses.replace(
        load_description("h100-sxm-8"),
        figures={k: v for k, v in load_description("h100-sxm-8").figures.items() if not k.endswith(".fp32")},
    )
    with pytest.raises(ValueError, match="matmul_tflops"):
        prior_time(Workload(seq_len=64, heads=2, head_dim=16, dtype="fp32"), CPConfig("ring", 2),
                   DescribedProfile(description))


# --------------------------------------------------------------------------- calibration


def test_fit_recovers_latency_and_bandwidth_from_exact_points():
    sizes = np.array(MESSAGE_SIZES, dtype=float)
    latency, bandwidth = 25e-6, 3.5e9
    fitted_latency, fitted_bandwidth = fit_latency_bandwidth(sizes, latency + sizes / bandwidth)
    assert fitted_latency == pytest.approx(latency, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_fit_stays_non_negative_on_noisy_points():
    rng = np.random.default_rng(7)
    sizes = np.array(MESSAGE_SIZES, dtype=float)
    for _ in range(20):
        # nearly no latency: noise alone would push an unconstrained fit below zero
        times = (1e-9 + sizes / 2e9) * rng.uniform(0.7, 1.3, sizes.size)
        latency, bandwidth = fit_latency_bandwidth(sizes, times)
        assert latency >= 0.0 and bandwidth > 0.0
        assert 1e9 < bandwidth < 4e9


def test_fit_of_flat_times_is_all_latency():
    sizes = np.array(MESSAGE_SIZES, dtype=float)
    latency, bandwidth = fit_latency_bandwidth(sizes, np.full(sizes.size, 5e-5))
    assert latency == pytest.approx(5e-5, rel=1e-6)
    # no size term: the bandwidth seen at the largest size, finite so it stores as JSON
    assert bandwidth == pytest.approx(sizes[-1] / 5e-5) and math.isfinite(bandwidth)


def test_group_sizes_are_the_divisors_above_one():
    assert group_sizes(1) == []
    assert group_sizes(2) == [2]
    assert group_sizes(12) == [2, 3, 4, 6, 12]


def test_collective_fit_time():
    fit = CollectiveFit(kind="p2p", ranks=2, group=2, latency_s=1e-5, bandwidth=1e9, bus_bandwidth=1e9,
                        sizes=(1,), times_s=(1e-5,))
    assert fit.time(0) == 0.0
    assert fit.time(2e6, calls=3) == pytest.approx(3e-5 + 2e-3)


def test_calibration_round_trips_through_json():
    calibration = make_calibration(max_ranks=4)
    data = json.loads(json.dumps(calibration.to_dict()))  # what the store keeps
    back = Calibration.from_dict(data)
    assert back == calibration
    assert isinstance(back.collectives[0].sizes, tuple) and isinstance(back.compute[0], ComputeRate)
    assert back.max_ranks == 4


def test_collective_falls_back_to_the_nearest_rank_count():
    fits = tuple(
        CollectiveFit(kind="p2p", ranks=n, group=g, latency_s=n * 1e-6 + g * 1e-7, bandwidth=1e9,
                      bus_bandwidth=1e9, sizes=(1,), times_s=(1.0,))
        for n, g in [(2, 2), (4, 2), (4, 4), (8, 2)]
    )
    calibration = Calibration("mpi", fits, (rate_entry(1, 64, 1e9),), "2025-01-01T00:00:00+00:00")

    def picked(ranks, group):
        fit = calibration.collective("p2p", ranks, group)
        return fit.ranks, fit.group

    assert picked(4, 2) == (4, 2)  # calibrated: exact
    assert picked(5, 2) == (4, 2)  # nearest rank count with that group
    assert picked(7, 2) == (8, 2)
    assert picked(16, 4) == (4, 4)  # only 4 ranks have groups of 4
    with pytest.raises(ValueError, match="all_gather"):
        calibration.collective("all_gather", 2, 2)


def test_attention_rate_picks_the_nearest_head_dim_in_ratio():
    calibration = make_calibration(max_ranks=2)
    assert calibration.attention_rate(1, 64) == pytest.approx(RATES[64])
    assert calibration.attention_rate(1, 128) == pytest.approx(RATES[128])
    assert calibration.attention_rate(1, 80) == pytest.approx(RATES[64])  # 80/64 < 128/80
    assert calibration.attention_rate(1, 100) == pytest.approx(RATES[128])  # 128/100 < 100/64
    assert calibration.attention_rate(1, 16) == pytest.approx(RATES[64])
    assert calibration.attention_rate(1, 256) == pytest.approx(RATES[128])


def test_a_call_below_the_calibrated_sizes_keeps_its_fixed_cost():
    latency, rate = 1e-3, 50e9  # every timed size exactly latency + work / rate
    shapes = [ComputeRate(ranks=1, heads=4, seq_q=q, seq_k=4 * q, head_dim=64, seconds=0.0)
              for q in (128, 256)]
    timed = tuple(dataclasses.replace(r, seconds=latency + r.computed_flops("numpy") / rate) for r in shapes)
    calibration = Calibration("mpi", (), timed, "2025-01-01T00:00:00+00:00")
    smallest = timed[0].computed_flops("numpy")
    for flops in (smallest / 4, smallest / 40):  # the line through the sizes, not the smallest's rate
        expected = flops / (latency + flops / rate)
        assert calibration.attention_rate(1, 64, flops=flops) == pytest.approx(expected)
    held = Calibration("mpi", (), tuple(dataclasses.replace(r, seconds=r.computed_flops("numpy") / rate)
                                        for r in shapes), "2025-01-01T00:00:00+00:00")
    assert held.attention_rate(1, 64, flops=smallest / 4) == pytest.approx(rate)  # no fixed cost: the rate


def test_attention_rate_beyond_the_calibrated_ranks_uses_the_largest():
    calibration = make_calibration(max_ranks=2, rank_scale=1.0)
    assert calibration.attention_rate(2, 64) == pytest.approx(RATES[64] / 2)
    assert calibration.attention_rate(8, 64) == pytest.approx(RATES[64] / 2)


#: The numpy kernel's step costs, seconds per element, by rank count: (query fp16, query fp32, merge).
STEP_SECONDS = {1: (1e-9, 2e-10, 4e-10), 2: (1.5e-9, 3e-10, 5e-10)}


def with_steps(calibration: Calibration) -> Calibration:
    """``calibration`` plus the kernel's step costs of STEP_SECONDS, timed on 1000 elements."""
    steps = tuple(
        StepCost(ranks=n, kind=kind, wire=wire, elements=1000, seconds=1000 * seconds)
        for n, costs in STEP_SECONDS.items()
        for (kind, wire), seconds in zip((("query", "float16"), ("query", "float32"), ("merge", "float32")),
                                         costs, strict=True)
    )
    return dataclasses.replace(calibration, steps=steps)


def keys_s(profile: CalibratedProfile, workload: Workload, config: CPConfig) -> float:
    """The prior's seconds preparing the keys ``config``'s calls read, beyond those its rate
    holds (one call's work: every strategy here rates its calls as one)."""
    flops = computed_flops(workload, config, "numpy")
    elements = key_elements(workload, config, "numpy")
    return profile.key_preparation_s(workload, config.ranks, elements, flops, flops)


def sized_calibration(max_ranks: int = 1) -> Calibration:
    """Head_dim 64 on every rank count: 1 GFLOP/s on a small call, 4 GFLOP/s on a call 16x
    larger; causal calls at half those rates (of the FLOPs the numpy kernel executes).
    Collectives as in ``make_calibration``."""
    def entry(ranks, seq_q, rate, causal):
        shape = ComputeRate(ranks=ranks, heads=4, seq_q=seq_q, seq_k=4 * seq_q, head_dim=64, seconds=1.0,
                            causal=causal)
        return ComputeRate(ranks=ranks, heads=4, seq_q=seq_q, seq_k=4 * seq_q, head_dim=64,
                           seconds=shape.computed_flops("numpy") / rate, causal=causal)

    compute = tuple(entry(n, seq_q, rate / (1 + causal), causal)
                    for n in range(1, max_ranks + 1)
                    for seq_q, rate in ((256, 1e9), (1024, 4e9)) for causal in (False, True))
    return Calibration("mpi", make_calibration(max_ranks).collectives, compute, "2025-01-01T00:00:00+00:00")


def test_causal_compute_rate_counts_only_visible_pairs():
    dense = ComputeRate(ranks=1, heads=2, seq_q=4, seq_k=8, head_dim=16, seconds=1.0)
    causal = ComputeRate(ranks=1, heads=2, seq_q=4, seq_k=8, head_dim=16, seconds=1.0, causal=True)
    assert dense.flops == 4 * 2 * 16 * 4 * 8
    # queries at the last 4 of 8 positions see 5, 6, 7 and 8 keys
    assert causal.flops == 4 * 2 * 16 * (5 + 6 + 7 + 8)
    assert causal.flops_per_s == causal.flops


def test_attention_rate_interpolates_over_the_work_per_call():
    calibration = sized_calibration()
    small, large = sorted(r.flops for r in calibration.compute if not r.causal)
    assert large == 16 * small
    assert calibration.attention_rate(1, 64, flops=small) == pytest.approx(1e9)
    assert calibration.attention_rate(1, 64, flops=large) == pytest.approx(4e9)
    assert calibration.attention_rate(1, 64, flops=4 * small) == pytest.approx(2e9)  # log-log midpoint
    # below the sizes the call keeps most of its fixed cost (test_a_call_below_the_calibrated_sizes...)
    assert calibration.attention_rate(1, 64, flops=small / 100) < 1e9 / 50
    assert calibration.attention_rate(1, 64, flops=large * 100) == pytest.approx(4e9)
    assert calibration.attention_rate(1, 64) == pytest.approx(2e9)  # no size: geometric mean


def test_attention_rate_pools_the_effect_of_the_rank_count_over_every_shape():
    """Two ranks' rate against one rank's, measured shape by shape, scatters; the prior reads
    it as one line in log work per call fitted through all shapes (least squares), and each
    shape keeps the geometric mean of its measured rates. The measured points stay stored."""
    def timed(ranks, seq_q, head_dim, rate):
        shape = {"heads": 4, "seq_q": seq_q, "seq_k": 4 * seq_q, "head_dim": head_dim}
        return ComputeRate(ranks=ranks, **shape, seconds=4 * 4 * head_dim * seq_q * 4 * seq_q / rate)

    shapes = [(256, 64, 1e9), (256, 128, 1.5e9), (1024, 64, 3e9), (1024, 128, 4e9)]
    scatter = [1.06, 0.93, 1.01, 0.97]  # two ranks' rate / (half of one rank's), per shape
    one = [timed(1, q, d, rate) for q, d, rate in shapes]
    two = [timed(2, q, d, rate / 2 * s) for (q, d, rate), s in zip(shapes, scatter, strict=True)]
    calibration = Calibration("mpi", (), (*one, *two), "2025-01-01T00:00:00+00:00")
    work = np.array([r.flops for r in one], dtype=float)
    measured = np.log([b.flops_per_s / a.flops_per_s for a, b in zip(one, two, strict=True)])
    line = np.polyval(np.polyfit(np.log(work), measured, 1), np.log(work))

    def rate(ranks, head_dim, flops):
        return calibration.attention_rate(ranks, head_dim, flops=flops)

    for (_, d, _), w, expected, a, b in zip(shapes, work, line, one, two, strict=True):
        assert np.log(rate(2, d, w) / rate(1, d, w)) == pytest.approx(expected, abs=1e-9)
        assert rate(1, d, w) * rate(2, d, w) == pytest.approx(a.flops_per_s * b.flops_per_s, rel=1e-9)
    assert not np.allclose(line, measured, atol=1e-3)  # the scatter was smoothed, not kept
    assert calibration.compute == (*one, *two)
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))) == calibration


def test_attention_rate_uses_the_shapes_with_the_same_mask():
    calibration = sized_calibration()
    causal_large = max(r.computed_flops("numpy") for r in calibration.compute if r.causal)
    assert calibration.attention_rate(1, 64, causal=True, flops=causal_large) == pytest.approx(2e9)
    assert calibration.attention_rate(1, 64, causal=True) == pytest.approx(1e9)
    # a calibration without causal shapes answers causal questions from the others
    dense_only = make_calibration(max_ranks=1)
    assert dense_only.attention_rate(1, 64, causal=True) == pytest.approx(RATES[64])


def test_every_rate_of_a_shape_is_read_at_the_same_calibrated_head_dim_and_mask():
    """The forward's rate, a call's fixed cost and the backward's speed all read the head_dim
    nearest in ratio, the smaller where two are equally near (d64 between d32 and d128), and
    the same mask where it was timed, else the one that was."""
    calibration = make_calibration(max_ranks=1, rates={32: 2e9, 128: 8e9})
    speed = {32: 0.5, 128: 2.0}
    calibration = dataclasses.replace(calibration, backward=tuple(
        dataclasses.replace(rate, seconds=rate.seconds * BACKWARD_FLOPS_RATIO / speed[rate.head_dim])
        for rate in calibration.compute))
    assert calibration.attention_rate(1, 64) == pytest.approx(2e9)
    assert calibration.attention_rate(1, 90) == pytest.approx(8e9)  # nearer 128 than 32 in ratio
    assert calibration.backward_speed(64) == pytest.approx(0.5)
    assert calibration.backward_speed(90) == pytest.approx(2.0)
    # only unmasked shapes were timed: a causal question reads them
    assert calibration.attention_rate(1, 64, causal=True) == calibration.attention_rate(1, 64)
    assert calibration.backward_speed(64, causal=True) == calibration.backward_speed(64)
    assert calibration.call_seconds(1, 64, causal=True) == calibration.call_seconds(1, 64) == 0.0  # one size


def test_ring_compute_is_rated_at_the_work_of_one_block():
    p = CalibratedProfile(HOST, sized_calibration(max_ranks=4))
    workload = Workload(seq_len=768, heads=8, head_dim=64)
    ring, ulysses = CPConfig("ring", 4), CPConfig("ulysses", 4)
    flops = analytic_cost(workload, ring).flops
    assert analytic_cost(workload, ulysses).flops == flops  # the same work per rank...
    ring_rate = p.calibration.attention_rate(4, 64, False, flops / 4)
    ulysses_rate = p.calibration.attention_rate(4, 64, False, flops)
    assert ring_rate < ulysses_rate  # ...but the Ring does it in 4 smaller calls
    assert prior_time(workload, ring, p).compute_s == pytest.approx(flops / ring_rate)
    assert prior_time(workload, ulysses, p).compute_s == pytest.approx(flops / ulysses_rate)
    # where the calibration times what each Ring step repeats, those costs are charged as
    # steps, and the calls together are rated as one call over all keys: not counted twice;
    # that rate holds one call's fixed cost, and each of the 3 others adds its own
    timed = CalibratedProfile(HOST, with_steps(p.calibration))
    assert timed.charges_ring_steps and not p.charges_ring_steps
    call_s = timed.calibration.call_seconds(4, 64)
    assert prior_time(workload, ring, timed).compute_s == pytest.approx(
        flops / ulysses_rate + 3 * call_s + keys_s(timed, workload, ring))
    assert prior_time(workload, ring, timed).memory_s > 0
    assert prior_time(workload, ulysses, timed).compute_s == pytest.approx(
        flops / ulysses_rate + keys_s(timed, workload, ulysses))


def test_a_calls_fixed_cost_is_the_latency_of_its_time_against_its_work():
    """Two sizes lie on time = a + work / rate: 1 GFLOP/s on a call of w FLOPs and 4 GFLOP/s
    on one of 16w give a = 0.8 w / 1 GFLOP/s; the causal shapes, at half those rates, the
    line through their own two points. On each rank count; a head_dim or rank count not timed
    reads the nearest."""
    calibration = sized_calibration(max_ranks=2)
    small = min(r.computed_flops("numpy") for r in calibration.compute if not r.causal)
    (w1, t1), (w2, t2) = sorted((r.computed_flops("numpy"), r.seconds) for r in calibration.compute
                                if r.causal and r.ranks == 1)
    for ranks in (1, 2, 8):
        assert calibration.call_seconds(ranks, 64) == pytest.approx(0.8 * small / 1e9)
        causal_call_s = calibration.call_seconds(ranks, 128, causal=True)
        assert causal_call_s == pytest.approx(t1 - w1 * (t2 - t1) / (w2 - w1))
    assert make_calibration().call_seconds(2, 64) == 0.0  # one size: no line to fit
    described = DescribedProfile(load_description("h100-sxm-8"))
    assert described.ring_call_s(W, 8) == 0.0  # its attention_call_s counts every call


def test_step_costs_round_trip_and_answer_for_the_nearest_rank_count():
    calibration = with_steps(make_calibration(max_ranks=4))
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))) == calibration
    assert calibration.step_seconds("query", 1, "float16") == pytest.approx(1e-9)
    assert calibration.step_seconds("merge", 2, "float32") == pytest.approx(5e-10)
    assert calibration.step_seconds("query", 8, "float32") == pytest.approx(3e-10)  # beyond: the largest
    assert calibration.step_seconds("query", 2, "float64") == 0.0  # not timed
    assert make_calibration().step_seconds("merge", 2, "float32") == 0.0


def test_ring_steps_pay_the_calibrated_query_preparation_and_merge_per_element():
    """Each Ring step after the first prepares its query block again and merges the block's
    output: per element of the block, the wire dtype's query cost plus the merge's. A
    calibration without step costs (stored before they were timed) charges nothing."""
    untimed = CalibratedProfile(HOST, make_calibration(max_ranks=4))
    timed = CalibratedProfile(HOST, with_steps(untimed.calibration))
    for dtype, query in (("bf16", 1.5e-9), ("fp32", 3e-10)):
        workload = Workload(seq_len=4096, heads=8, head_dim=64, batch=2, dtype=dtype)
        ring = CPConfig("ring", 2)
        elements = 2 * (4096 // 2) * 8 * 64  # the block each rank merges, once (c - 1 = 1)
        t, before = prior_time(workload, ring, timed), prior_time(workload, ring, untimed)
        assert t.memory_s == pytest.approx(elements * (query + 5e-10))
        assert before.memory_s == 0.0
        assert t.total_s == pytest.approx(before.total_s + t.memory_s + keys_s(timed, workload, ring))
        for other in (CPConfig("allgather_kv", 2), CPConfig("ulysses", 2), CPConfig("ring", 1)):
            assert prior_time(workload, other, timed).total_s == pytest.approx(
                prior_time(workload, other, untimed).total_s + keys_s(timed, workload, other))
    # the Ring's share falls with length: the steps grow as S, the attention as S^2
    shares = []
    for seq_len in (1024, 4096):
        t = prior_time(Workload(seq_len=seq_len, heads=8, head_dim=64), CPConfig("ring", 2), timed)
        shares.append(t.memory_s / t.total_s)
    assert shares[1] < shares[0] / 2


def test_a_stored_calibration_without_mask_fields_still_loads():
    data = json.loads(json.dumps(make_calibration(max_ranks=2).to_dict()))
    for rate in data["compute"]:
        del rate["causal"]  # stored before causal shapes were calibrated
    assert all(not r.causal for r in Calibration.from_dict(data).compute)
    assert Calibration.from_dict(data).steps == ()  # and without step costs


# --------------------------------------------------------------------------- what is known


def test_prior_range_adds_each_figures_largest_move_in_quadrature():
    swings = (FigureSwing("a", 9.0, 13.0), FigureSwing("b", 12.0, 6.0), FigureSwing("c", 10.0, 10.0))
    low, high = prior_range(10.0, swings)
    assert low == pytest.approx(10 - (1**2 + 4**2) ** 0.5)
    assert high == pytest.approx(10 + (3**2 + 2**2) ** 0.5)
    assert prior_range(10.0, ()) == (10.0, 10.0)


def test_figure_swings_move_the_prior_the_way_each_figure_does():
    a100 = load_description("a100-sxm-8")
    workload = Workload(seq_len=32768, heads=32, head_dim=32, batch=2, causal=True)
    swings = {s.figure: s for s in figure_swings(workload, CPConfig("ring", 8, 2), DescribedProfile(a100))}
    assert set(swings) == {key for key, figure in a100.figures.items() if figure.uncertain}
    matmul = swings["device.matmul_tflops.bf16"]
    assert matmul.at_low_s > matmul.at_high_s  # a slower GEMM, a longer latency
    launch = swings["device.launch_us"]
    assert launch.at_low_s < launch.at_high_s
    # a calibrated host's rates are measured: no ranges to swing
    assert figure_swings(workload, CPConfig("ring", 4), profile()) == ()


def test_decide_ties_what_the_ranges_can_reorder_and_names_the_figure():
    pick = (FigureSwing("x", 1.0, 1.0), FigureSwing("y", 0.9, 1.2))
    close = (FigureSwing("x", 1.05, 1.05), FigureSwing("y", 1.0, 1.1))  # y high: 1.1 < 1.2
    tie = decide(1.0, pick, 1.05, close, CPConfig("ring", 4))
    assert tie == Tie(CPConfig("ring", 4), "y", "high", movers=frozenset({"y"}))  # x moves neither way
    far = (FigureSwing("x", 2.0, 2.0), FigureSwing("y", 1.9, 2.2))
    assert decide(1.0, pick, 2.0, far, CPConfig("ring", 4)) is None


@pytest.mark.parametrize("name", ["l20-pcie-8", "h100-sxm-2x8-ib", "a100-pcie-4"])
def test_one_evaluation_over_every_figure_range_is_each_range_alone(name):
    """The fast path (the prior once over numpy arrays of figure variants) equals the
    reference (the prior at each end of each figure's range, one at a time) for every feasible
    configuration: its total bit for bit, its swings to rounding."""
    from cptune.feasibility import candidate_configs, feasibility
    from cptune.model._ties import described_prior

    description = load_description(name)
    profile = DescribedProfile(description)
    workloads = [Workload(seq_len=16896, heads=24, head_dim=128),
                 Workload(seq_len=131072, heads=32, kv_heads=8, head_dim=128, causal=True)]
    for workload in workloads:
        for config in candidate_configs(description.max_ranks):
            if feasibility(workload, config):
                continue
            fast = described_prior(workload, config, profile)
            assert fast is not None and fast.total_s == prior_time(workload, config, profile).total_s
            for swing in fast.swings:
                figure = description.figures[swing.figure]
                for end in ("low", "high"):
                    alone = DescribedProfile(description.with_figure(swing.figure, getattr(figure, end)))
                    assert getattr(swing, f"at_{end}_s") == pytest.approx(
                        prior_time(workload, config, alone).total_s, rel=1e-12), (config, swing.figure, end)
            assert (fast.low_s, fast.high_s) == prior_range(fast.total_s, fast.swings)


# -- a training step ---------------------------------------------------------------------------


def trained(calibration: Calibration, speed: float) -> Calibration:
    """``calibration`` with its backward timed on every forward shape at ``speed`` of the
    forward's FLOP rate (the backward's FLOPs: BACKWARD_FLOPS_RATIO times the forward's)."""
    backward = tuple(dataclasses.replace(rate, seconds=rate.seconds * BACKWARD_FLOPS_RATIO / speed)
                     for rate in calibration.compute)
    return dataclasses.replace(calibration, backward=backward)


@pytest.mark.parametrize("config", [CPConfig("ulysses", 4, 4), CPConfig("allgather_kv", 4),
                                    CPConfig("ring", 4), CPConfig("ring", 4, 2)], ids=lambda c: c.label)
def test_a_training_step_is_its_forward_then_the_backward_at_the_calibrated_speed(config):
    """The backward's attention runs at the calibrated share of the forward's rate, and each
    strategy's backward exchanges add to its forward's: Ulysses' all-to-alls (dO in, dQ and
    dK/dV out), AllGather-KV's gather again and reduce-scatter of dK/dV, the Ring's K/V and
    gradient blocks behind the backward of the block in hand."""
    host = CalibratedProfile(HOST, trained(make_calibration(), 0.5))
    train = Workload(seq_len=4096, heads=8, head_dim=64, kv_heads=4, causal=True, mode="train")
    forward, step = prior_time(train.in_mode("forward"), config, host), prior_time(train, config, host)
    assert step.compute_s == pytest.approx(forward.compute_s * (1 + BACKWARD_FLOPS_RATIO / 0.5))
    assert step.memory_s == forward.memory_s and step.overhead_s == forward.overhead_s  # the forward's
    if config.head_group > 1:
        # dO in and dQ out as Q and O, dK/dV as K/V (no KV head replicated here): the forward's again
        assert step.all_to_all_s == pytest.approx(2 * forward.all_to_all_s)
    if config.strategy == "allgather_kv":
        assert step.all_gather_s > 2 * forward.all_gather_s  # gathered again, gradients in fp32
    if config.strategy == "ring":
        assert step.ring_exposed_s > forward.ring_exposed_s  # the last gradient goes home exposed
    faster = CalibratedProfile(HOST, trained(make_calibration(), 1.0))
    assert prior_time(train, config, faster).total_s < step.total_s


def test_the_backward_speed_moves_with_the_work_per_call_pooled_over_rank_counts():
    """A call's fixed costs weigh in the forward's time and the backward's alike, so the
    calibrated ratio is read size by size (each size's pooled over rank counts), interpolated
    in log work per call and held beyond the timed sizes; a training step's backward reads it
    at its own calls' work."""
    small = {"heads": 4, "seq_q": 128, "seq_k": 512, "head_dim": 64}
    large = {**small, "seq_q": 512, "seq_k": 2048}  # 16x the work
    compute, backward = [], []
    for shape, speeds in ((small, (1.5, 2.4)), (large, (0.9, 1.6))):  # on 1 and 2 ranks
        for ranks, speed in zip((1, 2), speeds, strict=True):
            rate = ComputeRate(ranks=ranks, seconds=0.01, **shape)
            compute.append(rate)
            backward.append(dataclasses.replace(rate, seconds=0.01 * BACKWARD_FLOPS_RATIO / speed))
    calibration = Calibration("mpi", (), tuple(compute), "2025-01-01T00:00:00+00:00",
                              backward=tuple(backward))
    small_work = 4 * 64 * 4 * 128 * 512
    at_small, at_large = math.sqrt(1.5 * 2.4), math.sqrt(0.9 * 1.6)
    for work, speed in ((small_work, at_small), (small_work / 10, at_small), (16 * small_work, at_large),
                        (160 * small_work, at_large), (4 * small_work, math.sqrt(at_small * at_large))):
        assert calibration.backward_speed(64, False, work) == pytest.approx(speed), work
    assert calibration.backward_speed(64) == pytest.approx(math.sqrt(at_small * at_large))

    host = CalibratedProfile(HOST, calibration)
    train = Workload(seq_len=256, heads=4, head_dim=64, mode="train")  # one call of the small shape's work
    local = CPConfig("ring", 1)
    forward, step = prior_time(train.in_mode("forward"), local, host), prior_time(train, local, host)
    backward_s = BACKWARD_FLOPS_RATIO * forward.compute_s / at_small
    assert step.compute_s - forward.compute_s == pytest.approx(backward_s)


def test_a_training_step_is_not_predicted_where_the_backward_speed_is_not_known(tmp_path):
    """A calibration stored before the backward was timed, and a description without its
    backward speed (no shipped one: a user's), refuse a training step in one line saying what to
    do; the forward runs."""
    import re

    from cptune.hardware import builtin_descriptions

    train = Workload(seq_len=4096, heads=8, head_dim=64, mode="train")
    with pytest.raises(UnpredictedModeError, match="did not time the mpi engine's backward: run cptune"):
        prior_time(train, CPConfig("ring", 2), profile())
    text = re.sub(r"\nbackward_speed = [^\n]*\n", "\n", builtin_descriptions()["a100-sxm-8"].read_text())
    (no_backward := tmp_path / "a100-no-backward.toml").write_text(text)
    a100 = DescribedProfile(load_description(no_backward))
    with pytest.raises(UnpredictedModeError, match=r"no attention backward speed.*\[device\] backward_speed"):
        prior_time(train, CPConfig("ring", 8), a100)
    assert prior_time(train.in_mode("forward"), CPConfig("ring", 8), a100).total_s > 0
    h100 = DescribedProfile(load_description("h100-sxm-8"))
    swings = {swing.figure for swing in figure_swings(train, CPConfig("ring", 8), h100)}
    assert "device.backward_speed" in swings  # its range is part of the interval


@pytest.mark.parametrize("config", [CPConfig("ulysses", 4), CPConfig("allgather_kv", 4), CPConfig("ring", 4)],
                         ids=lambda c: c.label)
def test_a_described_backward_counts_its_own_memory_bound_steps_and_launches(config):
    """On a described GPU the backward adds its own memory-bound steps and launches to the
    forward's: Ulysses' three exchanges back packed and unpacked as the forward's three are,
    the gradients' float32 accumulations (AllGather-KV's over the whole gathered sequence, the
    Ring's each step)."""
    h100 = DescribedProfile(load_description("h100-sxm-8"))
    train = Workload(seq_len=16384, heads=32, head_dim=128, kv_heads=8, causal=True, mode="train")
    cost = analytic_cost(train, config, "p2p", True)
    forward = prior_time(train.in_mode("forward"), config, h100)
    step = prior_time(train, config, h100)
    assert step.memory_s > forward.memory_s and step.overhead_s > forward.overhead_s
    if config.strategy == "ulysses":
        assert cost.backward_memory_bytes["permute"] == cost.memory_bytes["permute"]
        assert cost.backward_kernels["permute"] == 6
    kv_elements = 2 * train.kv_heads * (train.seq_len // 4) * train.head_dim
    grad = cost.backward_memory_bytes["grad"]
    if config.strategy == "allgather_kv":
        assert grad > 4 * kv_elements * 10  # every gathered key's dK/dV added into float32
    if config.strategy == "ring":
        assert 0 < cost.backward_ring_bytes <= grad and cost.backward_ring_kernels > 0
        assert cost.comm_steps["p2p"] == 3 + 3 + 4  # K/V forward and again, gradients with the home trip


def test_a_described_backward_ring_step_lasts_as_long_as_its_launches():
    """Where a Ring step's backward work is small, the host's launches of its kernels set its
    length (as in the forward): a slower launch lengthens the backward's exposed Ring time by
    at least the extra launch time of its c - 1 overlapped steps beyond the device's work."""
    description = load_description("h100-sxm-8")
    train = Workload(seq_len=2048, heads=8, head_dim=64, causal=True, mode="train")
    config = CPConfig("ring", 8)
    slow = DescribedProfile(description.with_figure("device.launch_us", 200e-6))
    fast = DescribedProfile(description.with_figure("device.launch_us", 1e-6))
    grow = (prior_time(train, config, slow).ring_exposed_s - prior_time(train, config, fast).ring_exposed_s
            - (prior_time(train.in_mode("forward"), config, slow).ring_exposed_s
               - prior_time(train.in_mode("forward"), config, fast).ring_exposed_s))
    cost = analytic_cost(train, config, "p2p", True)
    per_step = (cost.backward_ring_kernels + 8 * 6) / 8  # the stream's kernels and each call's six
    assert grow >= 7 * per_step * (200e-6 - 1e-6) * 0.9


def test_training_ties_take_the_training_structural_error():
    """``prior_ties`` without a structural error takes ``STRUCTURAL_ERROR_TRAIN`` for a training
    step and ``STRUCTURAL_ERROR`` for a forward."""
    from cptune.model import STRUCTURAL_ERROR, STRUCTURAL_ERROR_TRAIN

    h100 = DescribedProfile(load_description("h100-sxm-8"))
    pick, others = CPConfig("ring", 2), [CPConfig("ulysses", 2), CPConfig("allgather_kv", 2)]
    for mode, error in (("train", STRUCTURAL_ERROR_TRAIN), ("forward", STRUCTURAL_ERROR)):
        workload = Workload(seq_len=32768, heads=32, head_dim=128, kv_heads=8, causal=True, mode=mode)
        assert prior_ties(workload, pick, others, h100) == prior_ties(workload, pick, others, h100,
                                                                      structural=error)
    assert STRUCTURAL_ERROR_TRAIN != STRUCTURAL_ERROR


def test_the_keys_a_kernel_call_reads_are_those_of_the_steps_the_engine_runs():
    """Packed 512-token documents over 3,072 tokens on 2 ranks: documents kept whole leave the
    Ring one call over its own block (no step beyond: no block sees another's keys), while
    per-document zigzag chunks make AllGather-KV gather and read every key, though each query
    sees its own document's only; Ulysses reads the whole sequence for half the heads. Each
    count is that of the steps the strategy takes with a call (``kv_steps``, ``any_seen``)."""
    w = Workload(seq_len=3072, heads=8, head_dim=64, causal=True, documents=512)
    per_key = 2 * 8 * 64  # K and V, every head, head_dim
    whole = CPConfig("ring", 2, layout="doc_whole")
    zigzag = CPConfig("allgather_kv", 2, layout="doc_zigzag")
    assert key_elements(w, whole, "numpy") == per_key * 1536
    assert key_elements(w, zigzag, "numpy") == per_key * 3072
    assert key_elements(w, CPConfig("ulysses", 2), "numpy") == per_key // 2 * 3072
    for config in (whole, zigzag, CPConfig("ring", 2, layout="doc_zigzag")):
        layout = SequenceLayout(w, config)
        work, _ = _busiest_block(w, config, "numpy")
        group = blocks_work(w, config, True).index(work)
        q_pos = layout.block_positions(group)
        ran = [k for _, k in kv_steps(layout, group) if any_seen(q_pos, k, w.mask)]
        assert key_elements(w, config, "numpy") == per_key * sum(len(k) for k in ran)
    assert len(blocks_work(w, whole)[0].steps) == 1 and analytic_cost(w, whole).comm_steps["p2p"] == 0


def test_the_rate_holds_the_keys_its_calibrated_shapes_read():
    """At a calibrated size the keys held per FLOP are that shape's: 2 * heads * seq_k *
    head_dim K and V elements over the FLOPs its kernel executed."""
    calibration = sized_calibration(max_ranks=2)
    for rate in calibration.pooled_compute:
        work = rate.computed_flops("numpy")
        assert calibration.key_elements_per_flop(rate.ranks, 64, rate.causal, work) == pytest.approx(
            2 * 4 * rate.seq_k * 64 / work)


def test_documents_kept_whole_cost_less_than_ones_whose_chunks_gather_every_key():
    """The prior's pick among packed-document layouts on a calibration that times the kernel's
    steps: at 3,072 tokens on 2 ranks, AllGather-KV over per-document zigzag chunks computes
    4% fewer pairs than the Ring over whole documents, but its calls read twice the keys, each
    prepared (float32, a norm) at the calibrated query cost per element; the Ring over whole
    documents computes the faster (on the 2-core host its kernel ran 1.1x faster, interleaved).
    Without the keys' preparation the pairs alone put it the other way."""
    sized = sized_calibration(max_ranks=2)  # at 20x its rates: the 2-core host's, 10-40 GFLOP/s causal
    fast = dataclasses.replace(sized, compute=tuple(dataclasses.replace(r, seconds=r.seconds / 20)
                                                    for r in sized.compute))
    timed = CalibratedProfile(HOST, with_steps(fast))
    w = Workload(seq_len=3072, heads=8, head_dim=64, causal=True, documents=512)
    whole = CPConfig("ring", 2, layout="doc_whole")
    zigzag = CPConfig("allgather_kv", 2, layout="doc_zigzag")
    assert computed_flops(w, zigzag, "numpy") < computed_flops(w, whole, "numpy")
    assert keys_s(timed, w, zigzag) > keys_s(timed, w, whole) > 0
    compute = {c: prior_time(w, c, timed).compute_s for c in (whole, zigzag)}
    assert compute[whole] < compute[zigzag]
    assert prior_time(w, whole, timed).total_s < prior_time(w, zigzag, timed).total_s
    assert compute[zigzag] - keys_s(timed, w, zigzag) < compute[whole] - keys_s(timed, w, whole)
    # a fused kernel streams its keys inside its tiles: nothing to charge
    described = DescribedProfile(load_description("h100-sxm-8"))
    assert described.key_preparation_s(w, 2, 1e9, 1e9, 1e9) == 0.0
