"""What the search of one workload hands back: each visit as it happens (``Visit``, in one of
the ``PHASES``), and afterwards each configuration its verdict leaves out (``LeftOut``:
failed, or never ran clean), with why and the ``cptune measure`` command that runs it alone
(``measure_command``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cptune.config import CPConfig
from cptune.engines import ENGINES
from cptune.estimate import combine
from cptune.search._ledger import RETRIED_FAILURES, Ledger
from cptune.workload import Workload

#: The phases of a search (``Visit.phase``; see ``WorkloadSearch``).
PHASES = ("explore", "round", "race", "confirm")


@dataclass(frozen=True)
class Visit:
    """One run of a configuration by the search, or (``reused``) what the exploration took
    from the store instead of running it."""

    config: CPConfig
    status: str  # "ok" or an EngineError kind
    median_ms: float | None  # this run's median; a reused configuration's combined estimate
    error: str | None
    reused: bool
    phase: str = "explore"  # one of PHASES
    round_id: str | None = None
    #: Why the contention guard judged this run disturbed (it counts for nothing and is re-run).
    disturbed: str | None = None
    #: Visits still planned after this one, as things stand (``WorkloadSearch._planned``).
    left: int = 0


def measure_command(workload: Workload, config: CPConfig, backend: str = "mpi",
                    timeout: float | None = None, hosts: str | None = None) -> str:
    """The ``cptune measure`` command line that runs ``config`` of ``workload`` alone (on
    ``backend``, on the nodes ``hosts`` names, within ``timeout`` seconds when given) and
    prints its timing or its failure in full; it stores nothing."""
    parts = ["cptune", "measure", *workload.flags("--seq-len"), "--strategies", config.strategy,
             "--ranks", str(config.ranks), "--head-group", str(config.head_group)]
    parts += ["--layout", config.layout] if config.layout else []
    parts += ["--backend", backend] if backend != next(iter(ENGINES)) else []
    parts += ["--hosts", hosts] if hosts is not None else []
    parts += ["--timeout", f"{timeout:g}"] if timeout is not None else []
    return " ".join(parts)


@dataclass(frozen=True)
class LeftOut:
    """A configuration a search ran that its verdict leaves out, as it has no clean visit."""

    config: CPConfig
    #: Its latest run's status: an ``EngineError`` kind, or "disturbed" (ran, never clean).
    status: str
    #: Why, and what later searches do about it, in words.
    reason: str
    #: Whether the next search of the same space runs it again.
    retried: bool
    #: The ``cptune measure`` command that runs it alone (``measure_command``).
    command: str

    def describe(self) -> str:
        """The configuration, why it is left out, and how to measure it now, in one line."""
        return (f"{self.config.describe()} left out of the verdict: {self.reason}; measure it alone with: "
                f"{self.command}")


def left_out_of(ledger: Ledger, workload: Workload, engine: str, timeout: float | None,
                max_attempts: int, hosts: str | None = None) -> tuple[LeftOut, ...]:
    """The configurations in ``ledger`` that ran and have no clean visit the verdict counts,
    with why and the ``cptune measure`` command (on ``engine`` and the nodes ``hosts`` names,
    within ``timeout``) that runs each alone; a configuration disturbed in fewer than
    ``max_attempts`` runs is visited again."""
    counted = {config for (_, _, config) in combine(ledger.counted)}
    found = []
    for config, entry in ledger.tally.items():
        if config in counted or entry.latest is None:
            continue
        status = entry.latest.status if entry.failed else "disturbed"
        retried = entry.retry_due if entry.failed else entry.attempts < max_attempts
        if entry.failed:
            error = (entry.latest.error or "").strip().splitlines()
            reason = f"its latest run failed ({status}{': ' + error[0].rstrip(':.') if error else ''}); "
            reason += ("the next search of this space runs it once more" if retried else
                       "it failed again when retried, so searches do not run it again"
                       if status in RETRIED_FAILURES else
                       f"a failure of kind {status} is the configuration's, not the host's, so "
                       f"searches do not run it again")
        else:
            reason = f"it never ran clean in {entry.attempts} visit(s) (other load each time); " + (
                "the next search visits it again" if retried else
                "searches do not run it again (--remeasure does): rerun when the host is quiet")
        command = measure_command(workload, config, engine, timeout, hosts)
        found.append(LeftOut(config, status, reason, retried, command))
    return tuple(found)
