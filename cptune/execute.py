"""Run a configuration for real: ``compute`` its output, ``measure`` it, measure every
feasible configuration of a workload (``measure_all``, what ``cptune measure`` prints), or
measure several interleaved as one round of a search (``measure_round``), or run a batch
plan's groups side by side and time its makespan (``measure_batch``; ``measure_mix`` solves
the plan first).

Engine-independent: the sequence is split by ``SequenceLayout``, each rank gets its shard,
outputs are put back in token order, and ``measure`` checks the output against the float64
reference before it times anything. A training workload (``Workload.mode`` "train") runs
the forward and the backward from a given output gradient (``compute_gradients``), and its
output and the gradients of Q, K and V are all checked.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cptune.config import STRATEGIES, CPConfig
from cptune.cost import analytic_cost
from cptune.engines import Engine, Trained, check_runs, get_engine, given_hosts, ranks_per_node, untimed
from cptune.errors import EngineError, InfeasibleConfigError, SearchSetupError
from cptune.feasibility import check_feasible, closest_to_fitting, enumerate_configs, feasibility
from cptune.guard import Watch, join_reasons, own_spread
from cptune.guard import enabled as guard_enabled
from cptune.hardware import MAX_RANKS_PER_NODE
from cptune.hostlock import measuring
from cptune.layout import SequenceLayout, layout_refusal, normal
from cptune.measurement import (
    Measurement,
    TimingSummary,
    available_cores,
    describe_host,
    host_memory_limit,
    oversubscribed,
    summarize,
)
from cptune.reference import (
    make_inputs,
    make_output_gradient,
    reference_attention,
    reference_gradients,
    relative_error,
)
from cptune.space import SearchSpace, check_count
from cptune.workload import AttentionShape, Workload

if TYPE_CHECKING:
    from cptune.mixes import BatchPlan, LengthMix

#: Timed iterations of each configuration per pass of an interleaved round (``measure_round``):
#: a pass of a round must be much shorter than the host's slow phases.
ITERATIONS_PER_PASS = 2


def rank_count_problem(asked: str, ranks: int, engine: Engine, oversubscribe: bool) -> str | None:
    """Why ``ranks`` ranks (``asked``: what asks for them, in words, e.g. "--max-ranks 8") cannot
    run on ``engine`` here, None when they can: on CPU ranks, more than this host's cores
    without ``oversubscribe`` (ranks sharing a core time the sharing, not the strategy), or more
    than any node runs (``MAX_RANKS_PER_NODE``) with it. Checked before any configuration is
    enumerated, so a count of 10^12 is refused at once (a GPU engine's and a cluster's
    ``preflight`` refuse more ranks than they hold)."""
    cores = engine.capacity()
    if ranks <= cores or engine.device != "cpu":
        return None
    if not oversubscribe:
        return (f"{asked}: more ranks than this host's {cores} core{'s' if cores != 1 else ''}, and ranks "
                f"sharing a core time the sharing, not the strategy. Use at most {cores} "
                f"rank{'s' if cores != 1 else ''}, or add --oversubscribe to run them anyway (stored marked "
                f"oversubscribed, left out of the model and the picks)")
    if ranks > MAX_RANKS_PER_NODE:
        return (f"{asked}: {ranks:,} ranks on one host, more than any node runs, --oversubscribe or not: use "
                f"at most {MAX_RANKS_PER_NODE:,}")
    return None


def check_rank_count(asked: str, ranks: int, engine: Engine, oversubscribe: bool) -> None:
    """``SearchSetupError`` when ``ranks`` ranks (``asked``, in words) cannot run here as asked
    (``rank_count_problem``)."""
    if problem := rank_count_problem(asked, ranks, engine, oversubscribe):
        raise SearchSetupError(problem)


def space_rank_counts(space: SearchSpace, engine: Engine, max_ranks: int | None, oversubscribe: bool
                      ) -> tuple[int, ...]:
    """The rank counts of ``space`` that run on ``engine`` here, capped by ``max_ranks``
    (default: its cores or GPUs); ``SearchSetupError`` when none is left or oversubscription
    is refused. Arithmetic on the counts only, nothing preflighted: ``cptune search`` checks
    it before importing the search (10^12 ranks refused at once), the search before its
    nodes' preflight."""
    available = max_ranks or engine.capacity()
    if space.ranks is None:  # "auto", 1..available: bounded before they are listed
        check_rank_count(f"--max-ranks {available}", available, engine, oversubscribe)
    counts = tuple(n for n in space.rank_counts(available) if max_ranks is None or n <= max_ranks)
    if not counts:
        raise SearchSetupError(f"--max-ranks {max_ranks} leaves none of the space's rank counts")
    if (nodes := given_hosts(engine)) is not None:
        nodes.check_ranks(max(counts))  # the nodes' size speaks before any one host's cores
    over = [n for n in counts if n > engine.capacity()]
    if over:
        check_rank_count(f"ranks {', '.join(map(str, over))} of {space.origin}", max(over), engine,
                         oversubscribe)
    return counts


