"""What a blocking exchange waits between ranks that compute on shared cores: the calibration
record, how calibrate builds it from its timings, and how the prior charges it (no MPI)."""

import dataclasses
import json

import numpy as np
import pytest

from conftest import make_calibration
from cptune.calibration import Calibration, ExchangeWait
from cptune.calibration import _calibrate as calibrate_module
from cptune.config import CPConfig
from cptune.cost import STREAM_KINDS
from cptune.engines import ENGINES
from cptune.hardware import Hardware, load_description
from cptune.model import CalibratedProfile, DescribedProfile, prior_time
from cptune.workload import Workload

HOST = Hardware(host="waits-test", cpu_model="test cpu", cpu_count=2, gpu_model=None, gpu_count=0,
                interconnect="shared memory (one host)", mpi_library="MPICH 5")
W = Workload(seq_len=2048, heads=8, head_dim=64, causal=True)
#: Waits of 4 ranks sharing their cores: 1 ms + 0.1 s per compute second in groups of 2, twice
#: that in groups of 4; 3 ranks: half of 4's.
WAITS = tuple(
    ExchangeWait(ranks=ranks, group=group, compute_s=(0.01, 0.05),
                 wait_s=(fixed + share * 0.01, fixed + share * 0.05))
    for ranks, group, fixed, share in ((3, 2, 0.5e-3, 0.05), (4, 2, 1e-3, 0.1), (4, 4, 2e-3, 0.2))
)


def with_waits(waits=WAITS) -> Calibration:
    return dataclasses.replace(make_calibration(max_ranks=4), waits=waits)


def test_a_wait_reads_along_the_line_through_its_points_and_never_below_zero():
    wait = WAITS[1]
    assert wait.seconds(0.03) == pytest.approx(1e-3 + 0.1 * 0.03)
    assert wait.seconds(0.2) == pytest.approx(1e-3 + 0.1 * 0.2)  # beyond the points, the same line
    # noise took the longer point below zero: the line stays non-negative everywhere
    noisy = ExchangeWait(ranks=4, group=2, compute_s=(0.01, 0.05), wait_s=(2e-3, -1e-4))
    assert all(noisy.seconds(c) >= 0 for c in (0.0, 0.01, 0.05, 1.0))


def test_a_wait_is_read_at_the_nearest_group_and_the_timed_count_at_or_below_the_ranks():
    calibration = with_waits()
    assert calibration.exchange_wait(4, 2, 0.02) == pytest.approx(WAITS[1].seconds(0.02))
    assert calibration.exchange_wait(4, 3, 0.02) == pytest.approx(WAITS[1].seconds(0.02))  # 2 and 4: fewer
    assert calibration.exchange_wait(4, 4, 0.02) == pytest.approx(WAITS[2].seconds(0.02))
    assert calibration.exchange_wait(3, 3, 0.02) == pytest.approx(WAITS[0].seconds(0.02))  # 3's only group
    assert calibration.exchange_wait(8, 4, 0.02) == pytest.approx(WAITS[2].seconds(0.02))  # beyond: the most
    assert calibration.exchange_wait(2, 2, 0.02) == 0.0  # 2 ranks were not timed: they had cores of their own
    assert make_calibration(max_ranks=4).exchange_wait(4, 2, 0.02) == 0.0  # none timed


def test_waits_round_trip_and_a_calibration_stored_before_them_loads_and_prices_as_before():
    calibration = with_waits()
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))) == calibration
    old = make_calibration(max_ranks=4).to_dict()
    del old["waits"]  # as stored before waits were timed
    loaded = Calibration.from_dict(old)
    assert loaded.waits == ()
    for config in (CPConfig("allgather_kv", 2), CPConfig("ring", 4), CPConfig("ulysses", 4)):
        busy = CalibratedProfile(HOST, loaded).beside(4)
        before = CalibratedProfile(HOST, make_calibration(max_ranks=4)).beside(4)
        assert prior_time(W, config, busy) == prior_time(W, config, before)
        assert prior_time(W, config, busy).wait_s == 0.0


def test_beside_busy_ranks_each_stretch_of_compute_that_ends_at_an_exchange_waits_once():
    """AllGather-KV and Ulysses: one wait after the whole compute; the Ring on c ranks: c
    waits, each after a block's compute; one rank: none. The rest of the prior is unchanged."""
    plain = CalibratedProfile(HOST, make_calibration(max_ranks=4)).beside(4)
    busy = CalibratedProfile(HOST, with_waits()).beside(4)
    for config, group_wait, stretches in ((CPConfig("allgather_kv", 2), WAITS[1], 1),
                                          (CPConfig("ulysses", 4), WAITS[2], 1),
                                          (CPConfig("ring", 4), WAITS[2], 4),
                                          (CPConfig("ring", 2), WAITS[1], 2)):
        with_wait, without = prior_time(W, config, busy), prior_time(W, config, plain)
        expected = stretches * group_wait.seconds(with_wait.compute_s / stretches)
        assert with_wait.wait_s == pytest.approx(expected)
        assert with_wait.total_s == pytest.approx(without.total_s + expected)
        assert with_wait.comm_s == pytest.approx(without.comm_s + expected)
    assert prior_time(W, CPConfig("allgather_kv", 1), busy).wait_s == 0.0


