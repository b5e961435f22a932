"""Prepared GPU check: the torch engine's kernel path on one GPU at the per-rank shapes of the
shipped 8-GPU descriptions' configurations, each piece beside what the description predicts.

One GPU cannot run NCCL between ranks, so no configuration runs whole: for every configuration
of the description's 8 ranks (Ring, AllGather-KV, Ulysses and their hybrids) this times what
the busiest rank computes between its exchanges, in one process without ``torch.distributed``,
on the functions the engine's ranks call (``cptune.engines.torch._ops``):

- attention: the rank's ``attend`` calls (one; the Ring's one per block, its own first), its
  pieces and causal zigzag halves included, GQA heads as the engine passes them;
- permute: the all-to-all copies into send order and out of receive order
  (``in_send_order``, ``out_of_receive_order``) of Q, K/V and the output (Ulysses groups);
- replicate: the K/V heads repeated for a head group larger than the KV heads;
- merge: the Ring's ``merge_partials`` of its blocks' partials, one per block;
- sdpa: where the engine's attention is one call with no merge (Ulysses), the same call
  through the public ``scaled_dot_product_attention`` with the backend PyTorch picks (cuDNN,
  flash or efficient) instead of the log-sum-exp-returning op the engine runs: whether the
  engine leaves speed on the table there (not part of "local");
- local: all of the above together.

Predicted, from the description (``DescribedProfile``, the prior's own terms): attention =
the prior's compute term (useful FLOPs / ``attention_rate``), plus its query re-reads for the
Ring; each step = ``memory_time`` of the bytes ``analytic_cost`` counts for it; local = compute
+ memory + launch overhead. Ratio = measured / predicted (above 1: slower than predicted).

Workloads: bf16, 32 heads x 128 (MHA, and GQA with 4 KV heads: Ulysses-8 replicates them)
and 16 heads x 64, causal and not, at 1K, 4K, 16K and 64K tokens per rank (8K-512K in
all). Timing: CUDA events, one warm-up, the median of ``--repeats`` (at most 3 where the
warm-up took over 0.5 s). Cases run from the shortest length up; one likely to end past
``--budget-s`` is skipped and named, so that the whole run stays under 8 minutes on one H100
or H200 (at the description's rates the plan takes about 150 s).

On a machine with one H100 or H200, from the repository root (it needs PyTorch with CUDA,
numpy and scipy; not ``cptune.model``'s package, SQLAlchemy, scikit-learn, Optuna or mpi4py):

    pip install --no-deps -e .
    python benchmarks/gpu_check.py --out gpu_check.txt

The description is picked by the GPU's name (``--description`` overrides it); ``--per-rank``
reruns some lengths only (e.g. ``--per-rank 65536`` for the cases a budget skipped).

Smoke test on a CPU (tiny shapes; the ratios say nothing there):

    python benchmarks/gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from _provenance import command, commit

import cptune
from cptune.config import CPConfig
from cptune.cost import analytic_cost
from cptune.engines.torch._ops import (
    TORCH_DTYPES,
    attend,
    attention_pieces,
    in_send_order,
    kernel_name,
    merge_partials,
    out_of_receive_order,
)
from cptune.feasibility import enumerate_configs
from cptune.hardware import load_description
from cptune.layout import SequenceLayout, kv_replication
from cptune.strategies.primitives import HEADS, SEQ, Partial
from cptune.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
#: (heads, KV heads, head_dim) of the workloads, each causal and not.
SHAPES = ((32, 32, 128), (32, 4, 128), (16, 16, 64))
PER_RANK = (1024, 4096, 16384, 65536)
QUICK_PER_RANK = (32,)
#: A description for each GPU the check is meant for (by a word of its name).
DESCRIPTIONS = {"H200": "h200-sxm-8", "H100": "h100-sxm-8"}
PIECES = ("attention", "sdpa", "permute", "replicate", "merge", "local")
#: A piece whose warm-up takes longer than this is timed at most 3 times.
LONG_PIECE_S = 0.5

T = TypeVar("T")


def _prior() -> ModuleType:
    """``cptune.model._prior`` loaded on its own: the ``cptune.model`` package also brings
    SQLAlchemy and scikit-learn, which this check does not need."""
    name = "cptune_prior_for_gpu_check"
    spec = importlib.util.spec_from_file_location(name, Path(cptune.__file__).parent / "model" / "_prior.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Row:
    """One timed piece of one configuration's busiest rank."""

    workload: Workload
    config: CPConfig
    piece: str
    work: str
    measured_s: float
    predicted_s: float
    #: Useful FLOPs (attention) or bytes (a memory step) the prediction counts; 0: none.
    amount: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


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
    """Median seconds of a callable on ``device`` after one warm-up call, and what the warm-up
    returned: CUDA events on a GPU, wall clock on a CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], T]) -> tuple[float, T]:
        self._sync()
        started = time.perf_counter()
        result = fn()
        self._sync()
        repeats = min(self.repeats, 3) if time.perf_counter() - started > LONG_PIECE_S else self.repeats
        samples = []
        for _ in range(repeats):
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
        return statistics.median(samples), result


def run_case(workload: Workload, config: CPConfig, profile: Any, prior: ModuleType,
             timer: Timer, generator: torch.Generator) -> list[Row]:
    """Time the busiest rank's local pieces of ``config`` (rank 0: every rank does the same
    work) and predict each from ``profile``."""
    device, wire = timer.device, TORCH_DTYPES[workload.dtype]
    u, c = config.head_group, config.context_degree
    layout = SequenceLayout(workload, config)
    rep = kv_replication(workload, u) if u > 1 else 1
    heads, kv_heads = workload.heads // u, workload.kv_heads * rep // u
    b, d = workload.batch, workload.head_dim
    rank_tokens = layout.padded_len // config.ranks

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=wire)

    q_pos = layout.block_positions(0)
    ring = config.strategy == "ring" and c > 1
    # the Ring's blocks in stream order (its own first); else the one call over all keys
    if ring:
        sources = [layout.block_positions(-step % c) for step in range(c)]
    else:
        sources = [layout.context_positions()]
    q = tensor(b, heads, len(q_pos), d)
    kv = tensor(2, b, kv_heads, len(sources[0]), d)

    def attention() -> list[Partial]:
        return [attend(q, kv, q_pos, k_pos, workload.causal, workload.seq_len) for k_pos in sources]

    def merge() -> Partial:
        result: Partial | None = None
        for part in parts:
            result = merge_partials(result, part)
        assert result is not None
        return result

    measured: dict[str, float] = {}
    measured["attention"], parts = timer(attention)
    out = parts[0].out
    if ring:
        measured["merge"], merged = timer(merge)
        out = merged.out
    if rep > 1:
        kv_in = tensor(2, b, workload.kv_heads, rank_tokens, d)
        measured["replicate"], _ = timer(lambda: kv_in.repeat_interleave(rep, dim=HEADS))
    if u > 1:
        q_in = tensor(b, workload.heads, rank_tokens, d)
        kv_sent = tensor(2, b, workload.kv_heads * rep, rank_tokens, d)

        def permute() -> None:
            out_of_receive_order(in_send_order(q_in, HEADS, u, wire), SEQ)
            out_of_receive_order(in_send_order(kv_sent, HEADS, u, wire), SEQ)
            out_of_receive_order(in_send_order(out, SEQ, u, wire), HEADS)

        measured["permute"], _ = timer(permute)
    measured["local"] = sum(measured.values())
    plan = attention_pieces(q_pos, sources[0], workload.causal, workload.seq_len)
    whole = slice(0, len(sources[0]))
    if not ring and len(plan) == 1 and len(plan[0].pieces) == 1 and plan[0].pieces[0].keys == whole:
        # the same one call through the public API, the backend PyTorch picks (not in "local")
        causal_piece = plan[0].pieces[0].causal
        measured["sdpa"], _ = timer(lambda: F.scaled_dot_product_attention(
            q, kv[0], kv[1], is_causal=causal_piece, enable_gqa=heads != kv_heads))

    cost = analytic_cost(workload, config, profile.stream)
    prior_time = prior.prior_time(workload, config, profile)
    memory = {step: profile.memory_time(step, nbytes, workload, config.ranks)
              for step, nbytes in cost.memory_bytes.items()}
    predicted = {"attention": prior_time.compute_s + memory["requery"],
                 "sdpa": prior_time.compute_s + memory["requery"],
                 "local": prior_time.compute_s + prior_time.memory_s + prior_time.overhead_s} | memory
    amounts = {"attention": cost.flops, "sdpa": cost.flops} | cost.memory_bytes
    work = {
        "attention": f"q {heads}x{len(q_pos)} kv {kv_heads}x{len(sources[0])}" + (f" x{c}" if ring else ""),
        "sdpa": f"q {heads}x{len(q_pos)} kv {kv_heads}x{len(sources[0])}",
        "permute": f"{cost.memory_bytes['permute'] / 2**20:.0f} MiB",
        "replicate": f"kv {workload.kv_heads}->{workload.kv_heads * rep} heads",
        "merge": f"{c} x {heads}x{len(q_pos)}",
        "local": "",
    }
    return [Row(workload, config, piece, work[piece], measured[piece], predicted[piece],
                amounts.get(piece, 0)) for piece in PIECES if piece in measured]


def expected_s(workload: Workload, config: CPConfig, done: Sequence[Row], profile: Any, prior: ModuleType,
               repeats: int) -> float:
    """Seconds a case will likely take: its predicted local time x how much slower than
    predicted the last cases ran (the median of their 'local' ratios, at least 1) x the calls
    the timer makes (the longest piece's; a margin of 1.2)."""
    recent = [row.ratio for row in done if row.piece == "local"][-7:]
    slowness = max(1.0, statistics.median(recent)) if recent else 1.0
    predicted = prior.prior_time(workload, config, profile)
    one = slowness * (predicted.compute_s + predicted.memory_s)
    calls = 1 + (min(repeats, 3) if one > LONG_PIECE_S else repeats)
    return 1.2 * calls * one


def _rate(row: Row) -> str:
    """What the piece reached: TFLOP/s for attention, GB/s for a memory step."""
    if not row.amount:
        return ""
    if row.piece in ("attention", "sdpa"):
        return f"{row.amount / row.measured_s / 1e12:.3g} TF/s"
    return f"{row.amount / row.measured_s / 1e9:.3g} GB/s"


def summary(rows: Sequence[Row]) -> list[str]:
    """Ratio median and range per piece, head_dim and mask."""
    lines = [f"{'piece':<11}{'head_dim':>9}{'causal':>8}{'cases':>7}{'median':>9}{'min':>9}{'max':>9}"]
    groups: dict[tuple[str, int, bool], list[float]] = {}
    for row in rows:
        groups.setdefault((row.piece, row.workload.head_dim, row.workload.causal), []).append(row.ratio)
    for key in sorted(groups, key=lambda k: (PIECES.index(k[0]), k)):
        piece, head_dim, causal = key
        ratios = groups[key]
        lines.append(f"{piece:<11}{head_dim:>9}{'yes' if causal else 'no':>8}{len(ratios):>7}"
                     f"{np.median(ratios):>9.3g}{min(ratios):>9.3g}{max(ratios):>9.3g}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--description", help="hardware description to predict with (default: by GPU name; "
                        "h100-sxm-8 where the name matches neither H100 nor H200)")
    parser.add_argument("--per-rank", type=int, nargs="+", help="tokens per rank (default 1K 4K 16K 64K)")
    parser.add_argument("--repeats", type=int, help="timed calls per piece (default 5; 2 with --quick)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip a case that would end past this many seconds (default 420)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes (32 tokens per rank): a smoke test")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("PyTorch sees no CUDA device here; use --device cpu (with --quick) to smoke-test")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    described = args.description or next((d for key, d in DESCRIPTIONS.items() if key in name), "h100-sxm-8")
    prior = _prior()
    profile = prior.DescribedProfile(load_description(described))
    per_rank = args.per_rank or (QUICK_PER_RANK if args.quick else PER_RANK)
    repeats = args.repeats or (2 if args.quick else 5)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# benchmarks/gpu_check.py: the torch engine's kernel path on one device at the per-rank shapes of "
        f"{described}'s {profile.max_ranks}-rank configurations, beside the description's prediction")
    say(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit()}, cptune {cptune.__version__}, "
        f"torch {torch.__version__}, device {name}, kernel {kernel_name(device, torch.bfloat16)}")
    say(f"#   {command('gpu_check.py', argv)}")
    say(f"# predicted from {profile.describe()}; ratio = measured / predicted")
    say()
    say(f"{'tokens/rank':>11}  {'workload':<26}{'config':<23}{'piece':<11}{'work':<26}"
        f"{'measured ms':>12}{'predicted ms':>13}{'ratio':>9}{'reached':>12}")
    rows: list[Row] = []
    skipped, failed = [], []
    generator = torch.Generator(device=device).manual_seed(0)
    timer = Timer(device, repeats)
    for tokens, workload, config in cases(described, per_rank):
        expected = expected_s(workload, config, rows, profile, prior, repeats)
        if time.perf_counter() - started + expected > args.budget_s:
            skipped.append(f"{label(workload)} {config.label}")
            continue
        try:
            case = run_case(workload, config, profile, prior, timer, generator)
        except torch.OutOfMemoryError:
            failed.append(f"{label(workload)} {config.label}: out of memory")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows += case
        for row in case:
            say(f"{_k(tokens):>11}  {label(workload):<26}{config.label:<23}{row.piece:<11}{row.work:<26}"
                f"{row.measured_s * 1e3:>12.4g}{row.predicted_s * 1e3:>13.4g}{row.ratio:>9.3g}"
                f"{_rate(row):>12}")
    say()
    say("ratio measured / predicted, by piece:")
    for line in summary(rows):
        say(line)
    for what, which in (("skipped past the budget", skipped), ("failed", failed)):
        if which:
            say(f"{len(which)} case(s) {what}: " + "; ".join(which))
    ran = len({(row.workload, row.config) for row in rows})
    say(f"elapsed {time.perf_counter() - started:.0f} s for {ran} cases")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