def default_timeout(workload: Workload, config: CPConfig, iterations: int = 1) -> float:
    """A deadline no healthy run gets near: a minute of slack plus each iteration at a
    pessimistic 1 GFLOP/s and 100 MB/s per rank, stretched when ranks outnumber cores."""
    cost = analytic_cost(workload, config)
    per_iteration = 1.0 + cost.flops / 1e9 + sum(cost.bytes_sent.values()) / 1e8
    crowding = max(1.0, config.ranks / available_cores())
    return 60.0 + iterations * per_iteration * crowding


def rank_memory_limit(engine: Engine) -> Callable[[int], int | None]:
    """The bytes each of n ranks of ``engine`` may hold here, by n: CPU ranks share this
    machine's memory (``host_memory_limit``, the limit ``recommend`` checks this host
    against); a GPU rank has a device of its own, not checked before it runs (None)."""
    return host_memory_limit if engine.device == "cpu" else lambda ranks: None


def _check_arrays(workload: Workload, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  dout: np.ndarray | None = None) -> None:
    """``ValueError`` naming the first of q, k, v (and ``dout``, shaped as q) whose shape is
    not the workload's."""
    wl = workload
    queries = (wl.batch, wl.seq_len, wl.heads, wl.head_dim)
    keys = (wl.batch, wl.seq_len, wl.kv_heads, wl.head_dim)
    given = [("q", q, queries), ("k", k, keys), ("v", v, keys)]
    for name, array, expected in [*given, *([("dout", dout, queries)] if dout is not None else [])]:
        shape = np.shape(array)
        if shape != expected:
            raise ValueError(
                f"{name} has shape {shape}, but the workload needs {expected} "
                f"([batch, seq_len, {'kv_heads' if expected is keys else 'heads'}, head_dim])"
            )


