"""Issue 56's acceptance matrix (benchmarks/mask_matrix.py) in the suite: a slice of it on
the mpi and torch engines, every mask and configuration on 1-4 ranks once (a head group of 4
padding the 6 heads to 8), its layout, heads (MHA/GQA/MQA) and mode (forward, training) rotated
through; what cannot run asserted refused;
and a perturbed mask caught on each engine. The whole matrix runs from the script (its
result in benchmarks/results/)."""

from __future__ import annotations

import pytest

from conftest import load_benchmark
from cptune.feasibility import feasibility

matrix = load_benchmark("mask_matrix")


def test_the_slice_meets_every_mask_strategy_layout_heads_and_mode_and_some_refusals():
    cases = list(matrix.slice_matrix(("mpi",)))
    assert len(cases) == len(matrix.MASKS) * len(matrix.CONFIGS)
    for mask in matrix.MASKS:
        mine = [c for c in cases if c.mask == mask]
        assert {c.config.strategy for c in mine} == {"ring", "allgather_kv", "ulysses"}
        assert {c.kind for c in mine} == set(matrix.HEAD_KINDS)
        assert {c.mode for c in mine} == set(matrix.MODES)
        assert {c.config.ranks for c in mine} == {1, 2, 3, 4}
    seen = {c.config.layout or "default" for c in cases}
    assert seen >= {"contiguous", "zigzag", "striped", "doc_zigzag", "doc_whole", "replicated_text"}
    refused = [feasibility(c.workload, c.config)[0] for c in cases if feasibility(c.workload, c.config)]
    # 4 ranks do not divide 6 heads: padded to 8, run for MHA and MQA, refused for GQA's groups of 3
    padded = [c for c in cases if c.config.pad_heads]
    assert {c.kind for c in padded if not feasibility(c.workload, c.config)} == {"mha", "mqa"}
    assert any("pad_heads: 6 heads padded to 8 are not whole groups of 3" in r for r in refused)
    assert any("replicated_text" in r for r in refused)  # replicated text does not train yet
    every = list(matrix.full_matrix(("mpi",)))
    per_document = {c.config.layout for c in every if c.mask == "17-documents"}
    assert per_document >= {"contiguous", "striped", "doc_zigzag", "doc_whole"}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mpi", "torch"])
def test_a_slice_of_every_strategy_layout_and_mask_matches_the_reference(engine):
    if engine == "torch":
        pytest.importorskip("torch")
    failures, ran = [], 0
    for case in matrix.slice_matrix((engine,)):
        verdict, ratio = matrix.run(case)
        ran += verdict == "ran"
        if verdict == "ran" and ratio > 1:
            failures.append(f"{case.describe()}: {ratio:.2f}x the tolerance")
    assert not failures, failures
    assert ran >= 150


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mpi", "torch"])
def test_an_engine_running_a_perturbed_mask_fails_the_reference_check(engine):
    if engine == "torch":
        pytest.importorskip("torch")
    for case, other in matrix.perturbed_cases((engine,)):
        verdict, ratio = matrix.run(case, ran_as=other)
        assert verdict == "ran" and ratio > 10, (case.describe(), other.describe(), ratio)
        assert matrix.run(case)[1] <= 1, case.describe()
