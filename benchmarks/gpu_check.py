"""Prepared GPU check of the torch engine, in one run under 10 minutes on one H100 or H200:

1. **Multi-rank correctness on one GPU**: every configuration on 2 and 4 ranks sharing the GPU,
   over gloo with CUDA tensors (NCCL refuses two ranks on one GPU), MHA, GQA and MQA, causal
   and not, fp32 and bf16, each run twice on the same tensors and checked against the float64
   reference, then trained one step (its output and gradients of Q, K and V against the
   float64 reference: the first run of the CUDA backward kernels) (``benchmarks/torch_ranks.py``;
   the Ring's send/recv, the all-gather and the reduce-scatter through host copies, which gloo
   takes where it may not take CUDA tensors). A correctness run: its exchange times are gloo's,
   not NCCL's, and nothing is stored.
2. **Each rank's local work against its ideal**, at the per-rank shapes of the shipped 8-GPU
   description's configurations (h200-sxm-8 on an H200, else h100-sxm-8: every strategy and
   hybrid of 8 ranks; bf16, 32 heads x 128 (MHA, and GQA with 4 KV heads, which Ulysses-8
   replicates) and 16 heads x 64, causal and not, 1K, 4K, 16K and 64K tokens per rank). Local
   work is what a rank of context block 1 (block 0 on one block) computes between its
   exchanges, on the functions its ranks call
   (``cptune.engines.torch._ops``): the Ulysses packs and unpacks of Q, K/V and the output,
   AllGather-KV's copy of the arrivals into position order, every attention step (the Ring's c
   steps, own block first, merged in place) and the output's cast. Its ideal, from figures of
   the same run: for each fused call the step needs (``cptune.calls``), the time one
   ``scaled_dot_product_attention`` call of that shape takes (the backend PyTorch picks, fixed
   cost included), plus the bytes the step must move (packs, unpacks and the gathered copy read
   and written once; a first write into the float32 accumulator w + 4 bytes per element, a merge
   8 + w, the output's cast 4 + w) at the copy rate of this GPU. Ratio = local / ideal; goal:
   median <= 1.15 and worst <= 1.5.
3. **The kernel probe's choice** per GPU, dtype, head_dim, grouping and call size.

Timing: CUDA events, one warm-up, the median of ``--repeats``. Cases run from the shortest
length up; one likely to end past ``--budget-s`` is skipped and named.

On a machine with one H100 or H200, from the repository root (PyTorch with CUDA, numpy,
scipy; not SQLAlchemy, scikit-learn, Optuna or mpi4py):

    pip install --no-deps -e .
    python benchmarks/gpu_check.py --out gpu_check.txt

``--smoke`` runs all three on the CPU at tiny shapes (gloo CPU ranks, staging through host
copies as on a GPU; the ratios say nothing there): what ``tests/test_benchmarks_torch.py``
runs, so the script is known to run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from _provenance import command, commit

import cptune
from cptune.calls import attention_calls
from cptune.config import CPConfig
from cptune.engines.torch import _kernels
from cptune.engines.torch._ops import (
    TORCH_DTYPES,
    activations,
    attend,
    joined_in_order,
    pack,
    unpack,
)
from cptune.feasibility import enumerate_configs
from cptune.hardware import load_description
from cptune.layout import SequenceLayout, kv_replication
from cptune.reference import REAL_BF16_TOLERANCE
from cptune.strategies.primitives import HEADS, SEQ, Partial
from cptune.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
#: (heads, KV heads, head_dim) of the workloads, each causal and not.
SHAPES = ((32, 32, 128), (32, 4, 128), (16, 16, 64))
PER_RANK = (1024, 4096, 16384, 65536)
SMOKE_PER_RANK = (32,)
#: The description whose 8-rank configurations are the cases, by a word of the GPU's name.
DESCRIPTIONS = {"H200": "h200-sxm-8", "H100": "h100-sxm-8"}
#: Ranks sharing the one GPU in the correctness run.
WORLDS = (2, 4)
#: Bytes of the copy that measures the copy rate (read and written once).
COPY_BYTES = 1 << 30
GOAL_MEDIAN, GOAL_WORST = 1.15, 1.5

T = TypeVar("T")


@dataclass(frozen=True)
class Row:
    """One configuration's local work on one rank against its ideal."""

    workload: Workload
    config: CPConfig
    calls: int
    local_s: float
    attention_ideal_s: float
    bytes_moved: int
    copy_rate: float

    @property
    def ideal_s(self) -> float:
        return self.attention_ideal_s + self.bytes_moved / self.copy_rate

    @property
    def ratio(self) -> float:
        return self.local_s / self.ideal_s


