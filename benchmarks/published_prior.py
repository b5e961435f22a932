"""Score the physical prior against published context-parallel measurements.

Each case of a development-set file (``benchmarks/published/*.toml``) is one workload on one
described machine with the published latency of several configurations (Ulysses degree u x
Ring degree N / u). Per case: the prior's pick among the published configurations, the
published best, the regret (published latency of the pick / the best) and the Spearman rank
correlation of the prior's latencies with the published ones. The same picks are scored for
three fixed rules: always-Ulysses (the largest published Ulysses degree), always-Ring (u = 1)
and always-USP-2 (u = 2).

    python benchmarks/published_prior.py [FILE.toml ...] [--json OUT] [--sensitivity]

``--sensitivity`` rescores cptune with each uncertain figure of each description at the low
and at the high end of its range (the others at their values): how much the picks depend on
any single figure.

``--confidence`` scores how sure cptune says it is, as ``recommend`` says it
(``cptune.model.prior_ties``, among the published configurations): a pick called without a
tie must be right (within 2% of the published best); a reported tie must hold the published
best. Per machine (a development-set source) and overall: picks called clearly and how many of
them were right, ties reported and how many held the best, and the mean size of a tie (the
pick included). No constant of the prior is fitted on these tables, so scoring each machine's
cases is already leaving that machine out.

``--paths`` rescores each case of a machine whose GPUs a CPU joins with NCCL's path named
(``recommend --nccl-path``), each path in turn: the pick, its regret and its tie. The published
tables do not say which path their machines took, so this shows what naming it buys, not a
score.

Only the prior is scored (no database, no measurement): these are machines nobody here ran on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

from scipy.stats import spearmanr

from cptune.config import CPConfig
from cptune.hardware import NCCL_PATHS, load_description
from cptune.model import STRUCTURAL_ERROR, DescribedProfile, prior_ties, prior_time
from cptune.workload import Workload

DEFAULT_FILES = sorted((Path(__file__).parent / "published").glob("*.toml"))
RULES = ("cptune", "always-ulysses", "always-ring", "always-usp-2")


@dataclass(frozen=True)
class Case:
    """One published comparison: ``latency_ms`` by Ulysses degree, for ``workload`` on ``ranks``
    ranks of the described ``hardware``."""

    id: str
    source: str
    hardware: str
    workload: Workload
    ranks: int
    latency_ms: dict[int, float]


def config_for(ranks: int, ulysses: int) -> CPConfig:
    """USP's ulysses_degree x ring_degree as a cptune configuration."""
    if ulysses == ranks:
        return CPConfig("ulysses", ranks)
    return CPConfig("ring", ranks, ulysses)


def ulysses_degree(config: CPConfig) -> int:
    """The inverse of ``config_for``."""
    return config.ranks if config.strategy == "ulysses" else config.head_group


def load_cases(path: Path) -> list[Case]:
    """The cases of one development-set file; throughput (iterations/s) becomes latency (ms)."""
    doc = tomllib.loads(path.read_text())
    cases = []
    for raw in doc["cases"]:
        latency = {int(u): 1e3 / float(rate) for u, rate in raw["iters_per_s"].items()}
        cases.append(Case(id=raw["id"], source=f"{path.name}: {raw['table']}; {raw['published']}",
                          hardware=raw["hardware"], workload=Workload(**raw["workload"]),
                          ranks=int(raw["ranks"]), latency_ms=latency))
    return cases


#: One figure of one description set to a value: (description, figure key, value in SI units).
Change = tuple[str, str, float]


def profile_of(case: Case, changed: Change | None = None, path: str | None = None) -> DescribedProfile:
    """The case's described machine; ``changed`` = (description, figure, value) sets one figure
    of one description, ``path`` names the path NCCL takes through a CPU."""
    description = load_description(case.hardware)
    if changed is not None and changed[0] == case.hardware:
        description = description.with_figure(changed[1], changed[2])
    return DescribedProfile(description if path is None else description.with_nccl_path(path))


