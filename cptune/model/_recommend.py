"""Recommendations: the fastest configuration for a workload on a hardware, and the evidence.

Each feasible configuration gets a latency from the best evidence there is: its own
measurements (``measured``: every clean visit combined, ``cptune.estimate.combine``, with
the estimate's 95% interval), the cost model fitted on this hardware's measurements
(``model``), or the physical prior alone (``prior``, for hardware that is only calibrated or
only described). The fastest wins; with ``ranks=None`` that may use fewer ranks than the
hardware has. A host measured but never calibrated (``cptune search --no-calibrate``,
``MeasuredHost``) has no prior to predict with: its measured configurations are compared
alone, the others listed as ``unpredicted``, and a workload with none measured is refused
with the command that adds a calibration.

How sure the pick is comes with it (``Recommendation.tied``, ``describe``): a measured pick
carries the measured verdict (``cptune.estimate.judge`` over the measured candidates): the
pick faster than the runner-up by p% (interval), or tied with those the noise of this
hardware cannot separate from it. A prior-only pick on a description lists the alternatives
its figures' ranges cannot order (``ties``). Model-predicted candidates are never called tied,
whatever their interval: a tie is a statement about measurements, and a prediction whose
band reaches the pick is a reason to measure it (``cptune search``), not evidence of a tie.

The model is fitted in memory from the database and refitted when the database gains
measurements or calibrations; nothing is ever unpickled. The learned correction is applied
unless, held out, it is worse than the prior alone beyond the noise (``correction_decision``,
decided once per database revision); otherwise the predictions are the prior's, and say so. After
the first call for a database, a recommendation costs one small query plus the predictions.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from stat import S_ISREG
from typing import ParamSpec, TypeVar

from cptune.config import STRATEGIES, CPConfig
from cptune.engines import get_engine
from cptune.errors import CPTuneError, InfeasibleConfigError
from cptune.estimate import Estimate, Verdict, judge
from cptune.feasibility import ConfigSplit, Excluded, split_configs
from cptune.hardware import Hardware, HardwareDescriptionError, load_description
from cptune.measurement import host_memory_bytes
from cptune.model._cost_model import Case, CostModel, training_set
from cptune.model._evaluation import CorrectionDecision, fit_advised
from cptune.model._prior import tier_split
from cptune.model._profiles import CalibratedProfile, DescribedProfile, Profile, StoredHost, check_predicts
from cptune.model._ties import Tie, prior_ties
from cptune.store import Store, StoreError, database_url, display_url, missing_database
from cptune.workload import Workload

SOURCES: tuple[str, ...] = ("measured", "model", "prior")
#: The most ranks ``recommend`` weighs every count up to when not given one (whole nodes beyond
#: the first, ``weighed_ranks``): 8,192 GPUs take under a second (``benchmarks/recommend_scaling.py``),
#: and the configurations grow with the ranks.
MAX_ANY_RANKS = 16_384


@dataclass(frozen=True)
class Candidate:
    """One feasible configuration with its latency (ms), interval and where they come from.
    Measured: the combined estimate and its 95% interval; ``measurement_ids`` the clean
    visits combined (oldest first), ``measurement_id`` the newest of them."""

    config: CPConfig
    latency_ms: float
    low_ms: float
    high_ms: float
    source: str
    measurement_id: int | None = None
    measurement_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            **self.config.to_dict(), "label": self.config.label, "latency_ms": self.latency_ms,
            "low_ms": self.low_ms, "high_ms": self.high_ms, "source": self.source,
            "measurement_id": self.measurement_id, "measurement_ids": list(self.measurement_ids),
        }


#: What a tier decision names each part of the prior's time: as the decider, and in a list.
_PARTS = {"compute": "compute (attention, memory-bound steps, launches)",
          "node": "the links inside a node", "network": "the network between nodes"}
_SHORT = {"compute": "compute", "node": "inside a node", "network": "across nodes"}


@dataclass(frozen=True)
class TierDecision:
    """On hardware of several nodes: the prior's seconds of the pick and of the runner-up by
    where they go (``cptune.model.tier_split``), and the part that decides between them: the
    one the runner-up loses most in (the pick's largest part when nothing runs up)."""

    pick: Mapping[str, float]
    runner_up: CPConfig | None
    runner_up_split: Mapping[str, float]

    @property
    def deciding(self) -> str:
        """"compute", "node" or "network" (``cptune.hardware.TIERS``)."""
        if self.runner_up is None:
            return max(self.pick, key=lambda part: self.pick[part])
        return max(self.pick, key=lambda part: self.runner_up_split[part] - self.pick[part])

    def describe(self) -> str:
        ms = ", ".join(f"{_SHORT[part]} {self.pick[part] * 1e3:.3g} ms" for part in self.pick)
        decides = f"{_PARTS[self.deciding]} {'decide' if self.deciding == 'node' else 'decides'}"
        if self.runner_up is None:
            return f"{decides} (the prior's time of the pick: {ms})"
        lost = (self.runner_up_split[self.deciding] - self.pick[self.deciding]) * 1e3
        return (f"{decides}: the runner-up, {self.runner_up.describe()}, spends {lost:.3g} ms more there "
                f"(the prior's time of the pick: {ms})")

    def to_dict(self) -> dict[str, object]:
        return {"deciding": self.deciding, "pick_s": dict(self.pick),
                "runner_up": None if self.runner_up is None else {**self.runner_up.to_dict(),
                                                                  "label": self.runner_up.label},
                "runner_up_s": dict(self.runner_up_split), "describe": self.describe()}


@dataclass(frozen=True)
class Recommendation:
    """The pick (``config``) and every alternative, fastest first, for ``workload`` on the
    hardware ``fingerprint`` names (a measured pick is the measured verdict's leader, which the
    rounds it shares with the others may put ahead of a lower median); ``infeasible`` gives the
    reasons of each configuration that cannot run, up to ``cptune.feasibility.LISTED_INFEASIBLE``
    of them, and ``excluded`` counts the rest by why (on a large cluster most cannot split the
    heads: they are never built);
    ``correction`` whether the learned correction changed any prediction here, and why."""

    workload: Workload
    hardware: str
    fingerprint: str
    candidates: tuple[Candidate, ...]
    infeasible: dict[CPConfig, list[str]]
    correction: CorrectionDecision
    #: Alternatives the description's figure ranges cannot tell from the pick (prior only),
    #: each with the figure that would decide.
    ties: tuple[Tie, ...] = ()
    #: The measured verdict over the measured candidates when the pick is measured, else None.
    verdict: Verdict | None = None
    #: Feasible configurations neither measured nor predicted: the hardware has measurements
    #: but no calibration (``MeasuredHost``) for the prior to stand on.
    unpredicted: tuple[CPConfig, ...] = ()
    #: The description's figures the path NCCL takes through a CPU would settle, where it is not
    #: given (``HardwareDescription.path_figures``).
    path_figures: tuple[str, ...] = ()
    #: On hardware of several nodes, which part of the prior's time decides the pick.
    tiers: TierDecision | None = None
    #: The configurations that cannot run beyond those ``infeasible`` lists, counted by reason.
    excluded: tuple[Excluded, ...] = ()
    #: Ranks per node where, beyond one node, only whole nodes were weighed (``weighed_ranks``:
    #: no rank count given, on hardware of several nodes); None where every count was.
    whole_nodes: int | None = None

    @property
    def infeasible_count(self) -> int:
        """Every configuration that cannot run: listed in ``infeasible`` or counted in ``excluded``."""
        return len(self.infeasible) + sum(e.count for e in self.excluded)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def config(self) -> CPConfig:
        return self.best.config

    @property
    def latency_ms(self) -> float:
        return self.best.latency_ms

    @property
    def interval_ms(self) -> tuple[float, float]:
        return self.best.low_ms, self.best.high_ms

    @property
    def source(self) -> str:
        return self.best.source

    @property
    def alternatives(self) -> tuple[Candidate, ...]:
        return self.candidates[1:]

    @property
    def tied(self) -> tuple[CPConfig, ...]:
        """The configurations that cannot be told from the pick: for a measured pick, those
        the measured verdict does not separate from it (fastest first); for a prior-only pick,
        those the description's figure ranges cannot order against it (``ties``). Never
        model-predicted ones (see the module docstring)."""
        if self.verdict is not None:
            return self.verdict.tied
        return tuple(t.other for t in self.ties)

    @property
    def contenders(self) -> tuple[CPConfig, ...]:
        """The pick and the configurations tied with it, the pick first: any of them runs at no
        cost the evidence can see (what a plan's bucket lists, ``cptune.plans.Bucket``)."""
        return (self.config, *self.tied)

    @property
    def path_decides(self) -> bool:
        """Whether naming the path NCCL takes through a CPU (``nccl_path``) settles a figure that
        moves some tie in the other configuration's favour."""
        return any(t.movers.intersection(self.path_figures) for t in self.ties)

    def settling_search(self) -> tuple[str, ...]:
        """The one ``cptune search`` command (as its words) that measures the pick and every
        configuration tied with it by the prior, on the machine itself (GPU ranks through the
        torch engine), which settles the tie; empty when the prior reports no tie."""
        if not self.ties:
            return ()
        configs = (self.config, *(t.other for t in self.ties))
        strategies = [s for s in STRATEGIES if s in {c.strategy for c in configs}]
        return ("cptune", "search", "--backend", "torch", *self.workload.flags("--seq-lens"),
                "--ranks", ",".join(str(n) for n in sorted({c.ranks for c in configs})),
                "--strategies", ",".join(strategies))

    def describe(self) -> str:
        """The pick in words: "X, faster than Y by p% (interval)" or "X and Y tied within the
        noise of this hardware" when measured; else the pick and where its figure comes from."""
        if self.verdict is not None:
            return self.verdict.describe()
        evidence = "predicted by the cost model" if self.source == "model" else "from the physical prior"
        if self.ties:
            names = [self.config.describe(), *(t.other.describe() for t in self.ties)]
            return (f"{', '.join(names[:-1])} and {names[-1]} tied within what the description's figures "
                    f"and the prior's own error allow ({evidence})")
        return f"{self.config.describe()} ({evidence})"

    def to_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload.to_dict(), "hardware": self.hardware, "fingerprint": self.fingerprint,
            "config": self.config.to_dict(), "latency_ms": self.latency_ms,
            "interval_ms": list(self.interval_ms), "source": self.source,
            "candidates": [c.to_dict() for c in self.candidates],
            "correction": self.correction.to_dict(),
            "infeasible": [
                {**c.to_dict(), "label": c.label, "reasons": r} for c, r in self.infeasible.items()
            ],
            "infeasible_count": self.infeasible_count,
            "excluded": [e.to_dict() for e in self.excluded],
            "whole_nodes": self.whole_nodes,
            "ties": [
                {**t.other.to_dict(), "label": t.other.label, "figure": t.figure, "end": t.end}
                for t in self.ties
            ],
            "tied": [{**c.to_dict(), "label": c.label} for c in self.tied],
            "settle": " ".join(self.settling_search()) or None,
            "nccl_path_decides": self.path_decides,
            "unpredicted": [{**c.to_dict(), "label": c.label} for c in self.unpredicted],
            "tiers": None if self.tiers is None else self.tiers.to_dict(),
            "verdict": self.describe(),
            "comparisons": [] if self.verdict is None else [
                {**c.other.to_dict(), "label": c.other.label, "ratio": c.ratio, "low": c.low, "high": c.high,
                 "paired_rounds": c.paired_rounds, "separated": c.separated}
                for c in self.verdict.comparisons
            ],
        }


