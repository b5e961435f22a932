"""The torch engine: its attention by position pieces against a float64 reference (quick),
then every configuration on 1-4 gloo ranks against the reference, its timings, its
calibration ops, its supervision and its refusals (slow: they start ranks)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the cptune[torch] extra; CI installs it

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import cptune  # noqa: E402
from conftest import EVERY_CONFIG, assert_pool_gone, reference_cases, torchrun_summary  # noqa: E402
from cptune import CPConfig, EngineError, Workload  # noqa: E402
from cptune.calls import Call, attention_calls, busiest_calls  # noqa: E402
from cptune.cost import analytic_cost  # noqa: E402
from cptune.engines import ENGINES, BackendUnavailableError, get_engine  # noqa: E402
from cptune.engines.torch import TorchEngine  # noqa: E402
from cptune.engines.torch._kernels import explicit, fused_attention  # noqa: E402
from cptune.engines.torch._ops import accumulator, attend, merge_into  # noqa: E402
from cptune.engines.torch._worker import group_members  # noqa: E402
from cptune.feasibility import enumerate_configs  # noqa: E402
from cptune.layout import SequenceLayout, position_runs  # noqa: E402
from cptune.masks import Mask  # noqa: E402
from cptune.reference import make_inputs, relative_error  # noqa: E402
from cptune.strategies import run_strategy  # noqa: E402
from cptune.strategies.primitives import Partial  # noqa: E402


def dense_reference(q, k, v, q_pos, k_pos, causal, seq_len):
    """float64 attention by positions, masks written out: keys at seq_len or beyond never
    count, a causal query sees keys at or before it. Rows that see nothing: output 0."""
    q64, k64, v64 = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(groups, dim=1), v64.repeat_interleave(groups, dim=1)
    scores = q64 @ k64.transpose(-1, -2) / np.sqrt(q.shape[-1])
    visible = torch.as_tensor(k_pos)[None, :] < seq_len
    if causal:
        visible = visible & (torch.as_tensor(k_pos)[None, :] <= torch.as_tensor(q_pos)[:, None])
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.where(visible, torch.exp(scores - lse[..., None].clamp(min=-1e300)), 0.0)
    return weights @ v64, lse


# zigzag blocks of a 2-way context split of 64 positions, padding past 60: chunks of 16
ZIGZAG = [np.r_[0:16, 48:64], np.r_[16:48]]
POSITIONS = {
    "zigzag-own": (ZIGZAG[0], ZIGZAG[0]),
    "zigzag-other": (ZIGZAG[0], ZIGZAG[1]),
    "zigzag-future": (ZIGZAG[1][:8], np.r_[48:64]),  # every key in every query's future
    "gathered": (ZIGZAG[1], np.concatenate(ZIGZAG)),
    "keys-start-inside": (np.r_[10:30], np.r_[20:40]),  # not aligned: the query run is cut
    "queries-after": (np.r_[30:50], np.r_[0:40]),  # the past, then a diagonal
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("positions", list(POSITIONS), ids=list(POSITIONS))
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_by_calls_matches_the_masked_reference(positions, causal, kv_heads):
    """Every real query's output and log-sum-exp (padding queries' outputs are dropped)."""
    q_pos, k_pos = POSITIONS[positions]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn((2, 4, len(q_pos), 16), generator=generator)
    kv = torch.randn((2, 2, kv_heads, len(k_pos), 16), generator=generator)
    out, lse = attend(q, kv, q_pos, k_pos, Mask(60, causal))
    ref_out, ref_lse = dense_reference(q, kv[0], kv[1], q_pos, k_pos, causal, 60)
    real = torch.as_tensor(q_pos < 60)
    assert torch.allclose(out.double()[..., real, :], ref_out[..., real, :], atol=1e-5)
    seen = torch.isfinite(ref_lse) & real
    assert torch.equal(torch.isfinite(lse) & real, seen)
    assert torch.allclose(lse.double()[seen], ref_lse[seen], atol=1e-5)


def test_calls_need_no_mask_tensor_and_skip_the_future():
    """A zigzag block over its own keys is one square causal call; over keys all in its
    future, none; padding keys are left out of an unmasked call; gathered keys in position
    order take the keys before each query chunk, then its square diagonal."""
    own = attention_calls(ZIGZAG[0], ZIGZAG[0], Mask(64, True))
    assert own == (Call(slice(0, 32), slice(0, 32), True),)
    assert attention_calls(ZIGZAG[1][:8], np.r_[48:64], Mask(64, True)) == ()
    unmasked = attention_calls(np.r_[0:8], np.r_[0:64], Mask(60, False))
    assert unmasked == (Call(slice(0, 8), slice(0, 60), False),)
    gathered = attention_calls(ZIGZAG[0], np.r_[0:64], Mask(64, True))
    assert gathered == (Call(slice(0, 16), slice(0, 16), True),
                        Call(slice(16, 32), slice(0, 48), False), Call(slice(16, 32), slice(48, 64), True))
    other = attention_calls(ZIGZAG[1], ZIGZAG[0], Mask(64, True))  # a later block: every query sees chunk 0
    assert other == (Call(slice(0, 32), slice(0, 16), False),)


class PlanOnly:
    """``Primitives`` that compute nothing and record each attention step's positions: the
    strategies' steps on any rank without running ranks."""

    def __init__(self, layout: SequenceLayout, rank: int) -> None:
        self.layout, self.rank, self.steps = layout, rank, []

    def attention(self, q, kv, q_pos, k_pos, into=None):
        self.steps.append((q_pos, k_pos))
        return Partial(None, None)

    def all_to_all(self, x, group, split_axis, concat_axis, repeat=1):
        return x

    def all_gather(self, x, group, axis, order=None):
        return x

    def kv_stream(self, kv, group, steps=None):
        members = self.layout.context_group_ranks(self.rank)
        me = members.index(self.rank)
        for step in range(len(members) if steps is None else steps + 1):
            yield (me - step) % len(members), kv

    def narrow(self, x, axis, start, stop):
        return x

    def pad(self, x, axis, size):
        return x


