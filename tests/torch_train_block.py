"""A transformer block whose attention is ``ContextParallelAttention`` trained one step on
gloo ranks, against the same block unsharded (tests/test_torch_training_module.py launches it
with ``python -m torch.distributed.run --standalone --nproc-per-node N torch_train_block.py``).

Every rank runs every case: each feasible configuration on up to N ranks
(``enumerate_configs``; one on fewer ranks leaves the others with empty shards) for GQA
attention (4 heads over 2 KV heads, head_dim 8) at a length every layout pads, in float32
causal and not, and in bfloat16 causal. As a user trains with context parallelism, each rank
runs the block on its shard, takes the loss over its own real tokens (padding left out; the
ranks' losses sum to the whole sequence's), backpropagates, and sums the parameters'
gradients over the group (``all_reduce``, as data parallelism does). That sum is compared
with the gradients of the block run on the whole sequence in float32 with
``scaled_dot_product_attention``, and the input's gradient, gathered with ``unshard``, with
the unsharded input's.

Rank 0 prints one JSON line: {"world": N, "cases": [{"dtype", "causal", "config", "ranks",
"error", "worst", "baseline", "input_error", "loss_error", "padding_grad"}, ...]}: ``error``
the largest relative difference of any parameter's gradient (``worst`` names it), each
relative to that parameter's largest; ``baseline`` the same for the unsharded block in the
case's dtype (0 in float32; in bfloat16 its own rounding); ``input_error`` and
``loss_error`` the input gradient's and the loss's; ``padding_grad`` the largest gradient any
q, k or v shard gets from a loss over the outputs at padding positions alone.
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from torch_block import Attention, full_attention  # the script's own folder: tests/

from cptune.feasibility import enumerate_configs
from cptune.torch import ContextParallelAttention
from cptune.workload import AttentionShape

HEADS, KV_HEADS, HEAD_DIM, BATCH = 4, 2, 8, 2
#: Not a multiple of 4 (nor of 8, the zigzag granularity on 4 ranks): every layout pads.
SEQ_LEN = 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Block(torch.nn.Module):
    """Pre-norm transformer block: a sinusoidal position signal by token position, then
    attention (q, k, v and output projections without bias, GQA) and an MLP, each with a
    residual."""

    frequencies: torch.Tensor  # a buffer: cast with the parameters

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        dim = heads * head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.register_buffer("frequencies", 10000.0 ** -(torch.arange(dim) / dim))
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.k = torch.nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = torch.nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_len: int,
                attention: Attention) -> torch.Tensor:
        batch, tokens, _ = x.shape
        x = x + torch.sin(positions[:, None] * self.frequencies).to(x.dtype)
        h = self.norm1(x)
        q = self.q(h).view(batch, tokens, self.heads, self.head_dim)
        k = self.k(h).view(batch, tokens, self.kv_heads, self.head_dim)
        v = self.v(h).view(batch, tokens, self.kv_heads, self.head_dim)
        x = x + self.o(attention(q, k, v, seq_len).reshape(batch, tokens, self.heads * self.head_dim))
        return x + self.mlp(self.norm2(x))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((got.double() - expected).abs().max() / expected.abs().max())


def loss_of(y: torch.Tensor, target: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The mean squared error over the whole sequence's tokens, of the tokens ``real`` marks
    (the shard's own: a rank's share, the ranks' shares summing to the whole)."""
    squared = (y.float() - target).square().sum(-1) * real
    return squared.sum() / (BATCH * SEQ_LEN)


def parameter_grads(block: Block) -> dict[str, torch.Tensor]:
    return {name: p.grad.float() for name, p in block.named_parameters() if p.grad is not None}


