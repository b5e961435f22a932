"""What a node must offer the TensorRT engine, checked in one line before anything starts:
a CUDA GPU, the Python packages (``pip install 'cptune[tensorrt]'``), NCCL's library loaded
(``load_nccl``: importing nccl4py succeeds without it), enough GPUs for the ranks, and
GPUs of compute capability 8.0 or newer (TensorRT's DistCollective needs SM80).

Nothing here imports TensorRT, nccl4py or cuda-bindings at module level: it imports, and
its checks run, where they are missing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from cptune.engines import BackendUnavailableError
from cptune.hardware import GpuInfo, list_gpus

#: TensorRT's DistCollective layers need compute capability 8.0 (Ampere) or newer.
MIN_COMPUTE_CAPABILITY = 80
#: Python modules the ranks import, and the package each comes from.
GPU_MODULES: dict[str, str] = {
    "tensorrt": "tensorrt", "nccl.core": "nccl4py", "cuda.bindings.runtime": "cuda-bindings",
}
INSTALL_HINT = "pip install 'cptune[tensorrt]' (TensorRT's libraries download from NVIDIA's package server)"
NCCL_HINT = "pip install nvidia-nccl-cu13 (the NCCL library nccl4py and TensorRT share)"


def load_nccl() -> str:
    """Load NCCL's library into this process, globally, and return its path: the copy
    nccl4py uses (found by cuda-pathfinder, as nccl4py finds it). TensorRT ``dlopen``s
    "libnccl.so.2" by bare name when it first needs NCCL; with this copy already loaded
    that name resolves to it, so TensorRT and nccl4py share one NCCL, as a communicator
    handed from one to the other requires. Otherwise TensorRT finds whatever the library
    path offers, or nothing. Call it before TensorRT is imported."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return str(load_nvidia_dynamic_lib("nccl").abs_path)


@dataclass(frozen=True)
class NodeProbe:
    """What a node offers the TensorRT engine: its visible CUDA GPUs (empty with
    ``gpu_problem`` saying why none could be listed) and the GPU packages that do not
    import (module: reason)."""

    gpus: tuple[GpuInfo, ...]
    gpu_problem: str | None
    missing: dict[str, str]
    #: Why NCCL's library could not be loaded (None: loaded, or its packages are missing).
    nccl_problem: str | None = None


def _import_problem(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or OSError from a library the module loads
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def probe_node() -> NodeProbe:
    """Ask the driver (nvidia-smi) for the GPUs, load NCCL's library and try importing each
    GPU package."""
    try:
        gpus, problem = tuple(list_gpus()), None
    except OSError as exc:
        gpus, problem = (), str(exc)
    nccl_problem = _nccl_problem()  # first, as on the ranks: TensorRT then finds this copy
    missing = {module: reason for module in GPU_MODULES if (reason := _import_problem(module))}
    return NodeProbe(gpus, problem, missing, nccl_problem)


def _nccl_problem() -> str | None:
    try:
        load_nccl()
    except Exception as exc:  # DynamicLibNotFoundError, OSError, ImportError
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def preflight(ranks: int, probe: NodeProbe) -> None:
    """Raise ``BackendUnavailableError`` when the node of ``probe`` cannot run the TensorRT
    engine on ``ranks`` ranks (one GPU each), naming the first thing missing: a CUDA GPU,
    the packages, enough GPUs, GPUs of SM80 or newer."""
    if not probe.gpus:
        why = probe.gpu_problem or "the NVIDIA driver lists none"
        raise BackendUnavailableError(
            f"--backend tensorrt needs NVIDIA GPUs, but this machine has no CUDA GPU ({why}); "
            f"run it on a GPU node with the NVIDIA driver installed (on this machine, search, measure "
            f"and calibrate with --backend mpi, the default; cptune doctor has no node to probe here)"
        )
    if probe.missing:
        packages = ", ".join(GPU_MODULES[m] for m in probe.missing)
        first = next(iter(probe.missing.items()))
        raise BackendUnavailableError(
            f"--backend tensorrt needs {packages}, which cannot be imported here "
            f"({first[0]}: {first[1]}); install with: {INSTALL_HINT}"
        )
    if probe.nccl_problem:
        raise BackendUnavailableError(
            f"--backend tensorrt needs NCCL's library, which cannot be loaded here ({probe.nccl_problem}); "
            f"install with: {NCCL_HINT}"
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


