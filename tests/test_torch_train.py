"""Training workloads on the torch engine's gloo ranks: the forward and the backward of every
feasible configuration on 2 and 4 ranks (Ulysses with its replicated KV heads folded back,
AllGather-KV's reduce-scatter, the Ring's travelling gradients, their hybrids), the output and
the gradients of Q, K and V put back in token order against the float64 reference, and the
training timings' fourth column (the forward's wall time)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the cptune[torch] extra; CI installs it

from cptune import Workload  # noqa: E402
from cptune.engines.torch import TorchEngine  # noqa: E402
from cptune.execute import _scatter  # noqa: E402
from cptune.feasibility import enumerate_configs  # noqa: E402
from cptune.layout import SequenceLayout  # noqa: E402
from cptune.reference import (  # noqa: E402
    make_inputs,
    make_output_gradient,
    reference_attention,
    reference_gradients,
    relative_error,
)

pytestmark = pytest.mark.slow  # starts torch ranks

TIMEOUT = 120.0
#: name -> workload: seq 64, 4 heads of 8 with 4 (MHA), 2 (GQA: Ulysses on 4 ranks replicates
#: them, their gradients folded back) or 1 (MQA) KV heads, fp32 and bf16, causal or not; and
#: two more: 62 tokens (padding rows on 4 ranks, their output gradient zero) and batch 2.
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
WORKLOADS = {
    f"{dtype}-{'causal' if causal else 'full'}-{kind}":
        Workload(64, 4, 8, kv_heads=kv_heads, dtype=dtype, causal=causal, mode="train")
    for dtype in ("fp32", "bf16") for causal in (True, False) for kind, kv_heads in KV_HEADS.items()
} | {
    "fp32-causal-gqa-padded": Workload(62, 4, 8, kv_heads=2, dtype="fp32", causal=True, mode="train"),
    "bf16-full-mqa-batch2": Workload(64, 4, 8, kv_heads=1, dtype="bf16", causal=False, mode="train", batch=2),
}


@pytest.fixture(scope="module")
def engine():
    made = TorchEngine()
    yield made
    made.close()


def train(engine: TorchEngine, layout: SequenceLayout, q, k, v, dout) -> tuple[list[np.ndarray], list[int]]:
    """One training run of ``layout``'s configuration: the output, dQ, dK and dV in token
    order ([batch, seq, heads or kv_heads, head_dim]), and each rank's peak bytes."""
    wl = layout.workload
    shards, peaks = engine.run_train(wl, layout.config, _scatter(layout, q, k, v, dout), TIMEOUT)
    assert len(shards) == layout.ranks
    gathered = []
    for field, heads in zip(("out", "dq", "dk", "dv"), (wl.heads, wl.heads, wl.kv_heads, wl.kv_heads),
                            strict=True):
        full = np.full((wl.batch, layout.padded_len, heads, wl.head_dim), np.nan, dtype=np.float32)
        for rank, shard in enumerate(shards):
            part = getattr(shard, field)
            assert part.dtype == np.float32, field
            full[:, layout.rank_positions(rank)] = part
        gathered.append(full[:, : wl.seq_len])
    return gathered, peaks


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_configuration_on_4_and_2_ranks_trains_to_the_reference(engine, name):
    """4 ranks first: the pool they start serves the 2-rank runs too."""
    workload = WORKLOADS[name]
    q, k, v = make_inputs(workload)
    dout = make_output_gradient(workload)
    reference = [reference_attention(workload, q, k, v), *reference_gradients(workload, q, k, v, dout)]
    tolerance = engine.tolerance[workload.dtype]
    configs = [c for ranks in (4, 2) for c in enumerate_configs(workload, ranks) if c.ranks == ranks]
    assert {c.strategy for c in configs} == {"ring", "ulysses", "allgather_kv"}
    for config in configs:
        layout = SequenceLayout(workload, config)
        got, peaks = train(engine, layout, q, k, v, dout)
        inputs = [sum(x.nbytes for x in shard) for shard in _scatter(layout, q, k, v, dout)]
        # beyond the inputs: the forward's saved tensors and the gradients, held at the end
        assert all(peak > held for peak, held in zip(peaks, inputs, strict=True)), config.describe()
        for field, value, expected in zip(("out", "dq", "dk", "dv"), got, reference, strict=True):
            assert value.shape == expected.shape, (config.describe(), field)
            error = relative_error(value, expected)
            assert error <= tolerance, f"{config.describe()}: {field} off by {error:.2e} (> {tolerance})"


def test_training_times_the_forward_apart_and_a_forward_run_keeps_three_columns(engine):
    workload = WORKLOADS["fp32-causal-gqa"]
    q, k, v = make_inputs(workload)
    dout = make_output_gradient(workload)
    for config in (c for c in enumerate_configs(workload, 2) if c.ranks == 2):
        train(engine, SequenceLayout(workload, config), q, k, v, dout)
        seconds = engine.time(0, 2, TIMEOUT, "x")
        assert seconds.shape == (2, 2, 4), config.describe()
        wall, compute, comm, forward = np.moveaxis(seconds, -1, 0)
        assert np.all(wall > 0) and np.all(compute > 0) and np.all(comm >= 0), config.describe()
        assert np.all((forward > 0) & (forward < wall)), config.describe()
    forward_only = Workload(64, 4, 8, kv_heads=2, dtype="fp32", causal=True)
    layout = SequenceLayout(forward_only, config)
    outputs, _ = engine.run(forward_only, config, _scatter(layout, q, k, v), TIMEOUT)
    assert len(outputs) == 2
    assert engine.time(0, 2, TIMEOUT, "x").shape == (2, 2, 3)
