"""A whole space searched on this machine, and this machine calibrated: what ``cptune search``
and ``cptune calibrate`` do, callable from Python with the same defaults.

``search_space`` resolves the space's rank counts on this machine (its cores, or its GPUs),
refuses oversubscription unless asked, checks every sequence length can run, calibrates new
hardware first (the cost model's prior needs it), probes the node where the engine has probes
(``EngineSpec.probes``: once per host and engine, the verdict kept in the store) and leaves
out what the verdict refuses, searches each sequence length (``WorkloadSearch``), then gives
each winner that is not yet sure a second sitting after the other lengths. ``check_host``
probes this node as ``cptune doctor`` does. ``SearchProgress`` hears each step; the command
line draws it live.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cptune.calibration import (
    REPEATS,
    ROUNDS,
    Calibration,
    CalibrationDisturbedError,
    CalibrationPieces,
    calibrate,
)
from cptune.config import CPConfig
from cptune.engines import ENGINES, Engine, NodeVerdict, get_engine, ranks_per_node, untimed
from cptune.errors import SearchSetupError
from cptune.estimate import Verdict
from cptune.execute import check_rank_count, rank_memory_limit, space_rank_counts
from cptune.feasibility import enumerate_configs, feasibility
from cptune.frameworks import FrameworkError, check_engine, get_framework
from cptune.guard import busy_notice, patience_s
from cptune.guard import enabled as guard_enabled
from cptune.hardware import Hardware, heads_span_nodes
from cptune.hostlock import measuring
from cptune.search._visits import Visit
from cptune.search._workload import WorkloadSearch
from cptune.space import DEMO_SPACE, ORDERS, SearchSpace, check_runnable, find_space
from cptune.store import Store, display_url, new_database
from cptune.workload import Workload


class SearchProgress:
    """What a search or a calibration of this machine tells as it goes. Every method does
    nothing here: override what you want to show."""

    def started(self, run: SpaceSearch) -> None:
        """The search is set up: space, hardware and database known, nothing run yet."""

    def host_busy(self, notice: str) -> None:
        """Other processes take the cores a run needs as the work begins: ``notice`` says so in
        one line, and what the contention guard will do (``cptune.guard.busy_notice``)."""

    def calibrating(self, hardware: Hardware, ranks: int, url: str, first_run: bool) -> None:
        """A calibration of 1..``ranks`` ranks begins (``first_run``: the one a search runs
        on hardware that has none)."""

    def calibration_step(self, step: str) -> None:
        """A calibration step begins, or was timed again (``cptune.calibration.RETIMED``)."""

    def checking_node(self, hardware: Hardware, ranks: int) -> None:
        """The engine's probes of this node on ``ranks`` ranks begin (``Engine.check_node``):
        the first search with a probing engine on this hardware keeps their verdict."""

    def node_checked(self, verdict: NodeVerdict, stored: bool) -> None:
        """The node's verdict the search goes by: taken from the store (``stored``), or just
        probed (and stored now)."""

    def refused(self, workload: Workload, config: CPConfig, reason: str) -> None:
        """The node's verdict refuses ``config`` of ``workload`` (``reason``, one line): it is
        left out of that workload's search."""

    def skipped(self, workload: Workload) -> None:
        """The node's verdict refuses every configuration of ``workload`` (each told to
        ``refused`` first): its search is skipped."""

    def sitting_started(self, search: WorkloadSearch, second: bool) -> None:
        """One sitting of a sequence length's search begins (``second``: its confirmation)."""

    def visited(self, search: WorkloadSearch, visit: Visit, second: bool) -> None:
        """A configuration was visited (or, ``visit.reused``, taken from the store)."""

    def sitting_done(self, search: WorkloadSearch, second: bool, visits: list[Visit],
                     unconfirmed: bool) -> None:
        """A sitting ended; ``unconfirmed``: its winner still wants a second sitting."""