def every_layout(lengths: tuple[int, ...], **shape) -> Iterator[SequenceLayout]:
    """The layout of every configuration on 1-8 ranks (each count's own) of each length's workload."""
    for seq_len in lengths:
        for ranks in range(1, 9):
            workload = Workload(seq_len=seq_len, **shape)
            for config in enumerate_configs(workload, ranks):
                if config.ranks == ranks:
                    yield SequenceLayout(workload, config)


def call_bound(workload: Workload, config: CPConfig, q_pos: np.ndarray) -> int:
    """At most one fused call per query run and step; two for AllGather-KV's causal query
    chunks (the keys before a chunk, then its square diagonal)."""
    per_run = 2 if config.strategy == "allgather_kv" and workload.causal and config.context_degree > 1 else 1
    return per_run * len(position_runs(q_pos))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
def test_every_configuration_makes_one_fused_call_per_query_run_and_step(causal, kv_heads):
    """Every configuration on 1-8 ranks, every rank, at lengths with and without padding:
    the calls ``attention_calls`` plans for each step the strategy takes (what TorchOps runs),
    never more than ``call_bound``, so the count does not grow with the ranks; the busiest
    rank's total is the prior's closed form (``busiest_calls``)."""
    most = 0
    for layout in every_layout((840, 837, 9), heads=8, head_dim=16, kv_heads=kv_heads, causal=causal):
        workload, config, busiest = layout.workload, layout.config, 0
        for rank in range(config.ranks):
            ops = PlanOnly(layout, rank)
            run_strategy(ops, layout, rank, None, None)
            assert len(ops.steps) == (layout.reach + 1 if config.strategy == "ring" else 1)
            for q_pos, k_pos in ops.steps:
                calls = attention_calls(q_pos, k_pos, workload.mask)
                assert len(calls) <= call_bound(workload, config, q_pos), (config.label, rank, calls)
                most = max(most, len(calls))
            mine = sum(len(attention_calls(q, k, workload.mask)) for q, k in ops.steps)
            busiest = max(busiest, mine)
        assert busiest_calls(layout) == busiest, config.label  # what the prior counts
    assert most == (4 if causal else 1)


