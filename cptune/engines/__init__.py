"""Engines run a configuration on real ranks: one subpackage each, described by an ``EngineSpec``.

``mpi`` (the default) runs anywhere: MPI processes with numpy math. ``onnx`` runs each
rank's ONNX graph (the one a TensorRT deployment builds) with ONNX's reference runtime on
MPI processes: it checks correctness and does not time. ``tensorrt`` builds the same graphs
into TensorRT engines and runs them on one GPU per rank (written for GPU nodes, not yet run
on one). ``torch`` runs the strategies on ``torch.distributed`` with PyTorch's fused
attention: gloo ranks on a CPU host, one NCCL rank per GPU on a GPU node.

What an engine is - its attention kernel, what its Ring's stream is made of, which
collectives it has, whether it times, whether calibration times its kernel's steps, where
its ranks run - is its ``EngineSpec``, known without importing the engine: the cost counts,
calibration, the prior and the report read the spec, never the engine's name. A new engine
is one more subpackage (an ``Engine`` and the rank side of its tasks) and one ``register``.
Engines are created on first use and kept, with their worker pools, until the interpreter
exits.
"""

from __future__ import annotations

import atexit
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from cptune.config import CPConfig
from cptune.cost import collectives_with
from cptune.engines._verdict import PROBES, UNTRIED, NodeVerdict, ProbeResult
from cptune.errors import CPTuneError
from cptune.kernels import check_kernel
from cptune.workload import Workload

if TYPE_CHECKING:
    from cptune.guard import CpuReading
    from cptune.hardware import Cluster, Hardware

#: Where an engine's ranks run: one per CPU core (more may share cores), one per GPU, or
#: either, by what the machine has ("any": ``Engine.device`` says which).
DEVICES: tuple[str, ...] = ("cpu", "gpu", "any")


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is, known without starting (or importing) it."""

    name: str
    #: One line for ``--help``.
    summary: str
    #: The attention kernel its ranks run (``cptune.kernels.ATTENTION_KERNELS``): what the
    #: prior counts as its compute.
    kernel: str
    #: What its Ring's K/V stream step is made of (``cptune.cost.STREAM_KINDS``).
    stream: str
    #: Whether it times anything (False: a correctness-only engine, which ``measure``,
    #: ``calibrate`` and ``search`` refuse before running).
    timed: bool
    #: Whether calibration times its kernel's memory-bound steps (``Engine.time_steps``).
    times_steps: bool
    #: Where its ranks run (``DEVICES``).
    device: str
    #: The ``Engine`` class, as "module:Class", imported on first use.
    engine: str
    #: The module mpiexec runs for each of its ranks.
    worker: str = "cptune.engines._worker"
    #: The module of its rank side in the shared worker (a ``RankTask`` for "run", and
    #: ``OPS``, its calibration ops), imported by a rank on its first request for this
    #: engine; None where its ranks run a ``worker`` of their own.
    rank_task: str | None = None
    #: Whether a node must be probed (``Engine.check_node``, ``cptune doctor``) before its
    #: first measurement: what only a GPU can tell about the runtime.
    probes: bool = False
    #: Whether its attention steps run as the fused calls ``cptune.calls`` plans by position
    #: (up to two per AllGather-KV query chunk) rather than one call per step: what the prior
    #: counts as its attention calls.
    position_calls: bool = False
    #: Whether its ranks can run on several nodes (``--hosts``, ``get_engine(hosts=)``).
    spans_nodes: bool = False
    #: Whether it runs training workloads (``Engine.run_train``: the forward and the backward).
    trains: bool = False
    #: Whether it runs masks cut by position beyond a causal one (windows, packed documents:
    #: ``Workload.window``, ``documents``); joint text is full attention, which every engine runs.
    masks: bool = False
    #: Whether it runs padded heads (``CPConfig.pad_heads``: the ``pad`` primitive).
    pads_heads: bool = False
    #: Whether calibration times what a blocking exchange costs beside ranks that compute, at
    #: rank counts that outnumber a node's cores (``Engine.time_waits``).
    times_waits: bool = False

    def __post_init__(self) -> None:
        check_kernel(self.kernel)
        collectives_with(self.stream)  # raises for an unknown stream kind
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collective kinds its runs use: what its calibration times."""
        return collectives_with(self.stream)


