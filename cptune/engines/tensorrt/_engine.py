"""The TensorRT engine: each rank's ONNX graph built into a TensorRT 11 engine, run on one GPU
per rank, the ranks' DistCollective layers talking over NCCL.

Written for GPU nodes and NOT YET RUN ON ONE: cptune is developed where there is no GPU
and TensorRT's libraries cannot be installed. What can be decided without a GPU is
decided and checked in the graph layer (``cptune.engines.onnx``: the graphs run on MPI
ranks with ONNX's reference runtime); this layer only builds, loads, runs and times them.

It runs under the shared supervised pool (``cptune.engines._pool``): one rank per GPU,
started once by mpiexec, every wait with a deadline (a rank stuck in NCCL becomes a timeout
and the pool is killed), no process left behind. The ranks are ``_worker``. Building
an engine can take minutes, so it is its own request with its own deadline
(``BUILD_TIMEOUT_S``) before the run; its duration is reported by ``describe()``
("build_s") and never counted as latency. Engines are cached on disk
(``_cache``).

``preflight`` (``_preflight``) says, in one line, what a node lacks before anything starts.

Nothing here imports TensorRT, nccl4py or cuda-bindings at module level: the module
imports, and its checks run, where they are missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from cptune.config import CPConfig
from cptune.engines import ENGINES, PROBES, BackendUnavailableError, NodeVerdict, ProbeResult, check_runs
from cptune.engines._pool import PooledEngine, WorkerPool
from cptune.engines.tensorrt._preflight import NodeProbe, preflight, probe_node
from cptune.errors import EngineError
from cptune.hardware import Hardware, tensorrt_version, this_gpu_node
from cptune.reference import REAL_BF16_TOLERANCE
from cptune.workload import Workload

#: Seconds allowed for building (or loading) the engines of one request on every rank.
BUILD_TIMEOUT_S = 1800.0
#: Seconds allowed for one of ``cptune doctor``'s probes (a few tiny engines built).
PROBE_TIMEOUT_S = 300.0


class TensorRTEngine(PooledEngine):
    """Runs configurations as TensorRT engines, one rank per GPU of this node; the ranks are
    ``_worker``."""

    spec = ENGINES["tensorrt"]
    #: bf16 is real bfloat16 here.
    tolerance: Mapping[str, float] = REAL_BF16_TOLERANCE

    def __init__(
        self, worker: Sequence[str] | None = None, start_timeout: float = 180.0,
        probe: Callable[[], NodeProbe] = probe_node,
    ) -> None:
        super().__init__(worker, start_timeout)
        self._probe = probe
        self._node: NodeProbe | None = None
        self._built: dict[str, str] = {}

    @property
    def node(self) -> NodeProbe:
        """This node's GPUs and packages: probed afresh while no ranks run (a driver or
        package installed meanwhile counts), kept while they do."""
        if self._node is None or self._pool is None:
            self._node = self._probe()
        return self._node

    def preflight(self, ranks: int) -> None:
        """``BackendUnavailableError`` naming the first thing this node lacks for ``ranks``
        ranks (one GPU each)."""
        preflight(ranks, self.node)

    def capacity(self) -> int:
        """This node's GPUs: one rank each."""
        self.preflight(1)
        return len(self.node.gpus)

    def hardware(self) -> Hardware:
        """This node as the engine uses it: its GPUs' model, count, driver, CUDA and links."""
        self.preflight(1)
        try:
            return this_gpu_node(self.node.gpus)
        except (OSError, ValueError) as exc:
            raise BackendUnavailableError(f"cannot read this node's GPU facts for its fingerprint ({exc}); "
                                          f"check that nvidia-smi works here") from None

    def check_node(self, ranks: int | None = None) -> NodeVerdict:
        """``cptune doctor``'s probes (``PROBES``) on ``ranks`` GPUs (default: all of this
        node's), after the preflight. Each has its own deadline: a probe that fails, crashes
        or hangs is recorded as failed with what was seen, and the next starts on fresh
        ranks."""
        ranks = ranks or self.capacity()
        self.preflight(ranks)
        return NodeVerdict(ranks, tuple(self._run_probe(name, ranks) for name in PROBES))

    def _run_probe(self, name: str, ranks: int) -> ProbeResult:
        self._pool_for(ranks)
        request = {"op": "probe", "probe": name, "ranks": ranks}
        try:
            replies = self._request({r: (request, []) for r in range(ranks)}, PROBE_TIMEOUT_S,
                                    f"cptune doctor's {name} probe", caller_set=False)
        except EngineError as failure:  # the rank's own words: the last line of its report
            said = [line.strip() for line in str(failure).splitlines() if line.strip()]
            return ProbeResult.judged(name, False, f"{failure.kind}: {said[-1]}", "error")
        answers = [replies[r][0] for r in range(ranks)]
        worst = next((a for a in answers if not a["passed"]), answers[0])
        return ProbeResult.judged(name, worst["passed"], worst["seen"], worst["answer"])

    def _pool_for(self, ranks: int) -> WorkerPool:
        """The pool, after ``preflight``: a library caller gets the same one-line reason as
        the command line, before any process starts."""
        self.preflight(ranks)
        return super()._pool_for(ranks)

    def _note_build(self, replies: dict) -> None:
        """Keep the last build's facts for ``describe``: seconds (slowest rank) or "cached"."""
        seconds = [h["build_seconds"] for h, _ in replies.values() if h.get("build_seconds") is not None]
        self._built = {"build_s": f"{max(seconds):.1f}" if seconds else "cached"}
        first = replies[min(replies)][0]
        for key in ("gpu", "tensorrt", "cast_boundary"):
            if key in first:
                self._built[key] = str(first[key])

    def run(
        self,
        workload: Workload,
        config: CPConfig,
        shards: Sequence[tuple[np.ndarray, ...]],
        timeout: float,
    ) -> tuple[list[np.ndarray], list[int]]:
        """Build (or load) and set up every rank's engine, then run once with rank r holding
        ``shards[r]``; returns each rank's output shard (float32) and device bytes held."""
        check_runs(self.spec, workload, config)
        self._pool_for(config.ranks)
        prepare = {"op": "prepare", "workload": workload.to_dict(), "config": config.to_dict()}
        what = config.describe()
        replies = self._request({r: (prepare, []) for r in range(config.ranks)}, BUILD_TIMEOUT_S,
                                f"building the engines of {what}", caller_set=False)
        self._note_build(replies)
        replies = self._request({r: ({"op": "run"}, list(shard)) for r, shard in enumerate(shards)},
                                timeout, what, caller_set=True)
        return self._ran(replies, config.ranks)

    def _time_cases(
        self, ranks: int, case: dict, warmup: int, repeats: int, timeout: float, what: str
    ) -> np.ndarray:
        self._pool_for(ranks)
        prepare = {"op": "prepare_cases", "ranks": ranks, "case": case}
        replies = self._request({r: (prepare, []) for r in range(ranks)}, BUILD_TIMEOUT_S, f"building {what}",
                                caller_set=False)
        self._note_build(replies)
        timing = {"op": "time_cases", "warmup": warmup, "repeats": repeats}
        replies = self._request({r: (timing, []) for r in range(ranks)}, timeout, what, caller_set=False)
        return np.max([replies[r][1][0] for r in range(ranks)], axis=0)

    def time_collective(
        self, kind: str, ranks: int, group: int, chunks: Sequence[int], warmup: int, repeats: int,
        timeout: float, along: str = "heads",
    ) -> np.ndarray:
        """Seconds [chunk, iteration], slowest rank, of one DistCollective ``kind`` layer in
        groups of ``group`` consecutive ranks, ``chunks[i]`` bytes per peer (one node: every
        layout crosses the same links, so ``along`` changes nothing)."""
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
