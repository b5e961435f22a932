"""Engines run a configuration on real ranks: one module each, behind ``Engine``.

``mpi`` (the default) runs anywhere: MPI processes with numpy math. ``tensorrt`` runs each
rank's ONNX graph as a TensorRT engine on one GPU per rank (written for GPU nodes, not yet
run on one). Engines are created on first use and kept, with their worker pools, until
the interpreter exits.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from cptune.config import CPConfig
from cptune.workload import Workload

BACKENDS: tuple[str, ...] = ("mpi", "tensorrt")


class Engine(Protocol):
    name: str
    #: The collective kinds (see ``cptune.cost.COLLECTIVES``) this engine's strategies use,
    #: which ``calibrate`` times.
    collectives: tuple[str, ...]

    def run(
        self, workload: Workload, config: CPConfig,
        shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]], timeout: float,
    ) -> tuple[list[np.ndarray], list[int]]:
        """Run once with rank r holding ``shards[r]``: output shards and peak bytes per rank."""

    def time(self, warmup: int, repeats: int, timeout: float, what: str) -> np.ndarray:
        """Repeat the last run: seconds [rank, iteration, (wall, compute, comm)]."""

    def time_collective(
        self, kind: str, ranks: int, group: int, chunks: Sequence[int], warmup: int, repeats: int,
        timeout: float,
    ) -> np.ndarray:
        """Seconds [chunk, iteration] of the slowest rank: collective ``kind`` (see
        ``cptune.cost.COLLECTIVES``) in groups of ``group`` among ``ranks`` ranks, ``chunks[i]``
        bytes per peer."""

    def time_attention(
        self, ranks: int, shapes: Sequence[dict[str, int]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [shape, iteration] of the slowest rank: the attention kernel on ``ranks``
        ranks at once, each shape given as heads, seq_q, seq_k, head_dim."""

    def describe(self) -> dict[str, str]:
        """The engine's software versions."""

    def close(self) -> None:
        """Stop the engine's processes."""


_engines: dict[str, Engine] = {}


def get_engine(backend: str | Engine) -> Engine:
    """The shared engine for ``backend`` (created on first use); an ``Engine`` instance is
    used as given."""
    if not isinstance(backend, str):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend not in _engines:
        if backend == "tensorrt":
            from cptune.engines.tensorrt import TensorRTEngine

            _engines[backend] = TensorRTEngine()
        else:
            from cptune.engines.mpi import MPIEngine

            _engines[backend] = MPIEngine()
    return _engines[backend]


@atexit.register
def close_engines() -> None:
    """Stop every engine's worker processes."""
    while _engines:
        _engines.popitem()[1].close()