def _scatter(layout: SequenceLayout, *arrays: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """Each rank's tokens of each of ``arrays`` (q, k, v; and a training run's output
    gradient), in the wire dtype, padded at the end to the layout's length (with zeros: a
    padding row's output gradient is zero, so it adds nothing to any gradient)."""
    wl = layout.workload
    pad = layout.padded_len - wl.seq_len

    def prepared(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=wl.wire_dtype)
        return np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x

    padded = [prepared(x) for x in arrays]
    return [tuple(x[:, layout.rank_positions(rank)] for x in padded) for rank in range(layout.ranks)]


def _gather(layout: SequenceLayout, outputs: Sequence[np.ndarray]) -> np.ndarray:
    """The ranks' shards of one tensor ([batch, seq shard, heads, head_dim]) in token order,
    float32, without the padding."""
    wl = layout.workload
    full = np.empty((wl.batch, layout.padded_len, *outputs[0].shape[2:]), dtype=np.float32)
    for rank, out in enumerate(outputs):
        full[:, layout.rank_positions(rank)] = out
    return full[:, : wl.seq_len]


def _gather_trained(layout: SequenceLayout, shards: Sequence[Trained]) -> Trained:
    """A training run's ranks' shards, each tensor put together in token order."""
    return Trained(*(_gather(layout, tensor) for tensor in zip(*shards, strict=True)))


def compute(
    workload: Workload,
    config: CPConfig,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    backend: str | Engine = "mpi",
    timeout: float | None = None,
) -> np.ndarray:
    """The attention output of ``config`` on real ranks, float32 [batch, seq, heads, head_dim].

    ``q`` is [batch, seq, heads, head_dim], ``k`` and ``v`` [batch, seq, kv_heads, head_dim];
    they travel in the workload's wire dtype, so 16-bit workloads round them first.
    Raises ``InfeasibleConfigError`` before any process starts if the pair cannot run."""
    check_feasible(workload, config)
    _check_arrays(workload, q, k, v)
    engine = get_engine(backend)
    check_runs(engine.spec, workload.in_mode("forward"))
    layout = SequenceLayout(workload, config)
    timeout = timeout or default_timeout(workload, config)
    outputs, _ = engine.run(workload.in_mode("forward"), config, _scatter(layout, q, k, v), timeout)
    return _gather(layout, outputs)


def compute_gradients(
    workload: Workload,
    config: CPConfig,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    backend: str | Engine = "mpi",
    timeout: float | None = None,
) -> Trained:
    """One training step of the layer by ``config`` on real ranks: the forward, then the
    backward from ``dout`` (the output's gradient, [batch, seq, heads, head_dim]): the output
    and the gradients of Q, K and V, float32, shaped as the inputs. ``workload`` may be in
    either mode (it runs as "train"). Raises as ``compute`` does, and
    ``UntrainedEngineError`` for an engine that runs the forward alone."""
    workload = workload.in_mode("train")
    check_feasible(workload, config)
    _check_arrays(workload, q, k, v, dout)
    engine = get_engine(backend)
    check_runs(engine.spec, workload)
    layout = SequenceLayout(workload, config)
    timeout = timeout or default_timeout(workload, config)
    shards, _ = engine.run_train(workload, config, _scatter(layout, q, k, v, dout), timeout)
    return _gather_trained(layout, shards)


#: Bytes of inputs and references kept for the next configurations of the same workloads:
#: a benchmark that interleaves a few workloads configuration by configuration checks each
#: against its reference without computing it again (16K x 8 heads x 64 takes 25 s).
REFERENCE_CACHE_BYTES = 2**30

_Case = tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]  # (inputs, references)
_references: OrderedDict[tuple[Workload, int], _Case] = OrderedDict()


def _reference_case(workload: Workload, seed: int) -> _Case:
    """Inputs (a training workload's with the output's gradient) and their float64
    reference (the output; then the gradients of Q, K and V), kept for the next
    configurations of the same workload: the most recently used cases whose arrays fit in
    ``REFERENCE_CACHE_BYTES`` (the newest always)."""
    key = (workload, seed)
    if key in _references:
        _references.move_to_end(key)
        return _references[key]
    q, k, v = make_inputs(workload, seed)
    reference = reference_attention(workload, q, k, v)
    if not workload.training:
        case: _Case = (q, k, v), (reference,)
    else:
        dout = make_output_gradient(workload, seed)
        case = (q, k, v, dout), (reference, *reference_gradients(workload, q, k, v, dout))
    _references[key] = case
    held = sum(a.nbytes for inputs, outputs in _references.values() for a in (*inputs, *outputs))
    while len(_references) > 1 and held > REFERENCE_CACHE_BYTES:
        inputs, outputs = _references.popitem(last=False)[1]
        held -= sum(a.nbytes for a in (*inputs, *outputs))
    return case


