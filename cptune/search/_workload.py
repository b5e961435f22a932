"""The search of one workload: Optuna trials over strategy, rank count and head group, each run
for real, then interleaved rounds, a final race and a second sitting that say how sure the
answer is (``WorkloadSearch``).

One study per (workload, hardware), seeded from the store, which is the single source of
truth: configurations already measured on this hardware are told to the sampler (with
their latency combined over every clean visit, ``cptune.estimate``) rather than explored
again (unless ``remeasure``), every new result is committed as soon as it exists, so an
interrupted search resumes where it stopped. A run that fails (crash, timeout, out of
memory, wrong output, a pool that cannot start) is stored with its reason and told to
Optuna as infeasible (``trial.set_constraint``); the search goes on. A failure the host's
state can explain (``RETRIED_FAILURES``) is tried once more by the next search of the same
space; whatever the verdict leaves out is named afterwards (``WorkloadSearch.left_out``),
with the ``cptune measure`` command that runs it alone (``measure_command``; both in
``_visits``, with the ``Visit`` each run is reported as).

Two orders (``cptune.space.ORDERS``). ``exhaustive``: spaces small enough for the trial
budget are covered exhaustively (BruteForceSampler); larger ones by TPE, warm-started with
the best configurations measured for the same model at other sequence lengths on this
hardware. ``guided`` (``GuidedSampler``): the cost model ``recommend`` uses, fitted on what
the store holds (refitted as each measurement lands), orders the trials and the search
stops when none left is likely enough to beat the leader or the budget is spent. Without a
calibration of the hardware covering the space's rank counts there is no model, and the
guided order falls back to the exhaustive one.

With ``study_storage`` (``Store.optuna_storage``) every stored run of the workload on this
hardware is also kept as a trial of an Optuna study in the database, named by
``study_name``: a view for ``optuna-dashboard`` and ``optuna.load_study`` (``StudyView``,
``_view``). The store stays the source of truth: the sampler's own study lives in memory,
seeded from the store.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import uuid4

import optuna
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from cptune.config import CPConfig
from cptune.engines import Engine, get_engine, given_hosts
from cptune.errors import EngineError
from cptune.estimate import MIN_PAIRED_ROUNDS, Comparison, Estimate, Verdict, combine
from cptune.execute import measure, measure_round
from cptune.guard import enabled as guard_enabled
from cptune.guard import patience_s, wait_for_quiet
from cptune.hardware import Hardware
from cptune.hostlock import measuring
from cptune.measurement import Measurement, oversubscribed
from cptune.model import Candidate, predict_for
from cptune.search._guided import STOP_PROBABILITY, EarlyStop, GuidedSampler
from cptune.search._ledger import Ledger, Tally, read_ledger
from cptune.search._trials import (
    Known,
    distributions,
    params_of,
    study_name,
    suggest,
    tree_of,
)
from cptune.search._view import StudyView
from cptune.search._visits import LeftOut, Visit, left_out_of
from cptune.space import ORDERS
from cptune.store import Store
from cptune.workload import Workload

# the search reports each failure itself; Optuna would also log every trial an exception
# ends (Ctrl-C included) with its traceback
optuna.logging.set_verbosity(logging.ERROR)

#: The objective of a configuration whose run failed; the constraint marks it infeasible.
FAILED_LATENCY_MS = float("inf")
_WARM_START = 3
#: A configuration separated from the leader by less than this ratio, on fewer shared rounds
#: than a paired comparison needs (``MIN_PAIRED_ROUNDS``), joins the race until it has them:
#: slow phases of this project's CPU hosts slowed both visits of one configuration by 1.22x
#: and 1.27-1.45x where other runs of the same sweep had it tied with the leader
#: (``docs/decisions/0005-race-near-misses.md``), and two visits cannot tell that apart
#: from a slower configuration.
NEAR_MISS_RATIO = 1.5


def is_near_miss(comparison: Comparison) -> bool:
    """Whether the leader's separation from ``comparison.other`` is narrow and rests on too
    few shared rounds to stand (see ``NEAR_MISS_RATIO``): such a configuration races on."""
    return (comparison.separated and comparison.paired_rounds < MIN_PAIRED_ROUNDS
            and comparison.ratio < NEAR_MISS_RATIO)


@dataclass
class WorkloadSearch:
    """Search the configurations ``configs`` of one workload on this hardware, in three phases.

    1. Exploration: the Optuna trials (see the module docstring), one visit each; they run
       back to back, so they share one round.
    2. Rounds: while a configuration that ran has fewer than ``rounds`` clean visits, one
       round visits each such configuration once, their iterations interleaved in passes of a
       fresh random order (``cptune.execute.measure_round``), so drift, other jobs and the
       host's slow phases hit all of them alike.
    3. The race: while the verdict (``cptune.estimate.judge`` over every clean visit stored)
       ties other configurations with the leader, or separates one from it only narrowly
       (by less than ``NEAR_MISS_RATIO``) on fewer rounds than a paired comparison needs,
       one round over the leader and those, until the leader is separated from each on
       enough rounds, each of them has ``rounds + race_rounds`` clean visits, or
       ``time_budget`` is spent. ``verdict`` holds the answer afterwards.
    4. The second sitting (``confirm``, called later, after the other workloads' searches):
       a winner separated from a configuration within ``NEAR_MISS_RATIO`` of it on rounds of
       one sitting only races that one again, ``confirm_rounds`` more rounds, so the verdict
       rests on rounds the host ran in two states.

    Visits are counted over what the store holds, so a rerun of a finished search runs
    nothing and an interrupted one continues where it stopped. A visit the contention guard
    judged disturbed is stored marked, counts for nothing, and its configuration is visited
    again in the next round, once the host is quiet (``cptune.guard.wait_for_quiet``, at
    most ``patience_s`` seconds; with ``$CPTUNE_GUARD`` "off", or once the host stayed busy
    that long, after a pause of ``settle_s`` seconds instead); after
    ``2 * (rounds + race_rounds)`` runs without enough clean ones it is left as it stands
    (``never_clean`` names those with none). A configuration whose latest run failed is not
    run again by this search; the next search runs it once more when the failure is one the
    host's state can explain (``RETRIED_FAILURES``) and its first. ``left_out`` names, after
    ``run``, each configuration that ran but has no clean visit, with why.
    ``run`` and ``confirm`` hold the host lock (``cptune.hostlock``).

    Counted are the stored runs of these configurations on this hardware and engine, not
    excluded, that ran with the oversubscription a run of them gets now: a search that runs
    more ranks than cores (the user's ``--oversubscribe``) races those configurations too,
    as the user asked, while runs of another core count or engine never mix in.

    ``remeasure``: the stored runs are not looked at when deciding what to run: every
    configuration is explored again and gets ``rounds`` fresh visits, and the caps count
    this search's visits only; the verdict, the race's and the one shown, still combines
    every visit stored (set old ones aside with ``cptune results --exclude``).
    """

    workload: Workload
    configs: list[CPConfig]
    store: Store
    hardware: Hardware
    warmup: int = 2
    repeats: int = 10  # timed iterations per visit
    run_timeout: float | None = None
    trials: int | None = None  # Optuna trials of the exploration; None: every configuration
    time_budget: float | None = None  # seconds for the whole search; None: no limit
    remeasure: bool = False
    backend: str | Engine = "mpi"
    on_visit: Callable[[Visit], None] | None = None
    order: str = "exhaustive"  # one of ORDERS
    stop_probability: float = STOP_PROBABILITY
    #: Clean visits every configuration that ran gets, at least.
    rounds: int = 2
    #: Further clean visits a configuration may get in the final race.
    race_rounds: int = 10
    #: Rounds of the second sitting that confirm a winner (``confirm``; 0: none).
    confirm_rounds: int = 3
    #: Seconds to wait before a round that visits again a configuration whose last visit was
    #: disturbed, so a burst of other load can pass, where the search does not wait for quiet.
    settle_s: float = 2.0
    #: The longest wait for the host to quiet down before such a round (None:
    #: ``cptune.guard.patience_s()``); once it ran out, the search pauses ``settle_s`` instead.
    patience_s: float | None = None
    #: Seed of the rounds' random order (None: a fresh one).
    seed: int | None = None
    #: Where the dashboard's study is kept (``Store.optuna_storage``); None: nowhere.
    study_storage: BaseStorage | None = None
    #: After ``run``: why a guided search stopped early, or why it could not be guided.
    early_stop: EarlyStop | None = field(default=None, init=False)
    unguided: str | None = field(default=None, init=False)
    #: The verdict over every clean visit stored (kept current during ``run``); None before any.
    verdict: Verdict | None = field(default=None, init=False)
    #: After ``run``: configurations left without any clean visit, every run of them disturbed.
    never_clean: tuple[CPConfig, ...] = field(default=(), init=False)
    #: After ``run``: every configuration that ran and that the verdict leaves out, with why.
    left_out: tuple[LeftOut, ...] = field(default=(), init=False)
    #: This search's rounds are named ``<session>:<n>`` (round 0: the exploration).
    session: str = field(default_factory=lambda: uuid4().hex[:12], init=False)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.rounds < 1 or self.race_rounds < 0 or self.confirm_rounds < 0:
            raise ValueError(f"need rounds >= 1, race_rounds >= 0 and confirm_rounds >= 0, got "
                             f"rounds={self.rounds}, race_rounds={self.race_rounds}, "
                             f"confirm_rounds={self.confirm_rounds}")
        self._rng = random.Random(self.seed)
        self._round = 0
        self._phase = "explore"
        self._explore_left = 0
        self._race_left = 0
        self._view: StudyView | None = None
        self._ran: Counter[CPConfig] = Counter()  # this search's runs of each configuration
        self._sittings = {self.session}
        self._budget_left: float | None = None  # of ``time_budget`` after ``run``, for ``confirm``
        #: Why the host stayed busy through a whole wait for quiet (the search waits no more).
        self.stayed_busy: str | None = None

    @property
    def cap(self) -> int:
        """The most clean visits a configuration gets."""
        return self.rounds + self.race_rounds

    @property
    def max_attempts(self) -> int:
        """The most runs of a configuration (clean, disturbed or failed): constant load ends here."""
        return 2 * self.cap

    def _ledger(self) -> Ledger:
        """Read what the store holds of this workload on this hardware, once (``Ledger``)."""
        engine = get_engine(self.backend).name
        return read_ledger(self.store, self.workload, self.hardware, self.configs, engine,
                           self._sittings if self.remeasure else None)

    def _runnable(self, config: CPConfig, entry: Tally) -> bool:
        """Whether ``config`` may be visited again: its latest run did not fail (or its one
        retry is due, ``_settled``) and its runs are not used up (counted in the store, and by
        this search itself, so it ends whatever the store holds)."""
        return not self._settled(entry) and max(entry.attempts, self._ran[config]) < self.max_attempts

    def _settled(self, entry: Tally) -> bool:
        """Its latest run failed and this search does not run it again: the failure says
        something about the configuration, or it was retried already, or it failed in this
        very search (its retry is the next search's, ``Tally.retry_due``)."""
        return entry.failed and not (entry.retry_due and entry.failed_in not in self._sittings)

    def current_verdict(self) -> Verdict | None:
        """The verdict over every clean visit stored of these configurations (None before any)."""
        return self._ledger().verdict

    def known(self) -> dict[CPConfig, Known]:
        """What the store says of each configuration already run, told to the sampler rather
        than run again: its combined latency, or the failure its latest run ended in. A
        configuration with only disturbed runs is run again, unless its runs are used up.
        Empty with ``remeasure`` before this search ran anything."""
        ledger = self._ledger()
        estimates = {config: e for (_, _, config), e in combine(ledger.own).items()}
        known: dict[CPConfig, Known] = {}
        for config, entry in ledger.tally.items():
            if config in estimates:
                known[config] = ("ok", estimates[config].median_ms, None)
            elif self._settled(entry):
                assert entry.latest is not None
                known[config] = (entry.latest.status, None, entry.latest.error)
            elif entry.attempts >= self.max_attempts:
                known[config] = ("disturbed", None, f"all {entry.attempts} runs disturbed by other load")
        return known

    def _warm_starts(self) -> list[CPConfig]:
        """Best configuration per other sequence length of the same model, fastest first."""
        rows = self.store.results(**self.workload.shape.to_dict(), hardware=self.hardware.fingerprint,
                                  status="ok", excluded=False, oversubscribed=False)
        best: dict[int, Estimate] = {}
        for (_, workload, config), estimate in combine(rows).items():
            seq = workload.seq_len
            other = workload.shape != self.workload.shape  # the same layer under another mask
            if seq == self.workload.seq_len or config not in self.configs or other:
                continue
            if seq not in best or estimate.median_ms < best[seq].median_ms:
                best[seq] = estimate
        ordered = [e.config for e in sorted(best.values(), key=lambda e: e.median_ms)]
        return list(dict.fromkeys(ordered))[:_WARM_START]

    def _why_not_guided(self) -> str | None:
        """Why the cost model cannot order this search (None when it can)."""
        calibration = self.store.calibration(self.hardware.fingerprint)
        if calibration is None:
            return "this hardware has no calibration, so there is no cost model to order by"
        if self.workload.training and not calibration.backward:
            return "its calibration did not time the backward (cptune calibrate again times it)"
        if (most := max(c.ranks for c in self.configs)) > calibration.max_ranks:
            return f"its calibration covers up to {calibration.max_ranks} ranks, the search {most}"
        return None

    def _predict(self, configs: list[CPConfig]) -> list[Candidate]:
        return predict_for(self.store, self.hardware.fingerprint, self.workload, configs)

    def run(self) -> list[Visit]:
        """Explore, run the rounds, race; every visit (and each configuration the exploration
        took from the store, ``reused``) in the order it happened."""
        with measuring(lazy=True):  # the lock from the first run on; none if nothing runs
            return self._run()

    def _run(self) -> list[Visit]:
        started = time.monotonic()
        deadline = None if self.time_budget is None else started + self.time_budget
        self.verdict = self.current_verdict()
        if self.study_storage is not None:
            self._view = StudyView.open(self.study_storage, self.store, self.workload, self.hardware)
            self._view.sync(self._ledger().stored)
        visits: list[Visit] = []
        self._explore(visits)
        self._phase = "round"
        while (due := self._due_for_rounds()) and self._round_of(due, "round", visits, deadline):
            pass
        self._phase = "race"
        while (entrants := self._race_entrants()) and self._round_of(entrants, "race", visits, deadline):
            pass
        self._finish()
        if self.time_budget is not None:
            self._budget_left = max(0.0, self.time_budget - (time.monotonic() - started))
        return visits

    def confirm(self) -> list[Visit]:
        """The second sitting, called after ``run`` once other work has run in between (the
        CLI: the other workloads' searches): while the winner is separated from a
        configuration within ``NEAR_MISS_RATIO`` of it on rounds of one sitting only
        (``unconfirmed``, taken once as the sitting starts), rounds of the two until this
        sitting has ``confirm_rounds`` of them, whatever a round shows; then the race again,
        should they now be tied. On this project's 2-core VMs the host
        switches between states that slow configurations unlike each other, for minutes at a
        time: two runs of one sweep put one configuration's latency apart by p10-p90
        0.78-1.17, more than one sitting's rounds can show. Its visits, in order."""
        with measuring(lazy=True):  # the lock from the first run on; none if nothing runs
            return self._confirm()

    def _confirm(self) -> list[Visit]:
        visits: list[Visit] = []
        deadline = None if self._budget_left is None else time.monotonic() + self._budget_left
        if not (group := self.unconfirmed()):
            return visits
        winner, *rivals = group  # fixed for the sitting: a round's outcome does not change what it checks
        self.session = uuid4().hex[:12]
        self._sittings.add(self.session)
        self._round = 1  # round 0 is a sitting's exploration
        self._phase = "confirm"
        while True:
            ledger = self._ledger()
            lacking = [c for c in rivals if ledger.shared(winner, c)[self.session] < self.confirm_rounds]
            if not (entrants := self._still_runnable(winner, lacking, ledger.tally)):
                break
            if not self._round_of(entrants, "confirm", visits, deadline):
                break
        self._phase = "race"
        while (entrants := self._race_entrants()) and self._round_of(entrants, "race", visits, deadline):
            pass
        self._finish()
        return visits

    def unconfirmed(self) -> list[CPConfig]:
        """The winner and the configurations within ``NEAR_MISS_RATIO`` of it whose separation
        from it no later sitting has confirmed (``confirm_rounds`` shared clean rounds there)
        and that may run again; empty without a winner, or unless the winner and one of those
        may run."""
        ledger = self._ledger()
        verdict = ledger.verdict
        if not self.confirm_rounds or verdict is None or verdict.winner is None:
            return []
        leader = verdict.leader.config
        rivals = []
        for comparison in verdict.comparisons:
            shared = ledger.shared(leader, comparison.other)
            later = list(shared)[1:]  # the sittings after the first the two shared
            if comparison.ratio < NEAR_MISS_RATIO and all(shared[s] < self.confirm_rounds for s in later):
                rivals.append(comparison.other)
        return self._still_runnable(leader, rivals, ledger.tally)

    def _still_runnable(self, leader: CPConfig, others: list[CPConfig], tally: dict[CPConfig, Tally]
                        ) -> list[CPConfig]:
        """``leader`` and those of ``others`` that may run again; empty unless the leader and
        one other can: a round without the leader compares nothing with it."""
        group = [c for c in (leader, *others) if c in tally and self._runnable(c, tally[c])]
        return group if len(group) > 1 and group[0] == leader else []

    def _finish(self) -> None:
        """The verdict over every clean visit stored, and who never ran clean."""
        self._phase = "done"
        ledger = self._ledger()
        self.verdict = ledger.verdict
        self.never_clean = tuple(c for c, entry in ledger.tally.items() if entry.clean == 0
                                 and not entry.failed and entry.attempts >= self.max_attempts)
        engine = get_engine(self.backend)
        nodes = given_hosts(engine)
        self.left_out = left_out_of(ledger, self.workload, engine.name, self.run_timeout, self.max_attempts,
                                    None if nodes is None else nodes.hydra_hosts())

    def _explore(self, visits: list[Visit]) -> None:
        """Phase 1: the Optuna trials, one visit each, all in round 0."""
        tree = tree_of(self.configs)
        known = self.known()
        exhaustive = self.trials is None or self.trials >= len(self.configs)
        self.unguided = self._why_not_guided() if self.order == "guided" else None
        guided = self.order == "guided" and self.unguided is None
        sampler: optuna.samplers.BaseSampler
        if guided:
            sampler = GuidedSampler(self.configs, self._predict, self.stop_probability)
        elif exhaustive:
            with warnings.catch_warnings():  # experimental since Optuna 3.1, and what we want
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.BruteForceSampler(seed=0, avoid_premature_stop=True)
        else:
            sampler = optuna.samplers.TPESampler(seed=0)
        study = optuna.create_study(direction="minimize", sampler=sampler,
                                    study_name=study_name(self.workload, self.hardware))
        for config, (status, median, _) in known.items():
            study.add_trial(optuna.trial.create_trial(
                params=params_of(config, tree), distributions=distributions(tree, config),
                value=median if status == "ok" else None,
                state=TrialState.COMPLETE if status == "ok" else TrialState.FAIL,
            ))
        pending = [c for c in self.configs if c not in known]
        if guided:
            budget = min(len(pending), max(0, (self.trials or len(self.configs)) - len(known)))
        elif exhaustive:
            budget = len(pending)
        else:
            budget = max(0, (self.trials or 0) - len(known))
            for config in self._warm_starts():
                if config in pending:
                    study.enqueue_trial(params_of(config, tree))
        self._explore_left = budget
        if budget == 0:
            return
        round_id = self._next_round_id()

        def objective(trial: optuna.Trial) -> float:
            config = suggest(trial, tree)
            self._explore_left -= 1
            if config in known:
                status, median, error = known[config]
                visit = Visit(config, status, median, error, reused=True, phase="explore")
                visits.append(visit)
                self._report(visit, self._ledger())
            else:
                visit = self._visit(config, "explore", round_id, visits)
                # a disturbed visit's latency too: it can only make that configuration look slower
                known[config] = (visit.status, visit.median_ms, visit.error)
            trial.set_constraint("runs", 0.0 if visit.status == "ok" else 1.0)
            if visit.error:
                trial.set_user_attr("error", visit.error)
            return visit.median_ms if visit.median_ms is not None else FAILED_LATENCY_MS

        study.optimize(objective, n_trials=budget, timeout=self.time_budget)
        self._explore_left = 0
        if isinstance(sampler, GuidedSampler):
            self.early_stop = sampler.early_stop

    def _due_for_rounds(self) -> list[CPConfig]:
        """Phase 2: configurations that ran, with fewer than ``rounds`` clean visits."""
        tally = self._ledger().tally
        return [c for c in self.configs
                if c in tally and self._runnable(c, tally[c]) and tally[c].clean < self.rounds]

    def _race_entrants(self) -> list[CPConfig]:
        """Phase 3: the leader, those tied with it and its near misses (see the class
        docstring), each while it has runs and clean visits left, and only with the leader."""
        ledger = self._ledger()
        self.verdict = ledger.verdict
        if self.verdict is None:
            return []
        tally = ledger.tally
        challengers = [*self.verdict.tied, *(c.other for c in self.verdict.comparisons if is_near_miss(c))]
        under_cap = {c: entry for c, entry in tally.items() if entry.clean < self.cap}
        return self._still_runnable(self.verdict.leader.config, challengers, under_cap)

    def _round_of(self, configs: list[CPConfig], phase: str, visits: list[Visit],
                  deadline: float | None) -> bool:
        """Visit ``configs`` once each as one round, their iterations interleaved in passes
        of a fresh random order (``cptune.execute.measure_round``); False when the time
        budget ran out before the round started."""
        tally = self._ledger().tally
        if any(tally[c].disturbed for c in configs if c in tally):
            self._settle(max(c.ranks for c in configs), deadline)
        if deadline is not None and time.monotonic() >= deadline:
            return False
        order = list(configs)
        self._rng.shuffle(order)  # stored in this order; the passes draw orders of their own
        round_id = self._next_round_id()
        self._race_left = len(order)
        for config in order:
            self._ran[config] += 1
        outcomes = measure_round(self.workload, order, backend=self.backend, warmup=self.warmup,
                                 repeats=self.repeats, timeout=self.run_timeout, rng=self._rng,
                                 deadline=deadline)
        for config, outcome in outcomes.items():
            self._race_left -= 1
            self._record(config, outcome, phase, round_id, visits)
        return True

    def _settle(self, ranks: int, deadline: float | None) -> None:
        """Before a round that visits a disturbed configuration again: wait for the host to
        quiet down for a run of ``ranks`` ranks (at most the patience and the time budget
        left), or, with the guard off or once the host stayed busy through a whole wait,
        pause ``settle_s``."""
        left = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
        if not guard_enabled() or self.stayed_busy is not None:
            time.sleep(min(self.settle_s, left))
            return
        patience = patience_s() if self.patience_s is None else self.patience_s
        engine = get_engine(self.backend)
        self.stayed_busy = wait_for_quiet(ranks, engine.process_ids, min(patience, left),
                                          f"seq {self.workload.seq_len}")

    def _next_round_id(self) -> str:
        round_id = f"{self.session}:{self._round}"
        self._round += 1
        return round_id

    def _visit(self, config: CPConfig, phase: str, round_id: str, visits: list[Visit]) -> Visit:
        """Measure ``config`` once and store the result (a failure with its reason)."""
        self._ran[config] += 1
        try:
            outcome: Measurement | EngineError = measure(
                self.workload, config, backend=self.backend, warmup=self.warmup, repeats=self.repeats,
                timeout=self.run_timeout)
        except EngineError as error:
            outcome = error
        return self._record(config, outcome, phase, round_id, visits)

    def _record(self, config: CPConfig, outcome: Measurement | EngineError, phase: str, round_id: str,
                visits: list[Visit]) -> Visit:
        """Store one visit's ``outcome`` (a failure with its reason) and report it."""
        if isinstance(outcome, EngineError):
            engine = get_engine(self.backend).name
            shared = oversubscribed(config.ranks, self.hardware.ranks_per_node)
            self.store.add_failure(self.hardware, self.workload, config, outcome.kind, str(outcome), engine,
                                   oversubscribed=shared, round_id=round_id)
            visit = Visit(config, outcome.kind, None, str(outcome), reused=False, phase=phase,
                          round_id=round_id)
        else:
            self.store.add_measurement(self.hardware, outcome, round_id=round_id)
            visit = Visit(config, "ok", outcome.median_ms, None, reused=False, phase=phase, round_id=round_id,
                          disturbed=outcome.disturbed)
        visits.append(visit)
        ledger = self._ledger()  # read once for the study view and the verdict
        if self._view is not None:
            self._view.sync(ledger.stored)
        self._report(visit, ledger)
        return visit

    def _report(self, visit: Visit, ledger: Ledger) -> None:
        """Bring ``verdict`` up to date from ``ledger`` and tell ``on_visit``, with the visits
        still planned."""
        self.verdict = ledger.verdict
        if self.on_visit is not None:
            self.on_visit(dataclasses.replace(visit, left=self._planned(ledger)))

    def _planned(self, ledger: Ledger) -> int:
        """Visits still planned as things stand: the exploration's trials left with their
        rounds, the rounds' missing clean visits, or the rest of the race's current round
        (the race plans one round at a time)."""
        if self._phase in ("race", "confirm"):
            return self._race_left
        tally = ledger.tally
        missing = sum(max(0, self.rounds - entry.clean) for config, entry in tally.items()
                      if self._runnable(config, entry))
        return missing + (self._explore_left * self.rounds if self._phase == "explore" else 0)
