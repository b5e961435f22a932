"""What each configuration costs at every length of a mix: the cost model's answers on a grid
of lengths, read between them as a line in log length against log time.

``mix_costs`` asks ``cptune.model.recommend`` at each length of the grid (the mix's own lengths
when there are few, else lengths evenly spaced in ratio from its shortest to its longest): a
configuration's time there is measured where the database holds it, the cost model's or the
prior's elsewhere, exactly as ``recommend`` would answer for that length alone. Between grid
lengths the time is interpolated in log-log (attention grows as a power of the length, so a
straight line there is close), beyond the last length a configuration was answered at,
extrapolated along its last segment. Memory is not interpolated: each configuration's longest
sequence within a rank's memory is found from the analytic peak (``cptune.cost.peak_bytes``),
so a plan never puts a sequence where it does not fit.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cptune.config import STRATEGIES, CPConfig
from cptune.cost import peak_bytes
from cptune.feasibility import format_bytes, split_configs
from cptune.mixes._mix import LengthMix, MixError, geometric_grid
from cptune.model import CalibratedProfile, hardware_profile, recommend
from cptune.workload import AttentionShape

#: How many lengths ``mix_costs`` asks the cost model about at most: a mix with no more distinct
#: lengths is answered at each of its own (measured ones read as measured).
GRID_POINTS = 48
#: How many of its entries (configurations x lengths) ``MixCosts.times`` computes at once.
TIMES_BLOCK = 1 << 16


@dataclass(frozen=True, eq=False)
class MixCosts:
    """Each configuration of ``shape`` on up to ``ranks`` ranks of one hardware: its time (ms per
    sequence, the slowest rank's) at each ``grid`` length where ``recommend`` answered for it
    (NaN elsewhere), alone on its ranks (``ms``, where that came from: ``sources``) and with all
    ``ranks`` ranks busy at once (``shared_ms``, as a batch plan's groups run; they differ on a
    host whose ranks share its cores), and the longest sequence it holds within a rank's memory,
    alone (``alone_max``) and with all ranks busy (``shared_max``; they differ on a host whose
    ranks share its memory)."""

    shape: AttentionShape
    ranks: int
    hardware: str
    fingerprint: str
    configs: tuple[CPConfig, ...]
    grid: np.ndarray
    ms: np.ndarray
    sources: np.ndarray
    alone_max: np.ndarray
    shared_max: np.ndarray
    shared_ms: np.ndarray

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Each configuration's rank count (read on every batch solved: built once)."""
        return np.array([c.ranks for c in self.configs], dtype=np.int64)

    def __post_init__(self) -> None:
        logs = np.log(self.grid.astype(np.float64))
        dense = {False: _dense(logs, self.ms)}
        dense[True] = dense[False] if self.shared_ms is self.ms else _dense(logs, self.shared_ms)
        object.__setattr__(self, "_dense", dense)
        object.__setattr__(self, "undominated", _undominated(dense[True], self.sizes, self.shared_max))

    #: The configurations (indices) no other of the same size beats at every length with all
    #: ranks busy (``shared_ms``, ``shared_max``): never slower at a grid length (so, read as
    #: lines between them, never slower anywhere) and holding as long a sequence. A batch plan
    #: needs no others.
    undominated: np.ndarray = field(init=False)

    def times(self, lengths: np.ndarray | Sequence[int], shared: bool = True,
              rows: np.ndarray | None = None) -> np.ndarray:
        """ms of every configuration (rows; ``rows``: only those) for each length (columns), with
        all ``ranks`` ranks busy (``shared``) or alone; inf where a configuration cannot run that
        length: fewer tokens than ranks, or over a rank's memory (``shared``: with all ranks
        busy). ``MixError`` for lengths outside the grid."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size and (lengths.min() < self.grid[0] or lengths.max() > self.grid[-1]):
            raise MixError(f"lengths {int(lengths.min()):,}-{int(lengths.max()):,} reach outside the "
                           f"{int(self.grid[0]):,}-{int(self.grid[-1]):,} tokens these costs were read for; "
                           f"read them for this mix (mix_costs)")
        dense: np.ndarray = self._dense[shared]  # type: ignore[attr-defined]
        picked = np.arange(len(self.configs)) if rows is None else np.asarray(rows)
        limit = (self.shared_max if shared else self.alone_max)[picked]
        sizes = self.sizes[picked]
        x = np.log(lengths.astype(np.float64))
        if self.grid.size > 1:
            logs = np.log(self.grid.astype(np.float64))
            at = np.clip(np.searchsorted(logs, x), 1, logs.size - 1)
            w = (x - logs[at - 1]) / (logs[at] - logs[at - 1])
            below = 1 - w
        y = np.empty((picked.size, lengths.size))
        # a few rows at a time: the table is a batch's largest array, and a fresh temporary of its
        # size costs more (its pages first touched) than the arithmetic
        step = max(1, TIMES_BLOCK // max(1, lengths.size))
        for start in range(0, picked.size, step):
            part, block = y[start:start + step], dense[picked[start:start + step]]
            if self.grid.size == 1:
                part[:] = block[:, :1]
            else:
                np.take(block, at - 1, axis=1, out=part, mode="clip")  # (at is in range; clip: unbuffered)
                part *= below
                upper = np.take(block, at, axis=1)
                upper *= w
                part += upper
            runs = (lengths[None, :] >= sizes[start:start + step, None]) \
                & (lengths[None, :] <= limit[start:start + step, None])
            runs &= np.isfinite(part)
            np.exp(part, out=part)  # (all of it: faster than only where it runs)
            np.copyto(part, np.inf, where=~runs)
        return y


def _undominated(dense: np.ndarray, sizes: np.ndarray, longest: np.ndarray) -> np.ndarray:
    """``MixCosts.undominated``: of each size's configurations, those no other beats (never
    slower at a grid length, holding as long a sequence; of equals, the first)."""
    kept = []
    answered = np.where(np.isfinite(dense), dense, np.inf)
    for g in np.unique(sizes).tolist():
        same = np.flatnonzero(sizes == g)
        block, reach = answered[same], longest[same]
        never = np.all(block[:, None, :] <= block[None, :, :], axis=2) & (reach[:, None] >= reach[None, :])
        strictly = np.any(block[:, None, :] < block[None, :, :], axis=2) | (reach[:, None] > reach[None, :])
        beats = never & (strictly | np.tri(same.size, k=-1, dtype=bool).T)
        np.fill_diagonal(beats, False)
        kept += [int(same[i]) for i in range(same.size) if not beats[:, i].any()]
    return np.array(sorted(kept), dtype=np.int64)


def _dense(logs: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """log ms at every grid length (rows: configurations): where a configuration was answered,
    its answer; between, the line through its answers either side; beyond its first or last,
    its first or last segment extended (one answer alone: attention's square from it); NaN for
    a configuration answered nowhere."""
    dense = np.full(ms.shape, np.nan)
    for i in range(ms.shape[0]):
        known = np.isfinite(ms[i])
        if not known.any():
            continue
        gx, gy = logs[known], np.log(ms[i, known])
        if gx.size == 1:
            dense[i] = gy[0] + 2 * (logs - gx[0])
            continue
        y = np.interp(logs, gx, gy)
        low, high = logs < gx[0], logs > gx[-1]
        y[low] = gy[0] + (logs[low] - gx[0]) * (gy[1] - gy[0]) / (gx[1] - gx[0])
        y[high] = gy[-1] + (logs[high] - gx[-1]) * (gy[-1] - gy[-2]) / (gx[-1] - gx[-2])
        dense[i] = y
    return dense


def _longest_within(shape: AttentionShape, config: CPConfig, limit: int | None, ceiling: int) -> int:
    """The longest sequence up to ``ceiling`` tokens whose analytic peak per rank under ``config``
    fits ``limit`` bytes (0 when not even ``config.ranks`` tokens do): the peak grows with the length."""
    if limit is None or peak_bytes(shape.at(ceiling), config) <= limit:
        return ceiling
    low, high = config.ranks - 1, ceiling  # fits at low (or low is below any length), not at high
    if peak_bytes(shape.at(config.ranks), config) > limit:
        return 0
    low = config.ranks
    while high - low > 1:
        middle = (low + high) // 2
        if peak_bytes(shape.at(middle), config) <= limit:
            low = middle
        else:
            high = middle
    return low


def check_fits(mix: LengthMix, shape: AttentionShape, ranks: int, memory_limit: int | None,
               strategies: Sequence[str] = STRATEGIES, hardware: str = "these ranks") -> None:
    """``MixError`` in one line when the mix's longest sequence fits no configuration of
    ``shape`` on up to ``ranks`` ranks within ``memory_limit`` bytes per rank: the least memory
    per rank any of them needs, and where."""
    workload = shape.at(mix.longest)
    split = split_configs(workload, range(1, ranks + 1), tuple(strategies))
    if not split.feasible:
        reason = next(iter(split.infeasible.values()), ["no configuration runs it"])[0]
        raise MixError(f"no configuration on up to {ranks} ranks can run the longest sequence, "
                       f"{workload.describe()}: {reason}")
    if memory_limit is None:
        return
    least = min(split.feasible, key=lambda c: peak_bytes(workload, c))
    need = peak_bytes(workload, least)
    if need > memory_limit:
        raise MixError(f"the longest sequence, {mix.longest:,} tokens, needs at least {format_bytes(need)} "
                       f"per rank ({least.describe()}, the least of any configuration on up to {ranks} "
                       f"ranks), over the {format_bytes(memory_limit)} per rank of {hardware}: use more "
                       f"ranks, or leave sequences that long out of the mix")


def mix_costs(shape: AttentionShape, mix: LengthMix, ranks: int | None = None, hardware: str | None = None,
              db: str | None = None, strategies: Sequence[str] = STRATEGIES, backend: str = "mpi",
              figures: Mapping[str, float] | None = None, nccl_path: str | None = None,
              grid_points: int = GRID_POINTS, memory_limit: int | None = None) -> MixCosts:
    """The costs of every configuration of ``shape`` on up to ``ranks`` ranks (None: the
    hardware's) across ``mix``'s lengths, from ``recommend`` (same ``hardware``, ``db``,
    ``strategies``, ``backend``, ``figures``, ``nccl_path``). ``MixError`` when the mix's longest
    sequence fits no configuration's memory. ``memory_limit``: bytes per rank the attention
    may take, instead of the hardware's (what the rest of a model leaves it)."""
    if shape.batch != 1:
        raise MixError(f"a length mix lists its sequences one by one: give the layer with batch 1, not "
                       f"{shape.batch}")
    profile = hardware_profile(hardware, db, backend, figures, nccl_path)
    top = profile.max_ranks if ranks is None else ranks
    if not 1 <= top <= profile.max_ranks:
        raise MixError(f"ranks must be between 1 and {profile.max_ranks} on {profile.describe()}, got {top}")
    def limit(ranks: int) -> int | None:
        return profile.memory_limit(ranks) if memory_limit is None else memory_limit

    check_fits(mix, shape, top, limit(top), strategies, profile.describe())
    grid = geometric_grid(mix.lengths.tolist(), grid_points)

    def answers(busy: int | None) -> dict[CPConfig, dict[int, tuple[float, str]]]:
        found: dict[CPConfig, dict[int, tuple[float, str]]] = {}
        for j, length in enumerate(grid):
            pick = recommend(shape.at(length), None, hardware, db, strategies, backend, figures, nccl_path,
                             busy_ranks=busy)
            for c in pick.candidates:
                if c.config.ranks <= top:
                    found.setdefault(c.config, {})[j] = (c.latency_ms, c.source)
        return found

    alone_answers = answers(None)
    configs = tuple(sorted(alone_answers, key=lambda c: (c.ranks, c.strategy, c.head_group, c.layout or "")))

    def table(found: dict[CPConfig, dict[int, tuple[float, str]]]) -> tuple[np.ndarray, np.ndarray]:
        ms = np.full((len(configs), len(grid)), np.nan)
        sources = np.full((len(configs), len(grid)), "", dtype=object)
        for i, config in enumerate(configs):
            for j, (latency, source) in found.get(config, {}).items():
                ms[i, j], sources[i, j] = latency, source
        return ms, sources

    ms, sources = table(alone_answers)
    # a calibrated host's ranks may share its cores: beside the others a group runs slower
    shared_ms = table(answers(top))[0] if isinstance(profile, CalibratedProfile) and top > 1 else ms
    ceiling = grid[-1]
    alone = np.array([_longest_within(shape, c, limit(c.ranks), ceiling) for c in configs], dtype=np.int64)
    shared = np.array([_longest_within(shape, c, limit(top), ceiling) for c in configs], dtype=np.int64)
    return MixCosts(shape, top, profile.describe(), profile.fingerprint, configs, np.asarray(grid), ms,
                    sources, alone, shared, shared_ms)