class Traffic(TorchDispatchMode):
    """Bytes every PyTorch op run under it reads and writes, and how many kernels it runs, the
    attention kernel itself, views, allocations and scalars (a fill's value) left out: what the
    engine's merges move through memory. An elementwise kernel reads each input once and writes
    its output once (an in-place one reads and writes ``self``; ``copy_`` and ``fill_`` only
    write it)."""

    #: Per op: None (no traffic of its own), else (whether in place, whether it reads ``self``).
    KINDS: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.kernels = 0, 0

    @classmethod
    def kind(cls, func) -> tuple[bool, bool] | None:
        if func not in cls.KINDS:
            schema, name = func._schema, func.__name__
            first = schema.arguments[0].alias_info if schema.arguments else None
            in_place = first is not None and first.is_write
            viewed = bool(schema.returns) and schema.returns[0].alias_info is not None and not in_place
            untracked = viewed or name.startswith("empty") or "attention" in name
            cls.KINDS[func] = None if untracked else (in_place, name.split(".")[0] not in ("copy_", "fill_"))
        return cls.KINDS[func]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (kind := self.kind(func)) is None:
            return out
        in_place, reads_self = kind
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor) and a.dim()]
        read = tensors if reads_self or not in_place else tensors[1:]
        written = [args[0]] if in_place else [o for o in (out if isinstance(out, tuple) else (out,))
                                              if isinstance(o, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in (*read, *written))
        self.kernels += 1
        return out


class TracedOps(PlanOnly):
    """``PlanOnly`` that runs each step's attention as ``TorchOps`` does (``attend``, its merges
    included) on real tensors of the step's shapes, under ``traffic``; K/V blocks as they would
    arrive (no exchange)."""

    def __init__(self, layout: SequenceLayout, rank: int, traffic: Traffic) -> None:
        super().__init__(layout, rank)
        self.traffic = traffic

    def attention(self, q, kv, q_pos, k_pos, into=None):
        workload = self.layout.workload
        with self.traffic:
            return attend(q, kv, q_pos, k_pos, workload.mask, into=into)

    def all_gather(self, x, group, axis, order=None):
        return torch.zeros((*x.shape[:-2], self.layout.padded_len, x.shape[-1]), dtype=x.dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_merges_the_prior_counts_are_the_traffic_the_engines_code_moves(causal, dtype):
    """Every configuration on 1-8 ranks, every rank, at a length with blocks of padding only
    and one without: the bytes and kernels of the merges ``analytic_cost`` counts where
    attention runs as fused calls (``position_calls``) are those of the busiest rank as the
    torch engine's ``attend`` runs it - its merges, its copies into the float32 accumulator,
    and the result's cast back to the wire dtype (a pass of its own; inside the pack of
    Ulysses' exchange back, which then reads float32) - op by op."""
    from cptune.engines.torch._ops import TORCH_DTYPES, pack
    from cptune.layout import heads_as_run
    from cptune.strategies import CONTEXT_STRATEGIES
    from cptune.strategies.primitives import SEQ

    wire = TORCH_DTYPES[dtype]
    for layout in every_layout((120, 9), heads=8, head_dim=16, dtype=dtype, causal=causal):
        config = layout.config
        u, rows = config.head_group, layout.padded_len // config.context_degree
        local = heads_as_run(layout.workload, config).heads // u  # padded heads where u does not divide 8
        q = torch.randn((1, local, rows, 16)).to(wire)
        kv = torch.randn((2, 1, local, rows, 16)).to(wire)
        moved, launched = 0, 0
        for rank in range(config.ranks):
            traffic = Traffic()
            strategy = CONTEXT_STRATEGIES[config.strategy]
            out = strategy.attend(TracedOps(layout, rank, traffic), layout, rank, q, kv).out
            with traffic:  # back to the wire dtype, as the engine hands the output on
                pack(out, SEQ, u, wire) if u > 1 else out.to(wire)
            if u > 1:  # the pack's own copy is a permute: only its wider read counts here
                as_wire, narrow = Traffic(), out.to(wire)
                with as_wire:
                    pack(narrow, SEQ, u, wire)
                traffic.bytes -= as_wire.bytes
                traffic.kernels -= as_wire.kernels
            moved, launched = max(moved, traffic.bytes), max(launched, traffic.kernels)
        cost = analytic_cost(layout.workload, config, position_calls=True)
        assert (cost.memory_bytes["merge"], cost.kernels["merge"]) == (moved, launched), \
            (config.label, layout.workload.seq_len)


def test_merging_two_halves_in_place_equals_attending_to_both():
    generator = torch.Generator().manual_seed(1)
    q = torch.randn((1, 2, 8, 16), generator=generator)
    k, v = torch.randn((1, 2, 32, 16), generator=generator), torch.randn((1, 2, 32, 16), generator=generator)
    whole = fused_attention(q, k, v, False)
    for dtype in (torch.float32, torch.bfloat16):
        acc = accumulator(q, [])  # no call yet: every row 0 and -inf
        assert torch.equal(acc.out, torch.zeros_like(acc.out)) and torch.isneginf(acc.lse).all()
        for keys in (slice(0, 20), slice(20, 32)):
            out, lse = fused_attention(*(x.to(dtype) for x in (q, k[..., keys, :], v[..., keys, :])), False)
            merge_into(acc, slice(0, 8), out, lse)
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        assert torch.allclose(acc.out, whole[0], atol=tolerance)
        assert torch.allclose(acc.lse, whole[1], atol=tolerance)
    acc = accumulator(q, [])
    out, lse = fused_attention(q[..., 2:5, :], k, v, False)
    merge_into(acc, slice(2, 5), out, lse)  # only those rows
    assert torch.equal(acc.out[..., 2:5, :], out) and torch.isneginf(acc.lse[..., :2]).all()


def test_the_explicit_fallback_agrees_with_the_fused_kernel():
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn((1, 4, 24, 8), generator=generator) for _ in range(3))
    for causal in (False, True):
        for scale in (None, 0.5):
            fused = fused_attention(q, k[:, :2], v[:, :2], causal, scale)
            expected = explicit(q, k[:, :2], v[:, :2], causal, scale)
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fused, expected, strict=True))


