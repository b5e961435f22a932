"""A batch plan on real mpi ranks (``cptune.execute.measure_batch``, ``cptune measure
--lengths``): its groups side by side on blocks of ranks, every sequence checked against the
float64 reference before the makespan is timed; a wrong output never timed; bad input refused
in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import assert_refused, make_calibration
from cptune.config import CPConfig
from cptune.engines.mpi import MPIEngine
from cptune.errors import EngineError
from cptune.execute import measure_batch
from cptune.hardware import this_host
from cptune.mixes import BatchPlan, Group
from cptune.reference import TOLERANCE
from cptune.store import Store
from cptune.workload import AttentionShape

SHAPE = AttentionShape(4, 2, 16, 1, "bf16", True)
LENGTHS = (256, 96, 160, 64)
#: Two groups of different sizes and strategies, and an idle rank (4 ranks on this host's 2
#: cores: oversubscribed, as the check of who runs what needs no clean timing).
PLAN = BatchPlan(LENGTHS, 4, (Group(CPConfig("ring", 2), (0, 3), 2.0),
                              Group(CPConfig("allgather_kv", 1), (1, 2), 1.5)), 2.0, "fast")


@pytest.fixture(scope="module")
def engine():
    made = MPIEngine()
    yield made
    made.close()


@pytest.mark.slow
def test_every_group_runs_checked_and_the_makespan_is_its_slowest(engine):
    m = measure_batch(PLAN, SHAPE, engine, warmup=1, repeats=3, oversubscribe=True)
    assert len(m.samples_ms) == 3 and len(m.group_ms) == 2 and all(t > 0 for t in m.group_ms)
    assert max(m.group_ms) <= max(m.samples_ms) * (1 + 1e-9)  # the makespan covers every group
    assert 0 < m.max_error <= TOLERANCE["bf16"] and m.oversubscribed
    trained = measure_batch(PLAN, AttentionShape(4, 2, 16, 1, "bf16", True, mode="train"), engine,
                            warmup=0, repeats=1, oversubscribe=True)
    assert 0 < trained.max_error <= TOLERANCE["bf16"]  # the gradients checked beside the output
    again = measure_batch(BatchPlan(LENGTHS, 4, (Group(CPConfig("ulysses", 2), (0, 1, 2, 3), 3.0),), 3.0,
                                    "one group"), SHAPE, engine, warmup=0, repeats=1, oversubscribe=True)
    assert again.group_ms[0] > 0  # another cut of the same ranks on the same pool
    json.dumps(m.to_dict())


@pytest.mark.slow
def test_a_wrong_output_is_never_timed(engine, monkeypatch):
    monkeypatch.setattr(engine, "tolerance", {"bf16": 0.0})
    with pytest.raises(EngineError, match="wrong result for sequence 1 of the batch") as caught:
        measure_batch(PLAN, SHAPE, engine, warmup=0, repeats=1, oversubscribe=True)
    assert caught.value.kind == "wrong_output"


@pytest.mark.parametrize(("groups", "says"), [
    ((*PLAN.groups, Group(CPConfig("ring", 2), (), 1.0)), "need 5 ranks, but it is for 4"),
    ((PLAN.groups[0],), "run sequences [0, 3], not each of its 4 once"),
])
def test_a_plan_no_ranks_can_run_is_refused_before_any_starts(groups, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        measure_batch(BatchPlan(LENGTHS, 4, groups, 2.0, "fast"), SHAPE, "mpi", oversubscribe=True)


def test_more_ranks_than_cores_are_refused_without_oversubscribe():
    with pytest.raises(Exception, match="--oversubscribe"):
        measure_batch(BatchPlan(LENGTHS, 64, PLAN.groups, 2.0, "fast"), SHAPE, "mpi")


@pytest.mark.slow
def test_measure_lengths_prints_measured_beside_predicted(tmp_path: Path, cptune_here):
    db = str(tmp_path / "host.db")
    with Store(db) as store:
        store.add_calibration(this_host(), make_calibration())
    batch = tmp_path / "batch.txt"
    batch.write_text("256\n96\n160\n64\n")
    result = cptune_here("measure", "--lengths", batch, "--ranks", "2", "--heads", "4", "--kv-heads", "2",
                         "--head-dim", "16", "--causal", "--warmup", "0", "--repeats", "2", "--db", db,
                         "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["predicted_ms"] == shown["plan"]["makespan_ms"] > 0 and shown["measured_ms"] > 0
    assert sorted(s for g in shown["plan"]["groups"] for s in g["sequences"]) == [0, 1, 2, 3]
    assert len(shown["group_ms"]) == len(shown["plan"]["groups"])


@pytest.mark.parametrize(("extra", "says"), [
    (["--ranks", "2,4"], "give --ranks N (one count)"),
    ([], "give --ranks N"),
    (["--ranks", "2", "--strategies", "ring"], "leave out --strategies"),
])
def test_bad_batch_flags_are_refused_in_one_line(tmp_path: Path, cptune_here, extra, says):
    batch = tmp_path / "batch.txt"
    batch.write_text("256\n96\n")
    assert_refused(cptune_here("measure", "--lengths", batch, *extra), says)
    assert list(tmp_path.iterdir()) == [batch]  # nothing written


def test_a_bad_lengths_file_is_refused_in_one_line(tmp_path: Path, cptune_here):
    batch = tmp_path / "batch.txt"
    batch.write_text("256\n0\n")
    assert_refused(cptune_here("measure", "--lengths", batch, "--ranks", "2"), "length 0")
    assert list(tmp_path.iterdir()) == [batch]