@dataclass
class SpaceSearch:
    """A whole space's search: how it was set up, and afterwards what it found."""

    space: SearchSpace  # its rank counts resolved on this machine
    hardware: Hardware
    engine: str  # the engine's name
    url: str  # the database, as it may be shown
    rounds: int
    race_rounds: int
    confirm_rounds: int
    order: str
    #: The calibration this search ran first (None: the hardware had one, or none was asked).
    calibration: Calibration | None = None
    #: Each sequence length's search, in the space's order.
    searches: dict[int, WorkloadSearch] = field(default_factory=dict)
    #: Visits run (not taken from the store), and how many failed or were disturbed.
    visits: int = 0
    failed: int = 0
    disturbed: int = 0
    #: (seq_len, configuration) pairs measured by this search.
    measured: set[tuple[int, CPConfig]] = field(default_factory=set)
    #: The node's verdict the search went by (engines with probes; None for the others).
    node: NodeVerdict | None = None
    #: Per sequence length, each configuration the node's verdict refused, with the reason:
    #: left out of that length's search (and of ``searches``, where it refused them all).
    refused: dict[int, dict[CPConfig, str]] = field(default_factory=dict)

    @property
    def skipped(self) -> tuple[int, ...]:
        """The sequence lengths not searched: the node's verdict refused every configuration."""
        return tuple(seq_len for seq_len in self.refused if seq_len not in self.searches)

    @property
    def refused_count(self) -> int:
        """(seq_len, configuration) pairs left out because the node's verdict refused them."""
        return sum(len(reasons) for reasons in self.refused.values())

    @property
    def verdicts(self) -> dict[int, Verdict | None]:
        """Each sequence length's verdict over every clean visit stored (None: none ran clean)."""
        return {seq_len: search.verdict for seq_len, search in self.searches.items()}

    def describe(self) -> str:
        """Each sequence length's verdict in words, a line each, and a line for each
        configuration it leaves out (``WorkloadSearch.left_out``), as ``cptune search`` ends."""
        verdicts = self.verdicts
        lines = []
        for seq_len in self.space.seq_lens:
            if seq_len in verdicts:
                verdict = verdicts[seq_len]
                lines.append(f"seq {seq_len}: {verdict.describe() if verdict else 'nothing ran clean'}")
                lines += [f"seq {seq_len}: {left.describe()}" for left in self.searches[seq_len].left_out]
            elif seq_len in self.skipped:
                lines.append(f"seq {seq_len}: not searched, this node refuses every configuration")
        return "\n".join(lines)


def _counted_ranks(space: SearchSpace, engine: Engine, max_ranks: int | None, oversubscribe: bool
                   ) -> tuple[SearchSpace, int, int]:
    """``space`` with the rank counts it runs here (``cptune.execute.space_rank_counts``, the
    nodes preflighted for the largest), the ranks available and this machine's capacity."""
    counts = space_rank_counts(space, engine, max_ranks, oversubscribe)
    engine.preflight(max(counts))  # on a cluster: the nodes hold them all
    return dataclasses.replace(space, ranks=counts), max_ranks or engine.capacity(), engine.capacity()


