"""benchmarks/gpu_check.py, gpu_attention_calls.py and far_edge.py: gpu_check's plan at full
size, the per-call fit, and smoke runs on the CPU at tiny shapes (the ratios there say nothing
about a GPU; they only have to be numbers)."""

from __future__ import annotations

import math

import pytest

from conftest import load_benchmark
from cptune.layout import kv_replication

pytest.importorskip("torch")


gpu_check = load_benchmark("gpu_check")


@pytest.mark.parametrize("description", ["h100-sxm-8", "h200-sxm-8"])
def test_the_plan_covers_the_per_rank_shapes_the_issue_names(description):
    cases = gpu_check.cases(description, gpu_check.PER_RANK)
    assert {tokens for tokens, _, _ in cases} == {1024, 4096, 16384, 65536}
    assert {w.head_dim for _, w, _ in cases} == {64, 128} and {w.causal for _, w, _ in cases} == {False, True}
    assert all(config.ranks == 8 and w.seq_len == 8 * tokens for tokens, w, config in cases)
    # every strategy and hybrid of 8 ranks, GQA among them, and one that replicates KV heads
    assert {config.label for _, _, config in cases} == {
        "allgather_kv", "ring", "ulysses", "ulysses2xring4", "ulysses4xring2",
        "ulysses2xallgather_kv4", "ulysses4xallgather_kv2"}
    assert any(w.kv_heads < w.heads and kv_replication(w, c.head_group) > 1 for _, w, c in cases)


@pytest.mark.slow
def test_the_smoke_run_checks_every_configuration_and_prints_finite_ratios(tmp_path, capsys):
    """--smoke on the CPU: the correctness run on 2 and 4 gloo ranks, the local work of the 42
    8-rank configurations against its ideal, and the probe section (the ratios say nothing)."""
    out = tmp_path / "gpu_check.txt"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert text == capsys.readouterr().out
    lines = text.splitlines()
    assert "device CPU" in lines[1] and "--out <file>" in lines[2] and str(tmp_path) not in text
    checked = [line for line in lines if line.endswith("  ok") or "WRONG" in line]
    assert len([line for line in checked if line.lstrip().startswith("2 ")]) == 18  # 3 strategies x 6
    assert len([line for line in checked if line.lstrip().startswith("4 ")]) == 30  # and 2 hybrids
    assert all(line.endswith("  ok") for line in checked) and "0 problem(s)" in lines
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("tokens/rank"))
    rows = lines[header + 1 : lines.index("", header)]
    assert len(rows) == 42
    for row in rows:
        assert math.isfinite(float(row.split()[-1])) and float(row.split()[-1]) > 0, row
    assert any(line.startswith("all") and len(line.split()) == 4 for line in lines)
    assert "none probed (only CUDA probes; the CPU runs flash_for_cpu)" in text
    assert lines[-1].startswith("elapsed") and "for 42 cases" in lines[-1]


attention_calls = load_benchmark("gpu_attention_calls")


def test_the_per_call_fit_recovers_a_known_floor_and_rate():
    points = [(flops, 30e-6 + flops / 600e12) for flops in (1e8, 1e9, 1e10, 1e11, 1e12)]
    floor, rate = attention_calls.fit(points)
    assert floor == pytest.approx(30e-6, rel=1e-6) and rate == pytest.approx(600e12, rel=1e-6)


def test_a_quick_cpu_run_of_the_attention_calls_writes_its_table(tmp_path):
    out = tmp_path / "calls.txt"
    assert attention_calls.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "sdpa" in text and "fixed costs:" in text and "floor us" in text


far_edge = load_benchmark("far_edge")


def test_the_far_edge_ab_times_both_ways_alike_and_writes_its_table(tmp_path, capsys):
    """A tiny run: the two window runs' outputs agree to bf16, and every case has its time."""
    out = tmp_path / "far_edge.txt"
    assert far_edge.main(["--seq-len", "512", "--window", "64", "--rounds", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out and "--out <file>" in text and str(tmp_path) not in text
    error = float(text.split("differ by at most ")[1].split()[0])
    assert error <= 2**-6  # a few bf16 ulps of outputs near 1
    rows = {line.split("  ")[0]: line for line in text.splitlines() if line.startswith(("plain", "window"))}
    assert set(rows) == {"plain", "window reversed", "window explicit"}
    assert text.splitlines()[-1].startswith("explicit / reversed: ")
