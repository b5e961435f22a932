"""Does the measured time follow the mask? Per configuration (strategy x layout) on this host's
mpi engine (or ``--backend torch``: gloo ranks, PyTorch's CPU flash kernel), a layer packed with
8 causal documents and one with a sliding window against the same layer plain causal: measured
time / (plain causal time x the mask's area ratio). Goal (issue 56): within 1.3x. And does the
measured winner among strategy x layout move between the plain and the packed layer where the
counts (the busiest rank's computed work and bytes, ``cptune.analytic_cost`` /
``cptune.model.computed_flops``) say it should?

Configuration by configuration, its three layers back to back (plain, packed, window; the
next configuration the other way round; ``cptune.measure`` checks each against its float64
reference, kept for the three), so a ratio's two times are seconds apart, in ``--rounds``
rounds whose configuration order alternates (``--reverse``: a run that starts with the
window); the host's load average is written at the start and the end, and runs the
contention guard judged disturbed are marked.

    python benchmarks/masks.py [--seq-len 16384] [--ranks 2] [--rounds 1] [--repeats 3] [--configs LABEL ...]
                               [--backend mpi|torch] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import command, commit  # noqa: E402

import cptune  # noqa: E402
from cptune import CPConfig, Workload, analytic_cost, measure  # noqa: E402
from cptune.feasibility import feasibility  # noqa: E402
from cptune.layout import default_layout, layout_choices, normal, runnable_layouts  # noqa: E402
from cptune.model import computed_flops  # noqa: E402

GOAL = 1.3


def workloads(seq_len: int) -> dict[str, Workload]:
    """The plain causal layer, packed with 8 causal documents, and with a window of seq/16."""
    shape = {"heads": 8, "head_dim": 64, "causal": True}
    return {
        "plain": Workload(seq_len, **shape),
        "packed": Workload(seq_len, documents=[seq_len // 8] * 8, **shape),
        "window": Workload(seq_len, window=[seq_len // 16, 0], **shape),
    }


def configurations(cases: dict[str, Workload], ranks: int) -> list[tuple[str, CPConfig]]:
    """Every strategy x layout a search sweeps for the packed layer on ``ranks``, and the
    plain layer's and the window's defaults, each named by its layout: (label, config)."""
    bases = [CPConfig("ring", ranks), CPConfig("allgather_kv", ranks), CPConfig("ulysses", ranks, ranks)]
    found: dict[str, CPConfig] = {}
    for base in bases:
        for name in ("plain", "packed", "window"):
            for layout in layout_choices(cases[name], base):
                config = base.with_layout(layout or default_layout(cases[name], base.context_degree))
                if base.context_degree == 1:
                    config = base
                found.setdefault(config.label, config)
    return sorted(found.items())


def runs(w: Workload, config: CPConfig) -> bool:
    return config.context_degree == 1 or config.layout in runnable_layouts(w, config)


def baseline(cases: dict[str, Workload], config: CPConfig) -> CPConfig:
    """The plain layer's configuration a masked one is compared with: the same one where the
    plain layer runs its layout, else the strategy in the plain layer's default layout."""
    if runs(cases["plain"], config):
        return config
    return config.with_layout(default_layout(cases["plain"], config.context_degree))


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reverse", action="store_true",
                        help="measure the workloads window, packed, plain (a second run's order, so that a "
                             "load that changes over the run biases its ratios the other way)")
    parser.add_argument("--configs", nargs="+", metavar="LABEL",
                        help="measure only these configurations (labels as the table writes them, "
                             "e.g. allgather_kv+zigzag ulysses), for a quick check; the plain layer's "
                             "baseline of each is measured with it")
    parser.add_argument("--backend", choices=("mpi", "torch"), default="mpi",
                        help="the engine that runs every layer (default: mpi)")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    cases = workloads(args.seq_len)
    kernel = "numpy" if args.backend == "mpi" else "fused"  # the work each engine's kernel does
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# {command('masks.py', sys.argv[1:])}")
    say(f"# cptune {cptune.__version__} at {commit()}, {args.backend} engine, {args.ranks} ranks, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    first = "window, packed, plain" if args.reverse else "plain, packed, window"
    say(f"# start: {load()}; the host is shared (others' runs on its 2 cores); each configuration's "
        f"layers back to back ({first}; the next configuration's the other way)")
    for name, w in cases.items():
        share = w.mask.area / cases["plain"].mask.area
        say(f"#   {name}: {w.describe()}, mask area {share:.4f} of plain causal")
    configs = configurations(cases, args.ranks)
    if args.configs:
        known = {label for label, _ in configs}
        unknown = sorted(set(args.configs) - known)
        if unknown:
            parser.error(f"unknown configurations {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        wanted = set(args.configs) | {baseline(cases, config).label for label, config in configs
                                      if label in args.configs}
        configs = [(label, config) for label, config in configs if label in wanted]
    times: dict[tuple[str, str], list[float]] = {}
    disturbed: set[tuple[str, str]] = set()
    named = list(cases.items())
    for round_ in range(args.rounds):
        order = configs if round_ % 2 == 0 else configs[::-1]
        for n, (label, config) in enumerate(order):
            for name, w in named[::-1] if args.reverse != (n % 2 == 1) else named:
                run = normal(w, config)
                if not runs(w, config) or feasibility(w, run):
                    continue
                m = measure(w, run, args.backend, warmup=1, repeats=args.repeats)
                times.setdefault((label, name), []).append(m.median_ms)
                if m.disturbed:
                    disturbed.add((label, name))
                print(f"  round {round_ + 1} {label:28} {name:7} {m.median_ms:9.1f} ms"
                      f"{'  (disturbed)' if m.disturbed else ''}", flush=True)
    say(f"# end: {load()}")
    say()
    say("Per configuration: median ms; mask / (plain x area ratio), goal <= 1.3; counts: the busiest "
        f"rank's {kernel}-kernel GFLOP and MB sent")
    say(f"{'configuration':28} {'plain':>9} {'packed':>9} {'ratio':>6} {'window':>9} {'ratio':>6}   "
        f"{'plain':>13} {'packed':>13} {'window':>13}")
    met = total = 0
    for label, config in configs:
        row = [f"{label:28}"]
        base = baseline(cases, config).label
        plain = statistics.median(times[(base, "plain")]) if (base, "plain") in times else None
        row.append(f"{plain:9.1f}" if plain else f"{'-':>9}")
        for name in ("packed", "window"):
            if (label, name) not in times or plain is None:
                row += [f"{'-':>9}", f"{'-':>6}"]
                continue
            ms = statistics.median(times[(label, name)])
            ratio = ms / (plain * cases[name].mask.area / cases["plain"].mask.area)
            total += 1
            met += ratio <= GOAL
            mark = "*" if (label, name) in disturbed or (base, "plain") in disturbed else " "
            row += [f"{ms:9.1f}", f"{ratio:5.2f}{mark}"]
        for w in cases.values():
            run = normal(w, config)
            if not runs(w, config) or feasibility(w, run):
                row.append(f"{'-':>13}")
                continue
            sent = sum(analytic_cost(w, run).bytes_sent.values())
            row.append(f"{computed_flops(w, run, kernel) / 1e9:6.1f} {sent / 1e6:6.1f}")
        say(" ".join(row))
    say(f"(* a run the contention guard judged disturbed; a layout the plain layer cannot run is compared "
        f"with the strategy's plain default)  within {GOAL}x: {met} of {total}")
    say()
    for name in ("plain", "packed", "window"):
        ranked = sorted((statistics.median(v), label) for (label, n), v in times.items() if n == name)
        counted = sorted((computed_flops(cases[name], normal(cases[name], config), kernel), label)
                         for label, config in configs if (label, name) in times)
        say(f"{name}: measured winner {ranked[0][1]} ({ranked[0][0]:.1f} ms; next {ranked[1][1]} "
            f"{ranked[1][0] / ranked[0][0]:.2f}x); least computed work {counted[0][1]}"
            if len(ranked) > 1 else f"{name}: one configuration")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