def search_space(
    space: SearchSpace | str | Path = DEMO_SPACE,
    db: str | None = None,
    *,
    backend: str | Engine = "mpi",
    max_ranks: int | None = None,
    trials: int | None = None,
    timeout: float | None = None,
    rounds: int | None = None,
    race_rounds: int | None = None,
    confirm_rounds: int | None = None,
    order: str = "exhaustive",
    remeasure: bool = False,
    oversubscribe: bool = False,
    calibrate_first: bool = True,
    seed: int | None = None,
    progress: SearchProgress | None = None,
    share: bool = False,
    framework: str | None = None,
) -> SpaceSearch:
    """Search every sequence length of ``space`` (a ``SearchSpace``, a TOML file or a
    built-in name) on this machine and keep every result in ``db`` (a path or SQLAlchemy
    URL; default ``$CPTUNE_DB`` or ./cptune.db), exactly as ``cptune search`` does.

    ``max_ranks`` caps the space's rank counts (default: this machine's cores or GPUs);
    ``trials`` (default: the space's) bounds each length's exploration and ``timeout`` its
    seconds; ``rounds``, ``race_rounds`` and ``confirm_rounds`` default to the space's
    ``[measure]`` settings. ``order`` is one of ``cptune.space.ORDERS``. ``calibrate_first``:
    hardware without a calibration is calibrated before the search. ``seed`` fixes the
    rounds' random order. ``share``: ``db`` may hold other programs' tables; cptune's are
    added beside them (``Store(share=True)``). Raises ``CPTuneError`` subclasses before
    anything runs for what cannot run here (an untimed or unavailable backend, a space with
    nothing feasible, more ranks than cores without ``oversubscribe``, a database that cannot
    be written). While another process measures on this host (``cptune.hostlock``), waits
    for it before the first run (not at all when every result is stored already).
    ``framework`` (a name of ``cptune.frameworks.FRAMEWORKS``): only the configurations that
    framework can run are measured."""
    guard_enabled()  # a bad CPTUNE_GUARD is refused before anything runs, not at the first run
    patience_s()  # ... and a bad CPTUNE_GUARD_PATIENCE
    if order not in ORDERS:
        raise SearchSetupError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    engine = get_engine(backend)
    if not engine.spec.timed:
        raise untimed(engine.name)
    space = find_space(space)
    engine.preflight(max_ranks or 1)
    space, available, cores = _counted_ranks(space, engine, max_ranks, oversubscribe)
    counts = space.rank_counts(available)
    memory_limit = rank_memory_limit(engine)
    check_runnable(space, available, space.origin, memory_limit)
    runs = _framework_filter(framework, engine.name, space, max(counts))
    engine.preflight(max(counts))
    hardware = engine.hardware()
    per_node = ranks_per_node(engine)
    told = progress or SearchProgress()
    with _measuring_into(db, share) as store:  # one measuring process per host: a second one waits
        run = SpaceSearch(
            space=space, hardware=hardware, engine=engine.name, url=store.url, order=order,
            rounds=rounds or space.measure.rounds,
            race_rounds=space.measure.race_rounds if race_rounds is None else race_rounds,
            confirm_rounds=space.measure.confirm_rounds if confirm_rounds is None else confirm_rounds,
        )
        told.started(run)
        _tell_busy(engine, min(max(counts), cores), told)
        studies = store.optuna_storage()
        if calibrate_first and store.calibration(hardware.fingerprint) is None:
            ranks = min(max(counts), cores)  # oversubscribed rank counts would time the sharing
            told.calibrating(hardware, ranks, store.url, first_run=True)
            run.calibration = _calibrated(store, hardware, engine, ranks, told)
        if engine.spec.probes:
            run.node = _node_verdict(store, engine, hardware, max(counts), told)
        pending = []  # searches whose winner a second sitting confirms
        for workload in space.workloads():
            configs = [c for c in enumerate_configs(workload, max(counts), space.strategies)
                       if c.ranks in counts and not feasibility(workload, c, memory_limit(c.ranks))
                       and runs(workload, c)
                       and not (space.within_node_heads and heads_span_nodes(c, per_node))]
            if run.node is not None:
                configs = _allowed(run, workload, configs, told)
                if not configs:
                    told.skipped(workload)
                    continue
            search = WorkloadSearch(
                workload, configs, store, hardware, warmup=space.measure.warmup,
                repeats=space.measure.repeats, run_timeout=space.measure.timeout,
                trials=trials or space.trials, time_budget=timeout, remeasure=remeasure,
                backend=engine, order=order, study_storage=studies, rounds=run.rounds,
                race_rounds=run.race_rounds, confirm_rounds=run.confirm_rounds, seed=seed,
            )
            run.searches[workload.seq_len] = search
            if _sitting(run, search, second=False, told=told):
                pending.append(search)
        for search in pending:
            _sitting(run, search, second=True, told=told)
    return run


