"""Does the prior (and the fitted model, each length held out) pick right on a packed-document
shape on this host? As ``cptune fit`` on ``spaces/holdout-*.toml`` does for plain shapes:
every strategy x layout of a causal layer packed with documents of ``--document`` tokens
(the same rule at every length) measured on the mpi engine at each of ``--seq-lens`` and 1-2
ranks, in ``--rounds`` interleaved rounds (configuration order alternating; a
configuration's time is its median over rounds); then per (length, ranks) decision the pick
of the calibrated prior, and of the cost model fitted on the other lengths
(``cptune.model.held_out_predictions``), against the measured fastest. Goal (issue 56):
regret median <= 1.02, worst <= 1.05.

Configurations that do the same work - the same counts (``same_work``: the busiest rank's
numpy-kernel FLOPs, bytes and rounds by collective, kernels and memory-bound bytes) - are one
choice: a packed layer whose documents each stay whole on a rank computes the same attention
with no exchange under the Ring or AllGather-KV, contiguous or per document. Each is measured
on its own, and a class's time is the median of all its members' samples, so which member a
pick names does not decide its regret; the spread between members' own medians is reported
(the noise between runs of identical work). The regret against each configuration alone is
reported beside it, and so is the measurement's own floor (``split_half_regrets``): the
regret the fastest class of half the rounds shows judged by the other half, which no pick's
regret can be read below.

Needs this host's calibration in ``--db`` (``cptune calibrate --db FILE``); measures through
``cptune.measure`` (each configuration's output checked against the float64 reference first).

    python benchmarks/masked_prior_regret.py --db CALIBRATED_DB [--seq-lens 1024 2048 3072 4096]
        [--document 512] [--rounds 9] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import command, commit  # noqa: E402

import cptune  # noqa: E402
from cptune import CPConfig, Workload, analytic_cost, measure  # noqa: E402
from cptune.feasibility import feasibility  # noqa: E402
from cptune.layout import layout_choices, normal  # noqa: E402
from cptune.model import Case, CostModel, computed_flops, hardware_profile, held_out_predictions, prior_time  # noqa: E402

GOALS = (1.02, 1.05)


def configurations(workload: Workload, ranks: int) -> list[CPConfig]:
    """Every strategy x head group x layout a search sweeps on ``ranks`` ranks."""
    found = []
    for u in (d for d in range(1, ranks + 1) if ranks % d == 0):
        strategies = ["ulysses"] if u == ranks and ranks > 1 else ["ring", "allgather_kv"]
        for strategy in strategies if ranks > 1 else ["ring"]:
            base = CPConfig(strategy, ranks, u)
            for layout in layout_choices(workload, base):
                config = normal(workload, base.with_layout(layout) if layout else base)
                if not feasibility(workload, config) and config not in found:
                    found.append(config)
    return found


def same_work(workload: Workload, config: CPConfig) -> tuple:
    """What a run of ``config`` does, count by count: configurations with equal counts compute
    the same attention and move the same bytes in the same rounds."""
    cost = analytic_cost(workload, config)
    return (computed_flops(workload, config, "numpy"), cost.flops,
            tuple(sorted((k, v) for k, v in cost.bytes_sent.items() if v)),
            tuple(sorted((k, v) for k, v in cost.comm_steps.items() if v)),
            tuple(sorted((k, v) for k, v in cost.kernels.items() if v)),
            tuple(sorted((k, v) for k, v in cost.memory_bytes.items() if v)))


def split_half_regrets(times: dict[int, list[float]], work: list[tuple],
                       decisions: list[list[int]]) -> list[float]:
    """The measurement's own floor: per decision (the cases of one length and rank count), the
    fastest class by the even rounds judged by the odd ones, and the other way round. A perfect
    predictor picks the truly fastest; judged by rounds of this noise, even it shows these
    regrets, which a pick's regret cannot be read below. ``times``: each case's samples by
    round, NaN where disturbed."""
    def pooled(key: tuple, first: int) -> float:  # the class's samples of every other round from ``first``
        kept = [t for i, k in enumerate(work) if k == key for t in times[i][first::2] if not np.isnan(t)]
        return float(np.median(kept)) if kept else float("nan")

    halves = {key: (pooled(key, 0), pooled(key, 1)) for key in set(work)}
    regrets = []
    for half in (0, 1):
        for members in decisions:  # classes with an undisturbed sample in both halves
            keys = {work[i] for i in members if not np.isnan(sum(halves[work[i]]))}
            pick = min(keys, key=lambda k: halves[k][half])
            regrets.append(halves[pick][1 - half] / min(halves[k][1 - half] for k in keys))
    return regrets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", required=True, help="a database holding this host's calibration")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 3072, 4096])
    parser.add_argument("--document", type=int, default=512, help="tokens per packed document")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    profile = hardware_profile(None, args.db)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    one, five, _ = os.getloadavg()
    say(f"# {command('masked_prior_regret.py', sys.argv[1:])}")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    say(f"# cptune {cptune.__version__} at {commit()}, mpi engine, {when}, "
        f"load average {one:.2f} / {five:.2f} at the start on {os.cpu_count()} cores")
    say(f"# {profile.describe()}")
    cases: list[tuple[Workload, CPConfig]] = []
    for seq_len in args.seq_lens:
        w = Workload(seq_len, args.heads, args.head_dim, causal=True, documents=args.document)
        cases += [(w, config) for ranks in (1, 2) for config in configurations(w, ranks)]
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    for round_ in range(args.rounds):
        order = range(len(cases)) if round_ % 2 == 0 else reversed(range(len(cases)))
        for i in order:
            w, config = cases[i]
            m = measure(w, config, warmup=1, repeats=args.repeats)
            times[i].append(m.median_ms if not m.disturbed else float("nan"))
    one, five, _ = os.getloadavg()
    say(f"# end: load average {one:.2f} / {five:.2f}")
    measured = np.array([np.nanmedian(times[i]) for i in range(len(cases))]) / 1e3
    samples = [Case(w, config, profile) for w, config in cases]
    prior = np.array([prior_time(w, config, profile).total_s for w, config in cases])
    _, fitted, _, _ = held_out_predictions(samples, measured, "seq_len", CostModel())
    work = [(w.seq_len, config.ranks, same_work(w, config)) for w, config in cases]
    pooled = {key: np.nanmedian([t for i, k in enumerate(work) if k == key for t in times[i]]) / 1e3
              for key in set(work)}
    regrets: dict[str, list[float]] = {"prior": [], "model": [], "prior alone": [], "model alone": []}
    spreads: list[float] = []
    decisions: list[list[int]] = []
    say("per (length, ranks) with a choice: the measured fastest configuration (its class's members "
        "of the same work), each pick and its regret against the fastest class (alone: against the "
        "fastest configuration, each measured alone)")
    for seq_len in args.seq_lens:
        for ranks in (1, 2):
            members = [i for i, (w, c) in enumerate(cases) if w.seq_len == seq_len and c.ranks == ranks]
            if len(members) == 1:
                continue
            decisions.append(members)
            best = min(members, key=lambda i: pooled[work[i]])
            twins = [i for i in members if work[i] == work[best]]
            if len(twins) > 1:
                spreads.append(max(measured[i] for i in twins) / min(measured[i] for i in twins))
            same = ", ".join(cases[i][1].label for i in twins if i != best)
            say(f"{seq_len} tokens on {ranks} ranks: fastest {cases[best][1].label} "
                f"({pooled[work[best]] * 1e3:.1f} ms{'; the same work: ' + same if same else ''})")
            alone = min(measured[i] for i in members)
            for name, predicted in (("prior", prior), ("model", fitted)):
                pick = min(members, key=lambda i: predicted[i])
                regrets[name].append(pooled[work[pick]] / pooled[work[best]])
                regrets[f"{name} alone"].append(measured[pick] / alone)
                say(f"  {name} pick {cases[pick][1].label}: regret {regrets[name][-1]:.3f} "
                    f"(alone {regrets[f'{name} alone'][-1]:.3f})")
    if spreads:
        say(f"members of one class, their own medians: max / min {min(spreads):.3f}-{max(spreads):.3f} "
            "(the noise between runs of the same work)")
    if args.rounds >= 2:
        floor = split_half_regrets(times, work, decisions)
        say(f"the measurement's floor: the fastest class of half the rounds judged by the other half, regret "
            f"median {statistics.median(floor):.3f}, worst {max(floor):.3f} over {len(floor)} (both ways)")
    for name, values in regrets.items():
        median, worst = statistics.median(values), max(values)
        met = median <= GOALS[0] and worst <= GOALS[1]
        say(f"{name}: regret median {median:.3f}, worst {worst:.3f} over {len(values)} decisions"
            + (f" (goal <= {GOALS[0]} / <= {GOALS[1]}: {'met' if met else 'not met'})" if "alone" not in name
               else ""))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
