"""How reproducible "the fastest configuration" is on this host: one run's pick judged by another.

Two databases hold two separate full runs of the same sweep on this host. For every
workload measured in both (on the configurations both measured cleanly), each run's pick is
judged by the other run, both ways (first by second, second by first), two ways:

- today's figures, as the tool judged before issue 13: each configuration's NEWEST single
  clean visit stands for it ("newest-wins"), the fastest one is the pick, and its regret
  is the other run's latency of the pick / the other run's best;
- the new figures: the run's verdict (``cptune.estimate``: every clean visit of a
  configuration combined, the leader judged against the rest). Where it reports a winner,
  the winner's regret is the other run's combined estimate of it / the other run's leader;
  where it reports a tie, the workload counts as a tie, with whether the other run's leader
  is among the tied configurations.

The acceptance goal (issue 13): where a winner is reported, median regret <= 1.02 and worst
<= 1.10. It also prints how far one configuration's combined latency moves between runs,
and the floor under ``cptune fit``'s regret: each run's leader taken as the pick for every
workload (a recommendation always names one) and judged as ``fit`` judges ``recommend``'s,
ties as ties (1.0 where the other run's verdict cannot tell the pick from its leader). A
model that predicted each configuration exactly as one run measured it would score this
against the other run, so ``fit``'s figures on one run cannot be read below it.

    python benchmarks/reproducibility.py --first run1.db --second run2.db [--json]

A run whose spaces went into several databases names them all: ``--first a1.db b1.db
--second a2.db b2.db``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.estimate import Estimate, Verdict, combine, judge
from cptune.hardware import this_host
from cptune.store import Result, Store
from cptune.workload import Workload

#: Where a winner is reported, the other run must agree this closely (issue 13).
GOAL_MEDIAN, GOAL_WORST = 1.02, 1.10

Run = dict[Workload, list[Result]]
#: Each run's picks judged by the other: (name, whether the pair is flipped to (second, first)).
WAYS = (("first_judged_by_second", False), ("second_judged_by_first", True))


@dataclass(frozen=True)
class Judged:
    """One workload's pick by one run, judged by the other."""

    workload: str
    pick: str  # the pick (``CPConfig.describe``): newest-wins fastest, or the verdict's leader
    other_best: str  # the other run's fastest (newest-wins) or leader (verdict)
    regret: float | None  # None: a tie, no winner to judge
    tied: tuple[str, ...] = ()  # the configurations tied with the leader (verdict only)
    other_leader_among_tied: bool | None = None  # tie only: the other run's leader is the leader or tied


def clean_rows(dbs: Sequence[str], fingerprint: str) -> Run:
    """The clean visits of every workload the databases ``dbs`` of one run hold for the
    hardware ``fingerprint`` (a sweep may store its spaces in several)."""
    by_workload: Run = defaultdict(list)
    for db in dbs:
        with Store(db, reading=True) as store:
            rows = store.results(hardware=fingerprint)
        for row in rows:
            if row.clean:
                by_workload[row.workload].append(row)
    return by_workload


def common(first: Run, second: Run) -> dict[Workload, tuple[list[Result], list[Result]]]:
    """Each workload both runs measured, with each run's clean visits of the configurations
    both measured cleanly (a pick is only judged where the other run has measured it)."""
    shared = {}
    for workload in sorted(set(first) & set(second), key=lambda w: (w.shape.describe(), w.seq_len)):
        configs = {r.config for r in first[workload]} & {r.config for r in second[workload]}
        if configs:
            shared[workload] = ([r for r in first[workload] if r.config in configs],
                                [r for r in second[workload] if r.config in configs])
    return shared


def newest_wins(rows: Iterable[Result]) -> dict[CPConfig, float]:
    """Each configuration's newest clean visit alone (rows oldest first), as before issue 13."""
    return {row.config: row.median_ms for row in rows if row.median_ms is not None}


