"""The mpi engine's driver side: configurations on a persistent pool of MPI ranks on this host.

Its ranks run in the shared supervised pool (``cptune.engines._pool``): started once and
kept, a deadline on every wait, one ``EngineError`` and no process left behind on failure.
The rank side is ``cptune.engines.mpi._rank``: the strategies over MPI communicators with
the numpy kernel (``_kernels``), whose work the prior counts (``cptune.kernels``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cptune.engines import ENGINES
from cptune.engines._pool import PooledEngine


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

    def describe(self) -> dict[str, str]:
        """The engine's software and its kernel (cptune's numpy kernel, the spec's), for the
        record of a measurement."""
        import mpi4py

        info = {"engine": self.name, "kernel": self.spec.kernel, "mpi4py": mpi4py.__version__,
                "numpy": np.__version__}
        return info | self._pool_software()
