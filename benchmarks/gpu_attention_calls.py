"""Prepared GPU microbenchmark: what one attention call costs on one GPU, from the shortest
calls up, for the per-call terms of the hardware descriptions (issue 32) and the torch
engine's choice of kernel.

For each shape (bf16, batch 2; heads x head_dim 32x128, 24x128, 32x64, 32x32; causal and not;
queries = keys = L tokens, L from 64 to 32K) it times, with CUDA events over back-to-back
calls (device time per call, launches queued ahead):

- ``sdpa``: the public ``scaled_dot_product_attention`` with the backend PyTorch picks;
- ``flash_lse``: ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2, returns the
  log-sum-exp a Ring merge needs; what cptune's torch engine runs on CUDA today);
- ``cudnn_lse``: ``aten._scaled_dot_product_cudnn_attention`` with the log-sum-exp, where
  this PyTorch has it;
- ``efficient_lse``: ``aten._scaled_dot_product_efficient_attention`` with the log-sum-exp.

Then the fixed costs around a call: an empty-ish kernel (``add_`` on 1 element) back to back
(the device's per-kernel floor) and with a host synchronisation after each (a launch's round
trip), a copy of 1 GiB (device-memory bandwidth), and a Ring-style merge of two partials.

Per op it fits ``t = floor + flops / rate`` by least squares on the non-causal calls of each
head shape (the per-call floor and the asymptotic rate) and prints the work per call at which
the call reaches half that rate.

On a machine with one GPU, from the repository root (needs PyTorch with CUDA only):

    python benchmarks/gpu_attention_calls.py --out gpu_attention_calls.txt

Smoke test on a CPU (tiny shapes; the numbers say nothing there):

    python benchmarks/gpu_attention_calls.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from _provenance import command, commit

#: (heads, head_dim) of the shapes timed.
SHAPES = ((32, 128), (24, 128), (32, 64), (32, 32))
LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (16, 32, 64)
BATCH = 2


def timed(call: Callable[[], object], device: str, budget_s: float = 0.05) -> float:
    """Seconds per ``call``, back to back: one warm-up, then enough calls to fill about
    ``budget_s``, the median of 3 such batches."""
    call()
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    once = max(time.perf_counter() - start, 1e-6)
    count = max(1, min(2000, int(budget_s / once)))
    batches = []
    for _ in range(3):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(count):
                call()
            end.record()
            end.synchronize()
            batches.append(begin.elapsed_time(end) / 1e3 / count)
        else:
            start = time.perf_counter()
            for _ in range(count):
                call()
            batches.append((time.perf_counter() - start) / count)
    return statistics.median(batches)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ops(device: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], object]]:
    """The attention calls timed, by name; those this PyTorch or device lacks are left out."""
    aten = torch.ops.aten
    found: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], object]] = {
        "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if device == "cuda":
        found["flash_lse"] = lambda q, k, v, causal: aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False)
        if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
            found["cudnn_lse"] = lambda q, k, v, causal: aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False)
        found["efficient_lse"] = lambda q, k, v, causal: aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal)
    return found


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The online-softmax merge of two partials over disjoint keys, as a Ring step does."""
    lse = torch.logaddexp(*lses)
    return sum(out * torch.exp(part - lse).unsqueeze(-1) for out, part in zip(outs, lses, strict=True))