def judge_newest(workload: Workload, picker: list[Result], judge_rows: list[Result]) -> Judged:
    mine, other = newest_wins(picker), newest_wins(judge_rows)
    pick, best = min(mine, key=mine.__getitem__), min(other, key=other.__getitem__)
    return Judged(workload.describe(), pick.describe(), best.describe(), other[pick] / other[best])


def _estimates(rows: list[Result]) -> dict[CPConfig, Estimate]:
    return {config: estimate for (_, _, config), estimate in combine(rows).items()}


def _judged(rows: list[Result]) -> tuple[dict[CPConfig, Estimate], Verdict]:
    """The run's combined estimates of one workload and its verdict on them."""
    estimates = _estimates(rows)
    verdict = judge(estimates.values())
    assert verdict is not None  # the rows hold clean visits
    return estimates, verdict


def judge_verdict(workload: Workload, picker: list[Result], judge_rows: list[Result]) -> Judged:
    (_, verdict), (other, other_verdict) = _judged(picker), _judged(judge_rows)
    leader, other_leader = verdict.leader.config, other_verdict.leader.config
    if verdict.winner is None:
        return Judged(workload.describe(), leader.describe(), other_leader.describe(), None,
                      tuple(c.describe() for c in verdict.contenders), other_leader in verdict.contenders)
    regret = other[leader].median_ms / other_verdict.leader.median_ms
    return Judged(workload.describe(), leader.describe(), other_leader.describe(), regret)


def fit_regret(picker: list[Result], judge_rows: list[Result]) -> float:
    """The picking run's leader judged as ``cptune fit`` judges a pick (ties as ties)."""
    (_, verdict), (other, other_verdict) = _judged(picker), _judged(judge_rows)
    pick, other_leader = verdict.leader.config, other_verdict.leader
    if pick in other_verdict.contenders:
        return 1.0
    return other[pick].median_ms / other_leader.median_ms


def summary(judged: list[Judged]) -> dict[str, object]:
    """Winners and ties, and the winners' median and worst regret against the goal."""
    regrets = [j.regret for j in judged if j.regret is not None]
    ties = [j for j in judged if j.regret is None]
    median = float(np.median(regrets)) if regrets else None
    worst = max(regrets) if regrets else None
    return {
        "workloads": len(judged), "winners": len(regrets), "ties": len(ties),
        "ties_with_other_leader_among_tied": sum(bool(j.other_leader_among_tied) for j in ties),
        "median_regret": median, "worst_regret": worst,
        "goal_met": None if median is None or worst is None
        else median <= GOAL_MEDIAN and worst <= GOAL_WORST,
    }


def ratio_spread(shared: dict[Workload, tuple[list[Result], list[Result]]]) -> dict[str, float | int]:
    """One configuration's combined latency in the second run over the first."""
    ratios = []
    for first_rows, second_rows in shared.values():
        first, second = _estimates(first_rows), _estimates(second_rows)
        ratios += [second[c].median_ms / first[c].median_ms for c in first.keys() & second.keys()]
    p10, p50, p90 = np.percentile(ratios, [10, 50, 90])
    return {"configurations": len(ratios), "median": float(p50), "p10": float(p10), "p90": float(p90),
            "min": min(ratios), "max": max(ratios)}


def figures(first: Run, second: Run) -> dict[str, object]:
    """Every figure the script prints, as one JSON-ready dictionary."""
    shared = common(first, second)
    out: dict[str, object] = {"workloads": len(shared)}
    if not shared:
        return out
    for name, judge_one in (("newest_wins", judge_newest), ("verdict", judge_verdict)):
        ways = {}
        for way, flip in WAYS:
            judged = [judge_one(w, *(pair[::-1] if flip else pair)) for w, pair in shared.items()]
            ways[way] = {"summary": summary(judged), "per_workload": [asdict(j) for j in judged]}
        out[name] = ways
    floor = {}
    for way, flip in WAYS:
        regrets = [fit_regret(*(pair[::-1] if flip else pair)) for pair in shared.values()]
        floor[way] = {"median_regret": float(np.median(regrets)), "worst_regret": max(regrets),
                      "above_1_05": sum(r > 1.05 for r in regrets)}
    out["fit_floor"] = floor
    out["ratio_second_over_first"] = ratio_spread(shared)
    out["goal"] = {"median_regret": GOAL_MEDIAN, "worst_regret": GOAL_WORST}
    return out


