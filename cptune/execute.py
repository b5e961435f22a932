"""Run a configuration for real: ``compute`` its output, or ``measure`` it.

Engine-independent: the sequence is split by ``SequenceLayout``, each rank gets its shard,
outputs are put back in token order, and ``measure`` checks the output against the float64
reference before it times anything.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from cptune.config import CPConfig
from cptune.cost import analytic_cost
from cptune.engines import Engine, get_engine, untimed
from cptune.errors import EngineError
from cptune.feasibility import check_feasible
from cptune.guard import Watch
from cptune.guard import enabled as guard_enabled
from cptune.layout import SequenceLayout
from cptune.measurement import Measurement, available_cores, describe_host, oversubscribed, summarize
from cptune.reference import make_inputs, reference_attention, relative_error
from cptune.workload import Workload

Shard = tuple[np.ndarray, np.ndarray, np.ndarray]


def default_timeout(workload: Workload, config: CPConfig, iterations: int = 1) -> float:
    """A deadline no healthy run gets near: a minute of slack plus each iteration at a
    pessimistic 1 GFLOP/s and 100 MB/s per rank, stretched when ranks outnumber cores."""
    cost = analytic_cost(workload, config)
    per_iteration = 1.0 + cost.flops / 1e9 + sum(cost.bytes_sent.values()) / 1e8
    crowding = max(1.0, config.ranks / available_cores())
    return 60.0 + iterations * per_iteration * crowding


def _check_arrays(workload: Workload, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    wl = workload
    expected = {
        "q": (wl.batch, wl.seq_len, wl.heads, wl.head_dim),
        "k": (wl.batch, wl.seq_len, wl.kv_heads, wl.head_dim),
        "v": (wl.batch, wl.seq_len, wl.kv_heads, wl.head_dim),
    }
    for name, array in (("q", q), ("k", k), ("v", v)):
        shape = np.shape(array)
        if shape != expected[name]:
            raise ValueError(
                f"{name} has shape {shape}, but the workload needs {expected[name]} "
                f"([batch, seq_len, {'heads' if name == 'q' else 'kv_heads'}, head_dim])"
            )


def _scatter(layout: SequenceLayout, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> list[Shard]:
    """Each rank's tokens, in the wire dtype, padded at the end to the layout's length."""
    wl = layout.workload
    pad = layout.padded_len - wl.seq_len

    def prepared(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=wl.wire_dtype)
        return np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x

    qp, kp, vp = prepared(q), prepared(k), prepared(v)
    shards = []
    for rank in range(layout.ranks):
        positions = layout.rank_positions(rank)
        shards.append((qp[:, positions], kp[:, positions], vp[:, positions]))
    return shards


def _gather(layout: SequenceLayout, outputs: list[np.ndarray]) -> np.ndarray:
    wl = layout.workload
    full = np.empty((wl.batch, layout.padded_len, wl.heads, wl.head_dim), dtype=np.float32)
    for rank, out in enumerate(outputs):
        full[:, layout.rank_positions(rank)] = out
    return full[:, : wl.seq_len]


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
    layout = SequenceLayout(workload, config)
    timeout = timeout or default_timeout(workload, config)
    outputs, _ = engine.run(workload, config, _scatter(layout, q, k, v), timeout)
    return _gather(layout, outputs)


@lru_cache(maxsize=1)
def _reference_case(workload: Workload, seed: int) -> tuple[np.ndarray, ...]:
    """Inputs and their reference output, kept for the next configuration of the same workload."""
    q, k, v = make_inputs(workload, seed)
    return q, k, v, reference_attention(workload, q, k, v)


def measure(
    workload: Workload,
    config: CPConfig,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = 10,
    timeout: float | None = None,
    seed: int = 0,
    guard: bool | None = None,
) -> Measurement:
    """Check ``config``'s output against the float64 reference on seeded random inputs, then
    time ``repeats`` iterations after ``warmup`` on real ranks.

    Raises ``InfeasibleConfigError`` before any process starts, ``UntimedEngineError`` for
    an engine that does not time (onnx), and ``EngineError`` when the run fails (kind: crash,
    timeout, error, out_of_memory) or its output is wrong (kind "wrong_output"): a wrong
    configuration never yields a timing. More ranks than this host's cores run, but the
    result says it was ``oversubscribed``. With ``guard`` (None: on unless ``$CPTUNE_GUARD``
    is "off") the contention guard (``cptune.guard``) watches the timed part and says in
    ``disturbed`` why other load on the host spoiled it; such a timing is kept but counts
    for nothing."""
    check_feasible(workload, config)
    guarded = guard_enabled() if guard is None else guard
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    engine = get_engine(backend)
    if not engine.timed:
        raise untimed(engine.name)
    layout = SequenceLayout(workload, config)
    q, k, v, reference = _reference_case(workload, seed)
    run_timeout = timeout or default_timeout(workload, config)
    outputs, peaks = engine.run(workload, config, _scatter(layout, q, k, v), run_timeout)
    error = relative_error(_gather(layout, outputs), reference)
    tolerance = engine.tolerance[workload.dtype]
    if not error <= tolerance:
        raise EngineError(
            "wrong_output",
            f"{config.describe()} computed a wrong result for {workload.describe()}: relative "
            f"error {error:.2e} exceeds the {workload.dtype} tolerance {tolerance:.0e}, so its "
            f"timing does not count. This is a bug in the strategy or engine; please report it.",
        )
    watch = Watch(engine.process_ids) if guarded else None
    timings = engine.time(
        warmup, repeats, timeout or default_timeout(workload, config, warmup + repeats), config.describe()
    )
    summary = summarize(timings)
    return Measurement(
        workload=workload,
        config=config,
        **summary,
        peak_bytes=max(peaks),
        max_error=error,
        engine=engine.name,
        host=describe_host() | engine.describe(),
        warmup=warmup,
        repeats=repeats,
        oversubscribed=oversubscribed(config.ranks),
        disturbed=watch.verdict(config.ranks, summary["samples_ms"]) if watch else None,
    )