@dataclass(frozen=True)
class MeasuredHost(StoredHost):
    """A host with measurements and no calibration (``cptune search --no-calibrate``): what
    was measured there can be compared, nothing predicted."""

    @property
    def ranks_per_node(self) -> int | None:
        return self.hardware.ranks_per_node

    @property
    def max_ranks(self) -> int:
        return self.hardware.gpu_count or self.hardware.cpu_count

    def describe(self) -> str:
        return f"{self.hardware.describe()} (measured, not calibrated)"


class _Advisor:
    """One database's fitted model and measurements, refreshed when the database changes.
    ``store`` None: the default database does not exist (yet), so only described hardware,
    from the prior alone, can be answered; nothing is created."""

    def __init__(self, url: str, store: Store | None) -> None:
        self.url = url
        self.store = store
        self.revision: tuple[int, int] | None = None
        self.model = CostModel()
        self.decision = CorrectionDecision(False, "nothing fitted yet", None, None)
        self.profiles: dict[str, CalibratedProfile] = {}
        self.fingerprints: list[str] = []
        self.measured: dict[tuple[str, Workload, CPConfig], Estimate] = {}
        #: Hosts with measurements and no calibration (``MeasuredHost``), by fingerprint.
        self.uncalibrated: dict[str, MeasuredHost] = {}

    def refresh(self) -> None:
        if self.store is None:
            self.model = CostModel().fit([], [])
            return
        revision = self.store.revision()
        if revision == self.revision:
            return
        data = training_set(self.store)
        self.model, self.decision = fit_advised(data.cases, data.latencies_s, data.tied_with_leader())
        self.profiles = data.profiles
        hosts = self.store.hardware()  # rows come only with measurements or calibrations
        self.fingerprints = list(hosts)
        self.measured = {(e.hardware, e.workload, e.config): e for e in (*data.estimates, *data.unfitted)}
        self.uncalibrated = {fp: MeasuredHost(hosts[fp]) for fp in data.uncalibrated if fp in hosts}
        self.revision = revision

    def profile(self, hardware: str | None, backend: str = "mpi", figures: Mapping[str, float] | None = None,
                nccl_path: str | None = None) -> Profile | MeasuredHost:
        """This host as ``backend``'s ranks use it, a stored fingerprint (or a unique prefix
        of one), or a description, with ``figures`` given and NCCL's path through a CPU
        settled (a description's only)."""
        profile = self._profile(hardware, backend)
        if not figures and nccl_path is None:
            return profile
        if not isinstance(profile, DescribedProfile):
            what, flag = (("figures are given", "--figure") if figures
                          else ("NCCL's path is given", "--nccl-path"))
            raise CPTuneError(
                f"{what} only to a hardware description, and {profile.describe()} is measured (its rates "
                f"come from its calibration); name a description with --hardware, or drop {flag}"
            )
        description = profile.description
        if nccl_path is not None:
            try:
                description = description.with_nccl_path(nccl_path)
            except ValueError as exc:
                raise CPTuneError(str(exc)) from None
        if figures:
            try:
                description = description.with_given(figures)
            except ValueError as exc:
                raise CPTuneError(f"{exc}; give --figure KEY=VALUE in the description file's units") from None
        return DescribedProfile(description)

    def _profile(self, hardware: str | None, backend: str) -> Profile | MeasuredHost:
        """``profile`` before any figures are given."""
        if hardware in (None, "host"):
            host = this_machine(backend)
            if self.store is None:
                raise StoreError(
                    f"no database at {missing_database(self.url)}: this host's recommendations stand on its "
                    f"calibration: run cptune calibrate (about a minute) or cptune search first, or name a "
                    f"hardware description with --hardware"
                )
            if host.fingerprint in self.uncalibrated:
                return _with_memory(self.uncalibrated[host.fingerprint])
            if host.fingerprint not in self.profiles:
                flag = "" if backend == "mpi" else f" --backend {backend}"
                raise CPTuneError(
                    f"this host as the {backend} engine runs it ({host.describe()}, {host.fingerprint}) has "
                    f"no calibration in {display_url(self.url)}: run cptune calibrate{flag} (about a "
                    f"minute), or name a hardware description with --hardware"
                )
            return _with_memory(self.profiles[host.fingerprint])
        assert hardware is not None
        stored = [fp for fp in self.fingerprints if fp.startswith(hardware.lower())]
        if len(hardware) >= 4 and len(stored) == 1:
            if stored[0] in self.uncalibrated:
                return _with_memory(self.uncalibrated[stored[0]])
            if stored[0] not in self.profiles:
                raise CPTuneError(
                    f"hardware {stored[0]} has measurements but no calibration in {display_url(self.url)}; "
                    f"run cptune calibrate on that machine with this database"
                )
            return _with_memory(self.profiles[stored[0]])
        try:
            return _described(hardware, _modified(hardware))
        except HardwareDescriptionError as exc:
            known = ", ".join(sorted(self.profiles)) or "none"
            where = display_url(self.url)
            raise CPTuneError(f"{exc} (calibrated fingerprints in {where}: {known})") from None


