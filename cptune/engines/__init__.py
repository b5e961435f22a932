"""Engines run a configuration on real ranks: one module each, behind ``Engine``.

``mpi`` (the default) runs anywhere: MPI processes with numpy math. ``onnx`` runs each
rank's ONNX graph (the one a TensorRT deployment builds) with ONNX's reference runtime on
MPI processes: it checks correctness and does not time. ``tensorrt`` builds the same graphs
into TensorRT engines and runs them on one GPU per rank (written for GPU nodes, not yet run
on one). Engines are created on first use and kept, with their worker pools, until the
interpreter exits.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.workload import Workload

BACKENDS: tuple[str, ...] = ("mpi", "onnx", "tensorrt")
#: Attention kernels, by the work they execute: "numpy", the mpi engine's, computes whole
#: query row blocks up to each block's last query (``cptune.engines.mpi.computed_pairs``);
#: "fused", a fused attention kernel (TensorRT's, FlashAttention's), skips masked tiles, and
#: the masked work inside its diagonal tiles is neglected.
ATTENTION_KERNELS: tuple[str, ...] = ("numpy", "fused")


def attention_kernel(engine: str) -> str:
    """The attention kernel ``engine`` runs (``ATTENTION_KERNELS``)."""
    return "numpy" if engine == "mpi" else "fused"


class Engine(Protocol):
    name: str
    #: Whether ``time`` and calibration measure anything (False: a correctness-only engine,
    #: which ``measure`` and ``calibrate`` refuse before running).
    timed: bool
    #: The largest relative error of an output, per workload dtype, ``measure`` accepts
    #: (``cptune.reference.TOLERANCE`` unless the engine computes in another precision).
    tolerance: Mapping[str, float]

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

    def process_ids(self) -> list[int]:
        """The engine's processes now (the contention guard counts their CPU time as ours)."""

    def close(self) -> None:
        """Stop the engine's processes."""


class UntimedEngineError(CPTuneError, ValueError):
    """A correctness-only engine was asked to time something."""


def untimed(engine: str) -> UntimedEngineError:
    """The error for timing with ``engine``, which only checks correctness."""
    return UntimedEngineError(
        f"the {engine} engine checks that each configuration's graphs compute the right "
        f"attention and does not time them: use compute(..., backend={engine!r}) to check a "
        f"configuration, and backend 'mpi' to measure one"
    )


_engines: dict[str, Engine] = {}


def get_engine(backend: str | Engine) -> Engine:
    """The shared engine for ``backend`` (created on first use); an ``Engine`` instance is
    used as given."""
    if not isinstance(backend, str):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend not in _engines:
        if backend == "onnx":
            from cptune.engines.onnx import OnnxEngine

            _engines[backend] = OnnxEngine()
        elif backend == "tensorrt":
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
