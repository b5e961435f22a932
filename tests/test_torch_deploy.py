"""cptune.torch: a plan's layout round-trips through shard and unshard; the module refuses
what it cannot run with the fix; and a transformer block on 2 and 4 gloo ranks, every
configuration, equals the block unsharded (tests/torch_block.py, under torchrun)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the cptune[torch] extra; CI installs it

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from conftest import torchrun_lines, torchrun_summary  # noqa: E402
from cptune.config import CPConfig  # noqa: E402
from cptune.errors import InfeasibleConfigError  # noqa: E402
from cptune.feasibility import enumerate_configs  # noqa: E402
from cptune.layout import SequenceLayout  # noqa: E402
from cptune.plans import Bucket, Plan, PlanError, PlanHardware, PlanMismatchError  # noqa: E402
from cptune.plans._plan import launch_for  # noqa: E402
from cptune.torch import ContextParallelAttention, shard_sequence, unshard_sequence  # noqa: E402
from cptune.version import __version__  # noqa: E402
from cptune.workload import AttentionShape  # noqa: E402

TESTS = Path(__file__).parent
SHAPE = AttentionShape(heads=4, kv_heads=2, head_dim=8, batch=2, dtype="fp32", causal=True)
#: Relative error the sharded block may differ by from the unsharded one in float32.
TOLERANCE = 1e-4


def make_plan(shape: AttentionShape, buckets: list[tuple[int, CPConfig]], ranks: int) -> Plan:
    """A plan for ``shape``: ``buckets`` lists each bucket's last length and its config."""
    made, start = [], 1
    for stop, config in buckets:
        made.append(Bucket(min_seq_len=start, max_seq_len=stop, seq_len=stop, config=config, latency_ms=1.0,
                           interval_ms=(0.9, 1.1), source="model", measurement_ids=()))
        start = stop + 1
    hardware = PlanHardware(fingerprint="0123456789abcdef", description="a test host", kind="host", name=None)
    return Plan(hardware=hardware, shape=shape, buckets=tuple(made), launch=launch_for(ranks, ranks, False),
                cptune_version=__version__, created_at="2026-01-01T00:00:00+00:00")


def plan_for(world: int) -> Plan:
    """Local attention for short sequences, then configurations on 2 and on ``world`` ranks."""
    longest = CPConfig("ring", world, 2) if world > 2 else CPConfig("ulysses", 2)
    buckets = [(8, CPConfig("ring", 1)), (26, CPConfig("allgather_kv", 2)), (64, longest)]
    return make_plan(SHAPE, buckets, world)


def positions_tensor(seq_len: int) -> torch.Tensor:
    """[batch 2, seq_len, 1]: each token holds its position + 1 (so padding, 0, stands out)."""
    return (torch.arange(seq_len, dtype=torch.float32) + 1).expand(2, seq_len)[..., None].contiguous()


# --------------------------------------------------------------------------- the layout, no processes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_len", [5, 37, 64, 101])
def test_every_configuration_shards_as_the_layout_says_and_round_trips(seq_len, causal):
    workload = AttentionShape(4, 2, 8, 2, "fp32", causal).at(seq_len)
    x = positions_tensor(seq_len)
    configs = enumerate_configs(workload, 4)
    assert len(configs) >= 8  # every strategy, hybrids included, at each length
    for config in configs:
        layout = SequenceLayout(workload, config)
        shards = [shard_sequence(x, workload, config, r) for r in range(config.ranks)]
        for rank, shard in enumerate(shards):
            positions = layout.rank_positions(rank)
            expected = np.where(positions < seq_len, positions + 1, 0)  # padding rows are zeros
            np.testing.assert_array_equal(shard[0, :, 0].numpy(), expected, err_msg=config.label)
        assert torch.equal(unshard_sequence(shards, workload, config), x), config.label
        assert shard_sequence(x, workload, config, config.ranks).shape == (2, 0, 1)  # a rank not taking part


