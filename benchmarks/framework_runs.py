"""Frameworks' own attention timed beside cptune's configurations, and the prior's order beside
the measured one (issue 55, item 3): on this host's torch ranks (gloo), for each workload and
rank count, ``time_framework`` rounds alternating yunchang's ``LongContextAttention`` and
torch's ``_templated_ring_attention`` (all-gather rotater, load balance off: what xDiT and
SGLang call), each round interleaving the implementation's configurations with cptune's own
(``measure_round``), every output checked against the float64 reference before it is timed.
The host is calibrated first (torch engine) into the same database, and the prior prices each
row as it runs: cptune's configurations by ``prior_time``, yunchang's contiguous ring as that
configuration, torch's ring as the all-gather attended block by block (``prior_as_run``).

    python benchmarks/framework_runs.py --db fw.db --out benchmarks/results/framework_runs-DATE.txt

More ranks than cores run oversubscribed (marked): their order times ranks waiting for a core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import command, commit  # noqa: E402

from cptune.config import CPConfig  # noqa: E402
from cptune.measurement import Measurement  # noqa: E402
from cptune.model import CalibratedProfile, prior_as_run, prior_time  # noqa: E402
from cptune.search import calibrate_host, time_framework  # noqa: E402
from cptune.workload import Workload  # noqa: E402

WORKLOADS = (Workload(seq_len=1024, heads=8, head_dim=64),
             Workload(seq_len=1024, heads=8, head_dim=64, causal=True))


def prior_ms(workload: Workload, config: CPConfig, implementation: str | None,
             profile: CalibratedProfile) -> float:
    """The prior's latency of a row as it runs."""
    if implementation == "torch_ring":
        gathered = CPConfig("allgather_kv", config.ranks, 1, "contiguous")
        return prior_as_run(workload, gathered, profile, per_block_calls=True).total_s * 1e3
    return prior_time(workload, config, profile).total_s * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--db", required=True, help="a fresh database (calibration and rows)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per implementation, alternated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    db = args.db if "://" in args.db else f"sqlite:///{Path(args.db).resolve()}"
    start, load = time.time(), os.getloadavg()
    hardware, calibration = calibrate_host(db, backend="torch", max_ranks=max(args.ranks),
                                           oversubscribe=max(args.ranks) > (os.cpu_count() or 1))
    profile = CalibratedProfile(hardware, calibration=calibration)
    lines = [f"# framework_runs: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}",
             f"# command: {command('framework_runs.py', sys.argv[1:])}", f"# code: {commit()}",
             f"# host: {hardware.describe()}; {os.cpu_count()} cores; load average at start "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (shared by five people)"]
    for workload in WORKLOADS:
        for ranks in args.ranks:
            # (config, implementation) -> medians per round, and ratio to the round's fastest of cptune's
            medians: dict[tuple[CPConfig, str | None], list[float]] = defaultdict(list)
            ratios: dict[tuple[CPConfig, str | None], list[float]] = defaultdict(list)
            flags: dict[tuple[CPConfig, str | None], set[str]] = defaultdict(set)
            errors: dict[tuple[CPConfig, str | None], float] = {}
            for r in range(args.rounds):
                for framework in ("yunchang", "xdit"):
                    timed = time_framework(framework, workload, ranks, db, seed=r)
                    ok = [t for t in timed if isinstance(t.result, Measurement)]
                    fastest = min(t.result.median_ms for t in ok if t.implementation is None
                                  and isinstance(t.result, Measurement))
                    for t in timed:
                        key = (t.config, t.implementation)
                        if not isinstance(t.result, Measurement):
                            flags[key].add(f"failed: {t.result.kind}")
                            continue
                        medians[key].append(t.result.median_ms)
                        ratios[key].append(t.result.median_ms / fastest)
                        errors[key] = max(errors.get(key, 0.0), t.result.max_error)
                        if t.result.disturbed:
                            flags[key].add("disturbed")
                        if t.result.oversubscribed:
                            flags[key].add("oversubscribed")
            rows = []
            for key, seen in medians.items():
                config, implementation = key
                rows.append((statistics.median(ratios[key]), statistics.median(seen), config, implementation,
                             prior_ms(workload, config, implementation, profile), key))
            by_prior = sorted(rows, key=lambda row: row[4])
            lines.append("")
            lines.append(f"## {workload.describe()} on {ranks} ranks: median over rounds; ratio: to the "
                         f"fastest of cptune's own configurations in the same round (median of rounds)")
            lines.append(f"  {'config':<22} {'implementation':<14} {'measured ms':>11} {'ratio':>6} "
                         f"{'rank':>4} {'prior ms':>9} {'prior rank':>10} {'max error':>9}  marks")
            measured = sorted(rows, key=lambda row: row[0])
            for place, (ratio, median, config, implementation, prior, key) in enumerate(measured, 1):
                prior_place = next(i for i, row in enumerate(by_prior, 1) if row[5] == key)
                lines.append(f"  {config.label:<22} {implementation or '-':<14} {median:>11.2f} "
                             f"{ratio:>6.2f} {place:>4} {prior:>9.2f} {prior_place:>10} {errors[key]:>9.1e}  "
                             f"{', '.join(sorted(flags[key])) or ''} (n={len(medians[key])})")
    lines.append("")
    lines.append(f"# took {time.time() - start:.0f} s; load average at end {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