def predicted(
    model: CostModel, workload: Workload, configs: Sequence[CPConfig], profile: Profile
) -> list[Candidate]:
    """``model``'s latency and interval for each of ``configs`` running ``workload`` on ``profile``."""
    cases = [Case(workload, config, profile) for config in configs]
    estimates, lows, highs = model.predict_interval(cases)
    return [
        Candidate(case.config, float(estimate) * 1e3, float(low_s) * 1e3, float(high_s) * 1e3,
                  "model" if model.corrects(case) else "prior")
        for case, estimate, low_s, high_s in zip(cases, estimates, lows, highs, strict=True)
    ]


_machines: dict[str, Hardware] = {}
Stored = TypeVar("Stored", bound=StoredHost)


def this_machine(backend: str = "mpi") -> Hardware:
    """This machine as ``backend``'s ranks use it (``Engine.hardware``): the fingerprint its
    measurements and calibration are stored under. Read once per engine."""
    if backend not in _machines:
        _machines[backend] = get_engine(backend).hardware()
    return _machines[backend]


def _with_memory(profile: Stored) -> Stored:
    """``profile`` with this machine's memory, when it is this machine's CPU ranks: the limit
    they share (a GPU rank's limit is its own device's)."""
    here = {this_machine().fingerprint, *(h.fingerprint for h in _machines.values())}
    if profile.fingerprint not in here or profile.hardware.gpu_count:
        return profile
    return dataclasses.replace(profile, memory_bytes=host_memory_bytes())


