"""A small transformer block whose attention is ``ContextParallelAttention``, on gloo ranks,
against the same block unsharded (tests/test_torch_deploy.py launches it with
``python -m torch.distributed.run --standalone --nproc-per-node N torch_block.py PLAN``).

Every rank runs every case: each configuration on all N ranks for MHA, GQA and MQA, causal
and not, at a length that needs padding; the plan at PLAN (one length per bucket); and, on 4
ranks, two context-parallel groups side by side (ranks 2, 0 and 3, 1). Each case shards the
input, runs the block on the shard, gathers the output and compares it with the block run
on the whole sequence with ``scaled_dot_product_attention``. Rank 0 prints one JSON line:
{"world": N, "cases": [{"case", "config", "seq_len", "error", "control"}, ...], "too_short"},
where ``error`` is the largest relative difference on any rank, ``control`` the same
block's difference when its attention masks the other way (what a wrong mask would cost)
and ``too_short`` the refusal of a sequence shorter than the ranks.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cptune.config import CPConfig
from cptune.feasibility import enumerate_configs
from cptune.plans import load_plan
from cptune.torch import ContextParallelAttention
from cptune.workload import AttentionShape

HEADS, HEAD_DIM, BATCH = 4, 8, 2
#: Not a multiple of 4 (nor of 8, the zigzag granularity on 4 ranks): every layout pads.
SEQ_LEN = 37
GQA_CAUSAL = AttentionShape(HEADS, 2, HEAD_DIM, BATCH, "fp32", causal=True)

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class Block(torch.nn.Module):
    """Pre-norm transformer block: a sinusoidal position signal by token position, then
    attention and an MLP, each with a residual."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        dim = heads * head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.frequencies = 10000.0 ** -(torch.arange(dim) / dim)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, heads * head_dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim)
        self.out = torch.nn.Linear(heads * head_dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_len: int,
                attention: Attention) -> torch.Tensor:
        batch, tokens, _ = x.shape
        x = x + torch.sin(positions[:, None] * self.frequencies)
        h = self.norm1(x)
        q = self.q(h).view(batch, tokens, self.heads, self.head_dim)
        k, v = self.kv(h).view(batch, tokens, 2, self.kv_heads, self.head_dim).unbind(2)
        x = x + self.out(attention(q, k, v, seq_len).reshape(batch, tokens, self.heads * self.head_dim))
        return x + self.mlp(self.norm2(x))


def full_attention(causal: bool) -> Attention:
    """Attention over the whole sequence ([batch, seq, heads, head_dim] in and out)."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int) -> torch.Tensor:
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
        return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=causal).transpose(1, 2)
    return attend


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def largest(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest of ``value`` over the ranks of ``group``."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def run_case(cp: ContextParallelAttention, seq_len: int, seed: int) -> dict[str, object]:
    """The block on this rank's shard, gathered, against the block on the whole sequence."""
    shape = cp.shape
    torch.manual_seed(seed)
    block = Block(shape.heads, shape.kv_heads, shape.head_dim)
    x = torch.randn(BATCH, seq_len, shape.heads * shape.head_dim)
    with torch.no_grad():
        everywhere = torch.arange(seq_len)
        expected = block(x, everywhere, seq_len, full_attention(shape.causal))
        control = block(x, everywhere, seq_len, full_attention(not shape.causal))
        got = cp.unshard(block(cp.shard(x), cp.positions(seq_len), seq_len, cp), seq_len)
    return {"config": cp.config_for(seq_len).label, "seq_len": seq_len,
            "error": largest(relative_error(got, expected), cp.group),
            "control": relative_error(control, expected)}


def every_config(world: int) -> list[dict[str, object]]:
    cases = []
    for causal in (False, True):
        for kv_heads in (HEADS, 2, 1):
            shape = AttentionShape(HEADS, kv_heads, HEAD_DIM, BATCH, "fp32", causal)
            for config in enumerate_configs(shape.at(SEQ_LEN), world):
                if config.ranks == world:
                    cp = ContextParallelAttention(config, shape)
                    case = f"{kv_heads}kv {'causal' if causal else 'full'} u={config.head_group}"
                    cases.append({"case": case} | run_case(cp, SEQ_LEN, seed=len(cases)))
    return cases


def plan_lengths(plan_path: str) -> list[dict[str, object]]:
    """The plan's configuration per length: one length inside each bucket, padded."""
    plan = load_plan(plan_path, force=True)  # tuned for a made-up host
    cp = ContextParallelAttention(plan)
    lengths = [b.min_seq_len + (b.max_seq_len - b.min_seq_len) // 2 for b in plan.buckets]
    return [{"case": "plan"} | run_case(cp, n, seed=n) for n in lengths]


def side_by_side_groups() -> list[dict[str, object]]:
    """Two 2-rank context-parallel groups over 4 ranks, ranks 2, 0 and 3, 1 (in that order
    where ``new_group`` keeps it): group ranks are not global ranks, and every process makes
    the other group's subgroups too."""
    keep_order = {"sort_ranks": False} if "sort_ranks" in inspect.signature(dist.new_group).parameters else {}
    groups = [dist.new_group([2, 0], **keep_order), dist.new_group([3, 1], **keep_order)]
    mine = groups[dist.get_rank() % 2]
    cases = []
    for config in enumerate_configs(GQA_CAUSAL.at(SEQ_LEN), 2):
        if config.ranks == 2:
            cp = ContextParallelAttention(config, GQA_CAUSAL, group=mine)
            result = run_case(cp, SEQ_LEN, seed=dist.get_rank() % 2)  # each group its own input
            cases.append({"case": "subgroup"} | result | {"error": largest(float(result["error"]))})
    return cases


def too_short(world: int) -> str:
    """What the module says when asked for fewer tokens than its configuration has ranks."""
    cp = ContextParallelAttention(CPConfig("ring", world), GQA_CAUSAL)
    empty = torch.zeros(BATCH, 0, HEADS, HEAD_DIM)
    try:
        cp(empty, empty, empty, world - 1)
    except ValueError as refusal:
        return str(refusal)
    return "not refused"


def main() -> None:
    torch.set_num_threads(1)  # N ranks share this host's cores
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cases = every_config(world) + plan_lengths(sys.argv[1])
    if world == 4:
        cases += side_by_side_groups()
    refusal = too_short(world)
    if dist.get_rank() == 0:
        print(json.dumps({"world": world, "cases": cases, "too_short": refusal}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