def measure(
    workload: Workload,
    config: CPConfig,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = 10,
    timeout: float | None = None,
    seed: int = 0,
) -> Measurement:
    """Check ``config``'s output against the float64 reference on seeded random inputs, then
    time ``repeats`` iterations after ``warmup`` on real ranks.

    Raises ``InfeasibleConfigError`` before any process starts, ``UntimedEngineError`` for
    an engine that does not time (onnx), and ``EngineError`` when the run fails (kind: crash,
    timeout, error, out_of_memory) or its output is wrong (kind "wrong_output"): a wrong
    configuration never yields a timing. More ranks than this host's cores run, but the
    result says it was ``oversubscribed``. The contention guard (``cptune.guard``) watches
    the timed part and says in ``disturbed`` why other load on the host spoiled it, whatever
    ``$CPTUNE_GUARD`` says; such a timing is kept but counts for nothing. Holds the host lock
    (``cptune.hostlock``) while it runs."""
    check_feasible(workload, config)
    _check_counts(warmup, repeats)
    engine = _timed_engine(backend)
    with measuring():
        error, peaks = _checked_run(engine, workload, config, seed, timeout)
        watch = Watch(engine.process_ids, engine.node_readings)
        timings = engine.time(
            warmup, repeats, timeout or default_timeout(workload, config, warmup + repeats), config.describe()
        )
        summary = summarize(timings)
        disturbed = watch.disturbance(config.ranks, summary["samples_ms"])
    return _measurement(engine, workload, config, summary, peaks, error, warmup, disturbed)


def measure_all(
    workload: Workload,
    max_ranks: int | None = None,
    strategies: Sequence[str] = STRATEGIES,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = 10,
    timeout: float | None = None,
    on_config: Callable[[CPConfig, int, int], None] | None = None,
    ranks: Sequence[int] | None = None,
    head_group: int | None = None,
    oversubscribe: bool = False,
    layout: str | None = None,
) -> tuple[list[Measurement], list[tuple[CPConfig, EngineError]]]:
    """``measure`` every feasible configuration of ``workload`` on 1..``max_ranks`` ranks
    (default: the engine's capacity here, this host's cores or its GPUs), one after another:
    the measurements, and each configuration whose run failed with its ``EngineError``.
    ``ranks`` keeps only those rank counts (``max_ranks`` is then not used) and
    ``head_group`` only that Ulysses degree and ``layout`` only that token layout (where it
    can deal the tokens out, a layout the search does not sweep included), so one
    configuration can be measured alone.
    More ranks than this host's cores are refused (``InfeasibleConfigError``) unless
    ``oversubscribe``; those measurements say they were ``oversubscribed``
    (``rank_count_problem``). ``on_config(config, index, total)`` is told before each one
    runs. Holds the host lock (``cptune.hostlock``) from the first configuration to the last."""
    guard_enabled()  # a bad CPTUNE_GUARD is refused before anything runs
    engine = _timed_engine(backend)
    largest = max(ranks) if ranks else max_ranks
    engine.preflight(largest or 1)
    asked = f"--ranks {','.join(map(str, ranks))}" if ranks else f"--max-ranks {largest}"
    if largest is not None and (problem := rank_count_problem(asked, largest, engine, oversubscribe)):
        raise InfeasibleConfigError(problem, [problem])
    largest = largest or engine.capacity()
    configs = [c for c in enumerate_configs(workload, largest, tuple(strategies))
               if (not ranks or c.ranks in ranks) and (head_group is None or c.head_group == head_group)
               and (engine.spec.pads_heads or not c.pad_heads)]  # padded heads where the engine pads them
    if layout is not None:
        configs = _in_layout(workload, configs, layout)
    if not configs:
        counts = f"{', '.join(map(str, ranks))} rank(s)" if ranks else f"1..{largest} ranks"
        group = "" if head_group is None else f" with head group {head_group}"
        raise InfeasibleConfigError(
            f"no configuration of {', '.join(strategies)} on {counts}{group} can run {workload.describe()}: "
            f"a head group must divide the ranks (ulysses: equal them) and the heads (or pad them, on "
            f"an engine that pads heads)", [])
    configs = _fitting(workload, configs, rank_memory_limit(engine))
    results: list[Measurement] = []
    failures: list[tuple[CPConfig, EngineError]] = []
    with measuring():
        for index, config in enumerate(configs):
            if on_config is not None:
                on_config(config, index, len(configs))
            try:
                results.append(measure(workload, config, backend=engine, warmup=warmup, repeats=repeats,
                                       timeout=timeout))
            except EngineError as error:
                failures.append((config, error))
    return results, failures


