"""Does timing a calibration in rounds steady the rates the prior reads?

Alternates ``calibrate`` in one pass (``--single-repeats`` timed calls per step, what it did
before rounds) with ``calibrate`` in ``--rounds`` rounds (``--repeats`` per round, the median
of the rounds), ``--pairs`` times each, first one then the other in turn (ABBA), on this
host's 1..``--max-ranks`` ranks, the contention guard on. Nothing is stored. For each
variant it prints:

- per attention shape, the standard deviation of the log rate ratio of one rank to the
  next count over that variant's calibrations (what sets the prior's local-against-two-rank
  picks), averaged over the shapes;
- per calibrated point, the worst log deviation from the median of that point over every
  calibration of both variants: a burst of other load in one calibration shows here;
- the wall time of a calibration.

    python benchmarks/calibration_rounds.py [--pairs 4] [--max-ranks 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cptune.calibration import REPEATS, ROUNDS, Calibration, calibrate

SINGLE, ROUNDED = "one pass", "rounds"


def ratio_spread(calibrations: list[Calibration]) -> float:
    """Mean over shapes of the sd (ddof 1) of log(rate on 1 rank / rate on 2 ranks)."""
    rates = [c.measured_rates() for c in calibrations]
    shapes = sorted({key[:3] for key in rates[0]})
    spreads = [np.std([np.log(r[(*shape, 1)] / r[(*shape, 2)]) for r in rates], ddof=1) for shape in shapes]
    return float(np.mean(spreads))


def worst_deviations(by_variant: dict[str, list[Calibration]]) -> dict[str, float]:
    """Per variant, the largest |log(rate / the point's median over every calibration)|."""
    rates = {variant: [c.measured_rates() for c in cals] for variant, cals in by_variant.items()}
    every = [r for variant in rates.values() for r in variant]
    median = {key: float(np.median([r[key] for r in every])) for key in every[0]}
    return {variant: float(max(abs(np.log(r[key] / median[key])) for r in variant_rates for key in median))
            for variant, variant_rates in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4, help="calibrations of each variant (default 4)")
    parser.add_argument("--max-ranks", type=int, default=2, help="rank counts calibrated (default 2)")
    parser.add_argument("--single-repeats", type=int, default=7,
                        help="timed calls per step in one pass (default 7, as before rounds)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds (default {ROUNDS})")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"timed calls per step in each round (default {REPEATS})")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    if args.max_ranks < 2 or args.pairs < 2:
        parser.error("--max-ranks and --pairs must be at least 2 (a ratio of rank counts, a spread)")

    variants = {SINGLE: {"rounds": 1, "repeats": args.single_repeats},
                ROUNDED: {"rounds": args.rounds, "repeats": args.repeats}}
    by_variant: dict[str, list[Calibration]] = {SINGLE: [], ROUNDED: []}
    seconds: dict[str, list[float]] = {SINGLE: [], ROUNDED: []}
    for pair in range(args.pairs):
        order = [SINGLE, ROUNDED] if pair % 2 == 0 else [ROUNDED, SINGLE]
        for variant in order:
            start = time.perf_counter()
            by_variant[variant].append(calibrate(args.max_ranks, **variants[variant]))
            seconds[variant].append(time.perf_counter() - start)
            print(f"pair {pair + 1}: {variant} in {seconds[variant][-1]:.0f} s", flush=True)
    worst = worst_deviations(by_variant)
    summary = {variant: {"settings": variants[variant], "ratio_sd": ratio_spread(by_variant[variant]),
                         "worst_point_deviation": worst[variant],
                         "seconds_median": float(np.median(seconds[variant]))}
               for variant in variants}
    if args.json:
        print(json.dumps(summary))
        return 0
    for variant, s in summary.items():
        print(f"{variant:>8s} ({s['settings']['rounds']} x {s['settings']['repeats']} timed calls): "
              f"1-rank / 2-rank rate ratio, log sd over calibrations {s['ratio_sd']:.4f} (mean over shapes); "
              f"worst point off the median {np.expm1(s['worst_point_deviation']) * 100:.1f}%; "
              f"{s['seconds_median']:.0f} s per calibration")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