def test_a_group_alone_on_ranks_with_cores_of_their_own_waits_for_none():
    alone = CalibratedProfile(HOST, with_waits())  # 2 ranks alone: a count calibration did not time
    assert prior_time(W, CPConfig("allgather_kv", 2), alone).wait_s == 0.0
    assert prior_time(W, CPConfig("allgather_kv", 2), alone.beside(3)).wait_s > 0.0


def test_a_training_steps_backward_waits_after_its_own_compute_too():
    busy = CalibratedProfile(HOST, with_waits()).beside(4)
    trained = prior_time(dataclasses.replace(W, mode="train"), CPConfig("allgather_kv", 2), busy)
    forward = prior_time(W, CPConfig("allgather_kv", 2), busy)
    backward_compute = trained.compute_s - forward.compute_s
    assert trained.wait_s == pytest.approx(forward.wait_s + WAITS[1].seconds(backward_compute))


def test_a_described_gpu_waits_for_none():
    h100 = DescribedProfile(load_description("h100-sxm-8"))
    assert prior_time(W, CPConfig("allgather_kv", 8), h100).wait_s == 0.0


def test_calibrate_times_waits_only_where_ranks_outnumber_the_cores_and_reads_each_group(monkeypatch):
    """On 4 ranks of a 2-core host the waits of 3 and 4 ranks are timed, in every group size;
    each is what the kernel and the all-gather cost together beyond each alone, per call."""
    monkeypatch.setattr(calibrate_module, "oversubscribed", lambda ranks, per_node=None: ranks > 2)
    engine = WaitingEngine()
    calibration = calibrate_module.calibrate(4, backend=engine, guard=False, rounds=1, repeats=2)
    assert engine.timed == [(3, [2, 3]), (4, [2, 3, 4])]
    assert [(w.ranks, w.group) for w in calibration.waits] == [(3, 2), (3, 3), (4, 2), (4, 3), (4, 4)]
    for wait in calibration.waits:
        assert wait.compute_s == pytest.approx(WaitingEngine.COMPUTE)
        assert wait.wait_s == pytest.approx([WaitingEngine.wait(wait.ranks, wait.group, c)
                                             for c in WaitingEngine.COMPUTE])
    monkeypatch.setattr(calibrate_module, "oversubscribed", lambda ranks, per_node=None: False)
    unshared = calibrate_module.calibrate(4, backend=WaitingEngine(), guard=False, rounds=1, repeats=2)
    assert unshared.waits == ()


class WaitingEngine:
    """An in-process stand-in for calibrate: attention 1 ms a call, collectives 1 ms plus 1 ns
    per byte, and ``time_waits``'s cases as a host whose exchanges wait ``wait`` after each
    compute."""

    name, spec = "mpi", dataclasses.replace(ENGINES["mpi"], times_steps=False)
    COMPUTE = (0.004, 0.05)
    EXCHANGE = 2e-4

    def __init__(self) -> None:
        self.timed: list[tuple[int, list[int]]] = []

    @staticmethod
    def wait(ranks: int, group: int, compute: float) -> float:
        return 1e-4 * ranks * group + 0.1 * compute

    def time_attention(self, ranks, shapes, warmup, repeats, timeout):
        return np.full((len(shapes), repeats), 1e-3)

    def time_collective(self, kind, ranks, group, chunks, warmup, repeats, timeout, along="heads"):
        return np.array([[1e-3 + 1e-9 * chunk * (1 if kind in STREAM_KINDS else group - 1)] * repeats
                         for chunk in chunks])

    def time_waits(self, ranks, groups, shapes, calls, chunk, warmup, repeats, timeout):
        assert list(shapes) == list(calibrate_module.WAIT_SHAPES)
        self.timed.append((ranks, list(groups)))
        per_call = list(self.COMPUTE)
        for g in groups:
            per_call += [c + self.wait(ranks, g, c) + self.EXCHANGE for c in self.COMPUTE] + [self.EXCHANGE]
        return np.repeat(np.array(per_call)[:, None] * calls, repeats, axis=1)

    def describe(self):
        return {"engine": self.name}

    def node_readings(self):
        return {}

    def process_ids(self):
        return []