def test_every_group_a_task_uses_is_made_once():
    groups = group_members(4)
    assert len(groups) == len(set(groups))
    assert set(groups) == {(0, 1), (0, 1, 2), (0, 1, 2, 3), (2, 3), (0, 2), (1, 3)}


def test_spec_and_fingerprint_keep_the_engine_apart_from_mpi():
    spec = ENGINES["torch"]
    assert (spec.kernel, spec.stream, spec.timed, spec.device) == ("fused", "p2p", True, "any")
    engine = TorchEngine()
    assert engine.device == "cpu"  # no CUDA in this build
    assert engine.hardware().fingerprint != get_engine("mpi").hardware().fingerprint
    assert "gloo" in engine.hardware().interconnect


def test_a_machine_without_pytorch_is_told_how_to_get_it(monkeypatch, cptune_here):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "torch" else real(name, *args))
    with pytest.raises(BackendUnavailableError, match=r"pip install 'cptune\[torch\]'"):
        TorchEngine().preflight(1)
    monkeypatch.setattr("cptune.engines._engines", {})
    result = cptune_here("measure", "--backend", "torch", "--max-ranks", "1")
    assert result.returncode == 2 and "pip install 'cptune[torch]'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# -- on real gloo ranks ---------------------------------------------------------------------

WORKLOADS = {
    f"{heads}-{dtype}": dict(seq_len=seq_len, heads=8, head_dim=16, kv_heads=kv, dtype=dtype)
    for heads, kv, seq_len in (("mha", 8, 37), ("gqa", 2, 64), ("mqa", 1, 50))
    for dtype in ("fp32", "bf16")
}
CONFIGS = EVERY_CONFIG


@pytest.fixture(scope="module")
def cases():
    return reference_cases(WORKLOADS)


def runnable_cases():
    for name in WORKLOADS:
        for causal, mask in ((False, "full"), (True, "causal")):
            workload = Workload(**WORKLOADS[name], causal=causal)
            for config in CONFIGS:
                if not cptune.feasibility(workload, config):
                    label = f"{name}-{mask}-{config.label}-{config.ranks}r"
                    yield pytest.param(name, causal, config, id=label)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "causal", "config"), list(runnable_cases()))
