"""Which configurations a search raced as near misses, and how each ended.

A search's race takes in, besides the configurations tied with the leader, those two visits
separated from it by less than ``NEAR_MISS_RATIO`` on fewer shared rounds than a paired
comparison needs (``cptune.search.is_near_miss``). This replays that decision on a
stored sweep: for each workload, the verdict over every configuration's first two clean
visits (what the search saw when the rounds ended) names the near misses; the verdict over
every clean visit stored says how each ended - the leader, tied with it, or separated.
A near miss that ended tied or leading is a configuration two visits would have dropped.

    python benchmarks/near_misses.py --db sweep.db [--db another.db ...] [--hardware FINGERPRINT]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass

from cptune.errors import CPTuneError
from cptune.estimate import combine, judge
from cptune.hardware import this_host
from cptune.search import is_near_miss
from cptune.store import Result, Store
from cptune.workload import Workload


@dataclass(frozen=True)
class NearMiss:
    """A configuration two visits separated narrowly from its workload's leader."""

    workload: str
    config: str
    ratio_after_two: float  # its latency over the leader's, from the first two visits each
    clean_visits: int  # in the end
    ended: str  # "leader", "tied" or "separated"


def near_misses(rows: list[Result]) -> list[NearMiss]:
    """The near misses of every workload among ``rows`` (one hardware), each engine's runs apart."""
    by_workload: dict[tuple[str, Workload], list[Result]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r.id):
        if row.clean:
            by_workload[(row.engine, row.workload)].append(row)
    found = []
    for (_, workload), visits in by_workload.items():
        seen: Counter = Counter()
        first_two = []
        for row in visits:
            if seen[row.config] < 2:
                first_two.append(row)
                seen[row.config] += 1
        early, final = judge(combine(first_two).values()), judge(combine(visits).values())
        assert early is not None and final is not None  # every workload here has clean visits
        counts = Counter(row.config for row in visits)
        for c in early.comparisons:
            if is_near_miss(c):
                ended = ("leader" if c.other == final.leader.config
                         else "tied" if c.other in final.tied else "separated")
                found.append(NearMiss(workload.describe(), c.other.describe(), c.ratio,
                                      counts[c.other], ended))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", action="append", required=True,
                        help="a swept database, read only (repeatable)")
    parser.add_argument("--hardware", help="fingerprint of the hardware to read (default: this host)")
    args = parser.parse_args(argv)
    for db in args.db:
        try:
            with Store(db, create=False) as store:
                rows = store.results(hardware=args.hardware or this_host().fingerprint)
        except CPTuneError as exc:
            print(f"near_misses: {exc}", file=sys.stderr)
            return 2
        found = near_misses(rows)
        for n in found:
            print(f"{db}  {n.workload:52s} {n.config:28s} {n.ratio_after_two:.2f}x after two visits, "
                  f"{n.clean_visits} clean visits, ended {n.ended}")
        kept = sum(n.ended != "separated" for n in found)
        print(f"{db}: {len(found)} near misses raced, {kept} ended tied with the leader or leading")
    return 0


if __name__ == "__main__":
    sys.exit(main())
