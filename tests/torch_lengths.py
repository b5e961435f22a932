"""Ranks passing different ``seq_len`` to ``ContextParallelAttention``, on 2 gloo ranks
(tests/test_torch_deploy.py launches it with ``python -m torch.distributed.run --standalone
--nproc-per-node 2 torch_lengths.py PLAN``; PLAN's buckets: up to 26 tokens AllGather-KV,
27 to 64 Ulysses, on 2 ranks).

Rank r passes 37 + r (one bucket), then 20 or 50 (two buckets), then unshards at 30 + r;
each rank shards its inputs for the length it passed. Then both pass 45, and unshard at 45 + r
(rank 0 at the length both just checked, rank 1 at a new one). Each rank prints one JSON line:
{"rank", "same_bucket", "other_buckets", "unshard", "after", "unshard_checked"}, "after" the
output's shape, the others the message of what the call raised ("not refused" if nothing).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from cptune.plans import load_plan
from cptune.torch import ContextParallelAttention


def refusal(call) -> str:
    try:
        call()
    except ValueError as refused:
        return str(refused)
    return "not refused"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = load_plan(sys.argv[1], force=True)  # tuned for a made-up host
    cp = ContextParallelAttention(plan)
    shape = plan.shape

    def attend(seq_len: int) -> torch.Tensor:
        x = torch.randn(shape.batch, seq_len, shape.heads, shape.head_dim)
        kv = torch.randn(shape.batch, seq_len, shape.kv_heads, shape.head_dim)
        with torch.no_grad():
            return cp(cp.shard(x), cp.shard(kv), cp.shard(kv), seq_len)

    def unshard(seq_len: int) -> torch.Tensor:
        return cp.unshard(cp.shard(torch.randn(shape.batch, seq_len, 1)), seq_len)

    report = {
        "rank": rank,
        "same_bucket": refusal(lambda: attend(37 + rank)),
        "other_buckets": refusal(lambda: attend((20, 50)[rank])),
        "unshard": refusal(lambda: unshard(30 + rank)),
        "after": list(attend(45).shape),
        "unshard_checked": refusal(lambda: unshard(45 + rank)),  # gloo aborted rank 1 (SIGABRT)
    }
    os.write(1, (json.dumps(report) + "\n").encode())  # one write: the two ranks share the pipe
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