def _framework_filter(
    name: str | None, engine: str, space: SearchSpace, max_ranks: int
) -> Callable[[Workload, CPConfig], bool]:
    """Whether framework ``name`` runs a configuration (every one when None); ``FrameworkError``
    before anything runs for an engine whose ranks do not stand for the framework's, or a
    length of ``space`` where it runs none of its configurations."""
    if name is None:
        return lambda workload, config: True
    framework = get_framework(name)
    check_engine(framework, engine)
    for workload in space.workloads():
        configs = enumerate_configs(workload, max_ranks, space.strategies)
        if configs and all(framework.refusal(workload.shape, c) for c in configs):
            reason = framework.refusal(workload.shape, configs[-1])
            raise FrameworkError(f"{framework.name} runs none of the {len(configs)} configuration(s) of "
                                 f"{workload.describe()} in this space ({configs[-1].describe()}: "
                                 f"{reason}): search without --for, or for another framework")
    return lambda workload, config: framework.refusal(workload.shape, config) is None


@contextmanager
def _measuring_into(db: str | None, share: bool) -> Iterator[Store]:
    """``db``'s store, checked writable, with the host lock held (``measuring``). An
    existing database is opened before the lock is waited for, so one that cannot be written
    is refused at once, and the lock is taken at the first run (none when every result is
    stored); a new one (``new_database``) is made only once the lock is held, so that failing
    to get it (a lock file that cannot be opened, Ctrl-C while waiting) leaves no empty
    database behind."""
    if new_database(db):
        with measuring(), Store(db, share=share) as store:
            yield store
        return
    with Store(db, share=share) as store:
        store.require_writable()
        with measuring(lazy=True):  # taken at the first run: a search with all stored never waits
            yield store


def _node_verdict(store: Store, engine: Engine, hardware: Hardware, ranks: int, told: SearchProgress
                  ) -> NodeVerdict:
    """The verdict of ``engine``'s probes on this node kept in ``store``, or (none kept, or
    one probed on fewer than ``ranks`` ranks) the node probed on ``ranks`` ranks now and kept."""
    verdict = store.node_verdict(hardware.fingerprint, engine.name)
    if verdict is not None and verdict.ranks >= ranks:
        told.node_checked(verdict, stored=True)
        return verdict
    told.checking_node(hardware, ranks)
    verdict = engine.check_node(ranks)
    store.add_node_verdict(hardware, engine.name, verdict)
    told.node_checked(verdict, stored=False)
    return verdict


def _allowed(run: SpaceSearch, workload: Workload, configs: list[CPConfig], told: SearchProgress
             ) -> list[CPConfig]:
    """``configs`` less those the node's verdict refuses, each told and kept in ``run.refused``."""
    assert run.node is not None
    allowed = []
    for config in configs:
        if (reason := run.node.refuses(workload, config)) is None:
            allowed.append(config)
        else:
            run.refused.setdefault(workload.seq_len, {})[config] = reason
            told.refused(workload, config, reason)
    return allowed


def _sitting(run: SpaceSearch, search: WorkloadSearch, second: bool, told: SearchProgress) -> bool:
    """One sitting of ``search`` (``run``, or ``confirm`` when ``second``), counted into
    ``run``; whether its winner is still unconfirmed."""

    def on_visit(visit: Visit) -> None:
        if not visit.reused:
            run.visits += 1
            run.failed += visit.status != "ok"
            run.disturbed += visit.disturbed is not None
        told.visited(search, visit, second)

    told.sitting_started(search, second)
    search.on_visit = on_visit
    visits = search.confirm() if second else search.run()
    run.measured.update((search.workload.seq_len, v.config) for v in visits if not v.reused)
    unconfirmed = bool(search.unconfirmed())
    told.sitting_done(search, second, visits, unconfirmed)
    return unconfirmed


def probing_engines() -> tuple[str, ...]:
    """The engines with node probes (``EngineSpec.probes``): what ``cptune doctor`` checks."""
    return tuple(name for name, spec in ENGINES.items() if spec.probes)


def no_probes(name: str) -> str:
    """Why ``cptune doctor`` has nothing to check with the engine ``name`` (one line)."""
    known = "has no node probes (its runs show all it can do)" if name in ENGINES else "is not an engine"
    return f"{name} {known}; engines with probes: {', '.join(probing_engines())}"


