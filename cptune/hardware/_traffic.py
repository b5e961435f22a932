"""Who sends how much over which tier: a collective's traffic over a description's shape.

A ``Topology`` is a hardware description less its figures (which tier a flow between two ranks
crosses, which tiers have uplinks); ``traffic`` works out, once per topology, collective and
layout, each sending rank's share of its bytes over each tier and the most any one domain sends
through an uplink. ``HardwareDescription.exchange`` prices that traffic with its figures, so
the flows are worked out once however many figures (or variants of them) price them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cptune.layout import Groups, RankGroups

#: Collective kinds whose every member sends a share of its bytes to every other member; every
#: other kind (the Ring's stream step, NCCL's ring all-gather, a broadcast chain) sends each
#: rank's bytes to its neighbour in the group.
ALL_TO_ALL_KINDS = frozenset({"all_to_all"})
#: Collective kinds each of whose flows stays on the link between its own two ranks: an
#: all-to-all's (a share to each peer, each over its own link) and a send/recv pair's (the
#: Ring's stream). The others (all-gather, reduce-scatter, broadcast) run as rings over several
#: channels; where every pair of a node's ranks has a link of its own (a mesh: MI300X's Infinity
#: Fabric), RCCL lays its channels' rings over every link between the group's ranks there, so
#: each rank's bytes spread over as many links as it has group members in its node, less one.
ONE_LINK_KINDS = ALL_TO_ALL_KINDS | {"p2p"}


@dataclass(frozen=True)
class Topology:
    """Which tier a flow between two ranks crosses, and which tiers have uplinks: a
    description less its figures. Tiers are numbered innermost first (domains, the node,
    the network); ``uplinks`` holds (tier, ranks per domain of it, whether flows crossing the
    tier itself use it - the network's - rather than only those crossing a tier above)."""

    ranks_per_node: int
    max_ranks: int
    domain_ranks: tuple[int, ...]
    node_tier: int
    network_tier: int | None
    uplinks: tuple[tuple[int, int, bool], ...]
    #: Whether every pair of a node's ranks has a link of its own (``links.node`` is a mesh):
    #: then a flow inside a node moves over its pair's link, beside the rank's other flows.
    mesh: bool = False


@dataclass(frozen=True)
class Traffic:
    """What one collective moves over a topology, per byte each rank sends: the outermost
    tier any flow crosses; each sending rank's share over each tier (rows: one per sender,
    or per sender of a window that holds every distinct one); and per tier with an uplink,
    the most any one domain sends through it."""

    outermost: int
    per_rank: np.ndarray
    uplink_peaks: tuple[tuple[int, float], ...]
    #: On a mesh node (``Topology.mesh``): per sending rank (rows as ``per_rank``), the largest
    #: share of its bytes any one of its links inside the node carries; None elsewhere.
    pair_peak: np.ndarray | None = None


def traffic(topology: Topology, kind: str, groups: Groups) -> Traffic | None:
    """The ``Traffic`` of collective ``kind`` run by all ``groups`` at once on ``topology``
    (None when no group has two ranks): every flow at once with numpy. A configuration's
    groups given by rule (``RankGroups``) cost what a few nodes' flows cost, whatever the
    cluster's size: only a representative window of them is worked out
    (``_representative_flows``), and configurations whose windows match share one answer."""
    return _traffic(topology, kind, canonical_groups(topology, kind, groups))


def canonical_groups(topology: Topology, kind: str, groups: Groups) -> Groups:
    """``groups``, or where given by rule the groups on the fewest ranks that move what they
    move (``_canonical``): what ``traffic`` works out, and what configurations share.
    ``ValueError`` for groups of more ranks than the topology has."""
    if not isinstance(groups, RankGroups):
        return groups
    if groups.ranks > topology.max_ranks:
        raise ValueError(f"rank must be an integer in 0..{topology.max_ranks - 1}, got {groups.ranks - 1}")
    if _spread_over(topology, kind) is not None:  # on a mesh a ring collective lists its flows
        return groups
    return _canonical(topology, kind, groups)


def _canonical(topology: Topology, kind: str, groups: RankGroups) -> RankGroups:
    """The groups on the fewest ranks whose traffic is that of ``groups``: head groups
    repeat every lcm(u, ranks per node) ranks; under a neighbour collective, context groups
    on many nodes differ only in the nodes from the first wrapping rank on (see
    ``_representative_flows``), so those move closer to the first node by whole periods of
    the groups and the nodes, leaving enough nodes between that every wrapping flow still
    crosses between nodes."""
    n, u, node = groups.ranks, groups.head_group, topology.ranks_per_node
    if groups.along == "heads":
        return RankGroups("heads", min(n, math.lcm(u, node)), u)
    if kind in ALL_TO_ALL_KINDS:
        return groups
    lead = (-(-u // node) + 1) * node  # whole nodes before the wrapping ones: past every wrap target
    period = math.lcm(u, node)  # moving n by this keeps the groups and the nodes aligned alike
    drop = max(0, ((n - u) // node * node - lead) // period) * period
    return RankGroups("context", n - drop, u) if drop else groups


@functools.lru_cache(maxsize=65536)
def _traffic(topology: Topology, kind: str, groups: Groups) -> Traffic | None:
    node = _spread_over(topology, kind)
    if isinstance(groups, RankGroups) and node is None:
        src, dst, share = _representative_flows(topology, kind, groups)
        links = np.ones(src.size)
    else:  # every flow (a ring collective on a mesh: as many flows as ranks)
        src, dst, share, links = _flows(kind, groups, node)
    if src.size == 0:
        return None
    ranks = np.concatenate([src, dst])
    if ranks.min() < 0 or ranks.max() >= topology.max_ranks:
        bad = int(ranks.max() if ranks.max() >= topology.max_ranks else ranks.min())
        raise ValueError(f"rank must be an integer in 0..{topology.max_ranks - 1}, got {bad}")
    tier = np.full(src.size, topology.node_tier)
    for index in reversed(range(len(topology.domain_ranks))):  # the innermost domain both share wins
        size = topology.domain_ranks[index]
        tier[src // size == dst // size] = index
    if topology.network_tier is not None:
        tier[src // topology.ranks_per_node != dst // topology.ranks_per_node] = topology.network_tier
    tiers = topology.node_tier + 1 + (topology.network_tier is not None)
    senders, sender = np.unique(src, return_inverse=True)
    per_rank = np.bincount(sender * tiers + tier, weights=share, minlength=senders.size * tiers)
    peaks = []
    for index, size, inclusive in topology.uplinks:
        leaving = tier >= index if inclusive else tier > index
        if leaving.any():
            _, domain = np.unique(src[leaving] // size, return_inverse=True)
            peaks.append((index, float(np.bincount(domain, weights=share[leaving]).max())))
    pair_peak = None
    if topology.mesh:  # each flow inside a node on its pair's link: the busiest link of each sender
        pair_peak = np.zeros(senders.size)
        inside = tier == topology.node_tier
        np.maximum.at(pair_peak, sender[inside], share[inside] / links[inside])
    return Traffic(int(tier.max()), per_rank.reshape(senders.size, tiers), tuple(peaks), pair_peak)


def _spread_over(topology: Topology, kind: str) -> int | None:
    """The ranks per node where collective ``kind`` spreads each rank's bytes over its links
    inside a node (a ring collective on a mesh, ``ONE_LINK_KINDS``), else None."""
    return topology.ranks_per_node if topology.mesh and kind not in ONE_LINK_KINDS else None


def _representative_flows(topology: Topology, kind: str,
                          groups: RankGroups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The flows of ``groups`` from a window of source ranks that holds every distinct
    sender (its shares over each tier), every distinct domain (what it sends out of
    itself) and the outermost tier crossed: what ``traffic`` keeps of all the flows.

    The topology repeats every node (each domain size divides the node's), so flows between
    ranks at a fixed distance repeat every node. Head groups (consecutive blocks of u) repeat
    every lcm(u, ranks per node) ranks: the groups of that first window stand for the rest
    (a last, partial window's ranks and domains are copies of the first's, or part of them).
    Context groups (ranks j, j + u, ...) under a neighbour collective send each rank's bytes
    u ranks on, the last u wrapping round to the first: the first node stands for every
    domain whose ranks send no wrapping flow, and the nodes from the first wrapping rank on
    are worked out as they are. Any other collective on context groups lists every flow."""
    n, u = groups.ranks, groups.head_group
    node = topology.ranks_per_node
    if groups.along == "heads":
        window = min(groups.ranks, math.lcm(u, node))
        return _flows(kind, RankGroups("heads", window, u))[:3]
    if kind in ALL_TO_ALL_KINDS or groups.size < 2:
        return _flows(kind, groups)[:3]
    wrap_from = n - u
    first = np.arange(min(n, node))
    last = np.arange(max(min(n, node), wrap_from // node * node), n)
    src = np.concatenate([first, last])
    dst = np.where(src < wrap_from, src + u, src - wrap_from)
    return src, dst, np.ones(src.size)


def _flows(kind: str, groups: Iterable[tuple[int, ...]], node: int | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sources, destinations, share of the source's bytes, links of the source's node the
    share spreads over) of every flow of ``kind``: an all-to-all sends an equal share to every
    other member, the others one whole share to the next member round the group. Each flow
    moves over one link, except where ``node`` is given (ranks per node of a mesh, for a kind
    that runs as rings over several channels, ``ONE_LINK_KINDS``): there it spreads over as
    many links as its source has group members in its node, less one."""
    by_size: dict[int, list[tuple[int, ...]]] = {}
    for group in groups:
        if len(group) >= 2:
            by_size.setdefault(len(group), []).append(group)
    parts = []
    for size, members in by_size.items():
        block = np.asarray(members, dtype=np.int64)  # [groups, size]
        if kind in ALL_TO_ALL_KINDS:
            src = np.repeat(block, size, axis=1)  # each member once per member
            dst = np.tile(block, (1, size))
            keep = src != dst
            count = int(keep.sum())
            parts.append((src[keep], dst[keep], np.full(count, 1.0 / (size - 1)), np.ones(count)))
        else:
            links = np.ones(block.size)
            if node is not None:  # each member's fellow members in its node
                rows = np.repeat(np.arange(len(members)), size)
                _, where, counts = np.unique(rows * (block.max() // node + 1) + block.ravel() // node,
                                             return_inverse=True, return_counts=True)
                links = np.maximum(1, counts[where] - 1).astype(float)
            parts.append((block.ravel(), np.roll(block, -1, axis=1).ravel(), np.ones(block.size), links))
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), np.empty(0)
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))  # type: ignore[return-value]

