"""Every strategy and hybrid, on real ranks, against the float64 reference."""

import numpy as np
import pytest

import cptune
from conftest import EVERY_CONFIG, reference_cases
from cptune import CPConfig, Workload
from cptune.reference import TOLERANCE, make_inputs, reference_attention, relative_error

WORKLOADS = {
    # odd sequence lengths need padding at 2, 3 and 4 ranks; 12 heads split 1..4 ways
    "mha": dict(seq_len=37, heads=12, head_dim=16, dtype="fp32"),
    "gqa-8q2kv": dict(seq_len=64, heads=8, head_dim=24, kv_heads=2, batch=2, dtype="fp32"),
    "mqa": dict(seq_len=50, heads=6, head_dim=8, kv_heads=1, dtype="fp32"),
    "gqa-bf16": dict(seq_len=45, heads=4, head_dim=32, kv_heads=2, dtype="bf16"),
}

CONFIGS = EVERY_CONFIG


@pytest.fixture(scope="module")
def cases():
    return reference_cases(WORKLOADS)


def every_case():
    """(name, causal, config) for each workload, mask and configuration; those that run (a
    feasible pair starts MPI ranks) are slow, the refusals are not."""
    for name in WORKLOADS:
        for causal, mask in ((False, "full"), (True, "causal")):
            workload = Workload(**WORKLOADS[name], causal=causal)
            for config in CONFIGS:
                yield pytest.param(name, causal, config, id=f"{name}-{mask}-{config.label}-{config.ranks}r",
                                   marks=() if cptune.feasibility(workload, config) else pytest.mark.slow)


@pytest.mark.parametrize(("name", "causal", "config"), list(every_case()))
def test_compute_matches_reference(cases, name, causal, config, monkeypatch):
    workload, (q, k, v), reference = cases(name, causal)
    reasons = cptune.feasibility(workload, config)
    if reasons:
        # An infeasible pair is refused before any process starts.
        monkeypatch.setattr("cptune.execute.get_engine", lambda backend: pytest.fail("engine started"))
        with pytest.raises(cptune.InfeasibleConfigError) as refused:
            cptune.compute(workload, config, q, k, v)
        assert refused.value.reasons == reasons
        return
    out = cptune.compute(workload, config, q, k, v)
    assert out.shape == reference.shape and out.dtype == np.float32
    assert relative_error(out, reference) <= TOLERANCE[workload.dtype]


def test_every_workload_has_runnable_hybrids():
    """The matrix above exercises Ulysses x Ring and Ulysses x AllGather-KV, with KV heads
    replicated, for every workload kind (so no case silently only hits the refusal path)."""
    for spec in WORKLOADS.values():
        workload = Workload(**spec)
        runnable = [c for c in CONFIGS if not cptune.feasibility(workload, c)]
        assert any(c.strategy == "ring" and 1 < c.head_group < c.ranks for c in runnable)
        assert any(c.strategy == "allgather_kv" and 1 < c.head_group < c.ranks for c in runnable)
    mqa = Workload(**WORKLOADS["mqa"])
    assert cptune.analytic_cost(mqa, CPConfig("ulysses", 3)).kv_replication == 3


def test_wrong_shapes_are_refused():
    workload = Workload(seq_len=16, heads=4, head_dim=8, kv_heads=2)
    q, k, v = make_inputs(workload)
    with pytest.raises(ValueError, match=r"k has shape .* kv_heads"):
        cptune.compute(workload, CPConfig("ring", 2), q, q, v)


@pytest.mark.slow
def test_long_causal_sequence_spanning_row_blocks():
    """A longer causal sequence where zigzag blocks span several query row blocks."""
    workload = Workload(seq_len=1100, heads=4, head_dim=16, kv_heads=2, dtype="fp32", causal=True)
    q, k, v = make_inputs(workload, seed=7)
    reference = reference_attention(workload, q, k, v)
    for config in (CPConfig("ring", 4), CPConfig("allgather_kv", 3), CPConfig("ring", 4, 2)):
        out = cptune.compute(workload, config, q, k, v)
        assert relative_error(out, reference) <= TOLERANCE["fp32"], config
