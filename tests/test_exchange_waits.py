"""What a blocking exchange costs beside computing ranks on shared cores: the calibration record,
how calibrate builds it from its timings, and how the prior charges it (no MPI)."""

import dataclasses
import json

import numpy as np
import pytest

from conftest import StandInCalibrationEngine, make_calibration
from cptune.calibration import Calibration, ExchangeWait
from cptune.calibration import _calibrate as calibrate_module
from cptune.config import CPConfig
from cptune.hardware import Hardware, load_description
from cptune.model import CalibratedProfile, DescribedProfile, prior_time
from cptune.workload import Workload

HOST = Hardware(host="waits-test", cpu_model="test cpu", cpu_count=2, gpu_model=None, gpu_count=0,
                interconnect="shared memory (one host)", mpi_library="MPICH 5")
W = Workload(seq_len=2048, heads=8, head_dim=64, causal=True)
#: What one exchange costs beside computing ranks: 4 ranks sharing their cores 3 ms in groups
#: of 2, 4 ms in groups of 4; 3 ranks 2 ms.
WAITS = tuple(ExchangeWait(ranks=ranks, group=group, seconds=seconds)
              for ranks, group, seconds in ((3, 2, 2e-3), (4, 2, 3e-3), (4, 4, 4e-3)))


def with_waits(waits=WAITS) -> Calibration:
    return dataclasses.replace(make_calibration(max_ranks=4), waits=waits)


def test_a_wait_is_read_at_the_nearest_group_and_the_timed_count_at_or_below_the_ranks():
    calibration = with_waits()
    assert calibration.exchange_wait(4, 2) == 3e-3
    assert calibration.exchange_wait(4, 3) == 3e-3  # 2 and 4 are as near: the fewer
    assert calibration.exchange_wait(4, 4) == 4e-3
    assert calibration.exchange_wait(3, 3) == 2e-3  # 3's only group
    assert calibration.exchange_wait(8, 4) == 4e-3  # beyond the counts timed: the most
    assert calibration.exchange_wait(2, 2) == 0.0  # 2 ranks were not timed: they had cores of their own
    assert make_calibration(max_ranks=4).exchange_wait(4, 2) == 0.0  # none timed
    # a wait timed within noise of none (below it) is none, never a saving
    assert with_waits((ExchangeWait(ranks=4, group=2, seconds=-1e-4),)).exchange_wait(4, 2) == 0.0


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


@pytest.mark.parametrize(("config", "wait", "exchanges"), [
    (CPConfig("allgather_kv", 2), 3e-3, 1),  # the gather, after the previous compute
    (CPConfig("allgather_kv", 4), 4e-3, 1),
    (CPConfig("ulysses", 4), 4e-3, 1),  # the output's; the first follows the last sequence's last exchange
    (CPConfig("allgather_kv", 4, head_group=2), 4e-3, 1),  # Ulysses x AllGather-KV: the gather follows one
    (CPConfig("ring", 4, head_group=2), 4e-3, 2),  # Ulysses x Ring: the output's and the one step
    (CPConfig("ring", 4), 4e-3, 3),  # each step, after its block
    (CPConfig("ring", 2), 3e-3, 1),
])
def test_beside_busy_ranks_each_exchange_after_compute_costs_the_timed_wait(config, wait, exchanges):
    plain = CalibratedProfile(HOST, make_calibration(max_ranks=4)).beside(4)
    busy = CalibratedProfile(HOST, with_waits()).beside(4)
    with_wait, without = prior_time(W, config, busy), prior_time(W, config, plain)
    assert with_wait.wait_s == pytest.approx(exchanges * wait)
    assert with_wait.total_s == pytest.approx(without.total_s + exchanges * wait)
    assert with_wait.comm_s == pytest.approx(without.comm_s + exchanges * wait)
    assert with_wait.compute_s == without.compute_s