def label(workload: Workload) -> str:
    """'32h/4kv d128 causal S=64K': a workload in a table cell."""
    kv = f"/{workload.kv_heads}kv" if workload.kv_heads != workload.heads else ""
    causal = " causal" if workload.causal else ""
    return f"{workload.heads}h{kv} d{workload.head_dim}{causal} S={_k(workload.seq_len)}"


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def cases(description: str, per_rank: Sequence[int]) -> list[tuple[int, Workload, CPConfig]]:
    """(tokens per rank, workload, configuration) for every configuration of all the
    description's ranks that fits its memory, shortest length first."""
    hardware = load_description(description)
    ranks = hardware.max_ranks
    found = []
    for tokens in per_rank:
        for heads, kv_heads, head_dim in SHAPES:
            for causal in (False, True):
                workload = Workload(seq_len=tokens * ranks, heads=heads, kv_heads=kv_heads,
                                    head_dim=head_dim, dtype="bf16", causal=causal)
                configs = enumerate_configs(workload, ranks, memory_limit=hardware.memory_bytes)
                found += [(tokens, workload, config) for config in configs if config.ranks == ranks]
    return found


class Timer:
    """Median seconds of a callable on ``device`` after one warm-up call: CUDA events on a
    GPU, wall clock on a CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        samples = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(begin.elapsed_time(end) / 1e3)
            else:
                started = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)


def copy_rate(timer: Timer, nbytes: int) -> float:
    """Bytes per second a device-to-device copy reads and writes (both counted)."""
    source = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=timer.device)
    target = torch.empty_like(source)
    return 2 * nbytes / timer(lambda: target.copy_(source))


class Ideal:
    """What one ``scaled_dot_product_attention`` call of each shape takes, timed once per shape."""

    def __init__(self, timer: Timer, generator: torch.Generator) -> None:
        self.timer, self.generator = timer, generator
        self.seconds: dict[tuple, float] = {}

    def call_s(self, batch: int, heads: int, kv_heads: int, rows: int, keys: int, head_dim: int,
               causal: bool, dtype: torch.dtype) -> float:
        key = (batch, heads, kv_heads, rows, keys, head_dim, causal, dtype)
        if key not in self.seconds:
            device = self.timer.device

            def draw(*shape: int) -> torch.Tensor:
                return torch.randn(shape, generator=self.generator, device=device).to(dtype)

            q = draw(batch, heads, rows, head_dim)
            k, v = draw(batch, kv_heads, keys, head_dim), draw(batch, kv_heads, keys, head_dim)
            self.seconds[key] = self.timer(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=heads != kv_heads))
        return self.seconds[key]


def run_case(workload: Workload, config: CPConfig, timer: Timer, ideal: Ideal, rate: float,
             generator: torch.Generator) -> Row:
    """Time a rank's local work of ``config`` (see the module docstring) and work out its ideal."""
    device, wire = timer.device, TORCH_DTYPES[workload.dtype]
    u, c = config.head_group, config.context_degree
    layout = SequenceLayout(workload, config)
    rep = kv_replication(workload, u) if u > 1 else 1
    heads, kv_heads = workload.heads // u, (workload.kv_heads * rep // u) if u > 1 else workload.kv_heads
    b, d, w = workload.batch, workload.head_dim, wire.itemsize
    tokens, block = layout.padded_len // config.ranks, layout.padded_len // c
    group = min(1, c - 1)  # context block 1: its calls are the busiest AllGather-KV makes
    q_pos = layout.block_positions(group)

    def draw(shape: Sequence[int], laid_out: bool = False) -> torch.Tensor:
        x = torch.randn(tuple(shape), generator=generator, device=device).to(wire)
        if laid_out:  # laid out as the engine holds its activations on this device
            target = activations(x.shape, wire, device)
            target.copy_(x)
            return target
        return x

    q_in = draw((b, workload.heads, tokens, d), True)
    kv_in = draw((2, b, workload.kv_heads, tokens, d), True)
    arrived_q = draw((u, b, heads, tokens, d))  # what the Ulysses all-to-all brings
    arrived_kv = draw((u, 2, b, kv_heads, tokens, d))
    gathers = config.strategy == "allgather_kv" and c > 1
    arrivals = [draw((2, b, kv_heads, block, d), True) for _ in range(c)] if gathers else []
    if config.strategy == "ring":  # each block arrives in the Ring's own buffer: one stands for all
        steps = [layout.block_positions((group - step) % c) for step in range(c)]
    else:
        steps = [layout.gathered_positions if gathers else q_pos]

    def local() -> torch.Tensor:
        q, kv = q_in, kv_in
        if u > 1:
            pack(q_in, HEADS, u, wire), pack(kv_in, HEADS, u, wire, rep)
            q, kv = unpack(arrived_q, SEQ), unpack(arrived_kv, SEQ)
        if gathers:
            kv = joined_in_order(arrivals, SEQ, layout.gather_order)
        result: Partial | None = None
        for k_pos in steps:
            result = attend(q, kv, q_pos, k_pos, workload.mask, into=result)
        assert result is not None
        out = result.out
        if u > 1:
            out = unpack(pack(out, SEQ, u, wire), HEADS)
        return out.to(wire)

    local_s = timer(local)

    attention_s, moved, written = 0.0, 0, set()
    plans = [attention_calls(q_pos, k_pos, workload.mask) for k_pos in steps]
    for plan in plans:
        for call in plan:
            rows, keys = call.rows.stop - call.rows.start, call.keys.stop - call.keys.start
            attention_s += ideal.call_s(b, heads, kv_heads, rows, keys, d, call.causal, wire)
            span = (call.rows.start, call.rows.stop)
            moved += b * heads * rows * d * ((8 + w) if span in written else (w + 4))
            written.add(span)
    calls = sum(len(plan) for plan in plans)
    if calls == 1 and written == {(0, len(q_pos))}:
        moved = 0  # one call over every row: the kernel's own output is the result
    else:
        moved += b * heads * len(q_pos) * d * (4 + w)  # the float32 result cast to the wire dtype
    if u > 1:
        sent = b * tokens * d * w
        moved += 2 * 2 * sent * (workload.heads + 2 * workload.kv_heads * rep)  # Q, K/V: pack, unpack
        moved += 2 * 2 * b * len(q_pos) * heads * d * w  # the output: pack, unpack
    if gathers:
        moved += 2 * 2 * b * kv_heads * layout.padded_len * d * w  # the gathered K/V into position order
    return Row(workload, config, calls, local_s, attention_s, moved, rate)


