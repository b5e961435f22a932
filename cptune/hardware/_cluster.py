"""The nodes a search's ranks run on, and where each rank lives.

A cluster is given the way MPICH's Hydra takes it: ``--hosts a:2,b:2`` (host, and the
ranks it runs) or a hostfile (one ``host[:ranks]`` per line, ``#`` comments). Its nodes
are equal (the prior reads one rank count per node, as hardware descriptions do), and ranks
fill the nodes in order: rank ``r`` runs on node ``r // ranks_per_node``. With the layout's
numbering (``cptune.layout``: a head group is ``head_group`` consecutive ranks) a head group
stays inside one node whenever its size divides a node's, so Ulysses' all-to-all runs over
the node's links and the context groups (Ring, AllGather-KV) go across nodes.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from cptune._files import FileRefused, read_regular
from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.hardware._description import MAX_RANKS, MAX_RANKS_PER_NODE
from cptune.layout import Groups

#: The link tiers a flow between two ranks may cross, innermost first.
TIERS: tuple[str, ...] = ("node", "network")
#: The largest hostfile cptune reads (a hostfile lists hosts: a few KiB at most).
MAX_HOSTFILE_BYTES = 1 << 20
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})")


class ClusterError(CPTuneError, ValueError):
    """The nodes given cannot run a search; the message says why and how to fix it."""


@dataclass(frozen=True)
class Cluster:
    """Equal nodes, each running ``ranks_per_node`` ranks, in rank order."""

    hosts: tuple[str, ...]
    ranks_per_node: int

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ClusterError("no hosts given: list them as host:ranks,host:ranks")
        if len(set(self.hosts)) != len(self.hosts):
            raise ClusterError(f"a host is listed twice in {','.join(self.hosts)}: list each node once, "
                               f"with all its ranks (host:ranks)")
        if self.ranks_per_node < 1:
            raise ClusterError(f"each node needs at least one rank, got {self.ranks_per_node}")
        if self.ranks_per_node > MAX_RANKS_PER_NODE:
            raise _too_many_per_node(f"{self.ranks_per_node:,}")
        if self.size > MAX_RANKS:
            raise ClusterError(f"{self.nodes:,} nodes x {self.ranks_per_node:,} ranks is {self.size:,} "
                               f"ranks, more than any machine built: give at most {MAX_RANKS:,} in all")

    @property
    def nodes(self) -> int:
        return len(self.hosts)

    @property
    def size(self) -> int:
        """Ranks in all."""
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node rank ``rank`` runs on."""
        return rank // self.ranks_per_node

    def where(self, rank: int) -> str:
        """Rank ``rank`` and its node, for a message: "rank 3 (node 1, b)"."""
        node = self.node_of(rank)
        return f"rank {rank} (node {node}, {self.hosts[node]})"

    def node_name(self, node: int) -> str:
        """Node ``node`` for a message: "node 1 (b)"."""
        return f"node {node} ({self.hosts[node]})"

    def hydra_hosts(self) -> str:
        """The cluster as mpiexec's ``-hosts`` takes it."""
        return ",".join(f"{host}:{self.ranks_per_node}" for host in self.hosts)

    def describe(self) -> str:
        return f"{self.nodes} nodes x {self.ranks_per_node} ranks ({', '.join(self.hosts)})"

    def check_ranks(self, ranks: int) -> None:
        """``ClusterError`` when ``ranks`` ranks do not fit on the nodes."""
        if ranks > self.size:
            raise ClusterError(f"{ranks} ranks asked and the nodes hold {self.size} ({self.hydra_hosts()}): "
                               f"ask for at most {self.size}, or give more nodes or ranks per node")

    def check_reachable(self) -> None:
        """``ClusterError`` naming the first host whose name does not resolve: one nobody can
        start ranks on (a host that resolves and still cannot be reached fails as the ranks start)."""
        for host in self.hosts:
            try:
                socket.getaddrinfo(host, None)
            except (socket.gaierror, UnicodeError) as exc:
                raise ClusterError(f"host {host!r} cannot be reached: its name does not resolve "
                                   f"({exc.strerror if isinstance(exc, OSError) else exc}); check the "
                                   f"spelling, or give its address") from None


def _node(entry: str, where: str) -> tuple[str, int]:
    """(host, ranks) of one ``host[:ranks]`` entry."""
    host, colon, count = entry.strip().partition(":")
    count = count.strip()
    if not _HOST.fullmatch(host) or (colon and not (count.isascii() and count.isdigit())):
        raise ClusterError(f"{where}: {entry.strip()!r} is not host or host:ranks (e.g. node1:8)")
    if len(count) > len(str(MAX_RANKS_PER_NODE)):  # bounded before it is read as a number
        raise _too_many_per_node(f"{where}: {count}")
    return host, int(count) if colon else 1


def _too_many_per_node(ranks: str) -> ClusterError:
    return ClusterError(f"{ranks} ranks on each node, more than any node runs: give at most "
                        f"{MAX_RANKS_PER_NODE:,} (host:ranks)")


def _cluster(nodes: list[tuple[str, int]], where: str) -> Cluster:
    sizes = {ranks for _, ranks in nodes}
    if len(sizes) > 1:
        listed = ", ".join(f"{host}:{ranks}" for host, ranks in nodes)
        raise ClusterError(f"{where}: the nodes are of unequal size ({listed}); cptune needs the same number "
                           f"of ranks on every node: give each the same host:ranks")
    return Cluster(tuple(host for host, _ in nodes), sizes.pop())


def parse_hosts(text: str) -> Cluster:
    """The cluster ``--hosts a:2,b:2`` names; ``ClusterError`` saying what is wrong."""
    entries = [entry for entry in text.split(",") if entry.strip()]
    if not entries:
        raise ClusterError("--hosts lists no host: give host:ranks,host:ranks (e.g. a:2,b:2)")
    return _cluster([_node(entry, "--hosts") for entry in entries], "--hosts")


def read_hostfile(path: str | Path) -> Cluster:
    """The cluster a Hydra hostfile lists (``host[:ranks]`` per line, ``#`` comments).
    Only a regular file is read, and at most ``MAX_HOSTFILE_BYTES`` of it."""
    path = Path(path)
    try:
        data = read_regular(path, MAX_HOSTFILE_BYTES)
    except FileRefused as refused:
        raise ClusterError(f"hostfile {refused}") from None
    except OSError as exc:
        raise ClusterError(f"cannot read hostfile {path} ({exc.strerror})") from None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ClusterError(f"hostfile {path} is not text: give a file listing host:ranks per line") from None
    nodes = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            nodes.append(_node(entry, f"{path}:{number}"))
    if not nodes:
        raise ClusterError(f"hostfile {path} lists no host: write host:ranks, one per line")
    return _cluster(nodes, str(path))


def tier_of(groups: Groups, ranks_per_node: int | None) -> str:
    """The outermost tier (``TIERS``) any of ``groups`` crosses when ranks fill nodes of
    ``ranks_per_node`` in order (None: one node)."""
    if ranks_per_node is None:
        return "node"
    for members in groups:
        if len({rank // ranks_per_node for rank in members}) > 1:
            return "network"
    return "node"


def heads_span_nodes(config: CPConfig, ranks_per_node: int | None) -> bool:
    """Whether a head group of ``config`` spans nodes of ``ranks_per_node`` ranks (its
    all-to-all then crosses the network): never on one node, nor when the head group's
    size divides a node's."""
    if ranks_per_node is None or config.ranks <= ranks_per_node or config.head_group == 1:
        return False
    return ranks_per_node % config.head_group != 0