def _in_layout(workload: Workload, configs: list[CPConfig], layout: str) -> list[CPConfig]:
    """Each distinct configuration of ``configs`` in ``layout``, where it can run there;
    ``InfeasibleConfigError`` saying why, in one line, when it runs on none of them."""
    laid = [normal(workload, c.with_layout(layout))
            for c in dict.fromkeys(c.with_layout(None) for c in configs)]
    fitting = [c for c in laid if not feasibility(workload, c)]
    if configs and not fitting:
        why = next((layout_refusal(workload, c) for c in laid if layout_refusal(workload, c)), None)
        reason = why or "; ".join(dict.fromkeys(r for c in laid for r in feasibility(workload, c)))
        raise InfeasibleConfigError(f"no configuration can run {workload.describe()} in layout {layout}: "
                                    f"{reason}", [reason])
    return fitting


def _fitting(workload: Workload, configs: list[CPConfig], limit: Callable[[int], int | None]
             ) -> list[CPConfig]:
    """Those of ``configs`` whose ranks hold their activations within ``limit``;
    ``InfeasibleConfigError`` naming the one closest to fitting when none does."""
    reasons = {c: feasibility(workload, c, limit(c.ranks)) for c in configs}
    fitting = [c for c in configs if not reasons[c]]
    if configs and not fitting:
        raise InfeasibleConfigError(
            f"no configuration can run {workload.describe()} in this host's memory: "
            f"{closest_to_fitting(workload, configs, limit)}",
            [reason for r in reasons.values() for reason in r],
        )
    return fitting


def measure_round(
    workload: Workload,
    configs: Sequence[CPConfig],
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = 10,
    timeout: float | None = None,
    seed: int = 0,
    rng: random.Random | None = None,
    deadline: float | None = None,
    implementations: dict[CPConfig, str] | None = None,
) -> dict[CPConfig, Measurement | EngineError]:
    """Measure ``configs`` of one workload interleaved, as one round: in passes, each
    visiting every configuration in a fresh random order, running it once (its output
    checked, as ``measure`` does; the run is also the warm-up after the switch) and timing
    ``ITERATIONS_PER_PASS`` iterations, until each has ``repeats``; ``warmup`` more
    iterations on its first pass. A slow phase of the host (on this project's VMs one to two
    seconds at 1.3x, as long as a round of whole visits) then falls on every configuration
    alike instead of on those visited during it (``docs/decisions/0006-interleaved-passes.md``).

    The guard watches the whole round: other load on the host marks every configuration
    of it, the spread of its own iterations each one. A configuration whose run fails gets
    its ``EngineError`` and leaves the later passes. Past ``deadline`` (``time.monotonic``)
    no further pass starts, and the configurations keep the iterations timed so far.
    ``implementations`` maps a configuration to a framework's own attention the torch engine
    runs in its place (``TorchEngine.run``), checked and timed the same way; its measurement
    names it in its facts ("implementation"). Holds the host lock (``cptune.hostlock``)
    while it runs."""
    for config in configs:
        check_feasible(workload, config)
    _check_counts(warmup, repeats)
    engine = _timed_engine(backend)
    rng = rng or random.Random()
    timings: dict[CPConfig, list[np.ndarray]] = {config: [] for config in configs}
    checks: dict[CPConfig, tuple[float, list[int]]] = {}
    failures: dict[CPConfig, EngineError] = {}
    implemented: dict[CPConfig, str | None] = {}  # the framework implementation each ran, if any
    with measuring():
        watch = Watch(engine.process_ids, engine.node_readings)
        for done in range(0, repeats, ITERATIONS_PER_PASS):
            if done and deadline is not None and time.monotonic() >= deadline:
                break
            iterations = min(ITERATIONS_PER_PASS, repeats - done)
            order = [config for config in configs if config not in failures]
            rng.shuffle(order)
            for config in order:
                try:
                    error, peaks = _checked_run(engine, workload, config, seed, timeout,
                                                (implementations or {}).get(config))
                    first = 0 if done else warmup
                    timings[config].append(engine.time(
                        first, iterations, timeout or default_timeout(workload, config, first + iterations),
                        config.describe()))
                except EngineError as failure:
                    failures[config] = failure
                    continue
                implemented[config] = engine.describe().get("implementation")
                seen_error, seen_peaks = checks.get(config, (0.0, []))
                checks[config] = (max(seen_error, error), [*seen_peaks, *peaks])
        host = watch.host_disturbance(max(config.ranks for config in configs))
    results: dict[CPConfig, Measurement | EngineError] = {}
    for config in configs:
        if config in failures:
            results[config] = failures[config]
            continue
        summary = summarize(np.concatenate(timings[config], axis=1))
        error, peaks = checks[config]
        disturbed = join_reasons(host, own_spread(config.ranks, summary["samples_ms"]))
        results[config] = _measurement(engine, workload, config, summary, peaks, error, warmup, disturbed,
                                       implemented[config])
    return results


