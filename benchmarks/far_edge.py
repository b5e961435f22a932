"""Does running a window's far edge as the fused causal call reversed make a windowed rank's
attention faster on the torch engine? (issue 56)

One rank's attention as the torch engine runs it (``attend``): rank 1 of AllGather-KV over a
contiguous split on 2 ranks (the later half of the queries over every key), bf16, one thread,
under a causal window, timed three ways in alternating order, round by round: the plain causal
layer, the window with its far-edge calls by the fused causal kernel reversed (the engine's
code), and the window with every masked call by the explicit float32 path (the same code with
``_ops._anti_causal`` answering no). Medians, ranges, the speed-up and each window time against
the plain time x the mask's area ratio; outputs of the two window runs compared first.

    python benchmarks/far_edge.py [--seq-len 16384] [--window 1024] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from _provenance import command, commit

from cptune.engines.torch import _ops
from cptune.masks import Mask

HEADS, HEAD_DIM = 8, 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seq = args.seq_len
    q_pos, k_pos = np.arange(seq // 2, seq), np.arange(seq)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq // 2, HEAD_DIM, generator=generator).to(torch.bfloat16)
    kv = torch.randn(2, 1, HEADS, seq, HEAD_DIM, generator=generator).to(torch.bfloat16)
    plain, window = Mask(seq, True), Mask(seq, True, window=(args.window, 0))
    area = float(window.visible(q_pos[:, None], k_pos[None, :]).sum()
                 / plain.visible(q_pos[:, None], k_pos[None, :]).sum())
    reversing = _ops._anti_causal

    def run(mask: Mask, reverse: bool) -> Callable[[], _ops.Partial]:
        def attend() -> _ops.Partial:
            _ops._anti_causal = reversing if reverse else (lambda visible: False)
            try:
                return _ops.attend(q, kv, q_pos, k_pos, mask)
            finally:
                _ops._anti_causal = reversing
        return attend

    cases = {"plain": run(plain, True), "window reversed": run(window, True),
             "window explicit": run(window, False)}
    got, expected = cases["window reversed"](), cases["window explicit"]()
    error = float((got.out.float() - expected.out.float()).abs().max())
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.rounds):
        for name in (list(cases) if round_ % 2 == 0 else list(cases)[::-1]):
            start = time.perf_counter()
            cases[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    median = {name: statistics.median(values) for name, values in times.items()}
    lines = [f"# {command('far_edge.py', sys.argv[1:] if argv is None else argv)}",
             f"# commit {commit()}, {time.strftime('%Y-%m-%dT%H:%M UTC', time.gmtime())}; "
             f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
             f"# rank 1 of allgather_kv+contiguous on 2 ranks: {seq // 2} queries x {seq} keys, "
             f"{HEADS} heads x {HEAD_DIM}, bf16, window {args.window}, area {area:.4f} of plain causal; "
             f"{args.rounds} rounds, order alternating",
             f"# the two window runs' outputs differ by at most {error:.2g} (bf16)",
             f"{'case':16} {'median ms':>10} {'range ms':>17} {'/ (plain x area)':>17}"]
    for name, values in times.items():
        against = "" if name == "plain" else f"{median[name] / (median['plain'] * area):17.2f}"
        lines.append(f"{name:16} {median[name]:10.1f} {min(values):8.1f}-{max(values):<8.1f} {against}")
    lines.append(f"explicit / reversed: {median['window explicit'] / median['window reversed']:.2f}x")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
