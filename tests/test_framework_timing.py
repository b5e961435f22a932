"""A framework's own attention timed by the torch engine (``time_framework``): what each
implementation can run is refused before any rank starts, and its runs are checked against
the reference and stored named and excluded, beside cptune's own rows, which name none."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import assert_refused
from cptune.config import CPConfig
from cptune.engines.torch import IMPLEMENTATIONS, TIMED_FRAMEWORKS, TorchEngine, framework_configs
from cptune.engines.torch._implementations import refusal
from cptune.search import FrameworkTimingError, time_framework
from cptune.store import Store
from cptune.workload import Workload

WORKLOAD = Workload(seq_len=64, heads=4, head_dim=16, dtype="fp32", causal=True)
GQA = Workload(seq_len=64, heads=4, kv_heads=2, head_dim=16)
WINDOW = Workload(seq_len=64, heads=4, head_dim=16, window=(8, 0))


def test_each_framework_timed_names_an_implementation_and_the_rings_it_runs():
    assert set(TIMED_FRAMEWORKS.values()) <= set(IMPLEMENTATIONS)
    assert TIMED_FRAMEWORKS["xdit"] == TIMED_FRAMEWORKS["sglang"] == "torch_ring"
    assert framework_configs("torch_ring", WORKLOAD, 4) == [CPConfig("ring", 4, 1, "contiguous")]
    if importlib.util.find_spec("yunchang") is not None:
        assert framework_configs("yunchang", WORKLOAD, 4) == [CPConfig("ring", 4, 1, "contiguous"),
                                                              CPConfig("ring", 4, 2, "contiguous")]


@pytest.mark.parametrize(("config", "workload", "said"), [
    (CPConfig("ring", 4, 2, "contiguous"), WORKLOAD, "ring alone"),
    (CPConfig("allgather_kv", 2), WORKLOAD, "runs a ring"),
    (CPConfig("ring", 2, 1, "zigzag"), WORKLOAD, "contiguous"),
    (CPConfig("ring", 2), WORKLOAD, "contiguous"),  # a causal ring's default layout is zigzag
    (CPConfig("ring", 2, 1, "contiguous"), GQA, "K/V heads"),
    (CPConfig("ring", 2, 1, "contiguous"), WINDOW, "mask"),
])
def test_what_an_implementation_cannot_run_is_refused_with_its_reason(config, workload, said):
    assert said in (refusal("torch_ring", workload, config) or "")


def test_a_framework_not_timed_and_another_engine_are_refused_before_anything_runs():
    with pytest.raises(FrameworkTimingError, match="read and priced"):
        time_framework("diffusers", WORKLOAD, 2, keep=False)
    with pytest.raises(FrameworkTimingError, match="--backend torch"):
        time_framework("xdit", WORKLOAD, 2, backend="mpi", keep=False)


@pytest.mark.parametrize(("flags", "said"), [
    (["--for", "diffusers", "--ranks", "2"], "read and priced"),
    (["--for", "xdit"], "--ranks N"),
    (["--ranks", "2"], "--for FRAMEWORK"),
])
def test_the_command_refuses_what_it_cannot_time_in_one_line(cptune_here, tmp_path, flags, said):
    shape = ["--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--backend", "torch"]
    db = f"sqlite:///{tmp_path / 'x.db'}"
    result = cptune_here("search", "--time-framework", "--db", db, *shape, *flags)
    assert_refused(result, said)
    assert not (tmp_path / "x.db").exists()


@pytest.mark.slow
def test_framework_runs_are_checked_and_stored_named_and_excluded(tmp_path):
    pytest.importorskip("torch")
    db = f"sqlite:///{tmp_path / 'fw.db'}"
    frameworks = ["xdit", *(["yunchang"] if importlib.util.find_spec("yunchang") else [])]
    for framework in frameworks:
        timed = time_framework(framework, WORKLOAD, 2, db, warmup=0, repeats=2, seed=0)
        assert {t.implementation for t in timed} == {None, TIMED_FRAMEWORKS[framework]}
        for t in timed:
            assert t.result.max_error <= TorchEngine.tolerance["fp32"]  # a Measurement: checked first
    with Store(db) as store:
        rows = store.results()
    theirs = [r for r in rows if r.facts.get("implementation")]
    assert sorted(r.facts["implementation"].split()[0] for r in theirs) == sorted(
        TIMED_FRAMEWORKS[f] for f in frameworks)
    assert all(r.excluded and r.config == CPConfig("ring", 2, 1, "contiguous") for r in theirs)
    assert all(r.facts["implementation"] in r.ran_with for r in theirs)  # what `cptune results` shows
    own = [r for r in rows if r not in theirs]
    assert own and not any(r.excluded for r in own)