def unsharded_step(block: Block, x: torch.Tensor, target: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The loss, the parameters' gradients and the input's of one step of ``block`` on the
    whole sequence ``x``, with ``scaled_dot_product_attention``."""
    x = x.clone().requires_grad_()
    loss = loss_of(block(x, torch.arange(SEQ_LEN), SEQ_LEN, full_attention(causal)), target,
                   torch.ones(BATCH, SEQ_LEN))
    loss.backward()
    assert x.grad is not None
    grads = parameter_grads(block)
    block.zero_grad(set_to_none=True)
    return loss.detach(), grads, x.grad


def largest_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The parameter whose gradient differs most, relative to its largest, and by how much."""
    assert got.keys() == expected.keys(), (got.keys(), expected.keys())
    errors = {name: relative_error(got[name], expected[name]) for name in expected}
    worst = max(errors, key=errors.__getitem__)
    return worst, errors[worst]


def run_case(cp: ContextParallelAttention, dtype: torch.dtype, seed: int) -> dict[str, object]:
    """One training step of the block on this rank's shard, its gradients summed over the
    group, against the same step unsharded in float32 (the exact gradients: in bfloat16 the
    unsharded block's own difference from them is ``baseline``)."""
    shape = cp.shape
    torch.manual_seed(seed)
    block = Block(shape.heads, shape.kv_heads, shape.head_dim).to(dtype)
    x = torch.randn(BATCH, SEQ_LEN, shape.heads * shape.head_dim).to(dtype)
    target = torch.randn(BATCH, SEQ_LEN, shape.heads * shape.head_dim)
    expected_loss, expected, expected_input = unsharded_step(copy.deepcopy(block).float(), x.float(), target,
                                                             shape.causal)
    baseline = largest_error(unsharded_step(block, x, target, shape.causal)[1], expected)[1]

    positions = cp.positions(SEQ_LEN)
    local_x = cp.shard(x).requires_grad_()
    y = block(local_x, positions, SEQ_LEN, cp)
    loss = loss_of(y, cp.shard(target), (positions < SEQ_LEN).expand(BATCH, -1))
    loss.backward()
    assert local_x.grad is not None
    got = parameter_grads(block)
    for grad in got.values():
        dist.all_reduce(grad, group=cp.group)  # in float32: the sum data parallelism takes
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss, group=cp.group)
    worst, error = largest_error(got, expected)
    input_error = relative_error(cp.unshard(local_x.grad, SEQ_LEN), expected_input)
    config = cp.config_for(SEQ_LEN)
    loss_error = abs(float(total_loss - expected_loss) / float(expected_loss))
    return {"config": config.label, "ranks": config.ranks, "error": error, "worst": worst,
            "baseline": baseline, "input_error": input_error, "loss_error": loss_error,
            "padding_grad": padding_grad(cp, dtype)}


def padding_grad(cp: ContextParallelAttention, dtype: torch.dtype) -> float:
    """The largest gradient any rank's q, k or v shard gets from a loss over the outputs at
    padding positions alone: none flows back through them, so 0."""
    shape, positions = cp.shape, cp.positions(SEQ_LEN)
    q = torch.randn(BATCH, len(positions), shape.heads, shape.head_dim).to(dtype).requires_grad_()
    k, v = (torch.randn(BATCH, len(positions), shape.kv_heads, shape.head_dim).to(dtype).requires_grad_()
            for _ in range(2))
    out = cp(q, k, v, SEQ_LEN)
    (out.float().sum((0, 2, 3)) * (positions >= SEQ_LEN)).sum().backward()
    grads = [t.grad for t in (q, k, v)]
    largest = torch.tensor([max(float(g.abs().max()) if g is not None and g.numel() else 0.0 for g in grads)])
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=cp.group)
    return float(largest)


def every_config(world: int) -> list[dict[str, object]]:
    """fp32 causal: every configuration on up to ``world`` ranks (those on fewer leave ranks
    out); fp32 without a mask and bf16 causal: those on all ``world`` ranks."""
    cases: list[dict[str, object]] = []
    for dtype, causal in (("fp32", True), ("fp32", False), ("bf16", True)):
        shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, BATCH, dtype, causal)
        every = (dtype, causal) == ("fp32", True)
        for config in (c for c in enumerate_configs(shape.at(SEQ_LEN), world) if every or c.ranks == world):
            cp = ContextParallelAttention(config, shape)
            case = {"dtype": dtype, "causal": causal}
            cases.append(case | run_case(cp, DTYPES[dtype], seed=len(cases)))
    return cases


def main() -> None:
    torch.set_num_threads(1)  # N ranks share this host's cores
    dist.init_process_group("gloo")
    cases = every_config(dist.get_world_size())
    if dist.get_rank() == 0:
        print(json.dumps({"world": dist.get_world_size(), "cases": cases}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
