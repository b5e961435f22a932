"""Hardware described in a file: machines cptune can plan for without running on them.

A description gives the physics that decides how fast context-parallel attention runs: how
many ranks there are and how they are grouped (PCIe switches, CPU sockets, nodes), how fast
one device computes attention and moves bytes through its memory, what each kernel launch
costs, and how fast and how soon ranks reach each other at each tier of the topology.
Shipped descriptions live in ``cptune/hardware/descriptions/`` and are loaded by name
(``load_description("h100-sxm-8")``); any other ``.toml`` file is loaded by path. Every key
is validated when loaded, and a problem is reported as one line ``"file: key: reason"``.

Every figure is either a number or ``{ value = 230, low = 200, high = 240 }``: the value the
prior uses and the range its source allows (``recommend`` turns the ranges into intervals and
names the figure that would decide between tied configurations). The format (every figure
should cite where it comes from in a comment)::

    description = "8x H100 SXM5 80GB in one HGX node, NVLink 4 through NVSwitch"  # optional
    ranks_per_node = 8          # required: ranks (devices) in one node
    nodes = 1                   # optional, default 1

    [device]
    name = "NVIDIA H100 SXM5 80GB"
    memory_gib = 80             # optional: device memory per rank, GiB (2**30 bytes)
    # TFLOP/s the attention kernel's two GEMMs (QK^T, PV) sustain, by dtype: bf16 required,
    # fp16 defaults to bf16, fp32 optional.
    matmul_tflops = { bf16 = { value = 700, low = 620, high = 760 } }
    softmax_tops = 3.9          # exponentials per second, 1e12/s (special function units)
    memory_gbps = 2900          # GB/s memory-bound kernels reach (permutes, merges)
    launch_us = 10              # fixed cost of one kernel launch, microseconds
    attention_call_us = 27      # optional: fixed cost of one attention call however little its
                                # work (default launch_us): t = this + FLOPs / rate
    overlap_slowdown = 0.1      # share of its speed compute loses while communication runs beside it
    backward_speed = 0.85       # optional: the attention backward's FLOP rate over the forward's
                                # (backward FLOPs: 2.5x the forward's); without it no training step

    [links.node]                # required: links between the ranks of one node
    name = "NVLink 4 through NVSwitch"
    bandwidth_gbps = 360        # GB/s (1e9 bytes/s) one rank reaches for large messages, as
                                # nccl-tests reports busbw (with domains: one flow between ranks
                                # of different top-level domains); or per collective kind:
                                # { default = 20, all_to_all = 6 }
    latency_us = 12.5           # microseconds: one small-message collective call
    mesh = false                # optional: true where every pair of the node's ranks has a link
                                # of its own and no switch joins them (MI300X's Infinity Fabric):
                                # bandwidth_gbps is then one pair's link, and
    aggregate_gbps = 318        # (required with mesh) what one rank sends over all its links at
                                # once, as busbw of a collective over every rank of the node

    [[links.domains]]           # optional, innermost first: groups of ranks inside a node
    name = "PCIe switch"        # (e.g. a PCIe switch, a CPU socket) that share a link out
    ranks = 2                   # consecutive ranks per domain; each size divides the next
    bandwidth_gbps = 22         # one flow between two ranks of one domain (not of a smaller one)
    latency_us = 20
    uplink_gbps = 22            # everything one domain sends out of itself, per direction
    through_cpu = false         # optional (also on links.node): ranks of different domains
                                # here reach each other only through a CPU; all-to-all then
                                # needs its own figure spanning NCCL's two paths (NCCL_PATHS)

    [links.network]             # required when nodes > 1, refused when nodes = 1
    name = "InfiniBand NDR 400 Gb/s, one NIC per GPU"
    bandwidth_gbps = 46         # one flow between nodes
    latency_us = 46
    uplink_gbps = 368           # optional: everything one node sends out (default: ranks x flow)

Global rank ``r`` lives on node ``r // ranks_per_node`` and in domain ``r // ranks`` of each
size. A flow between two ranks crosses the outermost tier that separates them: ``links.node``
for ranks of one node in different top-level domains (or anywhere in a node without domains),
``links.network`` across nodes. An exchange is limited by the slowest tier its traffic
crosses and by the share crossing it (see ``HardwareDescription.exchange``). On a mesh node a
rank's flows inside the node run side by side, each on its own pair's link: a send/recv (the
Ring's stream) reaches one link's bandwidth, an all-to-all among g ranks g - 1 links', a ring
collective (all-gather, reduce-scatter) as many links as its group has ranks in the node, less
one (RCCL lays its channels' rings over them), all of them at most ``aggregate_gbps``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cptune._toml import suggest
from cptune.hardware._traffic import Topology, Traffic, canonical_groups, traffic
from cptune.layout import Groups
from cptune.workload import WIRE_DTYPES

#: Attention dtypes a description gives GEMM throughput for (the workload dtypes).
DTYPES: tuple[str, ...] = tuple(WIRE_DTYPES)
#: The key of a per-kind bandwidth table that serves every collective kind not listed.
DEFAULT_KIND = "default"

#: How NCCL moves data between GPUs that reach each other only through a CPU (no PCIe switch
#: joins them, ``LinkTier.through_cpu``): "shm" stages it through host memory, "p2p" writes peer
#: to peer through the CPU's root complex. NCCL's ``ncclTopoCheckP2p`` (src/graph/paths.cc)
#: chooses: 2.15 to 2.22 go peer to peer at any PCIe distance on AMD CPUs and through host memory
#: on Intel, ARM and Zhaoxin ones; from 2.23.4 through host memory everywhere except AMD hosts with
#: two GPUs; NCCL_P2P_LEVEL overrides both.
NCCL_PATHS = ("shm", "p2p")

#: The most ranks one node's links may join: the largest NVLink domains join 72 to 576 GPUs.
MAX_RANKS_PER_NODE = 4096
#: The most ranks a description may have in all: more than any machine built.
MAX_RANKS = 1_000_000

#: Unit of each figure (and of the device's memory) as written in the file, and its factor to SI units.
_UNITS = {
    "memory_gib": ("GiB", 2**30),
    "matmul_tflops": ("TFLOP/s", 1e12), "softmax_tops": ("1e12 exponentials/s", 1e12),
    "memory_gbps": ("GB/s", 1e9), "launch_us": ("microseconds", 1e-6),
    "attention_call_us": ("microseconds", 1e-6),
    "overlap_slowdown": ("fraction (0 to 1)", 1.0), "backward_speed": ("ratio to the forward's rate", 1.0),
    "bandwidth_gbps": ("GB/s", 1e9),
    "latency_us": ("microseconds", 1e-6), "uplink_gbps": ("GB/s", 1e9), "aggregate_gbps": ("GB/s", 1e9),
}

#: The range each figure (and the memory) may take, in the file's units: orders of magnitude
#: wider on each side than the shipped descriptions' ranges (9.75-959 TFLOP/s, 2-384 GB/s links,
#: 5-60 us), so any real device or link lies within. Outside is a slip of the keyboard or of the
#: units, and a bandwidth of 1e-300 GB/s printed latencies of hundreds of digits. (The overlap
#: slowdown, a share, is bounded by its own check: above 0, below 1.)
_RANGES = {
    "memory_gib": (1e-3, 1e6), "matmul_tflops": (1e-3, 1e6), "softmax_tops": (1e-4, 1e4),
    "memory_gbps": (1e-2, 1e6), "launch_us": (1e-3, 1e6), "attention_call_us": (1e-3, 1e6),
    "backward_speed": (1e-2, 1e2), "bandwidth_gbps": (1e-3, 1e6),
    "latency_us": (1e-3, 1e7), "uplink_gbps": (1e-3, 1e7),
}


def _unit(key: str) -> tuple[str, float]:
    """(unit in the file, factor to SI) of figure ``key``."""
    return _UNITS[_kind(key)]


def _kind(key: str) -> str:
    """Which figure ``key`` is ("bandwidth_gbps" of "links.node.bandwidth_gbps.all_to_all")."""
    return next(part for part in key.split(".") if part in _UNITS)


def figure_range_problem(key: str, value: float) -> str | None:
    """Why ``value`` (in the file's units) is outside figure ``key``'s range (``_RANGES``), in
    words; None inside it."""
    least, most = _RANGES.get(_kind(key), (0.0, math.inf))
    if least <= value <= most:
        return None
    return (f"out of range: expected {least:g} to {most:g} {_unit(key)[0]} (any hardware lies within), got "
            f"{value:g}: check the number and its units")


def _size_problem(ranks_per_node: int, nodes: int) -> tuple[str, str] | None:
    """(key, reason) when a machine's size is beyond any built (``MAX_RANKS_PER_NODE``,
    ``MAX_RANKS``), else None."""
    if ranks_per_node > MAX_RANKS_PER_NODE:
        return ("ranks_per_node", f"out of range: at most {MAX_RANKS_PER_NODE} ranks share one node's links "
                f"(the largest NVLink domains join 72 to 576 GPUs), got {ranks_per_node}; describe a larger "
                f"machine as nodes joined by [links.network]")
    if ranks_per_node * nodes > MAX_RANKS:
        return ("nodes", f"out of range: {nodes} nodes x {ranks_per_node} ranks is "
                f"{ranks_per_node * nodes:,} ranks, more than any machine built; describe at most "
                f"{MAX_RANKS:,} ranks in all")
    return None


@dataclass(frozen=True)
class Figure:
    """One figure of a description in SI units: the ``value`` the prior uses and the
    ``low``..``high`` range its source allows (all three equal when the file gives a number)."""

    value: float
    low: float
    high: float

    @property
    def uncertain(self) -> bool:
        return self.low < self.high


@dataclass(frozen=True)
class LinkTier:
    """One tier of the topology: the links a flow between two ranks crosses when the
    outermost thing separating them is this tier. ``key`` is the tier's table in the file
    ("links.node", "links.domains[0]", "links.network"); ``ranks`` the size of one domain at
    this tier (the node's ranks for ``links.node``, every rank for the network)."""

    name: str
    key: str
    ranks: int
    #: Whether everything one domain of the tier below sends out is limited (uplink_gbps).
    has_uplink: bool
    #: Whether ranks of different domains at this tier reach each other only through a CPU: there
    #: all-to-all depends on the path NCCL takes (``NCCL_PATHS``), and the tier's all-to-all figure
    #: spans both.
    through_cpu: bool = False
    #: Whether every pair of ranks at this tier (a node's) has a link of its own, no switch
    #: between them: its bandwidth is one pair's link, its aggregate everything a rank sends.
    mesh: bool = False


@dataclass(frozen=True)
class HardwareDescription:
    """A machine described in a file (see the module docstring for the format). Built by
    ``load_description``, which validates every field; figures are read with ``figure``."""

    #: The file stem, e.g. "h100-sxm-8".
    name: str
    description: str
    #: The device's name, e.g. "NVIDIA H100 SXM5 80GB".
    device: str
    ranks_per_node: int
    nodes: int
    #: Device memory per rank in bytes (None: not given).
    memory_bytes: int | None
    #: Domains inside a node, innermost first (empty: every pair of ranks of a node is alike).
    domains: tuple[LinkTier, ...]
    #: Links between the ranks of one node, across its top-level domains.
    node_link: LinkTier
    #: Links between nodes; None exactly when nodes == 1.
    network_link: LinkTier | None
    #: Every figure in SI units by dotted key, e.g. "device.memory_gbps",
    #: "links.node.bandwidth_gbps.all_to_all" ("...bandwidth_gbps.default" for a plain number).
    figures: Mapping[str, Figure]
    #: The file it was loaded from.
    source: str
    #: Figures the user gave (``with_given``): (key, value in the file's units), in order given.
    given: tuple[tuple[str, float], ...] = ()
    #: The path NCCL takes through a CPU, where the user settled it (``with_nccl_path``), else None.
    nccl_path: str | None = None

    def __post_init__(self) -> None:
        # Direct construction gets the structural limits the TOML loader enforces.
        for field in ("ranks_per_node", "nodes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if reason := _size_problem(self.ranks_per_node, self.nodes):
            raise ValueError(f"{reason[0]}: {reason[1]}")
        if (self.network_link is None) != (self.nodes == 1):
            raise ValueError(f"network_link must be given exactly when nodes > 1 (nodes = {self.nodes})")
        dtypes = {key.rsplit(".", 1)[1] for key in self.figures if key.startswith("device.matmul_tflops.")}
        if "bf16" not in dtypes or dtypes - set(DTYPES):
            raise ValueError(f"matmul_tflops needs bf16 and only {', '.join(DTYPES)}, got {sorted(dtypes)}")
        for tier in self.tiers:
            for suffix in ("latency_us", f"bandwidth_gbps.{DEFAULT_KIND}"):
                if f"{tier.key}.{suffix}" not in self.figures:
                    raise ValueError(f"figure {tier.key}.{suffix} is missing")

    def __hash__(self) -> int:  # figures is a mapping; equal descriptions share a fingerprint
        return hash((self.fingerprint, self.source))

    @property
    def max_ranks(self) -> int:
        """Every rank of every node."""
        return self.ranks_per_node * self.nodes

    @property
    def tiers(self) -> tuple[LinkTier, ...]:
        """Every tier, innermost first."""
        return (*self.domains, self.node_link, *((self.network_link,) if self.network_link else ()))

    @functools.cached_property
    def fingerprint(self) -> str:
        """``"described:"`` and 12 hex digits hashing every field except ``source``, so a
        copy of the file describes the same hardware."""
        fields: dict[str, Any] = asdict(self)
        del fields["source"]
        # Which tiers run through a CPU changes no figure until a path is settled, and then the
        # path and the figures it set are hashed: a description unchanged otherwise keeps its print.
        for tier in (*fields["domains"], fields["node_link"], fields["network_link"] or {}):
            tier.pop("through_cpu", None)
            if not tier.get("mesh", True):  # a switched node's print stays what it was
                tier.pop("mesh")
        if self.nccl_path is None:
            del fields["nccl_path"]
        fields["figures"] = {key: asdict(figure) for key, figure in sorted(self.figures.items())}
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return "described:" + hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def figure(self, key: str) -> float:
        """The value of figure ``key`` in SI units."""
        return self.figures[key].value

    @functools.lru_cache(maxsize=256)  # noqa: B019 - descriptions are few, immutable and hashable
    def with_figure(self, key: str, value: float) -> HardwareDescription:
        """This description with figure ``key`` set to ``value`` (for the prior's ranges)."""
        if key not in self.figures:
            raise KeyError(key)
        return dataclasses.replace(self, figures={**self.figures, key: Figure(value, value, value)})

    def with_given(self, given: Mapping[str, float]) -> HardwareDescription:
        """This description with each figure in ``given`` (by key, e.g.
        "links.node.bandwidth_gbps.all_to_all", in the file's units) set to that value and its
        range closed: a figure measured on the machine itself (nccl-tests busbw, say), where a
        tie's deciding figure is named. Raises ValueError naming the key and the fix."""
        figures = dict(self.figures)
        for key, value in given.items():
            if key not in figures:
                raise ValueError(f"{key} is not a figure of {self.name}{suggest(key, list(figures))}; its "
                                 f"figures: {', '.join(figures)}")
            unit, scale = _unit(key)
            ceiling = 1.0 if key == "device.overlap_slowdown" else math.inf
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < ceiling:
                bound = " below 1" if ceiling == 1.0 else ""
                raise ValueError(f"{key} must be a positive number{bound} ({unit}), got {value!r}")
            if problem := figure_range_problem(key, value):
                raise ValueError(f"{key}: {problem}")
            figures[key] = Figure(value * scale, value * scale, value * scale)
        if "device.launch_us" in given and "device.attention_call_us" not in given \
                and self.figures["device.attention_call_us"] == self.figures["device.launch_us"]:
            figures["device.attention_call_us"] = figures["device.launch_us"]  # its default follows
        return dataclasses.replace(self, figures=figures, given=(*self.given, *given.items()))

    @property
    def path_figures(self) -> tuple[str, ...]:
        """The all-to-all figures of the tiers through a CPU, which the path NCCL takes there
        settles (``with_nccl_path``); none once it is settled."""
        if self.nccl_path is not None:
            return ()
        return tuple(f"{tier.key}.bandwidth_gbps.all_to_all" for tier in self.tiers if tier.through_cpu)

    def with_nccl_path(self, path: str) -> HardwareDescription:
        """This description with the path NCCL takes through a CPU settled (``NCCL_PATHS``), where
        each tier through a CPU has an all-to-all figure spanning both. Through host memory
        all-to-all runs as fast as the tier's other collectives (NVIDIA/nccl issue 1603: 18 GB/s
        busbw, as all-reduce), so it takes the tier's default figure, range and all; peer to peer
        through the CPU it collapses among more than two GPUs, so it is closed at its range's low
        end, the measurement of that path. Raises ValueError naming the fix."""
        if path not in NCCL_PATHS:
            raise ValueError(f"the NCCL path is one of {' or '.join(NCCL_PATHS)}, got {path!r}")
        if self.nccl_path is not None:
            raise ValueError(f"the NCCL path of {self.name} is already settled ({self.nccl_path})")
        if not self.path_figures:
            raise ValueError(f"no GPUs of {self.name} reach each other only through a CPU ("
                             f"{', '.join(tier.name for tier in self.tiers)}), so NCCL's path decides "
                             f"nothing there: name it only for a PCIe description whose GPUs a CPU joins")
        figures = dict(self.figures)
        for key in self.path_figures:
            both = figures[key]
            figures[key] = (figures[key.removesuffix("all_to_all") + DEFAULT_KIND] if path == "shm"
                            else Figure(both.low, both.low, both.low))
        return dataclasses.replace(self, figures=figures, nccl_path=path)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - descriptions are few, immutable and hashable
    def spread(self, keys: tuple[str, ...]) -> HardwareDescription:
        """This description with every figure an array over ``2 * len(keys) + 1`` variants:
        variant 2i has figure ``keys[i]`` at its low end and 2i + 1 at its high end, every other
        figure at its value; the last has every figure at its value. The prior evaluated once
        on it gives its value and every figure's swing at once (``cptune.model``'s ranges)
        instead of once per end of each range. Its figures are arrays, so it is never hashed
        or stored."""
        unknown = set(keys) - set(self.figures)
        if unknown:
            raise KeyError(sorted(unknown)[0])
        figures = {}
        for key, figure in self.figures.items():
            values = np.full(2 * len(keys) + 1, figure.value)
            for i, swung in enumerate(keys):
                if swung == key:
                    values[2 * i], values[2 * i + 1] = figure.low, figure.high
            figures[key] = Figure(values, values, values)  # type: ignore[arg-type]
        return dataclasses.replace(self, figures=figures)

    def matmul_flops(self, dtype: str) -> float | None:
        """GEMM FLOP/s of the attention kernel in ``dtype``; fp16 defaults to bf16, None when
        the file gives no figure for it."""
        key = f"device.matmul_tflops.{dtype}"
        if key in self.figures:
            return self.figure(key)
        return self.figure("device.matmul_tflops.bf16") if dtype == "fp16" else None

    def _by_kind(self, key: str, kind: str) -> float:
        """Figure ``key`` (a table by collective kind) for ``kind``, or its default."""
        return self.figure(f"{key}.{kind}" if f"{key}.{kind}" in self.figures else f"{key}.{DEFAULT_KIND}")

    def bandwidth(self, tier: LinkTier, kind: str) -> float:
        """Bytes/s of one flow of collective ``kind`` across ``tier`` (on a mesh: over one pair's link)."""
        return self._by_kind(f"{tier.key}.bandwidth_gbps", kind)

    def uplink(self, tier: LinkTier, kind: str) -> float:
        """Bytes/s everything one domain of the tier below sends across ``tier`` reaches."""
        return self._by_kind(f"{tier.key}.uplink_gbps", kind)

    def node_of(self, rank: int) -> int:
        """The node global rank ``rank`` lives on."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.max_ranks:
            raise ValueError(
                f"rank must be an integer in 0..{self.max_ranks - 1} on {self.name}, got {rank!r}"
            )
        return rank // self.ranks_per_node

    def between(self, a: int, b: int) -> LinkTier:
        """The outermost tier separating ranks ``a`` and ``b`` (the innermost for a == b)."""
        if self.node_of(a) != self.node_of(b):
            assert self.network_link is not None
            return self.network_link
        for domain in self.domains:
            if a // domain.ranks == b // domain.ranks:
                return domain
        return self.node_link

    def link(self, ranks: Sequence[int]) -> LinkTier:
        """The outermost tier a group of global ranks talks over (the slowest it crosses)."""
        if not ranks:
            raise ValueError("a group of ranks must not be empty")
        ranks = list(ranks)
        order = self.tiers
        return max((self.between(ranks[0], r) for r in ranks), key=order.index)

    @functools.cached_property
    def topology(self) -> Topology:
        """The description's shape without its figures: what decides which links a flow crosses."""
        tiers = self.tiers
        network = len(tiers) - 1 if self.network_link is not None else None
        uplinks = tuple(
            (index, self.ranks_per_node if index == network else level.ranks, index == network)
            for index, level in enumerate(tiers) if level.has_uplink
        )
        return Topology(self.ranks_per_node, self.max_ranks, tuple(d.ranks for d in self.domains),
                        len(self.domains), network, uplinks, mesh=self.node_link.mesh)

    def exchange(self, kind: str, groups: Groups) -> tuple[float, float]:
        """(latency s, seconds per byte each rank sends) of collective ``kind`` run by all
        ``groups`` at once. Each flow moves at the bandwidth of the outermost tier it crosses;
        a rank's flows share its link (their times add up), and everything one domain sends
        out of itself shares that domain's uplink: the slowest of these limits the exchange. On
        a mesh node a rank's flows inside it share no link: its time there is its busiest pair's
        link's, or everything it sends there at the aggregate, whichever is longer.
        Who sends how much over which tier (``traffic``) depends on the topology alone, so it is
        worked out once per collective and layout, whatever the figures; the price of each
        (collective, groups) once per description, since many configurations share them."""
        asked = self._exchanges.get((kind, groups))
        if asked is None:  # first asked: priced once per canonical groups, which configurations share
            same = canonical_groups(self.topology, kind, groups)
            if (asked := self._exchanges.get((kind, same))) is None:
                asked = self._exchanges[kind, same] = self._price(kind, traffic(self.topology, kind, same))
            self._exchanges[kind, groups] = asked
        return asked

    def _price(self, kind: str, load: Traffic | None) -> tuple[float, float]:
        """``exchange`` of the traffic ``load`` of collective ``kind``, at this description's figures."""
        if load is None:
            return 0.0, 0.0
        per_byte, uplinks, latencies, aggregates = self._rates(kind)  # per tier (and variant: ``spread``)
        variants = (1,) * (per_byte.ndim - 1)
        per_rank = load.per_rank.reshape(load.per_rank.shape + variants)
        time = per_rank * per_byte  # [sender, tier(, variant)]
        if load.pair_peak is not None:  # the mesh tier: the busiest pair's link, or all of them
            tier = self.topology.node_tier
            peak = load.pair_peak.reshape(load.pair_peak.shape + variants)
            time[:, tier] = np.maximum(peak * per_byte[tier], per_rank[:, tier] / aggregates[tier])
        slowest = time.sum(axis=1).max(axis=0)  # one order of sums either way
        for index, peak_share in load.uplink_peaks:
            slowest = np.maximum(slowest, peak_share / uplinks[index])
        if isinstance(slowest, np.ndarray):
            slowest.setflags(write=False)  # shared by every configuration that asks
        return latencies[load.outermost], slowest

    @functools.cached_property
    def _exchanges(self) -> dict[tuple[str, Groups], tuple[float, float]]:
        """``exchange`` by collective and groups as asked and as canonical, worked out once per
        description."""
        return {}

    @functools.cached_property
    def _rates_by_kind(self) -> dict[str, tuple[np.ndarray, dict[int, float], list[float], dict[int, float]]]:
        return {}

    def _rates(self, kind: str) -> tuple[np.ndarray, dict[int, float], list[float], dict[int, float]]:
        """(seconds per byte of one flow across each tier, each tier's uplink bytes/s where it has
        one, each tier's latency, a mesh tier's aggregate bytes/s) for collective ``kind``: looked
        up once per description."""
        rates = self._rates_by_kind
        if kind not in rates:
            tiers = self.tiers
            rates[kind] = (np.array([1.0 / self.bandwidth(tier, kind) for tier in tiers]),
                           {i: self.uplink(tier, kind) for i, tier in enumerate(tiers) if tier.has_uplink},
                           [self.figure(f"{tier.key}.latency_us") for tier in tiers],
                           {i: self._by_kind(f"{tier.key}.aggregate_gbps", kind)
                            for i, tier in enumerate(tiers) if tier.mesh})
        return rates[kind]

    def summary(self) -> dict[str, Any]:
        """What ``cptune hardware`` lists: the name, GPU, ranks, ranks per node and nodes, and
        each tier's link, innermost first ("domain" inside a node, "node", "network" between
        nodes), with its bandwidth, uplink and (a mesh's) aggregate in GB/s by collective kind
        ("default" for the kinds the file does not list) and its latency in microseconds, each as
        value, low and high, whether its GPUs reach each other only through a CPU, and whether
        every pair of them has a link of its own (a mesh)."""
        def in_file_units(key: str) -> dict[str, float]:
            unit = _unit(key)[1]
            figure = self.figures[key]
            return {"value": figure.value / unit, "low": figure.low / unit, "high": figure.high / unit}

        def by_kind(prefix: str) -> dict[str, dict[str, float]] | None:
            kinds = {key.rsplit(".", 1)[1]: in_file_units(key) for key in self.figures
                     if key.startswith(f"{prefix}.")}
            return dict(sorted(kinds.items(), key=lambda item: item[0] != DEFAULT_KIND)) or None

        links = []
        for tier in self.tiers:
            where = "network" if tier is self.network_link else "node" if tier is self.node_link else "domain"
            links.append({"tier": where, "key": tier.key, "name": tier.name, "ranks": tier.ranks,
                          "through_cpu": tier.through_cpu, "mesh": tier.mesh,
                          "bandwidth_gbps": by_kind(f"{tier.key}.bandwidth_gbps"),
                          "latency_us": in_file_units(f"{tier.key}.latency_us"),
                          "uplink_gbps": by_kind(f"{tier.key}.uplink_gbps"),
                          "aggregate_gbps": by_kind(f"{tier.key}.aggregate_gbps")})
        return {"name": self.name, "description": self.description, "gpu": self.device,
                "ranks": self.max_ranks, "ranks_per_node": self.ranks_per_node, "nodes": self.nodes,
                "memory_gib": None if self.memory_bytes is None else self.memory_bytes / 2**30,
                "links": links}

    def describe(self) -> str:
        """One line, e.g. "8x NVIDIA H100 SXM5 80GB (h100-sxm-8), NVLink 4 through NVSwitch"."""
        head = f"{self.max_ranks}x {self.device} ({self.name})"
        inside = ", ".join([*(f"{d.name} per {d.ranks}" for d in self.domains), self.node_link.name])
        given = "".join(f"; given {key} = {value:g} {_unit(key)[0]}" for key, value in self.given)
        if self.nccl_path is not None:
            path = "through host memory" if self.nccl_path == "shm" else "peer to peer through the CPU"
            given = f"; NCCL goes {path} ({self.nccl_path}){given}"
        if self.network_link is None:
            return f"{head}, {inside}{given}"
        return (
            f"{head}, {self.nodes} nodes x {self.ranks_per_node}: {inside} within a node, "
            f"{self.network_link.name} between nodes{given}"
        )