def _check_counts(warmup: int, repeats: int) -> None:
    """The counts a search space allows (``cptune.space.MEASURE_COUNTS``), else ``ValueError``."""
    check_count("warmup", warmup)
    check_count("repeats", repeats)


def _timed_engine(backend: str | Engine) -> Engine:
    engine = get_engine(backend)
    if not engine.spec.timed:
        raise untimed(engine.name)
    return engine


def _checked_run(engine: Engine, workload: Workload, config: CPConfig, seed: int,
                 timeout: float | None, implementation: str | None = None) -> tuple[float, list[int]]:
    """Run ``config`` once on the seeded inputs and check its output (a training run's
    gradients of Q, K and V too, each relative to its own scale) against the float64
    reference: the largest relative error and peak bytes per rank; ``EngineError``
    "wrong_output" naming what was wrong when an error exceeds the engine's tolerance (a
    wrong configuration is never timed). ``implementation``: a framework's own attention in
    place of the strategy (the torch engine's, ``TorchEngine.run``)."""
    check_runs(engine.spec, workload)
    layout = SequenceLayout(workload, config)
    inputs, references = _reference_case(workload, seed)
    timeout = timeout or default_timeout(workload, config)
    results: Sequence[np.ndarray]
    if workload.training:
        shards, peaks = engine.run_train(workload, config, _scatter(layout, *inputs), timeout)
        results = _gather_trained(layout, shards)
    elif implementation is not None:
        run = getattr(engine, "run")  # noqa: B009 - the torch engine's, which takes an implementation
        if engine.name != "torch":
            raise ValueError(f"a framework's implementation runs on the torch engine, not {engine.name}")
        outputs, peaks = run(workload, config, _scatter(layout, *inputs), timeout,
                             implementation=implementation)
        results = [_gather(layout, outputs)]
    else:
        outputs, peaks = engine.run(workload, config, _scatter(layout, *inputs), timeout)
        results = [_gather(layout, outputs)]
    tolerance = engine.tolerance[workload.dtype]
    errors = {name: relative_error(result, reference)
              for name, result, reference in zip(Trained._fields, results, references, strict=False)}
    for name, error in errors.items():
        if not error <= tolerance:
            what = "result" if name == "out" else f"gradient of {name[1:].upper()}"
            ran = f"{implementation} as {config.describe()}" if implementation else config.describe()
            raise EngineError(
                "wrong_output",
                f"{ran} computed a wrong {what} for {workload.describe()}: relative "
                f"error {error:.2e} exceeds the {workload.dtype} tolerance {tolerance:.0e}, so its "
                f"timing does not count. This is a bug in the strategy or engine; please report it.",
            )
    return max(errors.values()), peaks


