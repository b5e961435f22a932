"""The mpi engine's driver side: configurations on a persistent pool of MPI ranks on this host.

Its ranks run in the shared supervised pool (``cptune.engines._pool``): started once and
kept, a deadline on every wait, one ``EngineError`` and no process left behind on failure.
The rank side is ``cptune.engines.mpi._rank``: the strategies over MPI communicators with
the numpy kernel (``_kernels``), whose work the prior counts (``cptune.kernels``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cptune.config import CPConfig
from cptune.engines import ENGINES
from cptune.engines._pool import PooledEngine
from cptune.measurement import threads_per_rank
from cptune.workload import Workload


class MPIEngine(PooledEngine):
    """Runs configurations on a persistent pool of MPI ranks on this host."""

    spec = ENGINES["mpi"]

    def run(
        self,
        workload: Workload,
        config: CPConfig,
        shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        timeout: float,
    ) -> tuple[list[np.ndarray], list[int]]:
        """Run ``config`` once with rank r holding ``shards[r]`` (q, k, v in the API layout);
        returns each rank's output shard and peak bytes. The ranks keep the inputs for
        ``time``."""
        return self._run(workload, config, shards, timeout, config.describe(),
                         threads=threads_per_rank(config.ranks))

    def time_collective(
        self, kind: str, ranks: int, group: int, chunks: Sequence[int], warmup: int, repeats: int,
        timeout: float,
    ) -> np.ndarray:
        """Seconds [chunk, iteration], slowest rank, of collective ``kind`` in groups of
        ``group`` consecutive ranks among the first ``ranks`` (all groups at once), moving
        ``chunks[i]`` bytes per peer."""
        header = {"op": "time_collective", "kind": kind, "ranks": ranks, "group": group,
                  "chunks": [int(c) for c in chunks], "warmup": warmup, "repeats": repeats}
        return self._time_slowest(ranks, header, timeout, f"{kind} calibration on {ranks} ranks")

    def time_attention(
        self, ranks: int, shapes: Sequence[dict[str, int]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [shape, iteration], slowest rank, of the attention kernel on each shape
        (heads, seq_q, seq_k, head_dim), ``ranks`` ranks computing at once on their share
        of the cores."""
        header = {"op": "time_attention", "ranks": ranks, "shapes": list(shapes),
                  "threads": threads_per_rank(ranks), "warmup": warmup, "repeats": repeats}
        return self._time_slowest(ranks, header, timeout, f"attention calibration on {ranks} ranks")

    def time_steps(
        self, ranks: int, steps: Sequence[dict[str, object]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [step, iteration], slowest rank, of the kernel's memory-bound steps (kind
        "query" or "merge", wire dtype, heads, rows, head_dim), ``ranks`` ranks at once."""
        header = {"op": "time_steps", "ranks": ranks, "steps": list(steps),
                  "threads": threads_per_rank(ranks), "warmup": warmup, "repeats": repeats}
        return self._time_slowest(ranks, header, timeout, f"step calibration on {ranks} ranks")

    def describe(self) -> dict[str, str]:
        """The engine's software, for the record of a measurement."""
        import mpi4py

        info = {"engine": self.name, "mpi4py": mpi4py.__version__, "numpy": np.__version__}
        return info | self._pool_software()