def _modified(name_or_path: str) -> int | None:
    """When the regular file ``name_or_path`` names was last changed (None: it names no such
    file, and loading it says why), so an edited description is read again."""
    try:
        stat = os.stat(name_or_path)
    except OSError:
        return None
    return stat.st_mtime_ns if S_ISREG(stat.st_mode) else None


@functools.lru_cache(maxsize=32)
def _described(name_or_path: str, modified: int | None) -> DescribedProfile:
    """A description, read once per name (and per modification time of a file)."""
    return DescribedProfile(load_description(name_or_path))


_advisors: dict[str, _Advisor] = {}


def _advisor(db: str | None) -> _Advisor:
    """The advisor of ``db``, which is only read. A database that does not exist is never
    created: named (``db`` or $CPTUNE_DB), it is refused; the default one stands for an
    empty database."""
    url = database_url(db)
    if url not in _advisors:
        if db is None and not os.environ.get("CPTUNE_DB") and missing_database(url) is not None:
            advisor = _Advisor(url, None)  # not kept: the file may be created later
            advisor.refresh()
            return advisor
        store = Store(url, reading=True)
        if store.copied:  # an older database read through a copy: not kept, it would go stale
            with store:
                advisor = _Advisor(url, store)
                advisor.refresh()
            return advisor
        _advisors[url] = _Advisor(url, store)
    advisor = _advisors[url]
    advisor.refresh()
    return advisor


