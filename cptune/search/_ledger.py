"""What the store holds of one workload's search, read once per decision (``Ledger``)."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from cptune.config import CPConfig
from cptune.estimate import Verdict, combine, judge
from cptune.hardware import Hardware
from cptune.measurement import oversubscribed
from cptune.store import Result, Store
from cptune.workload import Workload


def sitting_of(round_id: str) -> str:
    """The sitting (one ``WorkloadSearch`` session) a stored round belongs to: the part of
    its id before ``:<n>``."""
    return round_id.rpartition(":")[0] or round_id


#: Failures that can come from the host's state at the time rather than from the
#: configuration: a rank killed (by the kernel's out-of-memory killer, or by hand), a run held
#: up past its timeout by other load, a pool that could not start, memory other processes
#: held. A configuration whose latest run failed so gets one more run, in a later search of
#: the same space (not the one it failed in: the host is likely still in that state). A wrong
#: output or an exception in the code is a verdict about the configuration: not run again.
RETRIED_FAILURES = ("crash", "timeout", "launch", "out_of_memory")


@dataclass
class Tally:
    """What the counted rows say of one configuration's visits."""

    clean: int = 0  # clean visits (``Result.clean``)
    attempts: int = 0  # every run: clean, disturbed or failed
    failures: int = 0  # failed runs
    latest: Result | None = None  # the newest run

    @property
    def failed(self) -> bool:
        """Its latest run failed: a search does not run it again (a failure is not noise),
        unless ``retry_due`` in a later search."""
        return self.latest is not None and self.latest.status != "ok"

    @property
    def retry_due(self) -> bool:
        """Its latest run failed in a way the host's state can explain (``RETRIED_FAILURES``)
        and it is its only failure: one more run is due, in a search other than the one it
        failed in (``failed_in``)."""
        latest = self.latest
        return latest is not None and latest.status in RETRIED_FAILURES and self.failures == 1

    @property
    def failed_in(self) -> str | None:
        """The sitting its latest, failed run belonged to (None: not failed, or no round kept)."""
        if not self.failed or self.latest is None or self.latest.round_id is None:
            return None
        return sitting_of(self.latest.round_id)

    @property
    def disturbed(self) -> bool:
        """Its latest run was judged disturbed by other load."""
        return self.latest is not None and self.latest.disturbed is not None


@dataclass
class Ledger:
    """What the store holds of one search's workload, read once: every stored run on this
    hardware (``stored``, oldest first: the study view's), the runs the search counts
    (``counted``, see ``WorkloadSearch``), those among them that decide what to run
    (``own``: all, or with ``remeasure`` this search's sittings') and each configuration's
    ``tally`` of those."""

    stored: list[Result]
    counted: list[Result]
    own: list[Result]
    tally: dict[CPConfig, Tally]

    @functools.cached_property
    def verdict(self) -> Verdict | None:
        """The verdict over every counted clean visit (None before any)."""
        return judge(combine(self.counted).values())

    def shared(self, one: CPConfig, other: CPConfig) -> Counter[str]:
        """The clean rounds of ``own`` that ``one`` and ``other`` share, counted by sitting,
        the sittings in the order they ran."""
        rounds: dict[CPConfig, dict[str, None]] = {one: {}, other: {}}
        for row in self.own:
            if row.clean and row.round_id is not None and row.config in rounds:
                rounds[row.config][row.round_id] = None
        return Counter(sitting_of(r) for r in rounds[one] if r in rounds[other])


def read_ledger(store: Store, workload: Workload, hardware: Hardware, configs: list[CPConfig], engine: str,
                sittings: set[str] | None) -> Ledger:
    """Every stored run of ``workload`` on ``hardware``; counted, those of ``configs`` on
    ``engine``, not excluded, that ran with the oversubscription a run of them gets now;
    owned, the counted ones of ``sittings`` (None: all of them)."""
    stored = store.results(workload=workload, hardware=hardware.fingerprint)
    wanted = set(configs)
    counted = [r for r in stored if not r.excluded and r.config in wanted and r.engine == engine
               and r.oversubscribed == oversubscribed(r.config.ranks, hardware.ranks_per_node)]
    own = counted if sittings is None else [
        r for r in counted if r.round_id is not None and sitting_of(r.round_id) in sittings]
    tally: dict[CPConfig, Tally] = {}
    for row in own:
        entry = tally.setdefault(row.config, Tally())
        entry.clean += row.clean
        entry.attempts += 1
        entry.failures += row.status != "ok"
        entry.latest = row
    return Ledger(stored, counted, own, tally)