def _regret(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _judged_line(j: dict) -> str:  # type: ignore[type-arg]
    if j["regret"] is not None:
        return f"winner {j['pick']}, regret {j['regret']:.3f} (other's leader {j['other_best']})"
    among = "among them" if j["other_leader_among_tied"] else "NOT among them"
    return f"tie {' = '.join(j['tied'])}; other's leader {j['other_best']} {among}"


def report(out: dict) -> str:  # type: ignore[type-arg]
    """The side-by-side text: per workload, then today's and the new summary, both ways."""
    lines = [f"{out['workloads']} workloads measured in both runs on this host"]
    for way, _ in WAYS:
        lines.append(f"\n{way.replace('_', ' ')}:")
        lines.append(f"{'workload':<52} {'newest-wins (today)':<48} verdict (new)")
        today, new = out["newest_wins"][way], out["verdict"][way]
        for old_j, new_j in zip(today["per_workload"], new["per_workload"], strict=True):
            old_text = f"{old_j['pick']}, regret {old_j['regret']:.3f}"
            lines.append(f"{old_j['workload']:<52} {old_text:<48} {_judged_line(new_j)}")
        t, n = today["summary"], new["summary"]
        lines.append(f"  today (newest-wins): regret median {_regret(t['median_regret'])}, worst "
                     f"{_regret(t['worst_regret'])} over {t['workloads']} workloads (every pick a winner)")
        lines.append(f"  new (verdict): {n['winners']} winners, {n['ties']} ties (other run's leader among "
                     f"the tied in {n['ties_with_other_leader_among_tied']} of {n['ties']}); winners' regret "
                     f"median {_regret(n['median_regret'])}, worst {_regret(n['worst_regret'])}; goal median "
                     f"<= {GOAL_MEDIAN}, worst <= {GOAL_WORST}: "
                     f"{ {True: 'met', False: 'NOT met', None: 'no winner to judge'}[n['goal_met']] }")
    r = out["ratio_second_over_first"]
    lines.append(f"\none configuration's combined latency, second run / first: median {r['median']:.2f}, "
                 f"p10 {r['p10']:.2f}, p90 {r['p90']:.2f}, range {r['min']:.2f}-{r['max']:.2f} over "
                 f"{r['configurations']} configurations")
    lines.append("\nthe floor under cptune fit's regret (each run's leader judged by the other, ties as "
                 "ties, every workload):")
    for way, f in out["fit_floor"].items():
        lines.append(f"  {way.replace('_', ' ')}: median {f['median_regret']:.3f}, worst "
                     f"{f['worst_regret']:.3f}, {f['above_1_05']} of {out['workloads']} above 1.05")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", required=True, nargs="+", metavar="DB",
                        help="database(s) of the first run (read only)")
    parser.add_argument("--second", required=True, nargs="+", metavar="DB",
                        help="database(s) of the second run (read only)")
    parser.add_argument("--hardware", help="fingerprint of the hardware to judge (default: this host)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    try:
        fingerprint = args.hardware or this_host().fingerprint
        first, second = clean_rows(args.first, fingerprint), clean_rows(args.second, fingerprint)
    except CPTuneError as exc:
        print(f"reproducibility: {exc}", file=sys.stderr)
        return 2
    out = figures(first, second)
    if not out["workloads"]:
        print(f"reproducibility: no workload has clean measurements of the same configurations on hardware "
              f"{fingerprint} in both databases; run the same sweep into each", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json else report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
