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
from cptune.workload import Workload


class MPIEngine(PooledEngine):
    """Runs configurations on a persistent pool of MPI ranks on this host."""

    spec = ENGINES["mpi"]

    def time_steps(
        self, ranks: int, steps: Sequence[dict[str, object]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [step, iteration], slowest rank, of the kernel's memory-bound steps (kind
        "query" or "merge", wire dtype, heads, rows, head_dim), ``ranks`` ranks at once."""
        header = {"op": "time_steps", "ranks": ranks, "steps": list(steps),
                  "threads": self._threads(ranks), "warmup": warmup, "repeats": repeats}
        return self._time_slowest(ranks, header, timeout, f"step calibration on {ranks} ranks")

    def time_waits(
        self, ranks: int, groups: Sequence[int], shape: dict[str, int], calls: int, chunk: int, warmup: int,
        repeats: int, timeout: float,
    ) -> np.ndarray:
        """Seconds [case, iteration], slowest rank, inside one blocking exchange
        (``_rank._time_waits``): per group size, a group of that size computing ``shape`` and
        then exchanging ``chunk`` bytes per peer while the other ranks compute, then the same
        exchanges with the others idle."""
        header = {"op": "time_waits", "ranks": ranks, "groups": list(groups), "shape": shape,
                  "calls": calls, "chunk": chunk, "threads": self._threads(ranks), "warmup": warmup,
                  "repeats": repeats}
        return self._time_slowest(ranks, header, timeout, f"exchange waits on {ranks} ranks")

    def run_batch(self, ranks: int, groups: Sequence[tuple[CPConfig, Sequence[Workload]]],
                  shards: Sequence[Sequence[np.ndarray]],
                  timeout: float) -> tuple[list[list[np.ndarray]], list[int]]:
        """Run a batch plan's groups side by side once on the first ``ranks`` ranks: group i
        its configuration and workloads (one per sequence, in turn) on the next block of
        ranks, rank r holding ``shards[r]`` (its sequences' inputs in turn): each rank's
        outputs (each sequence's output shard, a training run's gradients after it) and peak
        bytes. The ranks keep the batch for ``time``: per iteration, each rank's wall seconds
        from one barrier of all ``ranks``."""
        self._pool_for(ranks)
        header = {"op": "run_batch", "engine": self.name, "ranks": ranks, "threads": self._threads(ranks),
                  "groups": [{"config": c.to_dict(), "workloads": [w.to_dict() for w in workloads]}
                             for c, workloads in groups]}
        messages = {r: (header, list(shards[r])) for r in range(ranks)}
        replies = self._request(messages, timeout, f"a batch plan of {len(groups)} groups", caller_set=True)
        return self._arrays(replies, ranks)

    def describe(self) -> dict[str, str]:
        """The engine's software and its kernel (cptune's numpy kernel, the spec's), for the
        record of a measurement."""
        import mpi4py

        info = {"engine": self.name, "kernel": self.spec.kernel, "mpi4py": mpi4py.__version__,
                "numpy": np.__version__}
        return info | self._pool_software()