def flops(heads: int, head_dim: int, length: int, causal: bool) -> float:
    """Useful FLOPs of one call: 4 * head_dim per (query, key) pair and head, half the pairs
    (and the diagonal) when causal."""
    pairs = length * (length + 1) / 2 if causal else length * length
    return 4.0 * BATCH * heads * head_dim * pairs


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(floor s, rate FLOP/s) of ``t = floor + flops / rate`` over (flops, seconds) points, by
    least squares on the relative error (each point weighted 1 / t^2), so that the short calls
    that decide the floor count as much as the long ones that decide the rate."""
    weights = [1.0 / y**2 for _, y in points]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points, strict=True)) / total
    mean_y = sum(w * y for w, (_, y) in zip(weights, points, strict=True)) / total
    slope = (sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points, strict=True))
             / sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points, strict=True)))
    return mean_y - slope * mean_x, 1.0 / slope


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--out", help="also write the result to this file")
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --device cpu --quick for a smoke test",
              file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    shapes = SHAPES[:1] if args.quick else SHAPES
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [
        "# benchmarks/gpu_attention_calls.py: one attention call's cost on one GPU, shortest calls first.",
        f"# {datetime.now(UTC):%Y-%m-%d}, code at {commit()}, on {name}, torch {torch.__version__}:",
        f"#   {command('gpu_attention_calls.py', argv)}",
        f"# bf16 (float32 on CPU), batch {BATCH}, queries = keys = L tokens; device time per call, calls",
        "# back to back (CUDA events); TF/s = useful FLOPs (4 x head_dim per pair and head, causal: half)",
        "# / time.",
        "",
        f"{'op':<14}{'heads':>6}{'dim':>5}{'causal':>7}{'L':>7}{'us/call':>11}{'TF/s':>9}",
    ]
    print("\n".join(lines), flush=True)
    points: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for heads, head_dim in shapes:
        for causal in (False, True):
            for length in lengths:
                q, k, v = (torch.randn(BATCH, heads, length, head_dim, device=device, dtype=dtype)
                           for _ in range(3))
                for op, call in ops(device).items():
                    try:
                        seconds = timed(functools.partial(call, q, k, v, causal), device)
                    except RuntimeError as exc:  # a kernel this shape or GPU lacks
                        line = (f"{op:<14}{heads:>6}{head_dim:>5}{causal!s:>7}{length:>7}"
                                f"  n/a: {str(exc)[:60]}")
                    else:
                        work = flops(heads, head_dim, length, causal)
                        if not causal:
                            points.setdefault((op, heads, head_dim), []).append((work, seconds))
                        line = (f"{op:<14}{heads:>6}{head_dim:>5}{causal!s:>7}{length:>7}"
                                f"{seconds * 1e6:>11.1f}{work / seconds / 1e12:>9.1f}")
                    lines.append(line)
                    print(line, flush=True)
    fits = ["", "fit of t = floor + flops / rate, non-causal calls of each head shape, by relative least "
            "squares:",
            f"{'op':<14}{'heads':>6}{'dim':>5}{'floor us':>10}{'rate TF/s':>11}{'half-rate GFLOP':>17}"]
    for (op, heads, head_dim), found in points.items():
        if len(found) >= 3:
            floor, rate = fit(found)
            fits.append(f"{op:<14}{heads:>6}{head_dim:>5}{floor * 1e6:>10.1f}{rate / 1e12:>11.1f}"
                        f"{floor * rate / 1e9:>17.2f}")
    fixed = ["", "fixed costs:"]
    one = torch.zeros(1, device=device)
    fixed.append(f"  tiny kernel back to back:         {timed(lambda: one.add_(1), device) * 1e6:8.2f} us")

    def round_trip() -> None:
        one.add_(1)
        sync(device)

    fixed.append(f"  tiny kernel + host synchronise:   {timed(round_trip, device) * 1e6:8.2f} us")
    size = (2**20 if args.quick else 2**28)  # float32 elements: 4 MiB / 1 GiB
    source = torch.empty(size, device=device)
    target = torch.empty_like(source)
    copy_s = timed(lambda: target.copy_(source), device)
    fixed.append(f"  copy of {size * 4 / 2**30:.3g} GiB: {copy_s * 1e3:8.3f} ms = "
                 f"{2 * size * 4 / copy_s / 1e9:7.0f} GB/s read + written")
    for length in sorted({lengths[len(lengths) // 2], lengths[-1]}):
        outs = [torch.randn(BATCH, 32, length, 128, device=device) for _ in range(2)]
        lses = [torch.randn(BATCH, 32, length, device=device) for _ in range(2)]
        fixed.append(f"  Ring merge of two float32 partials, 32 heads x 128, L={length}: "
                     f"{timed(functools.partial(merge, outs, lses), device) * 1e6:8.1f} us")
    for line in fits + fixed:
        print(line, flush=True)
    lines += fits + fixed
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
