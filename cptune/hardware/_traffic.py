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


@dataclass(frozen=True)
class Traffic:
    """What one collective moves over a topology, per byte each rank sends: the outermost
    tier any flow crosses; each sending rank's share over each tier (rows: one per sender,
    or per sender of a window that holds every distinct one); and per tier with an uplink,
    the most any one domain sends through it."""

    outermost: int
    per_rank: np.ndarray
    uplink_peaks: tuple[tuple[int, float], ...]


def traffic(topology: Topology, kind: str, groups: Groups) -> Traffic | None:
    """The ``Traffic`` of collective ``kind`` run by all ``groups`` at once on ``topology``
    (None when no group has two ranks): every flow at once with numpy. A configuration's
    groups given by rule (``RankGroups``) cost what a few nodes' flows cost, whatever the
    cluster's size: only a representative window of them is worked out
    (``_representative_flows``), and configurations whose windows match share one answer."""
    if isinstance(groups, RankGroups):
        if groups.ranks > topology.max_ranks:
            raise ValueError(
                f"rank must be an integer in 0..{topology.max_ranks - 1}, got {groups.ranks - 1}")
        groups = _canonical(topology, kind, groups)
    return _traffic(topology, kind, groups)


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
    if isinstance(groups, RankGroups):
        src, dst, share = _representative_flows(topology, kind, groups)
    else:
        src, dst, share = _flows(kind, groups)
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
    return Traffic(int(tier.max()), per_rank.reshape(senders.size, tiers), tuple(peaks))


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
        return _flows(kind, RankGroups("heads", window, u))
    if kind in ALL_TO_ALL_KINDS or groups.size < 2:
        return _flows(kind, groups)
    wrap_from = n - u
    first = np.arange(min(n, node))
    last = np.arange(max(min(n, node), wrap_from // node * node), n)
    src = np.concatenate([first, last])
    dst = np.where(src < wrap_from, src + u, src - wrap_from)
    return src, dst, np.ones(src.size)


def _flows(kind: str, groups: Iterable[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sources, destinations, share of the source's bytes) of every flow of ``kind``: an
    all-to-all sends an equal share to every other member, the others one whole share to
    the next member round the group."""
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
            parts.append((src[keep], dst[keep], np.full(int(keep.sum()), 1.0 / (size - 1))))
        else:
            parts.append((block.ravel(), np.roll(block, -1, axis=1).ravel(), np.ones(block.size)))
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0)
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))  # type: ignore[return-value]

