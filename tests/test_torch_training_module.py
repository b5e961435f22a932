"""cptune.torch trains: ``ContextParallelAttention``'s gradients are attention's on one rank,
and a transformer block trained one step on 2 and 4 gloo ranks, every feasible
configuration, gets the unsharded block's parameter gradients (tests/torch_train_block.py,
under torchrun)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the cptune[torch] extra; CI installs it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from conftest import torchrun_summary  # noqa: E402
from cptune.config import CPConfig  # noqa: E402
from cptune.feasibility import enumerate_configs  # noqa: E402
from cptune.torch import ContextParallelAttention  # noqa: E402
from cptune.workload import AttentionShape  # noqa: E402

TESTS = Path(__file__).parent
#: Relative error a gradient may differ by from the unsharded one's, by dtype.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-process gloo world in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def leaf_inputs(shape: AttentionShape, seq_len: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seq_len)
    q = torch.randn(2, seq_len, shape.heads, shape.head_dim, generator=generator)
    k, v = torch.randn(2, 2, seq_len, shape.kv_heads, shape.head_dim, generator=generator)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float | None = None) -> torch.Tensor:
    """Attention in float64 by ``scaled_dot_product_attention``, [batch, seq, heads, head_dim]."""
    groups = q.shape[2] // k.shape[2]
    k, v = (t.double().repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.double().transpose(1, 2), k, v, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_on_one_rank_the_module_s_gradients_are_attention_s(one_rank, dtype, causal):
    shape = AttentionShape(4, 2, 8, 2, dtype, causal)
    cp = ContextParallelAttention(CPConfig("ring", 1), shape, scale=0.3)
    q, k, v = leaf_inputs(shape, 37, cp.dtype)
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out = cp(q, k, v, 37)
    assert out.requires_grad and out.dtype == cp.dtype and out.shape == q.shape
    (out.float() * weights).sum().backward()

    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (reference(exact[0], exact[1], exact[2], causal, scale=0.3) * weights.double()).sum().backward()
    for got, want in zip((q, k, v), exact, strict=True):
        assert got.grad is not None and want.grad is not None
        assert got.grad.dtype == cp.dtype and got.grad.shape == got.shape
        assert relative_error(got.grad, want.grad) < TOLERANCE[dtype] / 3

    # a loss whose gradient autograd hands over expanded (stride 0): made dense first
    for t in (q, k, v):
        t.grad = None
    cp(q, k, v, 37).sum().backward()
    assert all(t.grad is not None and bool(t.grad.isfinite().all()) for t in (q, k, v))


def test_without_gradients_the_module_keeps_no_graph_and_computes_the_same(one_rank):
    shape = AttentionShape(4, 2, 8, 2, "fp32", True)
    cp = ContextParallelAttention(CPConfig("ring", 1), shape)
    q, k, v = leaf_inputs(shape, 21, torch.float32)
    trained = cp(q, k, v, 21)
    with torch.no_grad():
        plain = cp(q, k, v, 21)
    detached = cp(*(t.detach() for t in (q, k, v)), 21)
    assert trained.grad_fn is not None
    assert plain.grad_fn is None and not plain.requires_grad and detached.grad_fn is None
    assert torch.equal(plain, trained.detach()) and torch.equal(plain, detached)
    torch.testing.assert_close(plain.double(), reference(q, k, v, True), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_block_trained_one_step_on_gloo_ranks_gets_the_unsharded_gradients_for_every_configuration(world):
    summary = torchrun_summary(world, TESTS / "torch_train_block.py")
    assert summary["world"] == world
    cases = summary["cases"]
    expected = [  # fp32 causal: every configuration on up to world ranks; the others on world ranks
        (dtype, causal, config.label, config.ranks)
        for dtype, causal in (("fp32", True), ("fp32", False), ("bf16", True))
        for config in enumerate_configs(AttentionShape(4, 2, 8, 2, dtype, causal).at(30), world)
        if (dtype, causal) == ("fp32", True) or config.ranks == world
    ]
    assert [(c["dtype"], c["causal"], c["config"], c["ranks"]) for c in cases] == expected
    labels = {"allgather_kv", "ring", "ulysses"} | ({"ulysses2xallgather_kv2", "ulysses2xring2"} if world == 4
                                                   else set())
    assert {c["config"] for c in cases if c["ranks"] == world} == labels
    for case in cases:
        tolerance = TOLERANCE[case["dtype"]]
        assert case["error"] < tolerance, case
        assert case["input_error"] < tolerance, case
        assert case["loss_error"] < tolerance, case
        assert case["padding_grad"] == 0.0, case  # no gradient flows back through padding outputs
