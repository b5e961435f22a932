"""The TensorRT engine: each rank's ONNX graph built into a TensorRT 11 engine, run on one GPU
per rank, the ranks' DistCollective layers talking over NCCL.

Written for GPU nodes and NOT YET RUN ON ONE: cptune is developed where there is no GPU
and TensorRT's libraries cannot be installed. What can be decided without a GPU is
decided and checked in the graph layer (``cptune.engines._onnx_graph``: the graphs run on MPI
ranks with ONNX's reference runtime); this layer only builds, loads, runs and times them.

It runs under the MPI engine's supervised pool (``MPIEngine``): one rank per GPU, started
once by mpiexec, every wait with a deadline (a rank stuck in NCCL becomes a timeout and
the pool is killed), no process left behind. The ranks are ``_tensorrt_worker``. Building
an engine can take minutes, so it is its own request with its own deadline
(``BUILD_TIMEOUT_S``) before the run; its duration is reported by ``describe()``
("build_s") and never counted as latency. Engines are cached on disk
(``_engine_cache``).

``preflight`` says, in one line, what a node lacks before anything starts: a CUDA GPU,
the Python packages (``pip install 'cptune[tensorrt]'``), enough GPUs for the ranks, or
GPUs of compute capability 8.0 or newer (TensorRT's DistCollective needs SM80).

Nothing here imports TensorRT, nccl4py or cuda-bindings at module level: the module
imports, and its checks run, where they are missing.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import CPConfig
from cptune.engines._pool import WorkerPool
from cptune.engines.mpi import MPIEngine
from cptune.errors import CPTuneError
from cptune.hardware._host import GpuInfo, list_gpus, tensorrt_version
from cptune.reference import TOLERANCE
from cptune.workload import Workload

WORKER = [sys.executable, "-P", "-m", "cptune.engines._tensorrt_worker"]
#: Seconds allowed for building (or loading) the engines of one request on every rank.
BUILD_TIMEOUT_S = 1800.0
#: TensorRT's DistCollective layers need compute capability 8.0 (Ampere) or newer.
MIN_COMPUTE_CAPABILITY = 80
#: Python modules the ranks import, and the package each comes from.
GPU_MODULES: dict[str, str] = {
    "tensorrt": "tensorrt", "nccl.core": "nccl4py", "cuda.bindings.runtime": "cuda-bindings",
}
INSTALL_HINT = "pip install 'cptune[tensorrt]' (TensorRT's libraries download from NVIDIA's package server)"


class BackendUnavailableError(CPTuneError):
    """This machine cannot run the requested engine; the message says what is missing and
    how to get it."""


@dataclass(frozen=True)
class NodeProbe:
    """What a node offers the TensorRT engine: its visible CUDA GPUs (empty with
    ``gpu_problem`` saying why none could be listed) and the GPU packages that do not
    import (module: reason)."""

    gpus: tuple[GpuInfo, ...]
    gpu_problem: str | None
    missing: dict[str, str]


def _import_problem(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or OSError from a library the module loads
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def probe_node() -> NodeProbe:
    """Ask the driver (nvidia-smi) for the GPUs and try importing each GPU package."""
    try:
        gpus, problem = tuple(list_gpus()), None
    except OSError as exc:
        gpus, problem = (), str(exc)
    missing = {module: reason for module in GPU_MODULES if (reason := _import_problem(module))}
    return NodeProbe(gpus, problem, missing)


def preflight(ranks: int, probe: NodeProbe) -> None:
    """Raise ``BackendUnavailableError`` when the node of ``probe`` cannot run the TensorRT
    engine on ``ranks`` ranks (one GPU each), naming the first thing missing: a CUDA GPU,
    the packages, enough GPUs, GPUs of SM80 or newer."""
    if not probe.gpus:
        why = probe.gpu_problem or "the NVIDIA driver lists none"
        raise BackendUnavailableError(
            f"--backend tensorrt needs NVIDIA GPUs, but this machine has no CUDA GPU ({why}); "
            f"run it on a GPU node with the NVIDIA driver installed, or use --backend mpi here"
        )
    if probe.missing:
        packages = ", ".join(GPU_MODULES[m] for m in probe.missing)
        first = next(iter(probe.missing.items()))
        raise BackendUnavailableError(
            f"--backend tensorrt needs {packages}, which cannot be imported here "
            f"({first[0]}: {first[1]}); install with: {INSTALL_HINT}"
        )
    if len(probe.gpus) < ranks:
        have = len(probe.gpus)
        raise BackendUnavailableError(
            f"--backend tensorrt runs one process per GPU, so {ranks} ranks need {ranks} GPUs, but this "
            f"node has {have} visible; use --max-ranks {have} (or fewer --ranks), or a node with more GPUs"
        )
    for gpu in probe.gpus[:ranks]:
        if gpu.sm < MIN_COMPUTE_CAPABILITY:
            raise BackendUnavailableError(
                f"--backend tensorrt needs GPUs of compute capability 8.0 (Ampere) or newer for TensorRT's "
                f"DistCollective layers, but GPU {gpu.index} ({gpu.name}) is {gpu.compute_capability}; "
                f"run it on A100-, H100-class or newer GPUs"
            )


class TensorRTEngine(MPIEngine):
    """Runs configurations as TensorRT engines, one rank per GPU of this node. The pool and
    ``time`` are the MPI engine's; the ranks are ``_tensorrt_worker``."""

    name = "tensorrt"
    #: bf16 is real bfloat16 here (8 significant bits: inputs rounded to it alone are off by
    #: up to 2^-9 ~ 2e-3), not the MPI engine's float16 wire: held to 3e-2, the bound the
    #: same graphs are checked to on ONNX's reference runtime. A wrong lowering is off by
    #: far more (of order one).
    tolerance: Mapping[str, float] = TOLERANCE | {"bf16": 3e-2}

    def __init__(
        self, worker: Sequence[str] = WORKER, start_timeout: float = 180.0,
        probe: Callable[[], NodeProbe] = probe_node,
    ) -> None:
        super().__init__(worker, start_timeout)
        self._probe = probe
        self._node: NodeProbe | None = None
        self._built: dict[str, str] = {}

    def _pool_for(self, ranks: int) -> WorkerPool:
        """The pool, after ``preflight``: a library caller gets the same one-line reason as
        the command line, before any process starts."""
        if self._node is None:
            self._node = self._probe()
        preflight(ranks, self._node)
        return super()._pool_for(ranks)

    def _note_build(self, replies: dict) -> None:
        """Keep the last build's facts for ``describe``: seconds (slowest rank) or "cached"."""
        seconds = [h["build_seconds"] for h, _ in replies.values() if h.get("build_seconds") is not None]
        self._built = {"build_s": f"{max(seconds):.1f}" if seconds else "cached"}
        first = replies[min(replies)][0]
        for key in ("gpu", "tensorrt"):
            if key in first:
                self._built[key] = str(first[key])

    def run(
        self,
        workload: Workload,
        config: CPConfig,
        shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        timeout: float,
    ) -> tuple[list[np.ndarray], list[int]]:
        """Build (or load) and set up every rank's engine, then run once with rank r holding
        ``shards[r]``; returns each rank's output shard (float32) and device bytes held."""
        self._pool_for(config.ranks)
        prepare = {"op": "prepare", "workload": workload.to_dict(), "config": config.to_dict()}
        what = config.describe()
        replies = self._request({r: (prepare, []) for r in range(config.ranks)}, BUILD_TIMEOUT_S,
                                f"building the engines of {what}")
        self._note_build(replies)
        replies = self._request({r: ({"op": "run"}, list(shard)) for r, shard in enumerate(shards)},
                                timeout, what)
        self._timed_ranks = config.ranks
        ordered = [replies[r] for r in range(config.ranks)]
        return [arrays[0] for _, arrays in ordered], [int(h["peak_bytes"]) for h, _ in ordered]

    def _time_cases(
        self, ranks: int, case: dict, warmup: int, repeats: int, timeout: float, what: str
    ) -> np.ndarray:
        self._pool_for(ranks)
        prepare = {"op": "prepare_cases", "ranks": ranks, "case": case}
        replies = self._request({r: (prepare, []) for r in range(ranks)}, BUILD_TIMEOUT_S, f"building {what}")
        self._note_build(replies)
        timing = {"op": "time_cases", "warmup": warmup, "repeats": repeats}
        replies = self._request({r: (timing, []) for r in range(ranks)}, timeout, what)
        return np.max([replies[r][1][0] for r in range(ranks)], axis=0)

    def time_collective(
        self, kind: str, ranks: int, group: int, chunks: Sequence[int], warmup: int, repeats: int,
        timeout: float,
    ) -> np.ndarray:
        """Seconds [chunk, iteration], slowest rank, of one DistCollective ``kind`` layer in
        groups of ``group`` consecutive ranks, ``chunks[i]`` bytes per peer."""
        case = {"collective": kind, "group": group, "chunks": [int(c) for c in chunks]}
        return self._time_cases(ranks, case, warmup, repeats, timeout, f"{kind} calibration on {ranks} GPUs")

    def time_attention(
        self, ranks: int, shapes: Sequence[dict[str, int]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [shape, iteration], slowest rank, of the fused attention op on each shape,
        ``ranks`` GPUs computing at once."""
        return self._time_cases(ranks, {"shapes": list(shapes)}, warmup, repeats, timeout,
                                f"attention calibration on {ranks} GPUs")

    def describe(self) -> dict[str, str]:
        """The engine's software and the last engine build (seconds, or "cached"): build
        time is shown here, never in a latency."""
        import mpi4py

        info = {"engine": self.name, "mpi4py": mpi4py.__version__,
                "tensorrt": tensorrt_version() or "unknown"}
        return info | self._pool_software() | self._built