def test_every_configuration_matches_the_reference(cases, name, causal, config):
    workload, (q, k, v), reference = cases(name, causal)
    out = cptune.compute(workload, config, q, k, v, backend="torch")
    assert out.shape == reference.shape and out.dtype == np.float32
    assert relative_error(out, reference) <= get_engine("torch").tolerance[workload.dtype]


def run_torch_ranks(world: int) -> dict:
    """benchmarks/torch_ranks.py on ``world`` gloo ranks under torchrun; rank 0's JSON summary."""
    script = Path(__file__).parent.parent / "benchmarks" / "torch_ranks.py"
    return torchrun_summary(world, script, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_on_gloo_ranks_each_step_is_one_fused_call_and_a_rerun_is_right(world):
    """Every configuration on ``world`` ranks run twice on the same tensors (the engine's
    timed iterations after its checked run): both runs match the reference (from 3 ranks the
    Ring used to receive into the caller's K/V and start its second run from another rank's
    block), and each rank's fused calls per step stay within ``call_bound``."""
    summary = run_torch_ranks(world)
    assert summary["world"] == world
    expected = [
        config.label for causal in (False, True) for kv_heads in (4, 2, 1)
        for config in enumerate_configs(Workload(seq_len=37, heads=4, head_dim=8, kv_heads=kv_heads,
                                                 causal=causal), world)
        if config.ranks == world
    ]
    assert [case["config"] for case in summary["cases"]] == expected
    for case in summary["cases"]:
        assert case["failed"] is None and all(error <= 1e-5 for error in case["errors"]), case
        causal = case["workload"].endswith("causal")
        workload = Workload(seq_len=37, heads=4, head_dim=8, kv_heads=4, causal=causal)
        config = next(c for c in enumerate_configs(workload, world)
                      if c.label == case["config"] and c.ranks == world)
        layout = SequenceLayout(workload, config)
        for rank, steps in enumerate(case["calls"]):
            q_pos = layout.block_positions(layout.head_group_of(rank))
            assert len(steps) == (config.context_degree if config.strategy == "ring" else 1), case
            assert all(calls <= call_bound(workload, config, q_pos) for calls in steps), (rank, case)


class Corrupting(TorchEngine):
    """The torch engine with one rank's output shard off by a little after each run."""

    def run(self, workload, config, shards, timeout):
        outputs, peaks = super().run(workload, config, shards, timeout)
        outputs[-1] = outputs[-1] + 0.05
        return outputs, peaks


@pytest.mark.slow
def test_a_wrong_output_is_caught_before_any_timing():
    engine = Corrupting()
    try:
        with pytest.raises(EngineError) as failure:
            cptune.measure(Workload(seq_len=32, heads=4, head_dim=8, dtype="bf16"), CPConfig("ring", 2),
                           backend=engine, warmup=0, repeats=1)
    finally:
        engine.close()
    assert failure.value.kind == "wrong_output"


@pytest.mark.slow
def test_a_measurement_records_the_engine_its_kernel_and_its_split():
    workload = Workload(seq_len=512, heads=4, head_dim=32, kv_heads=2, dtype="bf16", causal=True)
    m = cptune.measure(workload, CPConfig("ring", 2), backend="torch", warmup=1, repeats=3)
    assert m.engine == "torch"
    assert m.host["kernel"] == "flash_for_cpu" and m.host["process_group"] == "gloo"
    assert m.compute_ms > 0 and m.comm_ms >= 0 and m.compute_ms <= m.median_ms * 1.5
    assert m.peak_bytes > 0 and m.max_error <= TorchEngine.tolerance["bf16"]


@pytest.mark.slow
def test_calibration_ops_time_each_collective_and_shape_and_say_which_kernel_they_timed():
    """What a calibration keeps of the engine (``describe``, its facts) names the kernels its
    attention timings ran, forward and backward, and the process group; a collective's
    timing runs no kernel."""
    engine = TorchEngine()  # a pool of its own: nothing ran on it before
    try:
        for kind in ENGINES["torch"].collectives:
            timings = engine.time_collective(kind, 2, 2, [1024, 65536], warmup=1, repeats=2, timeout=120)
            assert timings.shape == (2, 2) and np.all(timings > 0)
        assert "kernel" not in engine.describe()
        shapes = [{"heads": 2, "seq_q": 64, "seq_k": 256, "head_dim": 32, "causal": c} for c in (0, 1)]
        timings = engine.time_attention(2, [*shapes, {**shapes[1], "backward": 1}], warmup=1, repeats=2,
                                        timeout=120)
        assert timings.shape == (3, 2) and np.all(timings > 0)
        ran = engine.describe()
        assert (ran["kernel"], ran["process_group"]) == ("flash_for_cpu, flash_for_cpu backward", "gloo")
    finally:
        engine.close()


@pytest.mark.slow
def test_a_killed_rank_ends_as_one_error_and_no_process_is_left(faulty_engine):
    engine = faulty_engine("kill", TorchEngine)  # rank 1 is SIGKILLed as its run starts
    workload = Workload(seq_len=64, heads=4, head_dim=8, dtype="fp32")
    engine._pool_for(2)
    pool_dir, pids = engine._pool.dir, list(engine._pool.pids)
    with pytest.raises(EngineError) as failure:
        cptune.compute(workload, CPConfig("ring", 2), *make_inputs(workload), backend=engine, timeout=120)
    assert failure.value.kind == "crash"
    assert "a rank crashed while running Ring on 2 ranks" in str(failure.value)
    assert_pool_gone(pool_dir, pids)


@pytest.mark.slow
def test_a_hung_run_times_out_and_no_process_is_left(faulty_engine):
    """Rank 1 never answers (rank 0 waits on it inside the Ring), however fast the machine:
    the run ends at its deadline, and the message shows a deadline under a second as it is
    and names every place a run's deadline is set."""
    engine = faulty_engine("hang", TorchEngine)
    workload = Workload(seq_len=64, heads=4, head_dim=8, dtype="fp32")
    engine._pool_for(2)
    pool_dir, pids = engine._pool.dir, list(engine._pool.pids)
    with pytest.raises(EngineError) as failure:
        cptune.compute(workload, CPConfig("ring", 2), *make_inputs(workload), backend=engine, timeout=0.5)
    assert failure.value.kind == "timeout"
    assert "did not finish Ring on 2 ranks within 0.5 s" in str(failure.value)
    for knob in ("--timeout of cptune measure", "search space's [measure] table", "timeout= in Python"):
        assert knob in str(failure.value)
    assert_pool_gone(pool_dir, pids)


# -- ranks the user launched (torchrun, srun) ------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_launched_ranks_are_read_from_torchrun_and_srun():
    from cptune.engines.torch._launch import launched_ranks

    assert launched_ranks({}) is None
    assert launched_ranks({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None  # alone
    torchrun = launched_ranks(TORCHRUN)
    assert (torchrun.rank, torchrun.size, torchrun.local_rank, torchrun.store) == (1, 2, 1, "127.0.0.1:29500")
    srun = launched_ranks({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3",
                           "SLURM_NNODES": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "1234"})
    assert (srun.rank, srun.size, srun.store, srun.nodes) == (3, 4, "node1:1234", 1)
    # several nodes: ranks fill them in order, LOCAL_WORLD_SIZE (or the tasks per node) each
    across = launched_ranks({**TORCHRUN, "WORLD_SIZE": "4", "RANK": "3"})
    assert (across.nodes, across.ranks_per_node, across.master) == (2, 2, "127.0.0.1")
    slurm = launched_ranks({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                            "SLURM_NNODES": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "1234"})
    assert (slurm.nodes, slurm.ranks_per_node, slurm.local_rank) == (2, 4, 1)


@pytest.mark.parametrize(("change", "reason"), [
    ({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, "not spread evenly over their nodes"),
    ({"MASTER_PORT": ""}, "MASTER_ADDR and MASTER_PORT"),
])
def test_a_launch_cptune_cannot_drive_is_refused_with_the_reason(change, reason):
    from cptune.engines.torch._launch import launched_ranks

    with pytest.raises(BackendUnavailableError, match=reason):
        launched_ranks({**TORCHRUN, **change})


def torchrun(*args, timeout=240):
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "cptune.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CPTUNE_GUARD": "off"})


@pytest.mark.slow
def test_a_measure_runs_on_ranks_torchrun_launched():
    done = torchrun("measure", "--backend", "torch", "--seq-len", "256", "--heads", "4", "--head-dim", "16",
                    "--repeats", "2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    rows = json.loads(done.stdout)["results"]
    configs = {(r["config"]["strategy"], r["config"]["ranks"]) for r in rows}
    assert configs >= {("ring", 2), ("ulysses", 2), ("allgather_kv", 2)}
    assert all(r["engine"] == "torch" and r["host"]["mpi_library"] == "torch.distributed gloo" for r in rows)


@pytest.mark.slow
def test_rank_0_refusing_ends_every_launched_rank():
    started = time.monotonic()
    done = torchrun("measure", "--backend", "torch", "--seq-len", "256", "--heads", "4", "--head-dim", "16",
                    "--max-ranks", "3")
    assert done.returncode != 0
    assert "cptune: error: 3 ranks asked and 2 were launched" in done.stderr
    assert time.monotonic() - started < 120  # the other rank was told and left


@pytest.mark.slow
def test_the_command_line_runs_end_to_end_on_the_torch_engine(tmp_path, cptune_here):
    """calibrate, search, fit, recommend, export and report with --backend torch: the rows
    record the engine, this host is the torch engine's view of it, the report names it; the
    plan in frameworks' terms. The commands that start ranks run as a user runs them
    (a process each); those that only read, in this one (each process would pay PyTorch's
    import again). The search is of what xDiT runs, so --for's filter runs on real ranks too."""
    import importlib.util
    import json

    from conftest import cptune

    db = str(tmp_path / "t.db")
    shape = ["--heads", "4", "--head-dim", "16"]
    calibrated = cptune("calibrate", "--backend", "torch", "--db", db, "--repeats", "1", "--rounds", "1")
    assert calibrated.returncode == 0, calibrated.stderr
    from cptune.store import Store

    with Store(db) as store:  # the fused backward timed too, for the prior of a training step
        calibration = store.calibration(TorchEngine().hardware().fingerprint)
    assert calibration is not None and calibration.backward_speed(16) > 0
    # ... and the kernel its rates describe, forward and backward (issue 59)
    assert calibration.timed_kernels == "flash_for_cpu, flash_for_cpu backward"
    assert calibration.facts["process_group"] == "gloo"
    # only what xDiT runs: no AllGather-KV
    searched = cptune("search", "--backend", "torch", "--db", db, *shape, "--seq-lens", "64,96",
                      "--ranks", "1,2", "--rounds", "1", "--race-rounds", "0", "--confirm-rounds", "0",
                      "--for", "xdit")
    assert searched.returncode == 0, searched.stderr
    assert "gloo over TCP loopback" in searched.stdout and "calibrating" not in searched.stdout
    rows = json.loads(cptune_here("results", "--db", db, "--json").stdout)
    assert len(rows) == 6 and {row["engine"] for row in rows} == {"torch"}
    assert {(row["kernel"], row["facts"]["process_group"]) for row in rows} == {("flash_for_cpu", "gloo")}
    assert {row["strategy"] for row in rows if row["ranks"] == 2} == {"ring", "ulysses"}
    assert cptune_here("fit", "--db", db).returncode == 0
    picked = cptune_here("recommend", "--backend", "torch", "--db", db, *shape, "--seq-len", "96", "--json")
    assert picked.returncode == 0, picked.stderr
    pick = json.loads(picked.stdout)
    assert pick["fingerprint"] == TorchEngine().hardware().fingerprint
    assert "attention timed with flash_for_cpu, flash_for_cpu backward" in pick["hardware"]
    # the plan, and the same plan as diffusers takes it (--ranks 2: every bucket runs context parallel)
    plan = tmp_path / "plan.json"
    exported = cptune_here("export", "--backend", "torch", "--db", db, *shape, "--seq-lens", "64,96",
                           "--ranks", "2", "-o", plan, "--for", "diffusers", "--json")
    assert exported.returncode == 0, exported.stderr
    assert json.loads(plan.read_text())["hardware"]["engine"] == "torch"
    reported = cptune_here("report", "--db", db, "-o", tmp_path / "report")
    assert reported.returncode == 0, reported.stderr
    assert "(engine: torch)" in (tmp_path / "report" / "report.html").read_text()

    # the plan in frameworks' terms, fed to the real packages where they install
    from test_frameworks import _package_takes

    from cptune.frameworks import for_framework
    from cptune.plans import load_plan

    as_yunchang = for_framework(load_plan(plan), "yunchang").buckets
    emitted = {"diffusers": [b["settings"] for b in json.loads(exported.stdout)["buckets"]],
               "yunchang": [dict(b.spelling.settings) for b in as_yunchang]}
    for name, all_settings in emitted.items():
        assert len(all_settings) == 2 and all(all_settings)
        if importlib.util.find_spec(name):
            for settings in all_settings:
                _package_takes(name, settings, 2)


# -- the kernel choice and the plans a deployment reuses -------------------------------------


def test_the_probe_keeps_the_fastest_right_kernel_repeating_kv_heads_where_refused(monkeypatch):
    """On CUDA the probe times every candidate that passes the float32 check; here CPU fakes
    stand for the CUDA kernels: one ignores the causal mask (refused), one refuses fewer KV
    heads (kept, with the KV heads repeated), and the faster correct one wins."""
    from cptune.engines.torch import _kernels

    cpu = _kernels.KERNELS["flash_for_cpu"]

    def no_gqa(q, k, v, causal, scale):
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("fewer KV heads")
        return cpu(q, k, v, causal, scale)

    def no_mask(q, k, v, causal, scale):
        return cpu(q, k, v, False, scale)

    fakes = {"no_mask": no_mask, "no_gqa": no_gqa, "right": cpu}
    monkeypatch.setattr(_kernels, "KERNELS", _kernels.KERNELS | fakes)
    monkeypatch.setattr(_kernels, "CUDA_KERNELS", tuple(fakes))
    speed = {"no_mask": 1.0, "no_gqa": 2.0, "right": 3.0}
    monkeypatch.setattr(_kernels.KernelChooser, "_seconds", lambda self, pick, q, k: speed[pick.kernel])
    q, k = torch.zeros(1, 4, 64, 16), torch.zeros(1, 2, 64, 16)
    assert _kernels.KernelChooser().probe(q, k) == _kernels.Pick("no_gqa", True)
    speed["right"] = 0.5
    assert _kernels.KernelChooser().probe(q, k) == _kernels.Pick("right", False)
    assert _kernels.KernelChooser().probe(q, q) == _kernels.Pick("right", False)
    # the probe's inputs are laid out as the call's: a sequence-major q stays sequence-major
    sequence_major = torch.zeros(1, 64, 4, 16).transpose(1, 2)
    generator = torch.Generator().manual_seed(0)
    assert not _kernels.heads_outer(_kernels._drawn(sequence_major, (1, 4, 96, 16), generator))
    assert _kernels.heads_outer(_kernels._drawn(q, (1, 4, 96, 16), generator))


def test_a_rank_takes_its_gpu_by_local_rank_modulo_the_gpus_it_sees(monkeypatch):
    from cptune.engines.torch._worker import local_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1
    assert local_device(3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert local_device(3) == torch.device("cuda", 3)


def test_a_layouts_plans_are_made_once_and_dropped_with_it():
    from cptune import calls

    workload = Workload(seq_len=64, heads=4, head_dim=8, causal=True)
    layout = SequenceLayout(workload, CPConfig("allgather_kv", 2))
    q_pos, k_pos = layout.block_positions(1), layout.gathered_positions
    first = attention_calls(q_pos, k_pos, Mask(64, True))
    assert attention_calls(q_pos, k_pos, Mask(64, True)) is first  # kept, no pass over the positions
    assert attention_calls(q_pos.copy(), k_pos.copy(), Mask(64, True)) == first  # writable: planned anew
    kept = len(calls._BY_ARRAYS)
    del layout, q_pos, k_pos
    import gc

    gc.collect()
    assert len(calls._BY_ARRAYS) < kept
