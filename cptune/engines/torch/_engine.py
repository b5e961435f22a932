"""The torch engine's driver side: configurations on a persistent pool of torch ranks.

Its ranks run in the shared supervised pool (``cptune.engines._pool``): mpiexec starts
them, every wait has a deadline, a rank that raises, dies or hangs ends the pool with one
``EngineError`` and no process left behind. The rank side is ``_worker``: the strategies on
``TorchOps`` in one ``torch.distributed`` world, gloo on the CPU, NCCL on a GPU node (one
GPU per rank). PyTorch is imported here only to ask where the ranks will run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from cptune.config import CPConfig
from cptune.engines import ENGINES, BackendUnavailableError
from cptune.engines._pool import PooledEngine, WorkerPool, driver_host, on_cluster
from cptune.engines.torch._implementations import refusal
from cptune.hardware import Cluster, Hardware, list_gpus, this_gpu_node, this_host
from cptune.measurement import RUN_FACTS, available_cores
from cptune.reference import REAL_BF16_TOLERANCE
from cptune.workload import Workload

INSTALL_HINT = "pip install 'cptune[torch]'"
#: How a CPU host's torch ranks are linked.
GLOO_LINK = "gloo over TCP loopback (one host)"
#: ... and a node's ranks, when they are one node of several.
GLOO_NODE_LINK = "gloo over TCP on the node's own addresses"


class TorchEngine(PooledEngine):
    """Runs configurations on torch ranks: one per GPU where PyTorch sees CUDA GPUs, CPU
    ranks with gloo otherwise."""

    spec = ENGINES["torch"]
    #: bf16 is real bfloat16 here.
    tolerance: Mapping[str, float] = REAL_BF16_TOLERANCE

    def __init__(self, worker: Sequence[str] | None = None, start_timeout: float = 120.0,
                 hosts: Cluster | None = None) -> None:
        super().__init__(worker, start_timeout, hosts)
        self._ran_with: dict[str, str] = {}
        self._store: Any = None  # the pools' rendezvous (a torch TCPStore), opened with the first
        self._worlds = 0
        self._launched_started = False

    @cached_property
    def launched(self) -> Any:
        """The ranks the user launched with torchrun or srun (``_launch.Launched``), whom
        this engine drives instead of starting its own; None when this process is alone."""
        self._torch  # noqa: B018 - PyTorch must be there before its launch is read
        from cptune.engines.torch._launch import launched_ranks

        return launched_ranks()

    @cached_property
    def _torch(self) -> tuple[str, int]:
        """PyTorch's version and the CUDA GPUs it sees (0: the ranks run on the CPU)."""
        if importlib.util.find_spec("torch") is None:
            raise BackendUnavailableError(
                f"the torch engine needs PyTorch, which is not installed: {INSTALL_HINT}")
        import torch

        return torch.__version__, torch.cuda.device_count() if torch.cuda.is_available() else 0

    @property
    def device(self) -> str:
        """Where this machine's ranks run: "gpu" (one each) or "cpu"."""
        return "gpu" if self._torch[1] else "cpu"

    def preflight(self, ranks: int) -> None:
        """``BackendUnavailableError`` when PyTorch is missing, when ``ranks`` exceeds the
        ranks the user launched, or on a GPU node its GPUs (NCCL takes one GPU per rank)."""
        gpus = self._torch[1]
        if self.launched is not None and self._hosts is not None:
            raise BackendUnavailableError("--hosts with ranks torchrun or srun launched: the launcher placed "
                                          "them already; drop --hosts")
        super().preflight(ranks)
        on_a_node = ranks if self.cluster is None else min(ranks, self.cluster.ranks_per_node)
        if gpus and on_a_node > gpus:
            raise BackendUnavailableError(
                f"{on_a_node} ranks on a node need {on_a_node} GPUs (one per rank) and PyTorch sees {gpus} "
                f"here: ask for at most {gpus} rank{'s' if gpus != 1 else ''} per node")
        if self.launched is not None and ranks > self.launched.size:
            raise BackendUnavailableError(
                f"{ranks} ranks asked and {self.launched.size} were launched: launch {ranks} "
                f"(torchrun --nproc-per-node {ranks}), or ask for at most {self.launched.size}")

    @property
    def cluster(self) -> Cluster | None:
        """The nodes the ranks run on: ``--hosts``', or those torchrun or srun launched them on."""
        if self._hosts is None and self.launched is not None:
            from cptune.engines.torch._launch import launched_cluster

            return launched_cluster(self.launched)
        return self._hosts

    def capacity(self) -> int:
        """The ranks the user launched; else this machine's GPUs, or its cores where it has none."""
        if self.launched is not None:
            return self.launched.size
        if self.cluster is not None:
            return self.cluster.size
        return self._torch[1] or available_cores()

    def hardware(self) -> Hardware:
        """This machine as its ranks use it: its GPUs (model, count, driver, CUDA, links) or
        its CPU cores."""
        if not self._torch[1]:
            # gloo talks over TCP on loopback, not MPI's shared memory: another stack, so
            # another fingerprint (its rows and calibration never mix with the mpi engine's)
            link = GLOO_LINK if self.cluster is None else GLOO_NODE_LINK
            node = dataclasses.replace(this_host(), interconnect=link, mpi_library=None)
            return on_cluster(node, self.cluster, self._network())
        try:
            node = dataclasses.replace(this_gpu_node(list_gpus()), mpi_library=None, tensorrt_version=None)
            return on_cluster(node, self.cluster, self._network())
        except (OSError, ValueError) as exc:
            raise BackendUnavailableError(f"cannot read this node's GPU facts for its fingerprint ({exc}); "
                                          f"check that nvidia-smi works here") from None

    def _network(self) -> str:
        """How ranks on different nodes reach each other: NCCL between GPUs, gloo over TCP
        (on the interface ``GLOO_SOCKET_IFNAME`` names, else the host name's)."""
        if self._torch[1]:
            return "NCCL"
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "the host name's interface")
        return f"gloo over TCP ({interface})"

    def _pool_for(self, ranks: int) -> WorkerPool:
        """The pool, after ``preflight`` (a library caller gets the command line's reason):
        the launched ranks where the user launched them, once; else a pool mpiexec starts."""
        self.preflight(ranks)
        if self.launched is None:
            return super()._pool_for(ranks)
        from cptune.engines.torch._launch import LaunchedPool, lost

        if self._pool is None:
            if self._launched_started:
                raise lost()
            self._launched_started = True
            self._pool = LaunchedPool(self.launched, self.worker, self.start_timeout)
        return self._pool

    def _pool_env(self) -> dict[str, str]:
        """Where a new pool's ranks rendezvous: a store this process holds, a fresh key
        prefix per pool (a pool after a failure is a new world)."""
        import torch.distributed as dist

        host = "127.0.0.1" if self.cluster is None else driver_host(self.cluster.hosts[-1])
        if self._store is None:
            self._store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False)
        self._worlds += 1
        return {"CPTUNE_TORCH_STORE": f"{host}:{self._store.port}",
                "CPTUNE_TORCH_WORLD": f"world-{self._worlds}"}

    def run(
        self, workload: Workload, config: CPConfig, shards: Sequence[tuple[np.ndarray, ...]],
        timeout: float, implementation: str | None = None,
    ) -> tuple[list[np.ndarray], list[int]]:
        """``PooledEngine.run``; with ``implementation`` (a name of ``IMPLEMENTATIONS``) that
        framework's own attention runs on the ranks instead of ``config``'s strategy, on the
        same shards (``ValueError`` where it cannot run ``config``)."""
        if implementation is None:
            return super().run(workload, config, shards, timeout)
        if problem := refusal(implementation, workload, config):
            raise ValueError(problem)
        what = f"{implementation} as {config.describe()}"
        arrays, peaks = self._run(workload, config, shards, timeout, what,
                                  threads=self._threads(config.ranks),
                                  implementation=implementation)
        return [shard[0] for shard in arrays], peaks

    def _reported(self, header: dict) -> None:
        """Keep the kernels, process group and GPU software the last run, or the last timing
        of attention for calibration, ran with (``RUN_FACTS``; a collective's timing names none),
        and the framework implementation it ran, if any (none: the strategy)."""
        self._ran_with.pop("implementation", None)
        self._ran_with |= {key: str(header[key]) for key, _ in RUN_FACTS if key in header}

    def describe(self) -> dict[str, str]:
        """The engine's software, and the kernels and process group the last run or attention
        timing used (on a GPU with the cuDNN and NCCL versions)."""
        version, gpus = self._torch
        info = {"engine": self.name, "torch": version, "device": f"{gpus} GPUs" if gpus else "cpu"}
        return info | self._pool_software() | self._ran_with