def _measurement(engine: Engine, workload: Workload, config: CPConfig, summary: TimingSummary,
                 peaks: list[int], error: float, warmup: int, disturbed: str | None,
                 implementation: str | None = None) -> Measurement:
    """The ``Measurement`` of ``config`` from the summary of its timings; its host facts name
    the framework ``implementation`` that ran in the strategy's place, and only where one did."""
    host = {key: value for key, value in engine.describe().items() if key != "implementation"}
    return Measurement(
        workload=workload,
        config=config,
        **summary,
        peak_bytes=max(peaks),
        max_error=error,
        engine=engine.name,
        host=describe_host() | host | ({"implementation": implementation} if implementation else {}),
        warmup=warmup,
        repeats=len(summary["samples_ms"]),
        oversubscribed=oversubscribed(config.ranks, ranks_per_node(engine)),
        disturbed=disturbed,
    )


@dataclass(frozen=True)
class BatchMeasurement:
    """A batch plan run on real ranks, its groups side by side: ``samples_ms`` the makespan of
    each timed iteration (all ranks start together after a barrier; the slowest rank's end),
    ``median_ms`` theirs; ``group_ms`` each group's median time (its slowest rank), in the
    plan's order; ``max_error`` the largest relative error of any sequence's output (and
    gradients) against the float64 reference, checked before anything was timed."""

    plan: BatchPlan
    samples_ms: tuple[float, ...]
    median_ms: float
    group_ms: tuple[float, ...]
    max_error: float
    peak_bytes: int
    engine: str
    oversubscribed: bool
    disturbed: str | None

    @property
    def error(self) -> float:
        """The predicted makespan's error relative to the measured one: (predicted - measured) / measured."""
        return (self.plan.makespan_ms - self.median_ms) / self.median_ms

    def to_dict(self) -> dict[str, object]:
        return {"plan": self.plan.to_dict(), "measured_ms": self.median_ms,
                "samples_ms": list(self.samples_ms), "group_ms": list(self.group_ms),
                "predicted_ms": self.plan.makespan_ms,
                "prediction_error": self.error, "max_error": self.max_error, "peak_bytes": self.peak_bytes,
                "engine": self.engine, "oversubscribed": self.oversubscribed, "disturbed": self.disturbed}


def measure_batch(
    plan: BatchPlan,
    shape: AttentionShape,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = 10,
    timeout: float | None = None,
    seed: int = 0,
    oversubscribe: bool = False,
) -> BatchMeasurement:
    """Run ``plan`` (``cptune.mixes.plan_batch``'s) for the layer ``shape`` (batch 1: one
    sequence at a time) on ``plan.ranks`` real ranks: its groups take consecutive blocks of
    ranks in the plan's order, each runs its sequences one after another in its configuration
    on a communicator of its own. Every sequence's output (a training shape's gradients too)
    is checked against the float64 reference on seeded inputs (``EngineError``
    "wrong_output" otherwise), then ``repeats`` iterations after ``warmup`` are timed, all
    groups starting together after a barrier. More ranks than cores are refused unless
    ``oversubscribe`` (``SearchSetupError``). The mpi engine runs batch plans. Holds the host lock."""
    _check_counts(warmup, repeats)
    engine = _timed_engine(backend)
    run_batch = getattr(engine, "run_batch", None)
    if run_batch is None:
        raise SearchSetupError(f"the {engine.name} engine does not run batch plans: use --backend mpi")
    check_rank_count(f"--ranks {plan.ranks}", plan.ranks, engine, oversubscribe)
    _check_plan(plan)
    sent: list[list[np.ndarray]] = [[] for _ in range(plan.ranks)]
    cases: list[tuple[int, Workload, SequenceLayout, int, tuple[np.ndarray, ...]]] = []
    groups, start = [], 0
    for group in plan.groups:
        workloads = []
        for s in group.sequences:
            workload = shape.at(plan.lengths[s])
            check_feasible(workload, group.config)
            layout = SequenceLayout(workload, group.config)
            inputs, references = _reference_case(workload, seed + s)
            for local, shard in enumerate(_scatter(layout, *inputs)):
                sent[start + local] += shard
            cases.append((s, workload, layout, start, references))
            workloads.append(workload)
        groups.append((group.config, workloads))
        start += group.config.ranks
    longest = sum(default_timeout(w, c) for c, ws in groups for w in ws)
    with measuring():
        outputs, peaks = run_batch(plan.ranks, groups, sent, timeout or longest)
        error = _check_batch(engine, cases, outputs)
        watch = Watch(engine.process_ids, engine.node_readings)
        timings = engine.time(warmup, repeats, timeout or longest * (warmup + repeats), "a batch plan")
        makespans = timings[:, :, 0].max(axis=0) * 1e3
        disturbed = watch.disturbance(plan.ranks, [float(x) for x in makespans])
    group_ms, start = [], 0
    for group in plan.groups:
        group_ms.append(float(np.median(timings[start:start + group.config.ranks, :, 0].max(axis=0)) * 1e3))
        start += group.config.ranks
    return BatchMeasurement(plan, tuple(float(x) for x in makespans), float(np.median(makespans)),
                            tuple(group_ms), error, max(peaks, default=0), engine.name,
                            oversubscribed(plan.ranks, ranks_per_node(engine)), disturbed)