def picks(case: Case, changed: Change | None = None,
          path: str | None = None) -> tuple[dict[str, int], dict[int, float]]:
    """The Ulysses degree each rule picks, and the prior's latency (ms) per degree, on
    ``profile_of(case, changed, path)``."""
    profile = profile_of(case, changed, path)
    predicted = {
        u: prior_time(case.workload, config_for(case.ranks, u), profile).total_s * 1e3
        for u in case.latency_ms
    }
    degrees = sorted(case.latency_ms)
    chosen = {
        "cptune": min(predicted, key=predicted.__getitem__),
        "always-ulysses": degrees[-1],
        "always-ring": 1 if 1 in degrees else degrees[0],
        "always-usp-2": 2 if 2 in degrees else degrees[0],
    }
    return chosen, predicted


def score(cases: list[Case], changed: Change | None = None) -> dict[str, object]:
    """Per case and per rule: the pick, its regret, and cptune's Spearman."""
    rows = []
    for case in cases:
        chosen, predicted = picks(case, changed)
        best = min(case.latency_ms, key=case.latency_ms.__getitem__)
        degrees = sorted(case.latency_ms)
        published = [case.latency_ms[u] for u in degrees]
        ranked = [predicted[u] for u in degrees]
        if len(degrees) > 2:
            rho = float(spearmanr(ranked, published)[0])
        else:  # two configurations: +1 when the order agrees, -1 when it does not
            rho = 1.0 if (ranked[0] < ranked[1]) == (published[0] < published[1]) else -1.0
        rows.append({
            "id": case.id, "hardware": case.hardware, "workload": case.workload.describe(),
            "ranks": case.ranks, "best": best, "best_ms": case.latency_ms[best],
            "published_ms": {str(u): case.latency_ms[u] for u in degrees},
            "prior_ms": {str(u): predicted[u] for u in degrees},
            "picks": {rule: chosen[rule] for rule in RULES},
            "regret": {rule: case.latency_ms[chosen[rule]] / case.latency_ms[best] for rule in RULES},
            "spearman": rho, "source": case.source,
        })
    summary = {}
    for rule in RULES:
        regrets = [row["regret"][rule] for row in rows]
        summary[rule] = {
            "top1": sum(r == 1.0 for r in regrets) / len(regrets),
            "median_regret": statistics.median(regrets), "worst_regret": max(regrets),
        }
    summary["cptune"]["median_spearman"] = statistics.median(row["spearman"] for row in rows)
    return {"cases": rows, "summary": summary}


#: A pick within this factor of the published best counts as right.
RIGHT_WITHIN = 1.02


def structural_estimate(cases: list[Case]) -> float:
    """The prior's structural error (``cptune.model.STRUCTURAL_ERROR``) as ``cases`` show it:
    over every pair of the prior's pick and another published configuration, the largest
    amount by which the log of the prior's latency ratio overstated the pick's lead beyond
    the 2% a pick may miss by, per unit of the two shares of predicted time spent outside
    attention compute (0 when no pair overstated it)."""
    worst = 0.0
    for case in cases:
        profile = DescribedProfile(load_description(case.hardware))
        times = {u: prior_time(case.workload, config_for(case.ranks, u), profile) for u in case.latency_ms}
        pick = min(times, key=lambda u: times[u].total_s)
        for u in times:
            overstated = (math.log(times[u].total_s / times[pick].total_s)
                          - math.log(case.latency_ms[u] / case.latency_ms[pick]) - math.log(RIGHT_WITHIN))
            share = times[u].outside_compute + times[pick].outside_compute
            if u != pick and overstated > 0:
                worst = max(worst, overstated / share)
    return worst