def check_host(
    db: str | None = None,
    *,
    backend: str | Engine = "tensorrt",
    max_ranks: int | None = None,
    share: bool = False,
) -> tuple[Hardware, NodeVerdict]:
    """Probe this node on ``max_ranks`` ranks (default: all its GPUs) with an engine that has
    node probes (``EngineSpec.probes``), exactly as ``cptune doctor`` does: this machine's
    hardware and the verdict. With ``db`` (a path or SQLAlchemy URL) the verdict is kept
    there, replacing the one before, and searches on this host go by it instead of probing
    again (``share``: in a database that holds other programs' tables too, ``Store(share=True)``).
    Raises before anything runs for an engine without probes (``SearchSetupError``),
    a node that cannot run it (``BackendUnavailableError``, the preflight's one line) or a
    database that cannot be written."""
    engine = get_engine(backend)
    if not engine.spec.probes:
        raise SearchSetupError(no_probes(engine.name))
    engine.preflight(max_ranks or 1)
    hardware = engine.hardware()
    if db is None:
        return hardware, engine.check_node(max_ranks)
    if new_database(db):  # made only once there is a verdict to keep: a failed probe leaves none
        verdict = engine.check_node(max_ranks)
        with Store(db, share=share) as store:
            store.add_node_verdict(hardware, engine.name, verdict)
        return hardware, verdict
    with Store(db, share=share) as store:
        store.require_writable()
        verdict = engine.check_node(max_ranks)
        store.add_node_verdict(hardware, engine.name, verdict)
    return hardware, verdict


def calibrate_host(
    db: str | None = None,
    *,
    backend: str | Engine = "mpi",
    max_ranks: int | None = None,
    oversubscribe: bool = False,
    repeats: int = REPEATS,
    rounds: int = ROUNDS,
    progress: SearchProgress | None = None,
    share: bool = False,
) -> tuple[Hardware, Calibration]:
    """Calibrate this machine on 1..``max_ranks`` ranks (default: its cores, or its GPUs) and
    keep the calibration in ``db`` (``share``: beside other programs' tables there,
    ``Store(share=True)``), exactly as ``cptune calibrate`` does: this machine's hardware and
    its calibration. While another process measures on this host (``cptune.hostlock``),
    waits for it first."""
    engine = get_engine(backend)
    engine.preflight(max_ranks or 1)
    max_ranks = max_ranks or engine.capacity()
    check_rank_count(f"--max-ranks {max_ranks}", max_ranks, engine, oversubscribe)
    told = progress or SearchProgress()
    with _measuring_into(db, share) as store:
        hardware = engine.hardware()
        _tell_busy(engine, min(max_ranks, engine.capacity()), told)
        told.calibrating(hardware, max_ranks, store.url, first_run=False)
        calibration = _calibrated(store, hardware, engine, max_ranks, told, repeats=repeats, rounds=rounds)
    return hardware, calibration


def _tell_busy(engine: Engine, ranks: int, told: SearchProgress) -> None:
    """Tell ``told`` where the host is busy for ``ranks`` ranks as the work begins, the guard on."""
    if guard_enabled() and (notice := busy_notice(ranks, engine.process_ids)) is not None:
        told.host_busy(notice)


def _calibrated(store: Store, hardware: Hardware, engine: Engine, ranks: int, told: SearchProgress,
                repeats: int = REPEATS, rounds: int = ROUNDS) -> Calibration:
    """``calibrate`` on 1..``ranks`` ranks, stored in
    ``store``: going on from the steps a calibration a busy host stopped kept there, and keeping
    each step timed clean as it goes (``CalibrationPieces``), so that a stop loses none of them."""
    def keep(key: str, seconds: tuple[float, ...]) -> None:
        store.add_calibration_piece(hardware, engine.name, key, seconds)

    pieces = CalibrationPieces(store.calibration_pieces(hardware.fingerprint, engine.name), keep)
    try:
        calibration = calibrate(ranks, backend=engine, repeats=repeats, progress=told.calibration_step,
                                rounds=rounds, pieces=pieces)
    except CalibrationDisturbedError as exc:
        raise CalibrationDisturbedError(
            f"{exc}. {exc.kept} of the calibration's {exc.total} steps ran clean and are kept in "
            f"{display_url(store.url)}: the same command, once the host is quieter, goes on from them",
            exc.kept, exc.total) from None
    store.add_calibration(hardware, calibration)
    return calibration