@pytest.mark.parametrize("world", [2, 4])
def test_a_plans_layout_round_trips_at_every_length(world):
    plan = plan_for(world)
    seen = set()
    for seq_len in range(1, plan.max_seq_len + 1):
        workload, config = SHAPE.at(seq_len), plan.select(seq_len)
        if config.ranks > seq_len:
            continue  # fewer tokens than ranks: the module refuses it (test_a_block_on_gloo_ranks...)
        x = torch.randn(2, seq_len, 4, 8)
        shards = [shard_sequence(x, workload, config, r) for r in range(config.ranks)]
        assert len({s.shape[1] for s in shards}) == 1  # every rank the same share
        assert torch.equal(unshard_sequence(shards, workload, config), x)
        seen.add(config)
    assert seen == {b.config for b in plan.buckets}


def test_shard_helpers_refuse_the_wrong_sequence_or_shard_count():
    workload, config = SHAPE.at(37), CPConfig("ring", 4)
    with pytest.raises(ValueError, match=r"x must be \[batch, 37, \.\.\.\]"):
        shard_sequence(torch.zeros(2, 36, 4, 8), workload, config, 0)
    shards = [shard_sequence(torch.zeros(2, 37, 4, 8), workload, config, r) for r in range(4)]
    with pytest.raises(ValueError, match="needs 4 shards, one per rank in rank order; got 3"):
        unshard_sequence(shards[:3], workload, config)
    with pytest.raises(ValueError, match=r"rank 1's shard must be \[batch, 10, \.\.\.\]"):
        unshard_sequence([shards[0], shards[1][:, :9], *shards[2:]], workload, config)


# --------------------------------------------------------------------------- the module on one rank


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-process gloo world in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def attention_inputs(seq_len: int, shape: AttentionShape = SHAPE) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seq_len)
    q = torch.randn(2, seq_len, shape.heads, shape.head_dim, generator=generator)
    k, v = torch.randn(2, 2, seq_len, shape.kv_heads, shape.head_dim, generator=generator)
    return q, k, v


def test_the_module_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group first"):
        ContextParallelAttention(CPConfig("ring", 1), SHAPE)


def test_on_one_rank_the_module_is_plain_attention_and_its_shard_the_whole_sequence(one_rank):
    cp = ContextParallelAttention(make_plan(SHAPE, [(64, CPConfig("ring", 1))], 1))
    q, k, v = attention_inputs(37)
    assert torch.equal(cp.shard(q), q) and torch.equal(cp.unshard(q, 37), q)
    assert torch.equal(cp.positions(37), torch.arange(37)) and cp.dtype == torch.float32
    with torch.no_grad():
        out = cp(q, k, v, 37)
    k, v = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True).transpose(1, 2)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_the_scale_reaches_the_kernel(one_rank):
    cp = ContextParallelAttention(CPConfig("ring", 1), SHAPE, scale=0.3)
    q, k, v = attention_inputs(37)
    with torch.no_grad():
        out = cp(q, k, v, 37)
    k, v = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=TOLERANCE, atol=TOLERANCE)
    assert out.is_contiguous()


