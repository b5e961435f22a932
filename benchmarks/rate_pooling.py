"""Does pooling a rank count's attention rate over every calibrated shape make the prior's picks better?

``Calibration.attention_rate`` reads ``pooled_compute``: each rank count's rate against the
fewest ranks' as one line in log work per call, fitted through all shapes at once. Before,
it read each shape's rates as measured. This script scores both readings of the same stored
calibrations on the same stored measurements (nothing is measured, nothing is written):

- the spread of the measured rate ratio, fewest ranks over the next count, shape by shape,
  across every calibration given (what pooling smooths);
- the error within a workload of the by-shape prediction held out by sequence length (the
  prior's trend times the configuration's own level from its other lengths): mean
  |log error - the workload's mean log error|, in percent, over every held-out measurement.
  It is what a pick depends on, free of any threshold;
- ``cptune fit``'s goal for ``recommend``'s pick, held out by sequence length, ties as ties:
  median <= 1.02 and worst <= 1.05 (issue 13's acceptance 2).

Each database is scored with its own calibration and, with ``--calibrations-from``, with the
attention rates of each other calibration given (in memory), since which calibration a
database holds decides as much as any change to the model:

    python benchmarks/rate_pooling.py --db run1.db run2.db --calibrations-from cal1.db cal2.db [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from cptune.calibration import Calibration
from cptune.model import Case, cross_validate_groups, load_training
from cptune.model._prior import CalibratedProfile
from cptune.store import Store

#: cptune fit's goal for recommend's pick (issue 13, acceptance 2): median and worst regret.
GOAL = (1.02, 1.05)


class MeasuredPoints(Calibration):
    """A calibration whose prior reads each shape's rates as measured (the reading before pooling)."""

    @property
    def pooled_compute(self):  # type: ignore[override]
        return self.compute


@dataclass(frozen=True)
class Score:
    """One reading of one calibration on one database."""

    workload_error_pct: float
    median_regret: float
    worst_regret: float

    @property
    def meets_goal(self) -> bool:
        return self.median_regret <= GOAL[0] and self.worst_regret <= GOAL[1]


def newest_calibration(db: str) -> Calibration:
    with Store(db, create=False) as store:
        calibrations = [c for fp in store.hardware() if (c := store.calibration(fp)) is not None]
    if not calibrations:
        raise SystemExit(f"{db} holds no calibration: run cptune calibrate --db {db}")
    return max(calibrations, key=lambda c: c.measured_at)


def rank_ratios(calibration: Calibration) -> dict[tuple, float]:
    """Measured rate of the fewest ranks over the next count, per shape."""
    rates = calibration.measured_rates()
    fewest, nearest = sorted({key[3] for key in rates})[:2]
    return {key[:3]: rate / rates[(*key[:3], nearest)] for key, rate in rates.items()
            if key[3] == fewest and (*key[:3], nearest) in rates}


def with_rates(cases: Sequence[Case], compute: tuple | None, pooled: bool) -> list[Case]:
    """``cases`` on their hardware with the attention points ``compute`` (None: their own),
    read pooled or as measured."""
    kind = Calibration if pooled else MeasuredPoints
    profiles: dict[str, CalibratedProfile] = {}
    out = []
    for case in cases:
        profile = case.profile
        assert isinstance(profile, CalibratedProfile)
        if profile.fingerprint not in profiles:
            calibration = profile.calibration
            values = {f.name: getattr(calibration, f.name) for f in fields(calibration)}
            if compute is not None:
                values["compute"] = compute
            profiles[profile.fingerprint] = replace(profile, calibration=kind(**values))
        out.append(replace(case, profile=profiles[profile.fingerprint]))
    return out


def workload_error(cases: Sequence[Case], latencies: np.ndarray) -> float:
    """Mean |held-out by-shape log error - its workload's mean|, percent."""
    residual = np.log(latencies) - np.log([case.prior().total_s for case in cases])
    by_shape: dict[tuple, dict[int, float]] = defaultdict(dict)
    for case, r in zip(cases, residual, strict=True):
        by_shape[case.shape][case.workload.seq_len] = float(r)
    errors: dict[object, list[float]] = defaultdict(list)
    for case, r in zip(cases, residual, strict=True):
        others = [v for length, v in by_shape[case.shape].items() if length != case.workload.seq_len]
        if others:
            errors[case.workload].append(r - float(np.mean(others)))
    spread = [np.abs(np.array(e) - np.mean(e)) for e in errors.values() if len(e) > 1]
    return float(np.mean(np.concatenate(spread)) * 100)


def score(db: str, compute: tuple | None, pooled: bool) -> Score:
    data = load_training(db)
    cases = with_rates(data.cases, compute, pooled)
    tied = data.tied_with_leader()
    picks = cross_validate_groups(cases, data.latencies_s, "seq_len", tied=tied, advised=True)
    return Score(workload_error(cases, data.latencies_s), picks.median_tie_regret, picks.worst_tie_regret)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", nargs="+", required=True,
                        help="databases of measured sweeps, each calibrated")
    parser.add_argument("--calibrations-from", nargs="*", default=[],
                        help="databases whose newest calibration's attention rates score each --db too")
    parser.add_argument("--json", action="store_true", help="one JSON object per cell, then the summary")
    args = parser.parse_args()

    sources: list[tuple[str, Calibration | None]] = [("own", None)]
    sources += [(Path(db).name, newest_calibration(db)) for db in args.calibrations_from]
    every = dict.fromkeys([*args.db, *args.calibrations_from])
    ratios = [rank_ratios(newest_calibration(db)) for db in every]
    print(f"measured rate ratio, fewest ranks / next count, across {len(ratios)} calibrations:")
    for shape in sorted(set.intersection(*(set(r) for r in ratios))):
        logs = np.log([r[shape] for r in ratios])
        print(f"  d{shape[0]:<3d} {'causal' if shape[1] else 'full  '} seq_q {shape[2]:5d}: "
              f"geometric mean {np.exp(logs.mean()):.3f}, sd {logs.std(ddof=1) * 100:.1f}%")

    cells = []
    for source, calibration in sources:
        for db in args.db:
            compute = None if calibration is None else calibration.compute
            measured, pooled = score(db, compute, pooled=False), score(db, compute, pooled=True)
            cells.append((source, Path(db).name, measured, pooled))
            if args.json:
                print(json.dumps({"calibration": source, "db": Path(db).name,
                                  "measured": measured.__dict__, "pooled": pooled.__dict__}))
            else:
                print(f"{source:>14s} {Path(db).name:>18s}  error within a workload "
                      f"{measured.workload_error_pct:.2f}% -> {pooled.workload_error_pct:.2f}%  recommend "
                      f"{measured.median_regret:.3f}/{measured.worst_regret:.3f} -> "
                      f"{pooled.median_regret:.3f}/{pooled.worst_regret:.3f}",
                      flush=True)
    for name, index in (("as measured", 2), ("pooled", 3)):
        scores = [cell[index] for cell in cells]
        print(f"{name:>11s}: error within a workload {np.mean([s.workload_error_pct for s in scores]):.3f}% "
              f"(mean); cptune fit's goal met on {sum(s.meets_goal for s in scores)} of {len(scores)}; "
              f"worst regret mean {np.mean([s.worst_regret for s in scores]):.4f}, "
              f"above {GOAL[1]} on {sum(s.worst_regret > GOAL[1] for s in scores)}")
    better = sum(c[3].workload_error_pct < c[2].workload_error_pct for c in cells)
    print(f"pooled has the smaller error within a workload on {better} of {len(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