def test_one_rank_and_a_group_alone_on_ranks_with_cores_of_their_own_wait_for_none():
    busy = CalibratedProfile(HOST, with_waits()).beside(4)
    assert prior_time(W, CPConfig("allgather_kv", 1), busy).wait_s == 0.0
    alone = CalibratedProfile(HOST, with_waits())  # 2 ranks alone: a count calibration did not time
    assert prior_time(W, CPConfig("allgather_kv", 2), alone).wait_s == 0.0
    assert prior_time(W, CPConfig("allgather_kv", 2), alone.beside(3)).wait_s == 2e-3


def test_a_training_steps_backward_waits_as_its_forward_does():
    busy = CalibratedProfile(HOST, with_waits()).beside(4)
    trained = prior_time(dataclasses.replace(W, mode="train"), CPConfig("allgather_kv", 2), busy)
    assert trained.wait_s == pytest.approx(2 * 3e-3)


def test_a_described_gpu_waits_for_none():
    h100 = DescribedProfile(load_description("h100-sxm-8"))
    assert prior_time(W, CPConfig("allgather_kv", 8), h100).wait_s == 0.0


def test_calibrate_times_waits_only_where_ranks_outnumber_the_cores_and_reads_each_group(monkeypatch):
    """On 4 ranks of a 2-core host the waits of 3 and 4 ranks are timed, in every group size;
    each is the time inside an exchange beside computing ranks less with them idle."""
    monkeypatch.setattr(calibrate_module, "oversubscribed", lambda ranks, per_node=None: ranks > 2)
    engine = WaitingEngine()
    calibration = calibrate_module.calibrate(4, backend=engine, guard=False, rounds=1, repeats=2)
    assert engine.timed == [(3, [2, 3]), (4, [2, 3, 4])]
    assert [(w.ranks, w.group) for w in calibration.waits] == [(3, 2), (3, 3), (4, 2), (4, 3), (4, 4)]
    for wait in calibration.waits:
        assert wait.seconds == pytest.approx(WaitingEngine.wait(wait.ranks, wait.group))
    monkeypatch.setattr(calibrate_module, "oversubscribed", lambda ranks, per_node=None: False)
    unshared = calibrate_module.calibrate(4, backend=WaitingEngine(), guard=False, rounds=1, repeats=2)
    assert unshared.waits == ()


class WaitingEngine(StandInCalibrationEngine):
    """An in-process stand-in for calibrate: attention 1 ms a call, collectives 1 ms plus 1 ns
    per byte, and ``time_waits``'s cases as a host whose exchanges cost ``wait`` more beside
    computing ranks than the 0.2 ms they take with them idle."""

    spec = dataclasses.replace(StandInCalibrationEngine.spec, times_waits=True)
    EXCHANGE = 2e-4

    def __init__(self) -> None:
        self.timed: list[tuple[int, list[int]]] = []

    @staticmethod
    def wait(ranks: int, group: int) -> float:
        return 1e-3 * ranks + 1e-4 * group

    def time_attention(self, ranks, shapes, warmup, repeats, timeout):
        return np.full((len(shapes), repeats), 1e-3)

    def time_waits(self, ranks, groups, shape, calls, chunk, warmup, repeats, timeout):
        assert shape == calibrate_module.WAIT_SHAPE
        self.timed.append((ranks, list(groups)))
        inside = [x for g in groups for x in (self.EXCHANGE + self.wait(ranks, g), self.EXCHANGE)]
        return np.repeat(np.array(inside)[:, None], repeats, axis=1)


@pytest.mark.slow
def test_the_mpi_ranks_time_each_group_inside_its_exchanges_beside_the_others_and_with_them_idle():
    """The engine's op on 3 real ranks (oversubscribed on a 2-core host; no timing asserted):
    one row per group size and case, a time inside the exchanges on a member (the slowest
    rank's), never negative."""
    from cptune.engines.mpi import MPIEngine

    engine = MPIEngine()
    try:
        seconds = engine.time_waits(3, [2, 3], calibrate_module.WAIT_SHAPE, 2, 1024, 0, 2, 120.0)
    finally:
        engine.close()
    assert seconds.shape == (4, 2)
    assert (seconds > 0).all()  # a member of every group was inside an exchange in every iteration
    waits = calibrate_module._exchange_waits(3, seconds[:, 0])
    assert [(w.ranks, w.group) for w in waits] == [(3, 2), (3, 3)]