def structural_estimates(cases: list[Case]) -> dict[str, float]:
    """``structural_estimate`` leaving each machine out in turn (by the machine left out), and
    from all of them ("all", the shipped constant's estimate)."""
    machines = sorted({case.hardware for case in cases})
    estimates = {m: structural_estimate([c for c in cases if c.hardware != m]) for m in machines}
    return {**estimates, "all": structural_estimate(cases)}


def tied_degrees(case: Case, structural: float, path: str | None = None) -> tuple[int, set[int]]:
    """cptune's pick (a Ulysses degree) and the degrees ``recommend`` reports tied with it,
    the pick included, with the prior's structural error at ``structural``."""
    pick = picks(case, path=path)[0]["cptune"]
    others = [config_for(case.ranks, u) for u in case.latency_ms if u != pick]
    ties = prior_ties(case.workload, config_for(case.ranks, pick), others, profile_of(case, path=path),
                      structural=structural)
    return pick, {pick} | {ulysses_degree(t.other) for t in ties}


def confidence(cases: list[Case], structural: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per machine and overall: how often a clear pick was right and a tie held the best, each
    machine's cases judged with the structural error estimated without it (``structural``)."""
    counts: dict[str, dict[str, float]] = {}
    for case in cases:
        pick, tied = tied_degrees(case, structural[case.hardware])
        best = min(case.latency_ms, key=case.latency_ms.__getitem__)
        for key in (case.hardware, "all"):
            c = counts.setdefault(key, dict.fromkeys(
                ("cases", "clear", "clear_right", "tied", "tie_holds_best", "tie_size"), 0))
            c["cases"] += 1
            if len(tied) == 1:
                c["clear"] += 1
                c["clear_right"] += case.latency_ms[pick] <= RIGHT_WITHIN * case.latency_ms[best]
            else:
                c["tied"] += 1
                c["tie_holds_best"] += best in tied
                c["tie_size"] += len(tied)
    for c in counts.values():
        c["tie_size"] = c["tie_size"] / c["tied"] if c["tied"] else 0.0
    return counts


def render_confidence(counts: dict[str, dict[str, float]]) -> str:
    lines = [f"{'machine':12} {'cases':>5} {'clear':>5} {'right':>5} {'tied':>5} {'holds best':>10} "
             f"{'mean tie size':>13}"]
    for name, c in sorted(counts.items(), key=lambda item: item[0] == "all"):
        lines.append(f"{name:12} {c['cases']:5d} {c['clear']:5d} {c['clear_right']:5d} {c['tied']:5d} "
                     f"{c['tie_holds_best']:10d} {c['tie_size']:13.2f}")
    return "\n".join(lines)


def by_path(cases: list[Case], structural: dict[str, float]) -> list[dict[str, object]]:
    """Each case of a machine whose GPUs a CPU joins, with each of NCCL's paths named: the pick,
    its regret, the degrees tied with it and whether they hold the published best."""
    rows = []
    for case in cases:
        if not load_description(case.hardware).path_figures:
            continue
        best = min(case.latency_ms, key=case.latency_ms.__getitem__)
        for path in NCCL_PATHS:
            pick, tied = tied_degrees(case, structural[case.hardware], path)
            rows.append({"id": case.id, "path": path, "pick": pick, "best": best,
                         "regret": case.latency_ms[pick] / case.latency_ms[best],
                         "tied": sorted(tied), "holds_best": best in tied})
    return rows


def render_paths(rows: list[dict[str, object]], ranks: dict[str, int]) -> str:
    lines = [f"{'case':24} {'path':>4} {'cptune pick':>16} {'regret':>7} {'tie holds best':>14}   "
             f"tied (pick included)"]
    for row in rows:
        n = ranks[row["id"]]
        tied = ", ".join(label(n, u) for u in row["tied"])
        lines.append(f"{row['id']:24} {row['path']:>4} {label(n, row['pick']):>16} {row['regret']:7.3f} "
                     f"{'yes' if row['holds_best'] else 'no':>14}   {tied}")
    return "\n".join(lines)


def sensitivity(cases: list[Case]) -> list[dict[str, object]]:
    """cptune's median and worst regret with each uncertain figure at either end of its range."""
    rows = []
    for name in sorted({case.hardware for case in cases}):
        for key, figure in load_description(name).figures.items():
            for end, value in (("low", figure.low), ("high", figure.high)):
                if figure.uncertain:
                    summary = score(cases, (name, key, value))["summary"]["cptune"]
                    rows.append({"hardware": name, "figure": key, "end": end,
                                 "median_regret": summary["median_regret"],
                                 "worst_regret": summary["worst_regret"]})
    return rows


def label(ranks: int, u: int) -> str:
    return config_for(ranks, u).label


def render(result: dict[str, object]) -> str:
    lines = [f"{'case':24} {'published best':>16} {'cptune pick':>16} {'regret':>7} {'spearman':>8}   "
             f"prior ms / published ms per Ulysses degree"]
    for row in result["cases"]:
        n = row["ranks"]
        per_degree = "  ".join(f"u{u}: {row['prior_ms'][u]:.3g}/{row['published_ms'][u]:.3g}"
                               for u in row["published_ms"])
        lines.append(f"{row['id']:24} {label(n, row['best']):>16} {label(n, row['picks']['cptune']):>16} "
                     f"{row['regret']['cptune']:7.3f} {row['spearman']:8.2f}   {per_degree}")
    lines.append("")
    lines.append(f"{'rule':16} {'top-1':>6} {'median regret':>14} {'worst regret':>13}")
    for rule, s in result["summary"].items():
        lines.append(f"{rule:16} {s['top1']:6.2f} {s['median_regret']:14.3f} {s['worst_regret']:13.3f}")
    lines.append(f"cptune median Spearman: {result['summary']['cptune']['median_spearman']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, default=DEFAULT_FILES)
    parser.add_argument("--json", type=Path, help="also write the full result as JSON here")
    parser.add_argument("--sensitivity", action="store_true",
                        help="rescore with each figure at either end of its range")
    parser.add_argument("--structural", action="store_true",
                        help="estimate the prior's structural error, leaving each machine out in turn")
    parser.add_argument("--confidence", action="store_true",
                        help="score how sure cptune says it is: clear picks right, ties holding the best")
    parser.add_argument("--paths", action="store_true",
                        help="rescore the PCIe cases with each of NCCL's paths through a CPU named")
    args = parser.parse_args()
    cases = [case for path in args.files for case in load_cases(path)]
    result = score(cases)
    print(render(result))
    if args.sensitivity:
        result["sensitivity"] = sensitivity(cases)
        print(f"\n{'description':12} {'figure at one end of its range':48} {'median':>7} {'worst':>7}")
        for row in result["sensitivity"]:
            print(f"{row['hardware']:12} {row['figure'] + ' ' + row['end']:48} "
                  f"{row['median_regret']:7.3f} {row['worst_regret']:7.3f}")
    if args.structural or args.confidence or args.paths:
        result["structural"] = structural_estimates(cases)
        print(f"\nthe prior's structural error, estimated leaving each machine out (shipped: "
              f"{STRUCTURAL_ERROR}):")
        print("  ".join(f"{m}: {e:.3f}" for m, e in result["structural"].items()))
    if args.confidence:
        result["confidence"] = confidence(cases, result["structural"])
        print("\nhow sure cptune says it is (a clear pick is right within 2% of the published best;\n"
              "each machine judged with the structural error estimated without it):")
        print(render_confidence(result["confidence"]))
    if args.paths:
        result["paths"] = by_path(cases, result["structural"])
        print("\nwith NCCL's path through a CPU named (recommend --nccl-path); the tables do not say which\n"
              "path their machines took, so this is what naming it buys, not a score:")
        print(render_paths(result["paths"], {case.id: case.ranks for case in cases}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