def hardware_profile(hardware: str | None = None, db: str | None = None, backend: str = "mpi",
                     figures: Mapping[str, float] | None = None, nccl_path: str | None = None,
                     nodes: int | None = None, ranks: int | None = None) -> Profile | MeasuredHost:
    """The profile ``recommend`` uses for ``hardware`` (same arguments)."""
    profile = _advisor(db).profile(hardware, backend, figures, nccl_path)
    return profile if nodes is None else _resized(profile, nodes, ranks)


def correction_decision_of(db: str | None = None) -> CorrectionDecision:
    """Whether ``recommend`` applies the learned correction on ``db``'s measurements, and why."""
    return _advisor(db).decision


Params = ParamSpec("Params")
Returned = TypeVar("Returned")


def _collection_paused(function: Callable[Params, Returned]) -> Callable[Params, Returned]:
    """``function`` run with Python's cyclic garbage collector paused (as it was after). Weighing
    thousands of configurations makes millions of small objects, which reference counting frees
    (they hold no cycles), and fills the prior's caches; meanwhile the collector would walk every
    object those caches hold several times over: about 40% of the CPU of a forward
    recommendation on 8,192 GPUs (``benchmarks/recommend_scaling.py``). It runs as usual after."""

    @functools.wraps(function)
    def paused(*args: Params.args, **kwargs: Params.kwargs) -> Returned:
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_collection_paused
def recommend(
    workload: Workload,
    ranks: int | None = None,
    hardware: str | None = None,
    db: str | None = None,
    strategies: Sequence[str] = STRATEGIES,
    backend: str = "mpi",
    figures: Mapping[str, float] | None = None,
    nccl_path: str | None = None,
    nodes: int | None = None,
    busy_ranks: int | None = None,
) -> Recommendation:
    """The fastest feasible configuration for ``workload``.

    ``ranks``: exactly this many ranks, or None for any count up to the hardware's (beyond one
    node in whole nodes, on hardware of several: ``weighed_ranks``).
    ``hardware``: None for this host (needs a calibration), a stored fingerprint, a shipped
    description name (e.g. "h100-sxm-8") or a description file. ``db``: a SQLAlchemy URL or
    a file path (default: $CPTUNE_DB or ./cptune.db). ``strategies``: the context strategies
    to consider (default all). ``backend``: the engine whose view of this host ``hardware``
    None means (its measurements and calibration are stored under their own fingerprint).
    ``figures``: a description's figures measured on the machine (key as a tie names it, value
    in the file's units, e.g. {"links.node.bandwidth_gbps.all_to_all": 17}), each range closed
    at that value. ``nccl_path``: how NCCL moves data between the description's GPUs that reach
    each other only through a CPU, "shm" (host memory) or "p2p" (``cptune.hardware.NCCL_PATHS``
    says which NCCL versions and CPUs take which); None leaves both open. ``nodes``: a
    calibrated cluster read for that many nodes sharing ``ranks`` (a size it never ran;
    ``CalibratedProfile.resized``). ``busy_ranks``: price every configuration with that many
    ranks busy at once, as a batch plan's groups run side by side (a calibrated host at the
    rates it measured with that many computing, ``CalibratedProfile.beside``; a configuration
    on fewer ranks is not answered by its measurements, timed alone; a described GPU's rates
    are its own whatever the others do). On hardware of several nodes the recommendation says
    which tier decides (``TierDecision``)."""
    advisor = _advisor(db)
    profile = advisor.profile(hardware, backend, figures, nccl_path)
    if nodes is not None:
        profile = _resized(profile, nodes, ranks)
    measured_from = 1  # the fewest ranks whose measurements (each timed alone) answer
    if busy_ranks is not None and isinstance(profile, CalibratedProfile):
        profile, measured_from = profile.beside(busy_ranks), busy_ranks
    if ranks is not None and not 1 <= ranks <= profile.max_ranks:
        raise CPTuneError(
            f"ranks must be between 1 and {profile.max_ranks} on {profile.describe()}, got {ranks}"
        )
    if ranks is None and profile.max_ranks > MAX_ANY_RANKS:
        raise CPTuneError(
            f"{profile.describe()} has {profile.max_ranks:,} ranks, and without a rank count recommend "
            f"weighs every count up to {MAX_ANY_RANKS:,}; name the count to weigh with --ranks "
            f"(e.g. --ranks {MAX_ANY_RANKS})"
        )
    counts = weighed_ranks(profile, ranks)
    split = split_configs(workload, counts, tuple(strategies), profile.memory_limit)
    feasible, infeasible = split.feasible, split.infeasible
    if not feasible:
        raise _nothing_runs(workload, profile, split)
    candidates = []
    to_predict = []
    measured = []
    for config in feasible:
        estimate = None
        if config.ranks >= measured_from:
            estimate = advisor.measured.get((profile.fingerprint, workload, config))
        if estimate is not None:
            measured.append(estimate)
            candidates.append(Candidate(config, estimate.median_ms, estimate.low_ms, estimate.high_ms,
                                        "measured", estimate.visits[-1].id, estimate.ids))
        else:
            to_predict.append(config)
    unpredicted: tuple[CPConfig, ...] = ()
    if to_predict:
        if not isinstance(profile, MeasuredHost):
            check_predicts(workload, profile)
            candidates += predicted(advisor.model, workload, to_predict, profile)
        elif measured:
            unpredicted = tuple(to_predict)
        else:
            raise _unmeasured(workload, ranks, profile, advisor, backend)
    candidates.sort(key=lambda c: c.latency_ms)
    verdict = judge(measured) if candidates[0].source == "measured" else None
    if verdict is not None:  # the rounds the verdict pairs outrank medians: its leader is the pick
        leader = next(c for c in candidates if c.config == verdict.leader.config)
        candidates.remove(leader)
        candidates.insert(0, leader)
    correction = advisor.decision
    if correction.applied and not any(c.source == "model" for c in candidates):
        # fitted and worth applying, but on other hardware: it changed none of these candidates
        correction = dataclasses.replace(correction, applied=False, reason=(
            f"it is fitted on other hardware's measurements, none of {profile.fingerprint}'s, so it changed "
            f"no candidate here (there: {correction.reason})"))
    return Recommendation(
        workload=workload, hardware=profile.describe(), fingerprint=profile.fingerprint,
        candidates=tuple(candidates), infeasible=infeasible, excluded=split.excluded, correction=correction,
        ties=() if isinstance(profile, MeasuredHost) else _ties(workload, profile, candidates),
        verdict=verdict, unpredicted=unpredicted,
        path_figures=profile.description.path_figures if isinstance(profile, DescribedProfile) else (),
        tiers=None if isinstance(profile, MeasuredHost) else _tier_decision(workload, profile, candidates),
        whole_nodes=profile.ranks_per_node if ranks is None and len(counts) < profile.max_ranks else None,
    )