def _check_plan(plan: BatchPlan) -> None:
    """``ValueError`` for a plan no ranks can run as given: groups needing more than its ranks,
    or a sequence run by no group or by several."""
    used = sum(g.config.ranks for g in plan.groups)
    if used > plan.ranks:
        raise ValueError(f"the plan's groups need {used} ranks, but it is for {plan.ranks}: solve the batch "
                         f"again (plan_batch)")
    placed = sorted(s for g in plan.groups for s in g.sequences)
    if placed != list(range(len(plan.lengths))):
        raise ValueError(f"the plan's groups run sequences {placed}, not each of its {len(plan.lengths)} "
                         f"once: solve the batch again (plan_batch)")


def _check_batch(engine: Engine, cases: Sequence[tuple[int, Workload, SequenceLayout, int, tuple]],
                 outputs: Sequence[Sequence[np.ndarray]]) -> float:
    """Every sequence's output (and gradients) put together from its group's ranks'
    ``outputs`` and checked against its reference: the largest relative error;
    ``EngineError`` "wrong_output" naming the sequence otherwise."""
    taken = [0] * len(outputs)  # arrays of each rank read so far
    worst = 0.0
    for s, workload, layout, start, references in cases:
        count = len(references)
        shards = []
        for local in range(layout.ranks):
            rank = start + local
            shards.append(outputs[rank][taken[rank]:taken[rank] + count])
            taken[rank] += count
        tolerance = engine.tolerance[workload.dtype]
        for i, (name, reference) in enumerate(zip(Trained._fields, references, strict=False)):
            error = relative_error(_gather(layout, [shard[i] for shard in shards]), reference)
            if not error <= tolerance:
                what = "result" if name == "out" else f"gradient of {name[1:].upper()}"
                raise EngineError(
                    "wrong_output",
                    f"{layout.config.describe()} computed a wrong {what} for sequence {s + 1} of the batch "
                    f"({workload.describe()}): relative error {error:.2e} exceeds the {workload.dtype} "
                    f"tolerance {tolerance:.0e}, so the batch's timing does not count. This is a bug in the "
                    f"strategy or engine; please report it.")
            worst = max(worst, error)
    return worst


def measure_mix(
    shape: AttentionShape,
    batch: LengthMix,
    ranks: int,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = 10,
    timeout: float | None = None,
    oversubscribe: bool = False,
    db: str | None = None,
) -> BatchMeasurement:
    """Solve ``batch`` (its sequences' lengths) for ``ranks`` ranks of this host
    (``cptune.mixes.plan_batch`` on this host's model: its measurements in ``db`` where
    stored, else the prior) and ``measure_batch`` the plan: its measured makespan beside the
    predicted one."""
    from cptune.mixes import mix_costs, plan_batch

    engine = _timed_engine(backend)
    check_rank_count(f"--ranks {ranks}", ranks, engine, oversubscribe)  # before the solver's work
    plan = plan_batch(mix_costs(shape, batch, ranks, db=db, backend=engine.name), batch)
    return measure_batch(plan, shape, engine, warmup, repeats, timeout, oversubscribe=oversubscribe)
