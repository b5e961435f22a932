"""Calibration: how fast this hardware moves bytes and computes attention, measured.

The cost model's prior turns the analytic terms of a configuration (FLOPs, bytes per
collective, steps) into time. It needs, per rank count, each collective's latency and
bandwidth and the attention compute rate; ``calibrate`` measures them on real ranks in
about a minute:

- each collective the strategies use (all-to-all, all-gather, the Ring's stream step) in
  groups of every size a configuration can form, over a sweep of message sizes, fitted to
  ``time = latency + bytes sent per rank / bandwidth``. The mpi engine times its all-to-all
  and all-gather as a strategy runs them, with the copies into send order and out of
  receive order (at fp32 they took 2.7-5.8x the bare collective). The bandwidth reported next
  to the fit is nccl-tests' bus bandwidth at the largest message: bytes each rank sends to its
  peers per second, which for all-gather and all-to-all is algbw * (n - 1) / n and for
  send/recv is algbw;
- the attention kernel on a few shapes, every rank computing at once on its share of the
  cores, so a rank count's rate includes the contention between its ranks. The rate
  depends on the work per call (small blocks pay fixed costs), the head_dim (the GEMMs'
  inner dimension) and the mask, so each is timed at five sizes, both head_dims and with
  and without a causal mask; the prior interpolates between them, each rank count's rate
  against one rank's read as one line in log work per call over all shapes
  (``Calibration.pooled_compute``: shape by shape that ratio is noisy); where the engine
  trains, its backward too on the smaller sizes, read as a share of the forward's rate
  that moves with the work per call (``Calibration.backward_speed``);
- where the engine's spec says so (``times_steps``: the mpi engine's numpy kernel), the work over
  a query block that a Ring step repeats beyond one call over all keys: preparing the query
  block (cast from each wire dtype, scaled, row norms) and merging the block's output into
  the running one, per element, every rank at once. Both are passes over memory whose cost
  grows with the sequence, not its square, so Ring's excess over the others falls as 1/S;
- where the engine's spec says so (``times_waits``: the mpi engine) and a rank count outnumbers
  the cores, what one blocking exchange costs beyond its own time when ranks beside it compute
  (``ExchangeWait``): a group of each size computes a small calibrated shape and then
  all-gathers, a few times in a row, while the other ranks compute throughout, against the same
  all-gathers with the others idle, each run from a sleeping barrier, as a batch plan's is; the
  time inside each exchange is what counts. The exchange completes only once its members run at
  the same time, and ranks computing beside them hold the cores for their slices: on this
  project's 2-core host, 4 ranks, a pair's all-gather took 2.6-4.7 ms inside beside two computing
  ranks, about alike from 16 to 256 KiB per peer and after 5 or 20 ms of compute, against 0.3-1.7
  ms with them idle. Nothing else calibration times holds it (the collectives are timed with every
  rank inside them and none computing, the kernel with none exchanging).

Every step is timed in rounds, rank counts in turn, and a point's time is the median of its
rounds: a burst of load the contention guard cannot see slows one round, not the median.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from cptune.calibration._record import (
    Calibration,
    CollectiveFit,
    ComputeRate,
    ExchangeWait,
    StepCost,
    fit_latency_bandwidth,
)
from cptune.cost import STREAM_KINDS
from cptune.engines import Engine, get_engine, ranks_per_node, untimed
from cptune.errors import CPTuneError
from cptune.guard import Watch, patience_s, wait_for_quiet
from cptune.guard import enabled as guard_enabled
from cptune.hardware import tier_of
from cptune.hostlock import measuring
from cptune.layout import RankGroups
from cptune.measurement import describe_host, oversubscribed
from cptune.version import __version__

#: Bytes each rank sends per collective call: 1 KiB to 16 MiB in steps of 4x.
MESSAGE_SIZES: tuple[int, ...] = tuple(2**e for e in range(10, 25, 2))
#: Attention shapes timed per rank count: a few heads' query block against its keys, at five
#: sizes (factors 4 of work apart, 67 MFLOP to 17 GFLOP at d64), head_dim 64 and 128, without
#: and with a causal mask. The largest (about 30 GFLOP) reaches the work of a whole layer on
#: one rank at a few thousand tokens: beyond the largest shape the rate is held, and two sizes
#: held it from 2048 tokens on one rank but 3072 on two, which skewed one rank against two
#: between those lengths. The smallest reach a training step's calls at a few hundred tokens
#: per rank, where a call's fixed costs halve the rate (25 against 55 GFLOP/s at d64 on one
#: rank of this project's 2-core host); held from 1 GFLOP down, the prior missed 512-token
#: training steps by 1.3-1.9x, by configuration.
ATTENTION_SHAPES: tuple[dict[str, int], ...] = tuple(
    {"heads": 4, "seq_q": seq_q, "seq_k": 4 * seq_q, "head_dim": head_dim, "causal": causal}
    for head_dim in (64, 128)
    for causal in (0, 1)
    for seq_q in (128, 256, 512, 1024, 2048)
)
#: Memory-bound steps timed per rank count (where ``EngineSpec.times_steps``) on a 4-head x
#: 1024-row x d128 block (half a million elements): preparing a query block from each wire
#: dtype, merging an output.
STEP_SHAPES: tuple[dict[str, Any], ...] = (
    *({"kind": "query", "wire": wire, "heads": 4, "rows": 1024, "head_dim": 128}
      for wire in ("float16", "float32")),
    {"kind": "merge", "wire": "float32", "heads": 4, "rows": 1024, "head_dim": 128},
)
#: The shape the ranks compute while the exchange waits are timed (``ExchangeWait``): the
#: smallest d64 causal one of ``ATTENTION_SHAPES`` (the wait moved little with the compute
#: before it, 5 or 20 ms, nor with the bytes, 16-256 KiB per peer).
WAIT_SHAPE: dict[str, int] = next(shape for shape in ATTENTION_SHAPES
                                  if shape["head_dim"] == 64 and shape["causal"] and shape["seq_q"] == 128)
#: Exchanges per timed run of the exchange waits, and the bytes per peer of each all-gather
#: (a short sequence's K/V on a few ranks).
WAIT_CALLS = 4
WAIT_CHUNK = 64 * 2**10
_TIMEOUT_S = 120.0
#: Times a calibration step the contention guard saw disturbed is timed again (each time once
#: the host is quiet) before calibrate gives up.
GUARD_RETRIES = 3
#: How a progress message about a step timed again begins after the step's name: the CLI
#: shows those beyond its spinner.
RETIMED = "disturbed by other load"
#: How the progress message begins that says a calibration goes on from the steps a stopped
#: one timed clean: the CLI shows it as a line of its own.
RESUMING = "going on from"
#: Rounds a calibration is timed in, and timed calls per step in each round (``calibrate``).
ROUNDS = 3
REPEATS = 5

Progress = Callable[[str], None]


def group_sizes(ranks: int) -> list[int]:
    """Every group a configuration on ``ranks`` ranks communicates in: the divisors > 1
    (head groups of u ranks, context groups of ranks / u)."""
    return [g for g in range(2, ranks + 1) if ranks % g == 0]


def _per_peer(kind: str, group: int, sent: int) -> int:
    return sent if kind in STREAM_KINDS else max(1, sent // (group - 1))


class CalibrationDisturbedError(CPTuneError):
    """Other load on the host disturbed a calibration step every time it was timed. ``kept``
    of the calibration's ``total`` steps were timed clean before it (those given to
    ``calibrate`` included): kept where its ``CalibrationPieces`` keeps them, they spare the
    next calibration their time."""

    def __init__(self, message: str, kept: int = 0, total: int = 0) -> None:
        super().__init__(message)
        self.kept = kept
        self.total = total


@dataclass
class CalibrationPieces:
    """The steps of a calibration timed clean so far, by key (``calibrate`` makes the keys: the
    round, the step, and a digest of what the step times and how, so a step timed another way
    is never taken for it): a calibration given these times only the others, and calls
    ``keep`` with each step it times clean (where the caller stores it), so one that a busy
    host stopped is gone on from by the next instead of started over."""

    done: dict[str, tuple[float, ...]] = field(default_factory=dict)
    keep: Callable[[str, tuple[float, ...]], None] = lambda key, seconds: None


def _guarded(
    engine: Engine, ranks: int, what: str, time_it: Callable[[], np.ndarray], guarded: bool, report: Progress
) -> tuple[np.ndarray, bool]:
    """``time_it()``'s timings of ``what`` on ``ranks`` ranks, and whether they ran clean. The
    contention guard (``cptune.guard``, the host's evidence: foreign load, the reference
    kernel) watches each timing: a rate measured under someone else's job misleads every prior
    read from it (one that ran beside other jobs here read 9 of its 24 attention rates at
    0.52-0.84x this host's usual). ``guarded``: a disturbed step waits for the host to quiet down
    (``wait_for_quiet``, up to ``patience_s``) and is timed again, up to ``GUARD_RETRIES``
    times; ``CalibrationDisturbedError`` when the host stays busy or the step disturbed.
    Unguarded, a disturbed timing is kept, and said so."""
    for attempt in range(1, GUARD_RETRIES + 2):
        watch = Watch(engine.process_ids, engine.node_readings)
        timings = time_it()
        reason = watch.host_disturbance(ranks)
        if reason is None:
            return timings, True
        if not guarded:
            report(f"{what} {RETIMED} ({reason}): kept, as CPTUNE_GUARD=off asks")
            return timings, False
        if attempt > GUARD_RETRIES:
            break
        report(f"{what} {RETIMED} ({reason}): timing it again once the host is quiet")
        busy = wait_for_quiet(ranks, engine.process_ids, patience_s(), f"calibrating {what}")
        if busy is not None:
            reason = f"{reason}; {busy}"
            break
    raise CalibrationDisturbedError(
        f"{what} was disturbed by other load {attempt} time{'s' if attempt > 1 else ''} ({reason}): "
        f"calibrate when the host is quieter, or set CPTUNE_GUARD=off to keep such timings"
    )


def _chunks(kind: str, group: int) -> list[int]:
    """Bytes per peer of each of ``MESSAGE_SIZES`` for ``kind`` in groups of ``group``."""
    return [_per_peer(kind, group, size) for size in MESSAGE_SIZES]


def _collective_timer(engine: Engine, kind: str, ranks: int, group: int, layout: tuple[str, str], warmup: int,
                      repeats: int) -> Callable[[], np.ndarray]:
    """What times ``kind`` at each of ``MESSAGE_SIZES``, its groups laid out ``along`` (of ``layout``)."""
    chunks = _chunks(kind, group)
    return functools.partial(engine.time_collective, kind, ranks, group, chunks, warmup, repeats, _TIMEOUT_S,
                             along=layout[0])


def _collective_name(kind: str, ranks: int, group: int, tier: str) -> str:
    """A collective step for progress and messages ("across nodes" where it crosses them)."""
    return f"{kind} on {ranks} ranks in groups of {group}{' across nodes' if tier == 'network' else ''}"


def layouts(ranks: int, group: int, ranks_per_node: int | None) -> list[tuple[str, str]]:
    """How calibration lays out groups of ``group`` among ``ranks`` ranks, as (along, tier):
    as head groups (consecutive ranks), and on a cluster as context groups too where those
    cross another link tier (``cptune.hardware.tier_of``): each tier a configuration uses is
    timed where it uses it."""
    found = {tier_of(RankGroups("heads", ranks, group), ranks_per_node): "heads"}
    context_tier = tier_of(RankGroups("context", ranks, ranks // group), ranks_per_node)
    found.setdefault(context_tier, "context")
    return [(along, tier) for tier, along in found.items()]


def _collective_fit(kind: str, ranks: int, group: int, tier: str, seconds: np.ndarray) -> CollectiveFit:
    """``latency + bytes / bandwidth`` through the times of ``kind`` at ``MESSAGE_SIZES``."""
    sizes = np.array([c if kind in STREAM_KINDS else c * (group - 1) for c in _chunks(kind, group)],
                     dtype=float)
    latency, bandwidth = fit_latency_bandwidth(sizes, seconds)
    return CollectiveFit(
        kind=kind, ranks=ranks, group=group, latency_s=latency, bandwidth=bandwidth,
        bus_bandwidth=float(sizes[-1] / seconds[-1]),
        sizes=tuple(int(s) for s in sizes), times_s=tuple(float(t) for t in seconds), tier=tier,
    )


def backward_shapes(shapes: tuple[dict[str, int], ...]) -> tuple[dict[str, int], ...]:
    """The backward's shapes, timed per rank count where the engine trains
    (``EngineSpec.trains``): those of ``shapes`` in the smaller half of their sizes, the middle
    one included, "backward" set. What the prior reads is the backward's rate against the
    forward's on the same shape, size by size (``Calibration.backward_speed``): it moves where
    a call's fixed costs weigh and is steady beyond; the smaller sizes keep the time
    calibration adds to about that of the forward's largest shape."""
    sizes = sorted({shape["seq_q"] for shape in shapes})
    timed = sizes[: len(sizes) // 2 + 1]
    return tuple({**shape, "backward": 1} for shape in shapes if shape["seq_q"] in timed)


def _round_order(max_ranks: int, round_index: int) -> list[int]:
    """The rank counts in the order round ``round_index`` times them: ascending, then
    descending, and so on, so that neither end always goes first."""
    counts = list(range(1, max_ranks + 1))
    return counts if round_index % 2 == 0 else counts[::-1]


#: One step of a calibration: its rank count, its name (in progress lines and its key), what
#: times it, and the list its rounds' times go into.
_Step = tuple[int, str, Callable[[], np.ndarray], list[np.ndarray]]


def _steps(engine: Engine, max_ranks: int, shapes: tuple[dict[str, int], ...],
           attention: dict[int, list[np.ndarray]], step_times: dict[int, list[np.ndarray]],
           collective_times: dict[tuple[str, int, int, tuple[str, str]], list[np.ndarray]],
           wait_times: dict[int, list[np.ndarray]], warmup: int, repeats: int) -> Iterator[_Step]:
    """Every step one round of a calibration times, rank count by rank count."""
    for ranks in range(1, max_ranks + 1):
        if ranks in wait_times:
            yield (ranks, f"exchanges beside computing ranks on {ranks} ranks",
                   functools.partial(engine.time_waits, ranks, wait_groups(ranks), WAIT_SHAPE, WAIT_CALLS,
                                     WAIT_CHUNK, warmup, repeats, _TIMEOUT_S),
                   wait_times[ranks])
        yield (ranks, f"attention on {ranks} rank(s)",
               functools.partial(engine.time_attention, ranks, shapes, warmup, repeats, _TIMEOUT_S),
               attention[ranks])
        if engine.spec.times_steps:
            yield (ranks, f"the kernel's memory-bound steps on {ranks} rank(s)",
                   functools.partial(engine.time_steps, ranks, STEP_SHAPES, warmup, repeats, _TIMEOUT_S),
                   step_times[ranks])
        for (kind, n, group, layout), into in collective_times.items():
            if n == ranks:
                yield (ranks, _collective_name(kind, ranks, group, layout[1]),
                       _collective_timer(engine, kind, ranks, group, layout, warmup, repeats), into)


def wait_groups(ranks: int) -> list[int]:
    """The group sizes the exchange waits on ``ranks`` ranks are timed in: every size from 2 to
    ``ranks`` (a batch plan's groups take any size; the ranks outside the group compute)."""
    return list(range(2, ranks + 1))


def _wait_counts(engine: Engine, max_ranks: int) -> list[int]:
    """The rank counts whose exchange waits calibration times: those that outnumber a node's
    cores, where the engine's spec says so (``times_waits``)."""
    if not engine.spec.times_waits:
        return []
    per_node = ranks_per_node(engine)
    return [ranks for ranks in range(2, max_ranks + 1) if oversubscribed(ranks, per_node)]


def _exchange_waits(ranks: int, seconds: np.ndarray) -> list[ExchangeWait]:
    """The ``ExchangeWait`` of each group size on ``ranks`` ranks from the seconds of
    ``Engine.time_waits``'s cases: inside one exchange beside computing ranks, less inside one
    with them idle."""
    return [ExchangeWait(ranks=ranks, group=group, seconds=float(seconds[2 * j] - seconds[2 * j + 1]))
            for j, group in enumerate(wait_groups(ranks))]


def _plan_digest(engine: str, shapes: tuple[dict[str, int], ...], times_steps: bool, times_waits: bool,
                 warmup: int, repeats: int) -> str:
    """What every step of a calibration times and how, as a short digest: a step timed by
    another version, engine, shape list, message sizes or repeat count has another key."""
    plan = {"engine": engine, "version": __version__, "shapes": shapes, "messages": MESSAGE_SIZES,
            "steps": STEP_SHAPES if times_steps else (), "warmup": warmup, "repeats": repeats}
    if times_waits:  # in the digest only where timed: an engine's keys without them stay as they were
        plan["waits"] = {"shape": WAIT_SHAPE, "calls": WAIT_CALLS, "chunk": WAIT_CHUNK}
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def calibrate(
    max_ranks: int,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = REPEATS,
    progress: Progress | None = None,
    guard: bool | None = None,
    rounds: int = ROUNDS,
    pieces: CalibrationPieces | None = None,
) -> Calibration:
    """Measure the collectives and the attention rate on 1..``max_ranks`` ranks, in
    ``rounds`` rounds that each time every step once (``repeats`` timed calls after
    ``warmup``); a step's time is the median of its rounds. A burst of other load the guard
    cannot see (a neighbour on the hypervisor's memory) slows one round, not the median: one
    calibration timed in a single pass read four of its 2-rank d64 attention rates at
    0.53-0.59x those of three others that hour, and the guard saw nothing. With ``guard``
    (None: on unless ``$CPTUNE_GUARD`` is "off") a step the contention guard saw disturbed is
    timed again once the host is quiet (``_guarded``); ``CalibrationDisturbedError`` when it
    stays disturbed. ``pieces``: the steps a stopped calibration timed clean, which are not
    timed again, and where each step timed clean now is kept (``CalibrationPieces``). Holds
    the host lock (``cptune.hostlock``) while it times. The calibration keeps what its
    timings ran with (``Calibration.facts``: the host's facts and the engine's ``describe``,
    the kernel its last attention timing ran among them)."""
    if max_ranks < 1:
        raise ValueError(f"max_ranks must be at least 1, got {max_ranks}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    engine = get_engine(backend)
    if not engine.spec.timed:
        raise untimed(engine.name)
    report = progress or (lambda _: None)
    guarded = guard_enabled() if guard is None else guard
    patience_s()  # a bad CPTUNE_GUARD_PATIENCE is refused before anything runs
    spec = engine.spec
    shapes = ATTENTION_SHAPES + (backward_shapes(ATTENTION_SHAPES) if spec.trains else ())
    attention: dict[int, list[np.ndarray]] = {ranks: [] for ranks in range(1, max_ranks + 1)}
    step_times: dict[int, list[np.ndarray]] = {ranks: [] for ranks in range(1, max_ranks + 1)}
    per_node = ranks_per_node(engine)
    collective_times: dict[tuple[str, int, int, tuple[str, str]], list[np.ndarray]] = {
        (kind, ranks, group, layout): []
        for ranks in range(1, max_ranks + 1) for group in group_sizes(ranks)
        for layout in layouts(ranks, group, per_node) for kind in spec.collectives
    }
    wait_times: dict[int, list[np.ndarray]] = {ranks: [] for ranks in _wait_counts(engine, max_ranks)}
    timed = list(_steps(engine, max_ranks, shapes, attention, step_times, collective_times, wait_times,
                        warmup, repeats))
    plan = _plan_digest(engine.name, shapes, spec.times_steps, bool(wait_times), warmup, repeats)
    pieces = pieces or CalibrationPieces()
    total = rounds * len(timed)
    keys = [f"{plan}/{round_index}/{what}" for round_index in range(rounds) for _, what, _, _ in timed]
    if resumed := sum(key in pieces.done for key in keys):
        report(f"{RESUMING} {resumed} of {total} steps a stopped calibration timed clean")
    kept = resumed
    with measuring():  # one measuring process per host (cptune.hostlock)
        for round_index in range(rounds):
            prefix = f"round {round_index + 1} of {rounds}: " if rounds > 1 else ""
            for ranks in _round_order(max_ranks, round_index):
                for n, what, time_it, into in timed:
                    key = f"{plan}/{round_index}/{what}"
                    if n != ranks:
                        continue
                    if key in pieces.done:  # a round's place does not matter: a step's time is their median
                        into.append(np.asarray(pieces.done[key]))
                        continue
                    report(f"{prefix}{what}")
                    try:
                        timings, clean = _guarded(engine, ranks, what, time_it, guarded, report)
                    except CalibrationDisturbedError as exc:
                        raise CalibrationDisturbedError(str(exc), kept, total) from None
                    seconds = tuple(float(t) for t in np.median(timings, axis=1))
                    if clean:
                        pieces.done[key] = seconds
                        pieces.keep(key, seconds)
                        kept += 1
                    into.append(np.asarray(seconds))
    rates = [
        (s.get("backward", 0),
         ComputeRate(ranks=ranks, heads=s["heads"], seq_q=s["seq_q"], seq_k=s["seq_k"],
                     head_dim=s["head_dim"], seconds=float(t), causal=bool(s["causal"])))
        for ranks, times in attention.items()
        for s, t in zip(shapes, np.median(times, axis=0), strict=True)
    ]
    steps = [
        StepCost(ranks=ranks, kind=str(s["kind"]), wire=str(s["wire"]), seconds=float(t),
                 elements=int(s["heads"]) * int(s["rows"]) * int(s["head_dim"]))
        for ranks, times in step_times.items() if times
        for s, t in zip(STEP_SHAPES, np.median(times, axis=0), strict=True)
    ]
    collectives = [_collective_fit(kind, ranks, group, layout[1], np.median(times, axis=0))
                   for (kind, ranks, group, layout), times in collective_times.items()]
    waits = [wait for ranks, times in wait_times.items()
             for wait in _exchange_waits(ranks, np.median(times, axis=0))]
    return Calibration(
        engine=engine.name,
        collectives=tuple(collectives),
        compute=tuple(rate for backward, rate in rates if not backward),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        steps=tuple(steps),
        backward=tuple(rate for backward, rate in rates if backward),
        facts=describe_host() | engine.describe(),
        waits=tuple(waits),
    )
