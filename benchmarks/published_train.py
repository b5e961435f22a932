"""Score the physical prior's training picks against published training comparisons.

The sibling of ``published_prior.py`` (whose cases are forward calls by Ulysses degree) for the
training development set (``benchmarks/published/train/*.toml``): each case is one training
layer (forward + backward) on one described machine with the published latency of each
strategy at one rank count. Per case: the prior's pick, the published best, the regret
(published latency of the pick / the best) and whether ``recommend`` would call the pick
clear or tied (``cptune.model.prior_ties`` among the published strategies, with the training
structural error ``STRUCTURAL_ERROR_TRAIN``).

    python benchmarks/published_train.py [FILE.toml ...] [--json OUT]

A pick is right within ``RIGHT_WITHIN`` (3%: the source's author treats differences under
about 3% as ties). The structural error is estimated as the forward's is (``published_prior
.structural_estimate``): over every pair of the pick and another published configuration, the
largest amount by which the log of the prior's latency ratio overstated the pick's lead beyond
what a pick may miss by, per unit of the two configurations' shares of predicted time outside
attention compute. With one machine in the set there is no machine to leave out: the estimate
is made leaving each case's layer shape out in turn (its three rank counts), and the confidence
of each case is judged with the estimate made without its shape.

Only the prior is scored (no database, no measurement).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cptune.config import CPConfig
from cptune.hardware import load_description
from cptune.model import STRUCTURAL_ERROR_TRAIN, DescribedProfile, prior_ties, prior_time
from cptune.workload import Workload

DEFAULT_FILES = sorted((Path(__file__).parent / "published" / "train").glob("*.toml"))
#: A pick within this factor of the published best counts as right.
RIGHT_WITHIN = 1.03


@dataclass(frozen=True)
class Case:
    """One published training comparison: ``latency_ms`` by strategy on ``ranks`` ranks."""

    id: str
    shape: str
    source: str
    hardware: str
    workload: Workload
    ranks: int
    latency_ms: dict[str, float]

    def config(self, strategy: str) -> CPConfig:
        return CPConfig(strategy, self.ranks)


def load_cases(path: Path) -> list[Case]:
    doc = tomllib.loads(path.read_text())
    return [Case(id=raw["id"], shape=raw["published"].split()[0], source=f"{path.name}: {raw['table']}",
                 hardware=raw["hardware"], workload=Workload(**raw["workload"]), ranks=int(raw["ranks"]),
                 latency_ms={k: float(v) for k, v in raw["latency_ms"].items()})
            for raw in doc["cases"]]


def predicted(case: Case) -> dict[str, Any]:
    profile = DescribedProfile(load_description(case.hardware))
    return {s: prior_time(case.workload, case.config(s), profile) for s in case.latency_ms}


def structural_estimate(cases: list[Case]) -> float:
    """The training structural error ``cases`` show (see the module docstring)."""
    worst = 0.0
    for case in cases:
        times = predicted(case)
        pick = min(times, key=lambda s: times[s].total_s)
        for s in times:
            overstated = (math.log(times[s].total_s / times[pick].total_s)
                          - math.log(case.latency_ms[s] / case.latency_ms[pick]) - math.log(RIGHT_WITHIN))
            if s != pick and overstated > 0:
                worst = max(worst, overstated / (times[s].outside_compute + times[pick].outside_compute))
    return worst


def score(cases: list[Case], structural: dict[str, float] | None = None) -> dict[str, object]:
    """Per case: pick, best, regret, clear or tied (each judged with the structural error
    estimated without its shape where ``structural`` is given, else the shipped one)."""
    rows = []
    for case in cases:
        times = predicted(case)
        pick = min(times, key=lambda s: times[s].total_s)
        best = min(case.latency_ms, key=case.latency_ms.__getitem__)
        error = STRUCTURAL_ERROR_TRAIN if structural is None else structural[case.shape]
        ties = prior_ties(case.workload, case.config(pick), [case.config(s) for s in times if s != pick],
                          DescribedProfile(load_description(case.hardware)), structural=error)
        tied = {pick} | {t.other.strategy for t in ties}
        regret = case.latency_ms[pick] / case.latency_ms[best]
        rows.append({"id": case.id, "ranks": case.ranks, "best": best, "pick": pick, "regret": regret,
                     "tied": sorted(tied), "clear": len(tied) == 1, "right": regret <= RIGHT_WITHIN,
                     "holds_best": best in tied, "structural": error,
                     "prior_ms": {s: float(t.total_s) * 1e3 for s, t in times.items()},
                     "published_ms": case.latency_ms})
    clear = [r for r in rows if r["clear"]]
    summary = {"cases": len(rows), "within": sum(r["right"] for r in rows), "clear": len(clear),
               "clear_right": sum(r["right"] for r in clear),
               "ties_hold_best": sum(r["holds_best"] for r in rows if not r["clear"]),
               "median_regret": statistics.median(r["regret"] for r in rows),
               "worst_regret": max(r["regret"] for r in rows)}
    return {"cases": rows, "summary": summary}


def structural_estimates(cases: list[Case]) -> dict[str, float]:
    """The estimate leaving each layer shape out in turn, and from every case ("all")."""
    shapes = sorted({case.shape for case in cases})
    return {**{s: structural_estimate([c for c in cases if c.shape != s]) for s in shapes},
            "all": structural_estimate(cases)}


def render(result: dict[str, object]) -> str:
    short = {"ring": "Ring", "allgather_kv": "AllGather-KV", "ulysses": "Ulysses"}
    lines = [f"{'case':30} {'published best':>14} {'cptune pick':>12} {'regret':>7} {'verdict':>28}   "
             f"prior ms / published ms"]
    for r in result["cases"]:
        verdict = "clear" if r["clear"] else "tied: " + ", ".join(short[s] for s in r["tied"])
        per = "  ".join(f"{short[s]}: {r['prior_ms'][s]:.2f}/{r['published_ms'][s]:.2f}"
                        for s in r["published_ms"])
        lines.append(f"{r['id']:30} {short[r['best']]:>14} {short[r['pick']]:>12} {r['regret']:7.3f} "
                     f"{verdict:>28}   {per}")
    s = result["summary"]
    lines += ["", f"picks within 3% of the published best: {s['within']} of {s['cases']}; clear: "
              f"{s['clear']} (right: {s['clear_right']}); ties holding the best: {s['ties_hold_best']} of "
              f"{s['cases'] - s['clear']}; median regret {s['median_regret']:.3f}, "
              f"worst {s['worst_regret']:.3f}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, default=DEFAULT_FILES)
    parser.add_argument("--json", type=Path, help="also write the full result as JSON here")
    args = parser.parse_args()
    cases = [case for path in args.files for case in load_cases(path)]
    estimates = structural_estimates(cases)
    print(f"training structural error (shipped {STRUCTURAL_ERROR_TRAIN}), estimated leaving each shape "
          "out: " + "  ".join(f"{k}: {v:.3f}" for k, v in estimates.items()))
    print("\nwith the shipped STRUCTURAL_ERROR_TRAIN:")
    result = score(cases)
    print(render(result))
    print("\neach case judged with the estimate made without its shape:")
    left_out = score(cases, estimates)
    print(render(left_out))
    if args.json:
        args.json.write_text(json.dumps({"shipped": result, "left_out": left_out, "structural": estimates},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
