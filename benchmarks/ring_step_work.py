"""What Ring's kernel work costs beyond one call over all keys, on one rank of two, and how
much of it the calibrated per-step work explains.

Ring on c ranks attends a rank's query block to each of the c K/V blocks in its own call and
merges the partial outputs; AllGather-KV and Ulysses make one call over all keys. Beyond the
pairs each computes (``cptune.model.computed_flops``, masked pairs of the numpy kernel's
diagonal row blocks included), each Ring step after the first repeats the query block's
preparation (cast to scaled float32, row norms: ``prepare_query``) and merges one block's
output: work that grows with the length, not its square. This script times, in one process
and one thread (what each rank of a 2-rank run on 2 cores has), for every rank of the
layout:

- ring: one call per block, merged in order, as ``cptune.strategies.ring`` runs them;
- one call: the same query block over all keys at once, as AllGather-KV's kernel runs it;
- the steps: ``prepare_query`` of the block in its wire dtype, and one ``merge``;

interleaved (ring, one call, steps, in turn) so drift hits all alike, and prints the
busiest rank's ring / one-call ratio beside the computed-pairs ratio and the share the
steps add, ``(pairs ratio * one call + steps) / one call``. No communication is timed.

    python benchmarks/ring_step_work.py [--seq-lens 1024,2048,3072,4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from cptune.config import CPConfig
from cptune.engines import _numpy_kernels as kernels
from cptune.layout import SequenceLayout
from cptune.model import computed_flops
from cptune.workload import Workload

SHAPES: tuple[dict[str, object], ...] = (
    {"heads": 8, "kv_heads": 2, "head_dim": 64, "dtype": "bf16", "causal": False},
    {"heads": 8, "kv_heads": 2, "head_dim": 64, "dtype": "fp32", "causal": False},
    {"heads": 8, "kv_heads": 4, "head_dim": 128, "dtype": "bf16", "causal": True},
    {"heads": 12, "kv_heads": 12, "head_dim": 128, "dtype": "bf16", "causal": True},
)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank_cases(workload: Workload, group: int, rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    """Ring's calls, the one call and the steps of context group ``group`` on 2 ranks (the
    first two return the rank's (output, log-sum-exp), the same attention)."""
    layout = SequenceLayout(workload, CPConfig("ring", 2))
    wire = workload.wire_dtype
    q_pos = layout.block_positions(group)
    blocks = [layout.block_positions(j) for j in range(2)]
    q = rng.standard_normal((1, workload.heads, len(q_pos), workload.head_dim)).astype(wire)
    kvs = [rng.standard_normal((2, 1, workload.kv_heads, len(b), workload.head_dim)).astype(wire)
           for b in blocks]
    all_kv, all_pos = np.concatenate(kvs, axis=3), np.concatenate(blocks)
    attend = dict(causal=workload.causal, seq_len=workload.seq_len)
    own = len(q_pos)
    part = (np.zeros((1, workload.heads, own, workload.head_dim), np.float32),
            np.zeros((1, workload.heads, own), np.float32))

    def ring() -> tuple[np.ndarray, np.ndarray]:
        result = None
        for step in range(2):  # the rank's own block first, then the one that streams in
            source = (group - step) % 2
            result = kernels.merge(result, kernels.attention(q, kvs[source], q_pos, blocks[source], **attend))
        assert result is not None
        return result

    def steps() -> None:
        kernels.prepare_query(q)
        kernels.merge((part[0].copy(), part[1].copy()), part)

    return {"ring": ring, "one call": lambda: kernels.attention(q, all_kv, q_pos, all_pos, **attend),
            "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="1024,2048,3072,4096")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    threadpool_limits(limits=1, user_api="blas")
    rng = np.random.default_rng(0)
    print("shape                         seq   ring ms  one call ms  ring/one  pairs ratio  "
          "+ steps   steps ms")
    for shape in SHAPES:
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            workload = Workload(seq_len=seq_len, **shape)
            pairs = (computed_flops(workload, CPConfig("ring", 2), "numpy")
                     / computed_flops(workload, CPConfig("allgather_kv", 2), "numpy"))
            busiest = None
            for group in range(2):
                cases = rank_cases(workload, group, rng)
                for fn in cases.values():
                    fn()  # warm up
                times = {name: [] for name in cases}
                for _ in range(args.repeats):
                    for name, fn in cases.items():
                        times[name].append(seconds(fn))
                median = {name: float(np.median(t)) for name, t in times.items()}
                if busiest is None or median["ring"] > busiest["ring"]:
                    busiest = median
            assert busiest is not None
            ring, one, steps = busiest["ring"], busiest["one call"], busiest["steps"]
            label = (f"{shape['heads']}/{shape['kv_heads']} x d{shape['head_dim']} {shape['dtype']}"
                     f"{' causal' if shape['causal'] else ''}")
            print(f"{label:28s} {seq_len:5d} {ring * 1e3:9.2f} {one * 1e3:12.2f} {ring / one:9.3f} "
                  f"{pairs:12.3f} {(pairs * one + steps) / one:8.3f} {steps * 1e3:10.3f}", flush=True)


if __name__ == "__main__":
    main()