def weighed_ranks(profile: Profile | MeasuredHost, ranks: int | None) -> Sequence[int]:
    """The rank counts ``recommend`` weighs: ``ranks`` alone when given; else every count up to
    the hardware's, in whole nodes beyond the first on hardware of several nodes (a job spanning
    nodes takes whole nodes; weighing every count, each pick on 16 to 256 GPUs of six workloads,
    forward and training, was on whole nodes anyway: ``benchmarks/recommend_scaling.py``). The
    cost follows them: on
    8,192 GPUs in nodes of 8, 1,031 counts rather than 8,192. Any other count is there for
    ``ranks``."""
    if ranks is not None:
        return (ranks,)
    node = profile.ranks_per_node
    if node is None or node >= profile.max_ranks:
        return range(1, profile.max_ranks + 1)
    return [*range(1, node + 1), *range(2 * node, profile.max_ranks + 1, node)]


#: How many configurations that cannot run the refusal of a workload none can run names.
NAMED_INFEASIBLE = 10


def _nothing_runs(workload: Workload, profile: Profile | MeasuredHost, split: ConfigSplit
                  ) -> InfeasibleConfigError:
    """The refusal of a workload no configuration can run: the first few that cannot, each
    with its reasons, and how many more cannot and why."""
    named = list(split.infeasible.items())[:NAMED_INFEASIBLE]
    listed = [f"{c.label} on {c.ranks}: {'; '.join(r)}" for c, r in named]
    if more := len(split.infeasible) - len(named):
        listed.append(f"{more:,} more listed with --json")
    listed += [e.describe() for e in split.excluded]
    return InfeasibleConfigError(
        f"no configuration can run {workload.describe()} on {profile.describe()}: {' | '.join(listed)}",
        [*(reason for r in split.infeasible.values() for reason in r), *(e.reason for e in split.excluded)],
    )


