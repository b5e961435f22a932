"""The published development set (benchmarks/published/): every case is a decision cptune can
express on a shipped description, and the scoring script reads it as published."""

import importlib.util
import sys
from pathlib import Path

import pytest

from cptune.feasibility import feasibility
from cptune.hardware import builtin_descriptions, load_description

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("published_prior", ROOT / "benchmarks" / "published_prior.py")
published_prior = importlib.util.module_from_spec(_spec)
sys.modules["published_prior"] = published_prior  # its dataclasses look their module up
_spec.loader.exec_module(published_prior)
CASES = [case for path in published_prior.DEFAULT_FILES for case in published_prior.load_cases(path)]


def test_the_development_set_has_the_usp_tables_of_both_machines():
    assert {case.hardware for case in CASES} >= {"a100-sxm-8", "l20-pcie-8"}
    assert len({case.id for case in CASES}) == len(CASES) >= 12


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_each_case_is_a_decision_between_feasible_configurations(case):
    assert case.hardware in builtin_descriptions()
    assert case.ranks <= load_description(case.hardware).max_ranks
    assert len(case.latency_ms) >= 2
    for u, latency in case.latency_ms.items():
        config = published_prior.config_for(case.ranks, u)
        assert config.ranks == case.ranks and config.head_group == u
        assert feasibility(case.workload, config) == []
        assert 0 < latency < 1e4  # milliseconds of one forward call


def test_throughput_becomes_latency_of_one_call():
    case = next(c for c in CASES if c.id == "l20-8k-h32-kv8-d128")
    assert case.latency_ms[2] == pytest.approx(1e3 / 454.93)
    assert case.workload.seq_len == 8192 and case.workload.kv_heads == 8 and case.workload.causal


def test_rules_pick_their_degree_and_regret_is_relative_to_the_published_best():
    result = published_prior.score(CASES[:1])
    row = result["cases"][0]
    assert row["picks"]["always-ring"] == 1 and row["picks"]["always-usp-2"] == 2
    assert row["picks"]["always-ulysses"] == max(CASES[0].latency_ms)
    best = min(CASES[0].latency_ms.values())
    for rule, regret in row["regret"].items():
        assert regret == pytest.approx(CASES[0].latency_ms[row["picks"][rule]] / best)
        assert regret >= 1.0


def test_confidence_counts_each_case_once_as_clear_or_tied_with_recommends_ties():
    """The confidence score sees what recommend would say: a case's pick is tied exactly with
    the published configurations ``prior_ties`` names, and every case is clear or tied."""
    from cptune.hardware import load_description
    from cptune.model import DescribedProfile, prior_ties

    structural = published_prior.structural_estimates(CASES)
    counts = published_prior.confidence(CASES, structural)
    total = counts["all"]
    assert total["cases"] == len(CASES) == total["clear"] + total["tied"]
    assert total["clear_right"] <= total["clear"] and total["tie_holds_best"] <= total["tied"]
    assert sum(c["cases"] for name, c in counts.items() if name != "all") == len(CASES)
    tied_cases = 0
    for case in CASES:
        chosen, _ = published_prior.picks(case)
        pick = published_prior.config_for(case.ranks, chosen["cptune"])
        others = [published_prior.config_for(case.ranks, u) for u in case.latency_ms if u != chosen["cptune"]]
        ties = prior_ties(case.workload, pick, others, DescribedProfile(load_description(case.hardware)),
                          structural=structural[case.hardware])
        tied_cases += bool(ties)
        assert {published_prior.ulysses_degree(t.other) for t in ties} <= set(case.latency_ms)
    assert tied_cases == total["tied"]


def test_the_structural_error_is_estimated_leaving_each_machine_out():
    """Each machine's estimate ignores its own cases; the shipped constant covers the estimate
    from every machine (issue 32: "estimated honestly - from leave-one-source-out residuals")."""
    from cptune.model import STRUCTURAL_ERROR

    estimates = published_prior.structural_estimates(CASES)
    machines = {case.hardware for case in CASES}
    assert set(estimates) == machines | {"all"}
    for machine in machines:
        assert estimates[machine] == published_prior.structural_estimate(
            [case for case in CASES if case.hardware != machine])
        assert estimates[machine] <= estimates["all"]
    assert estimates["all"] <= STRUCTURAL_ERROR < estimates["all"] + 0.01


def test_paths_rescore_only_the_cases_whose_gpus_a_cpu_joins_once_per_path():
    """``--paths`` names each of NCCL's paths for every case on a PCIe description (none on an
    NVLink one), and a named path is what ``recommend --nccl-path`` would pick."""
    from cptune.hardware import NCCL_PATHS

    structural = published_prior.structural_estimates(CASES)
    rows = published_prior.by_path(CASES, structural)
    pcie = [case for case in CASES if load_description(case.hardware).path_figures]
    assert pcie and len(pcie) < len(CASES)
    assert [(row["id"], row["path"]) for row in rows] == [(c.id, p) for c in pcie for p in NCCL_PATHS]
    for row, case in zip(rows, [c for c in pcie for _ in NCCL_PATHS], strict=True):
        assert row["pick"] == published_prior.picks(case, path=row["path"])[0]["cptune"]
        assert row["pick"] in row["tied"] and row["regret"] >= 1.0
        assert row["holds_best"] == (row["best"] in row["tied"])
    # the path moves some pick: it is a figure the prior reads
    assert any(len({row["pick"] for row in rows if row["id"] == case.id}) == 2 for case in pcie)


_train_spec = importlib.util.spec_from_file_location("published_train",
                                                   ROOT / "benchmarks" / "published_train.py")
published_train = importlib.util.module_from_spec(_train_spec)
sys.modules["published_train"] = published_train
_train_spec.loader.exec_module(published_train)
TRAIN_CASES = [case for path in published_train.DEFAULT_FILES for case in published_train.load_cases(path)]


def test_the_training_development_set_is_21_feasible_training_decisions():
    assert len(TRAIN_CASES) == len({case.id for case in TRAIN_CASES}) == 21
    for case in TRAIN_CASES:
        assert case.workload.training and case.hardware == "h100-sxm-8" and len(case.latency_ms) >= 2
        for strategy in case.latency_ms:
            assert feasibility(case.workload, case.config(strategy)) == []
    full = [case for case in TRAIN_CASES if not case.workload.causal]
    assert {case.shape for case in full} == {"cp_thd_1"}


def test_the_training_structural_error_covers_its_estimate_and_its_clear_picks_are_right():
    """``STRUCTURAL_ERROR_TRAIN`` is the training set's estimate (rounded up), and with it every
    pick the prior calls clearly is within 3% of the published best."""
    from cptune.model import STRUCTURAL_ERROR_TRAIN

    estimate = published_train.structural_estimate(TRAIN_CASES)
    assert estimate <= STRUCTURAL_ERROR_TRAIN < estimate + 0.01
    result = published_train.score(TRAIN_CASES)
    assert all(row["right"] for row in result["cases"] if row["clear"])
    assert result["summary"]["clear"] >= 1