def test_the_module_refuses_what_it_cannot_run_with_the_fix(one_rank):
    with pytest.raises(ValueError, match=r"needs 2 ranks, but the group has 1: start 2 ranks"):
        ContextParallelAttention(CPConfig("ring", 2), SHAPE)
    with pytest.raises(InfeasibleConfigError, match="Ulysses limit: 3 heads cannot be split"):
        ContextParallelAttention(CPConfig("ulysses", 2), AttentionShape(3, 3, 8, 2, "fp32", True))
    with pytest.raises(ValueError, match="with a CPConfig, name the attention shape"):
        ContextParallelAttention(CPConfig("ring", 1))
    plan = make_plan(SHAPE, [(64, CPConfig("ring", 1))], 1)
    with pytest.raises(PlanMismatchError, match="tuned for 4/2kv heads x d8.*not 4 heads x d8"):
        ContextParallelAttention(plan, AttentionShape(4, 4, 8, 2, "fp32", True))
    cp = ContextParallelAttention(plan, AttentionShape(4, 2, 8, 7, "fp32", True))  # another batch is fine
    q, k, v = attention_inputs(37)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"k must be \[2, 37, 2, 8\] .* got \[2, 36, 2, 8\]"):
            cp(q, k[:, :36], v, 37)
        with pytest.raises(ValueError, match=r"q must be \[2, 38, 4, 8\] .* got \[2, 37, 4, 8\]"):
            cp(q, k, v, 38)
        with pytest.raises(ValueError, match="q is torch.bfloat16 but the attention shape is fp32"):
            cp(q.bfloat16(), k, v, 37)
        with pytest.raises(PlanError, match="beyond this plan's longest bucket"):
            cp(q, k, v, 65)


# --------------------------------------------------------------------------- a block on gloo ranks


def run_ranks(world: int, plan: Path) -> dict:
    """tests/torch_block.py on ``world`` gloo ranks under torchrun; rank 0's JSON summary."""
    return torchrun_summary(world, TESTS / "torch_block.py", str(plan))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_block_on_gloo_ranks_equals_the_block_unsharded_for_every_configuration(world, tmp_path):
    plan = plan_for(world)
    summary = run_ranks(world, plan.write(tmp_path / "plan.json"))
    assert summary["world"] == world
    cases = summary["cases"]
    for case in cases:
        assert case["error"] < TOLERANCE, case
        assert case["control"] > 100 * TOLERANCE, case  # a wrong mask would show

    every = [c for c in cases if c["case"] not in ("plan", "subgroup")]
    expected = [
        config.label
        for causal in (False, True) for kv_heads in (4, 2, 1)
        for config in enumerate_configs(AttentionShape(4, kv_heads, 8, 2, "fp32", causal).at(37), world)
        if config.ranks == world
    ]
    assert [c["config"] for c in every] == expected
    strategies = {"allgather_kv", "ring", "ulysses"}
    if world == 4:
        strategies |= {"ulysses2xallgather_kv2", "ulysses2xring2"}
    assert set(expected) == strategies

    by_plan = [(c["seq_len"], c["config"]) for c in cases if c["case"] == "plan"]
    assert by_plan == [(n, plan.select(n).label) for n in (4, 17, 45)]
    assert len({label for _, label in by_plan}) == 3  # each bucket its own configuration

    assert f"seq_len {world - 1} is shorter than {world} ranks" in summary["too_short"]

    side_by_side = [c["config"] for c in cases if c["case"] == "subgroup"]
    assert side_by_side == (["allgather_kv", "ring", "ulysses"] if world == 4 else [])


@pytest.mark.slow
def test_ranks_passing_different_lengths_each_get_one_error_naming_every_rank_s_length(tmp_path):
    """It used to hang (lengths in different buckets) or abort in gloo (in one bucket); unshard
    checks at every call, so a rank passing a length checked before (rank 0's 45) meets the
    other's check, not its data (gloo aborted with SIGABRT)."""
    lines = torchrun_lines(2, TESTS / "torch_lengths.py", str(plan_for(2).write(tmp_path / "plan.json")))
    reports = sorted((json.loads(line) for line in lines if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        for case, lengths in (("same_bucket", (37, 38)), ("other_buckets", (20, 50)), ("unshard", (30, 31)),
                              ("unshard_checked", (45, 46))):
            assert report[case].startswith(f"the ranks passed different seq_len (rank 0 passed {lengths[0]}, "
                                           f"rank 1 passed {lengths[1]}): every rank of the group must pass "
                                           f"the same seq_len"), report[case]
        assert report["after"] == [SHAPE.batch, 23, SHAPE.heads, SHAPE.head_dim]  # the group still works
