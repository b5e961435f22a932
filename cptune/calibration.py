"""Calibration: how fast this hardware moves bytes and computes attention, measured.

The cost model's prior turns the analytic terms of a configuration (FLOPs, bytes per
collective, steps) into time. It needs, per rank count, each collective's latency and
bandwidth and the attention compute rate; ``calibrate`` measures them on real ranks in
about a minute:

- each collective the strategies use (all-to-all, all-gather, the Ring's stream step) in
  groups of every size a configuration can form, over a sweep of message sizes, fitted to
  ``time = latency + bytes sent per rank / bandwidth``. The bandwidth reported next to the
  fit is nccl-tests' bus bandwidth at the largest message: bytes each rank sends to its
  peers per second, which for all-gather and all-to-all is algbw * (n - 1) / n and for
  send/recv is algbw;
- the attention kernel on a few shapes, every rank computing at once on its share of the
  cores, so a rank count's rate includes the contention between its ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import numpy as np
from scipy.optimize import nnls

from cptune.cost import COLLECTIVES
from cptune.engines import Engine, get_engine

#: Bytes each rank sends per collective call: 1 KiB to 16 MiB in steps of 4x.
MESSAGE_SIZES: tuple[int, ...] = tuple(2**e for e in range(10, 25, 2))
#: Attention shapes timed per rank count: one context block of a few heads at head_dim 64
#: and 128 (the rate depends on head_dim through the GEMMs' inner dimension).
ATTENTION_SHAPES: tuple[dict[str, int], ...] = (
    {"heads": 4, "seq_q": 512, "seq_k": 2048, "head_dim": 64},
    {"heads": 4, "seq_q": 512, "seq_k": 2048, "head_dim": 128},
)
_TIMEOUT_S = 120.0

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CollectiveFit:
    """One collective on ``ranks`` ranks in groups of ``group``: ``latency_s`` + bytes sent
    per rank / ``bandwidth`` (B/s) fits its ``times_s`` at ``sizes`` (bytes sent per rank);
    ``bus_bandwidth`` is measured at the largest size, as nccl-tests reports it."""

    kind: str
    ranks: int
    group: int
    latency_s: float
    bandwidth: float
    bus_bandwidth: float
    sizes: tuple[int, ...]
    times_s: tuple[float, ...]

    def time(self, nbytes: float, calls: int = 1) -> float:
        """Seconds for ``calls`` calls sending ``nbytes`` per rank in total."""
        return calls * self.latency_s + nbytes / self.bandwidth if nbytes else 0.0


@dataclass(frozen=True)
class ComputeRate:
    """The attention kernel's rate per rank with ``ranks`` ranks computing at once."""

    ranks: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    seconds: float

    @property
    def flops_per_s(self) -> float:
        return 4 * self.heads * self.seq_q * self.seq_k * self.head_dim / self.seconds


@dataclass(frozen=True)
class Calibration:
    """Everything ``calibrate`` measured on one host."""

    engine: str
    collectives: tuple[CollectiveFit, ...]
    compute: tuple[ComputeRate, ...]
    measured_at: str

    @property
    def max_ranks(self) -> int:
        return max(rate.ranks for rate in self.compute)

    def collective(self, kind: str, ranks: int, group: int) -> CollectiveFit:
        """The fit for ``kind`` in groups of ``group`` among ``ranks`` ranks; the nearest
        calibrated rank count with that group size when ``ranks`` was not calibrated."""
        fits = [f for f in self.collectives if f.kind == kind]
        if not fits:
            raise ValueError(f"the calibration has no {kind} measurements")
        return min(fits, key=lambda f: (f.group != group, abs(f.group - group), abs(f.ranks - ranks)))

    def attention_rate(self, ranks: int, head_dim: int) -> float:
        """FLOP/s one of ``ranks`` ranks computes attention at, for the calibrated head_dim
        nearest ``head_dim`` (in ratio)."""
        at_ranks = [r for r in self.compute if r.ranks == min(ranks, self.max_ranks)]
        nearest = min({abs(np.log(r.head_dim / head_dim)) for r in at_ranks})
        rates = [r.flops_per_s for r in at_ranks if abs(np.log(r.head_dim / head_dim)) == nearest]
        return float(np.exp(np.mean(np.log(rates))))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        """The inverse of ``to_dict`` (plain JSON data, as the store keeps it)."""
        return cls(
            engine=data["engine"],
            collectives=tuple(
                CollectiveFit(**{**c, "sizes": tuple(c["sizes"]), "times_s": tuple(c["times_s"])})
                for c in data["collectives"]
            ),
            compute=tuple(ComputeRate(**c) for c in data["compute"]),
            measured_at=data["measured_at"],
        )


def fit_latency_bandwidth(sizes: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """Non-negative (latency, 1/bandwidth) minimising the relative error of
    ``latency + size / bandwidth`` against ``times``: small messages weigh as much as large."""
    weights = 1.0 / times
    (latency, inverse_bandwidth), _ = nnls(np.column_stack([weights, sizes * weights]), np.ones_like(times))
    return float(latency), float(1.0 / inverse_bandwidth) if inverse_bandwidth > 0 else float("inf")


def group_sizes(ranks: int) -> list[int]:
    """Every group a configuration on ``ranks`` ranks communicates in: the divisors > 1
    (head groups of u ranks, context groups of ranks / u)."""
    return [g for g in range(2, ranks + 1) if ranks % g == 0]


def _per_peer(kind: str, group: int, sent: int) -> int:
    return sent if kind == "p2p" else max(1, sent // (group - 1))


def _measure_collective(
    engine: Engine, kind: str, ranks: int, group: int, warmup: int, repeats: int
) -> CollectiveFit:
    chunks = [_per_peer(kind, group, size) for size in MESSAGE_SIZES]
    sizes = np.array([c if kind == "p2p" else c * (group - 1) for c in chunks], dtype=float)
    timings = engine.time_collective(kind, ranks, group, chunks, warmup, repeats, _TIMEOUT_S)
    seconds = np.median(timings, axis=1)
    latency, bandwidth = fit_latency_bandwidth(sizes, seconds)
    return CollectiveFit(
        kind=kind, ranks=ranks, group=group, latency_s=latency, bandwidth=bandwidth,
        bus_bandwidth=float(sizes[-1] / seconds[-1]),
        sizes=tuple(int(s) for s in sizes), times_s=tuple(float(t) for t in seconds),
    )


def calibrate(
    max_ranks: int,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = 7,
    progress: Progress | None = None,
) -> Calibration:
    """Measure the collectives and the attention rate on 1..``max_ranks`` ranks."""
    if max_ranks < 1:
        raise ValueError(f"max_ranks must be at least 1, got {max_ranks}")
    engine = get_engine(backend)
    report = progress or (lambda _: None)
    collectives, compute = [], []
    for ranks in range(1, max_ranks + 1):
        report(f"attention on {ranks} rank(s)")
        timings = engine.time_attention(ranks, ATTENTION_SHAPES, warmup, repeats, _TIMEOUT_S)
        seconds = np.median(timings, axis=1)
        compute += [ComputeRate(ranks=ranks, **shape, seconds=float(t))
                    for shape, t in zip(ATTENTION_SHAPES, seconds, strict=True)]
        for group in group_sizes(ranks):
            for kind in COLLECTIVES:
                report(f"{kind} on {ranks} ranks in groups of {group}")
                collectives.append(_measure_collective(engine, kind, ranks, group, warmup, repeats))
    return Calibration(
        engine=engine.name,
        collectives=tuple(collectives),
        compute=tuple(compute),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