def expected_s(workload: Workload, done: Sequence[Row], repeats: int) -> float:
    """Seconds a case will likely take: the last cases' local seconds per useful pair x this
    case's pairs x the calls the timer makes (local, and about as much again for its ideal)."""
    def pairs(w: Workload) -> float:
        return w.seq_len * w.seq_len * w.heads * w.head_dim / (2 if w.causal else 1)

    recent = [row.local_s / pairs(row.workload) for row in done[-7:]]
    if not recent:
        return 0.0
    return 2 * (1 + repeats) * statistics.median(recent) * pairs(workload)


def correctness(device: str, smoke: bool, say: Callable[[str], None]) -> list[str]:
    """Every configuration on each of ``WORLDS`` ranks sharing this device over gloo
    (``torch_ranks.py``); one line per world and what failed."""
    shapes = ["--seq-len", "1000", "--heads", "8", "--head-dim", "64", "--dtypes", "fp32,bf16"]
    args = ["--device", device, "--train", *(["--stage"] if smoke else shapes)]
    tolerance = REAL_BF16_TOLERANCE
    problems = []
    for world in WORLDS:
        command_line = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={world}", str(Path(__file__).parent / "torch_ranks.py"), *args]
        # a session of its own, so that a hang takes the launcher's ranks down with it
        launched = subprocess.Popen(command_line, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        try:
            stdout, stderr = launched.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(launched.pid, signal.SIGKILL)
            launched.communicate()
            problems.append(f"{world} ranks: did not finish within 240 s")
            say(problems[-1])
            continue
        done = subprocess.CompletedProcess(command_line, launched.returncode, stdout, stderr)
        if done.returncode != 0 or not done.stdout.strip():
            problems.append(f"{world} ranks: exit {done.returncode}: {done.stderr.strip()[-600:]}")
            say(problems[-1])
            continue
        summary = json.loads(done.stdout.splitlines()[-1])
        for case in summary["cases"]:
            dtype = "bf16" if "bf16" in case["workload"] else "fp32"
            worst = max(case["errors"])
            calls = max((max(steps, default=0) for steps in case["calls"]), default=0)
            verdict = "ok" if case["failed"] is None and worst <= tolerance[dtype] else "WRONG"
            say(f"{world:>5}  {case['workload']:<50}{case['config']:<24}{worst:>10.2e}{calls:>6}  "
                f"{verdict}{'' if case['failed'] is None else ': ' + case['failed']}")
            if verdict != "ok":
                problems.append(f"{world} ranks {case['config']} {case['workload']}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-rank", type=int, nargs="+", help="tokens per rank (default 1K 4K 16K 64K)")
    parser.add_argument("--repeats", type=int, help="timed calls per measurement (default 5; 2 with --smoke)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="skip a case that would end past this many seconds from the start (default 480)")
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU, tiny shapes: a test that the script runs, not a result")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    started = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("PyTorch sees no CUDA device here; --smoke runs the script on the CPU at tiny shapes")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    described = next((d for key, d in DESCRIPTIONS.items() if key in name), "h100-sxm-8")
    per_rank = args.per_rank or (SMOKE_PER_RANK if args.smoke else PER_RANK)
    repeats = args.repeats or (2 if args.smoke else 5)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say("# benchmarks/gpu_check.py: the torch engine on one device: every configuration on 2 and 4 ranks "
        "sharing it (gloo), each rank's local work against its ideal, the kernel probe's choices")
    software = " ".join(f"{k} {v}" for k, v in _kernels.software().items())
    say(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit()}, cptune {cptune.__version__}, "
        f"torch {torch.__version__}, device {name} {software}".rstrip())
    say(f"#   {command('gpu_check.py', argv)}")
    say()
    say("1. correctness: every configuration on ranks sharing the device over gloo, run twice on the same "
        "tensors, then trained one step (output and gradients), against the float64 reference")
    say(f"{'ranks':>5}  {'workload':<50}{'config':<24}{'rel. error':>10}{'calls':>6}")
    problems = correctness(device.type, args.smoke, say)
    say(f"{len(problems)} problem(s)" + (": " + "; ".join(problems) if problems else ""))
    say()

    timer = Timer(device, repeats)
    generator = torch.Generator(device=device).manual_seed(0)
    rate = copy_rate(timer, (1 << 20) if args.smoke else COPY_BYTES)
    ideal = Ideal(timer, generator)
    say(f"2. local work against its ideal at the per-rank shapes of {described}'s 8-rank configurations "
        f"(a rank of context block 1); copy rate {rate / 1e9:.4g} GB/s (read + write)")
    say(f"{'tokens/rank':>11}  {'workload':<26}{'config':<23}{'calls':>6}{'local ms':>11}{'calls ms':>10}"
        f"{'bytes ms':>10}{'ideal ms':>10}{'ratio':>8}")
    rows: list[Row] = []
    skipped, failed = [], []
    for tokens, workload, config in cases(described, per_rank):
        if time.perf_counter() - started + expected_s(workload, rows, repeats) > args.budget_s:
            skipped.append(f"{label(workload)} {config.label}")
            continue
        try:
            row = run_case(workload, config, timer, ideal, rate, generator)
        except torch.OutOfMemoryError:
            failed.append(f"{label(workload)} {config.label}: out of memory")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        say(f"{_k(tokens):>11}  {label(workload):<26}{config.label:<23}{row.calls:>6}"
            f"{row.local_s * 1e3:>11.4g}{row.attention_ideal_s * 1e3:>10.4g}"
            f"{row.bytes_moved / rate * 1e3:>10.4g}{row.ideal_s * 1e3:>10.4g}{row.ratio:>8.3g}")
    say()
    say(f"local / ideal (goal: median <= {GOAL_MEDIAN}, worst <= {GOAL_WORST}):")
    for line in summary(rows):
        say(line)
    for what, which in (("skipped past the budget", skipped), ("failed", failed)):
        if which:
            say(f"{len(which)} case(s) {what}: " + "; ".join(which))
    say()
    say("3. the kernel probe's choices (GPU, dtype, head_dim, grouped, call size, layouts: the kernel)")
    picks = _kernels.CHOOSER.picks
    for key, pick in sorted(picks.items(), key=str):
        gpu, dtype, head_dim, grouped, size, q_heads_outer, kv_heads_outer = key
        say(f"  {gpu} {str(dtype).removeprefix('torch.')} d{head_dim} {'GQA' if grouped else 'MHA'}, "
            f"sqrt(rows x keys) ~{_k(2 ** size)}, q {'heads' if q_heads_outer else 'sequence'}-major, "
            f"K/V {'heads' if kv_heads_outer else 'sequence'}-major: {pick.describe()}")
    if not picks:
        say("  none probed (only CUDA probes; the CPU runs flash_for_cpu)")
    say(f"elapsed {time.perf_counter() - started:.0f} s for {len(rows)} cases")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


def summary(rows: Sequence[Row]) -> list[str]:
    """Ratio median and worst overall and per head_dim and mask."""
    groups: dict[str, list[float]] = {"all": [row.ratio for row in rows]}
    for row in rows:
        key = f"d{row.workload.head_dim} {'causal' if row.workload.causal else 'full'}"
        groups.setdefault(key, []).append(row.ratio)
    lines = [f"{'cases':<14}{'count':>6}{'median':>9}{'worst':>9}"]
    for key, ratios in groups.items():
        if ratios:
            lines.append(f"{key:<14}{len(ratios):>6}{np.median(ratios):>9.3g}{max(ratios):>9.3g}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