class Trained(NamedTuple):
    """What a training run computes: the output and the gradients of Q, K and V, each
    [batch, seq, heads or kv_heads, head_dim] as the inputs (one rank's shards, or put
    together in token order)."""

    out: np.ndarray
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


class Engine(Protocol):
    """An engine's driver side: the ranks it runs, and what it can time on them."""

    spec: EngineSpec
    #: The largest relative error of an output, per workload dtype, ``measure`` accepts
    #: (``cptune.reference.TOLERANCE`` unless the engine computes in another precision).
    tolerance: Mapping[str, float]

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> str:
        """Where its ranks run on this machine: "cpu" (more ranks than cores share them) or
        "gpu" (one GPU each)."""

    def preflight(self, ranks: int) -> None:
        """Raise ``BackendUnavailableError`` naming what this machine lacks to run ``ranks``
        ranks, before any process starts."""

    def capacity(self) -> int:
        """Ranks this machine runs without sharing: its cores, or its GPUs."""

    def hardware(self) -> Hardware:
        """This machine as the engine uses it (its fingerprint keys what is stored)."""

    def check_node(self, ranks: int | None = None) -> NodeVerdict:
        """Probe what this node's runtime does on ``ranks`` ranks (default: all it has),
        where only running it can tell (``spec.probes``); an empty verdict elsewhere."""

    def run(
        self, workload: Workload, config: CPConfig,
        shards: Sequence[tuple[np.ndarray, ...]], timeout: float,
    ) -> tuple[list[np.ndarray], list[int]]:
        """Run once with rank r holding ``shards[r]``: output shards and peak bytes per rank."""

    def run_train(
        self, workload: Workload, config: CPConfig,
        shards: Sequence[tuple[np.ndarray, ...]], timeout: float,
    ) -> tuple[list[Trained], list[int]]:
        """A training run (``spec.trains``), the forward then the backward, rank r holding
        ``shards[r]`` (q, k, v and the output's gradient): each rank's ``Trained`` and
        peak bytes (the forward's saved activations included). ``time`` then repeats it,
        seconds [rank, iteration, (wall, compute, comm, forward wall)]."""

    def time(self, warmup: int, repeats: int, timeout: float, what: str) -> np.ndarray:
        """Repeat the last run: seconds [rank, iteration, (wall, compute, comm)]."""

    def time_collective(
        self, kind: str, ranks: int, group: int, chunks: Sequence[int], warmup: int, repeats: int,
        timeout: float, along: str = "heads",
    ) -> np.ndarray:
        """Seconds [chunk, iteration] of the slowest rank: collective ``kind`` (one of
        ``spec.collectives``) in groups of ``group`` among ``ranks`` ranks, ``chunks[i]``
        bytes per peer; the groups laid out as a configuration's head groups (``along="heads"``:
        consecutive ranks) or context groups ("context": every ``ranks / group``-th rank), so
        that on a cluster each link tier is timed where a configuration uses it."""

    def time_attention(
        self, ranks: int, shapes: Sequence[dict[str, int]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [shape, iteration] of the slowest rank: the attention kernel on ``ranks``
        ranks at once, each shape given as heads, seq_q, seq_k, head_dim."""

    def time_steps(
        self, ranks: int, steps: Sequence[dict[str, object]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [step, iteration] of the slowest rank: the kernel's memory-bound steps
        (only where ``spec.times_steps``)."""

    def time_waits(
        self, ranks: int, groups: Sequence[int], shape: dict[str, int], calls: int, chunk: int, warmup: int,
        repeats: int, timeout: float,
    ) -> np.ndarray:
        """Seconds [case, iteration] of the slowest rank inside one blocking exchange, of
        ``ranks`` ranks: per group size, a group of that many computing ``shape`` and then
        exchanging ``chunk`` bytes per peer (an all-gather), ``calls`` times, while the others
        compute; then the same exchanges with the others idle (only where
        ``spec.times_waits``)."""

    def describe(self) -> dict[str, str]:
        """The engine's software versions."""

    def process_ids(self) -> list[int]:
        """The engine's processes now (the contention guard counts their CPU time as ours)."""

    def node_readings(self) -> dict[str, CpuReading]:
        """The CPU accounts of each other node of a cluster, by node (the contention guard
        judges each): none on one node."""

    def close(self) -> None:
        """Stop the engine's processes."""


class UntimedEngineError(CPTuneError, ValueError):
    """A correctness-only engine was asked to time something."""


class UntrainedEngineError(CPTuneError, ValueError):
    """An engine that runs the forward alone was asked to train."""


class UnmaskedEngineError(CPTuneError, ValueError):
    """The engine runs full and causal masks only, not a window or packed documents."""


class UnpaddedEngineError(CPTuneError, ValueError):
    """The engine does not run padded heads (``CPConfig.pad_heads``)."""


def check_runs(spec: EngineSpec, workload: Workload, config: CPConfig | None = None) -> None:
    """``UntrainedEngineError`` where ``workload`` trains and the engine does not;
    ``UnmaskedEngineError`` where its mask has a window or documents and the engine runs
    full and causal masks only; ``UnpaddedEngineError`` where ``config`` pads heads and the
    engine does not."""
    if config is not None and config.pad_heads and not spec.pads_heads:
        padding = ", ".join(repr(s.name) for s in ENGINES.values() if s.pads_heads)
        raise UnpaddedEngineError(
            f"the {spec.name} engine's graphs do not pad heads ({config.describe()}): use a head group that "
            f"divides the heads, or a backend that pads them ({padding})")
    if workload.training and not spec.trains:
        raise UntrainedEngineError(
            f"the {spec.name} engine runs the forward alone (inference), not --mode train: use a "
            f"backend that trains ({trainers()})")
    if (workload.window or workload.documents) and not spec.masks:
        masked = ", ".join(repr(s.name) for s in ENGINES.values() if s.masks)
        raise UnmaskedEngineError(
            f"the {spec.name} engine's graphs hold full and causal masks, not a "
            f"{workload.shape.describe_mask()} mask: use a backend that runs it ({masked})")


class BackendUnavailableError(CPTuneError):
    """This machine cannot run the requested engine; the message says what is missing and
    how to get it."""


def untimed(engine: str) -> UntimedEngineError:
    """The error for timing with ``engine``, which only checks correctness."""
    timed = ", ".join(repr(spec.name) for spec in ENGINES.values() if spec.timed)
    return UntimedEngineError(
        f"the {engine} engine checks that each configuration's graphs compute the right "
        f"attention and does not time them: use compute(..., backend={engine!r}) to check a "
        f"configuration, and a timing backend ({timed}) to measure one"
    )


def trainers() -> str:
    """The engines that run training workloads, for a message: "'mpi', 'torch'"."""
    return ", ".join(repr(spec.name) for spec in ENGINES.values() if spec.trains)


#: Every engine, by name, in the order ``--backend`` lists them (the first is the default).
ENGINES: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    """Make ``spec``'s engine available as ``backend=spec.name`` (and ``--backend``)."""
    if spec.name in ENGINES and ENGINES[spec.name] != spec:
        raise ValueError(f"an engine named {spec.name!r} is registered already")
    ENGINES[spec.name] = spec
    return spec


register(EngineSpec(
    name="mpi", summary="CPU ranks under MPI, numpy math (runs anywhere)",
    kernel="numpy", stream="p2p", timed=True, times_steps=True, times_waits=True, device="cpu",
    engine="cptune.engines.mpi:MPIEngine", rank_task="cptune.engines.mpi._rank", spans_nodes=True,
    trains=True, masks=True, pads_heads=True,
))
register(EngineSpec(
    name="onnx", summary="each rank's ONNX graph on ONNX's reference runtime (checks, does not time)",
    kernel="fused", stream="broadcast", timed=False, times_steps=False, device="cpu",
    engine="cptune.engines.onnx:OnnxEngine", rank_task="cptune.engines.onnx._rank", pads_heads=True,
))
register(EngineSpec(
    name="tensorrt", summary="TensorRT 11 engines, one GPU per rank (pip install 'cptune[tensorrt]')",
    kernel="fused", stream="broadcast", timed=True, times_steps=False, device="gpu",
    engine="cptune.engines.tensorrt:TensorRTEngine", worker="cptune.engines.tensorrt._worker", probes=True,
))
register(EngineSpec(
    name="torch", summary="torch.distributed ranks, PyTorch's fused attention: gloo on CPUs, NCCL on GPUs "
                          "(pip install 'cptune[torch]')",
    kernel="fused", stream="p2p", timed=True, times_steps=False, device="any",
    engine="cptune.engines.torch:TorchEngine", worker="cptune.engines.torch._worker", position_calls=True,
    spans_nodes=True, trains=True, masks=True, pads_heads=True,
))


def ranks_per_node(engine: Engine) -> int | None:
    """Ranks per node where ``engine``'s ranks run on a cluster (``get_engine(hosts=)``), else None."""
    cluster = getattr(engine, "cluster", None)
    return None if cluster is None else int(cluster.ranks_per_node)


def given_hosts(engine: Engine) -> Cluster | None:
    """The nodes ``engine`` was given (``get_engine(hosts=)``, ``--hosts``); None on this host
    or where a launcher placed the ranks."""
    hosts: Cluster | None = getattr(engine, "hosts", None)
    return hosts


def engine_spec(name: str) -> EngineSpec:
    """The spec of the engine called ``name``; ``ValueError`` naming the known ones."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"backend must be one of {', '.join(ENGINES)}, got {name!r}") from None


_engines: dict[tuple[str, Cluster | None], Engine] = {}


def get_engine(backend: str | Engine, hosts: Cluster | None = None) -> Engine:
    """The shared engine for ``backend`` (created on first use), its ranks on this host or,
    given ``hosts``, on those nodes; an ``Engine`` instance is used as given.
    ``BackendUnavailableError`` for ``hosts`` with an engine that runs on one node."""
    if not isinstance(backend, str):
        return backend
    spec = engine_spec(backend)
    if hosts is not None and not spec.spans_nodes:
        across = " or ".join(repr(s.name) for s in ENGINES.values() if s.spans_nodes)
        raise BackendUnavailableError(
            f"--hosts: the {backend} engine runs its ranks on one node; across nodes use --backend {across}")
    if (backend, hosts) not in _engines:
        module, _, name = spec.engine.partition(":")
        kind = getattr(importlib.import_module(module), name)
        _engines[(backend, hosts)] = kind() if hosts is None else kind(hosts=hosts)
    return _engines[(backend, hosts)]


@atexit.register
def close_engines() -> None:
    """Stop every engine's worker processes."""
    while _engines:
        _engines.popitem()[1].close()


__all__ = [
    "DEVICES",
    "ENGINES",
    "BackendUnavailableError",
    "Engine",
    "EngineSpec",
    "NodeVerdict",
    "PROBES",
    "ProbeResult",
    "UNTRIED",
    "UntimedEngineError",
    "close_engines",
    "engine_spec",
    "get_engine",
    "given_hosts",
    "ranks_per_node",
    "register",
    "untimed",
]
