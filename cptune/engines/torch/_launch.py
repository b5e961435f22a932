"""Ranks the user launched the PyTorch way: torchrun (or srun) started one cptune per rank.

Rank 0's cptune runs the command and drives; it holds the world's key-value store at
MASTER_ADDR:MASTER_PORT (unless torchrun's agent holds it already). When its engine first
needs ranks it listens, writes where (and a token the ranks must show) into the store and
starts its own rank-0 worker; every other rank's cptune, instead of running the command,
waits for that address (``driver_address``), joins the world (``launched_world``) and serves
the driver until told to exit (the rank side, ``_worker.serve_launched``). A driver that
never needed its ranks tells them so as it ends, and they exit. A rank whose driver is gone
exits too (``_worker.exit_when_driver_closes``), so the launcher's job ends with its command.

One node: the driver listens on loopback only. Several nodes (``torchrun --nnodes N``, or
srun over several nodes): it listens on the address of this host that reaches MASTER_ADDR
(or ``$CPTUNE_DRIVER_ADDRESS``), and the ranks fill the nodes in order, LOCAL_WORLD_SIZE
(or SLURM_NTASKS_PER_NODE) to each.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from cptune.engines import BackendUnavailableError
from cptune.engines._pool import WorkerPool, driver_host, rank_environment
from cptune.engines._protocol import TOKEN_VARIABLE, tcp_address
from cptune.errors import EngineError
from cptune.hardware import Cluster
from cptune.measurement import machine_id

#: The prefix of the launched world's keys in the store.
_WORLD = "cptune-world"
_DRIVER_KEY = "cptune/driver"
_NO_DRIVER = "none"
#: How long launched ranks wait for their driver to need them.
_WAIT = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class Launched:
    """This process as one of ``size`` ranks the user launched, ``ranks_per_node`` on each
    of their nodes."""

    rank: int
    size: int
    local_rank: int
    #: host:port of the world's store (MASTER_ADDR:MASTER_PORT).
    store: str
    #: Whether torchrun's agent holds the store (else rank 0's driver opens it).
    agent_store: bool
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.size // self.ranks_per_node

    @property
    def master(self) -> str:
        """MASTER_ADDR: the host every node reaches."""
        return self.store.rpartition(":")[0]


def launched_ranks(environ: Mapping[str, str] = os.environ) -> Launched | None:
    """This process as one of several ranks torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE) or srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NNODES)
    launched, with MASTER_ADDR and MASTER_PORT; None when it is alone.
    ``BackendUnavailableError`` for a launch cptune cannot drive."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank, size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local_rank = int(environ.get("LOCAL_RANK", rank))
        per_node = int(environ.get("LOCAL_WORLD_SIZE", size))
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        rank, size = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
        local_rank = int(environ.get("SLURM_LOCALID", rank))
        nodes = int(environ.get("SLURM_NNODES", "1"))
        per_node = size // nodes if nodes and size % nodes == 0 else 0
    else:
        return None
    if size < 2:
        return None
    if per_node < 1 or size % per_node:
        raise BackendUnavailableError(
            f"these {size} ranks are not spread evenly over their nodes; cptune drives the same number of "
            f"ranks on every node: launch them so (torchrun --nproc-per-node, srun --ntasks-per-node)")
    address, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not address or not port:
        raise BackendUnavailableError(
            "launched ranks need MASTER_ADDR and MASTER_PORT (torchrun sets them; with srun, export "
            "MASTER_ADDR=$(hostname) and a free MASTER_PORT first)")
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return Launched(rank, size, local_rank, f"{address}:{port}", agent, per_node)


def _store(launch: Launched, is_master: bool) -> dist.TCPStore:
    host, _, port = launch.store.rpartition(":")
    return dist.TCPStore(host, int(port), launch.size if is_master else None, is_master=is_master,
                         timeout=_WAIT, wait_for_workers=False)


_driver_store: dist.TCPStore | None = None


@contextlib.contextmanager
def driving(launch: Launched) -> Iterator[None]:
    """Run rank 0's command as the launched ranks' driver: the store open while it runs;
    when it ends, ranks that were never needed are told to exit."""
    global _driver_store
    _driver_store = _store(launch, is_master=not launch.agent_store)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            if not _driver_store.check([_DRIVER_KEY]):
                _driver_store.set(_DRIVER_KEY, _NO_DRIVER)


def driver_address(launch: Launched) -> tuple[str, str, str] | None:
    """Where rank 0's driver listens (``tcp://host:port``), the token it asks for and its machine
    (``_protocol.machine_id``), once it needs the launched ranks (waiting up to an hour for
    that); None when it ended without ever needing them."""
    address = _store(launch, is_master=False).get(_DRIVER_KEY).decode()
    if address == _NO_DRIVER:
        return None
    where, token, machine = address.split(" ")
    return where, token, machine


def launched_world(launch: Launched) -> dist.Store:
    """The store the launched ranks' ``torch.distributed`` world rendezvouses in."""
    return dist.PrefixStore(_WORLD, _store(launch, is_master=False))


def launched_cluster(launch: Launched) -> Cluster | None:
    """The nodes of ranks launched on several, None on one: rank 0's by its host name, the
    others by number (a launcher does not tell rank 0 their names)."""
    if launch.nodes == 1:
        return None
    others = (f"node{i}" for i in range(1, launch.nodes))
    return Cluster((socket.gethostname(), *others), launch.ranks_per_node)


class LaunchedPool(WorkerPool):
    """The launched ranks as the pool an engine drives: rank 0's worker is a child of this
    process, the others are the user's processes, connected over loopback (one node) or the
    network (several), each showing the pool's token. A failure ends them all: the launcher's
    job cannot be started again from here."""

    def __init__(self, launch: Launched, worker: Sequence[str], start_timeout: float) -> None:
        if _driver_store is None:
            raise BackendUnavailableError("launched ranks are driven from cptune's command line on rank 0")
        cluster = launched_cluster(launch)
        host = "127.0.0.1" if cluster is None else driver_host(launch.master)
        listener = socket.create_server((host, 0), backlog=launch.size)
        address = tcp_address(host, listener.getsockname()[1])
        self._prepare(launch.size, "cptune-launched-", cluster)
        try:
            _driver_store.set(_DRIVER_KEY, f"{address} {self.token} {machine_id()}")
        except BaseException:
            listener.close()
            self._discard()
            raise
        environment = rank_environment({TOKEN_VARIABLE: self.token})  # rank 0: the driver's machine
        self._start([*worker, "--driver", address, "--driver-pid", str(os.getpid())], environment,
                    listener, start_timeout)
        self.pids = [self.proc.pid]  # the user's ranks exit when their connection closes

    def kill(self) -> None:
        if self.log.closed:
            return
        for sock in self.socks.values():
            sock.close()  # the user's ranks see it and exit
        self.socks.clear()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, 9)
        self.proc.wait()
        self.pids.clear()
        self._discard()


def lost() -> EngineError:
    """The error for a run after the launched ranks ended."""
    return EngineError("launch", "the ranks torchrun launched ended with an earlier failure and cannot be "
                                 "started again from here: launch them again to go on")