def _resized(profile: Profile | MeasuredHost, nodes: int, ranks: int | None) -> CalibratedProfile:
    """``profile``, a calibrated cluster, read for ``nodes`` nodes sharing ``ranks``."""
    if ranks is None or ranks % nodes:
        raise CPTuneError(f"--nodes {nodes} reads a calibrated cluster for {nodes} nodes sharing --ranks: "
                          f"give --ranks, a multiple of {nodes} (--nodes 2 --ranks 16: 2 nodes x 8 ranks)")
    if not isinstance(profile, CalibratedProfile):
        raise CPTuneError(f"--nodes reads a calibrated cluster for another size, and {profile.describe()} is "
                          f"not one: name a cluster's fingerprint with --hardware, or drop --nodes")
    try:
        return profile.resized(nodes, ranks // nodes)
    except ValueError as exc:
        raise CPTuneError(str(exc)) from None


def _tier_decision(workload: Workload, profile: Profile, candidates: list[Candidate]) -> TierDecision | None:
    """Which part of the prior's time decides the pick, on hardware of several nodes."""
    if profile.ranks_per_node is None:
        return None
    pick = candidates[0].config
    runner_up = candidates[1].config if len(candidates) > 1 else None
    return TierDecision(tier_split(workload, pick, profile), runner_up,
                        {} if runner_up is None else tier_split(workload, runner_up, profile))


def _unmeasured(workload: Workload, ranks: int | None, host: MeasuredHost, advisor: _Advisor, backend: str
                ) -> CPTuneError:
    """The refusal for a workload a host without a calibration has no measurement of: what
    it has measured of the shape, and the command that lets the prior predict the rest."""
    lengths = sorted({w.seq_len for (fp, w, c) in advisor.measured if fp == host.fingerprint
                      and w.shape == workload.shape and (ranks is None or c.ranks == ranks)})
    measured = (f"measured there: seq_len {', '.join(map(str, lengths))}" if lengths else
                "nothing of this shape is measured there")
    flag = "" if backend == "mpi" else f" --backend {backend}"
    on = "" if ranks is None else f" on {ranks} rank(s)"
    return CPTuneError(
        f"{host.hardware.describe()} ({host.fingerprint}) has measurements but no calibration in "
        f"{display_url(advisor.url)}, and none of {workload.describe()}{on} ({measured}): predicting it "
        f"needs a calibration: run cptune calibrate{flag} with this database (about a minute), or measure it "
        f"with cptune search"
    )


def _ties(workload: Workload, profile: Profile, candidates: list[Candidate]) -> tuple[Tie, ...]:
    """The prior-only alternatives whose order against a prior-only pick the figures' ranges
    do not settle (``prior_ties``)."""
    best = candidates[0]
    if best.source != "prior":
        return ()
    others = [c.config for c in candidates[1:] if c.source == "prior"]
    return prior_ties(workload, best.config, others, profile)


def predict_for(
    store: Store, fingerprint: str, workload: Workload, configs: Sequence[CPConfig]
) -> list[Candidate]:
    """What ``recommend``'s model, fitted on what ``store`` holds now (refitted when it changes),
    predicts for ``configs`` running ``workload`` on the calibrated hardware ``fingerprint``."""
    advisor = _advisor(store.engine.url.render_as_string(hide_password=False))
    profile = advisor.profile(fingerprint)
    assert not isinstance(profile, MeasuredHost), "a guided search needs a calibration (its _why_not_guided)"
    return predicted(advisor.model, workload, configs, profile)
