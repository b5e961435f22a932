"""Hardware described in a file: machines cptune can plan for without running on them.

A description gives what decides how fast context-parallel attention runs: how many ranks
there are and how they are grouped into nodes, how fast one device computes attention, and
how fast and how soon ranks reach each other inside a node and between nodes. Shipped
descriptions live in ``cptune/hardware/descriptions/`` and are loaded by name
(``load_description("h100-sxm-8")``); any other ``.toml`` file is loaded by path. Every key
is validated when loaded, and a problem is reported as one line ``"file: key: reason"``.

The format (every figure should cite where it comes from in a comment)::

    description = "8x H100 SXM5 80GB in one HGX node, NVLink 4 through NVSwitch"  # optional
    ranks_per_node = 8          # required: ranks (devices) in one node
    nodes = 1                   # optional, default 1

    [device]
    name = "NVIDIA H100 SXM5 80GB"
    memory_gib = 80             # optional: device memory per rank, GiB (2**30 bytes)
    # Attention forward throughput one device sustains, in TFLOP/s (1e12 FLOP/s; dense,
    # causal counted as useful FLOPs). bf16 is required, fp16 defaults to bf16, fp32 is
    # optional (None: no figure for fp32).
    attention_tflops = { bf16 = 600, fp16 = 600, fp32 = 33 }

    [links.node]                # required: links between the ranks of one node
    name = "NVLink 4 through NVSwitch"
    bandwidth_gbps = 360        # GB/s (1e9 bytes/s): bus bandwidth per rank for large
                                # messages, as nccl-tests reports it (busbw)
    latency_us = 12.5           # microseconds: one small-message collective call

    [links.network]             # required when nodes > 1, refused when nodes = 1
    name = "InfiniBand NDR 400 Gb/s, one NIC per GPU"
    bandwidth_gbps = 46
    latency_us = 46

Global rank ``r`` lives on node ``r // ranks_per_node``: a group of ranks inside one node
talks over ``links.node``, a group spanning nodes over ``links.network`` (the slowest tier
it crosses).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from cptune._toml import TomlFileError, _Reader, _show, _suggest
from cptune._toml import _read_file as _read_toml
from cptune.workload import WIRE_DTYPES

#: Allowed keys of each table, in the order the file format documents them.
TOP_KEYS = ("description", "ranks_per_node", "nodes", "device", "links")
DEVICE_KEYS = ("name", "memory_gib", "attention_tflops")
LINKS_KEYS = ("node", "network")
LINK_KEYS = ("name", "bandwidth_gbps", "latency_us")
#: Attention dtypes a description gives throughput for (the workload dtypes).
DTYPES: tuple[str, ...] = tuple(WIRE_DTYPES)

_NODE_EXAMPLE = (
    '[links.node] with name = "NVLink 4 through NVSwitch", bandwidth_gbps = 360 and latency_us = 12.5'
)
#: A line the user can copy for each key, shown when the key is missing or mistyped.
_EXAMPLES = {
    "description": 'description = "8x H100 SXM5 80GB in one node"',
    "ranks_per_node": "ranks_per_node = 8",
    "nodes": "nodes = 1",
    "device": '[device] with name = "NVIDIA H100 SXM5 80GB" and attention_tflops = { bf16 = 600 }',
    "device.name": 'name = "NVIDIA H100 SXM5 80GB"',
    "device.memory_gib": "memory_gib = 80",
    "device.attention_tflops": "attention_tflops = { bf16 = 600, fp16 = 600, fp32 = 33 }",
    "device.attention_tflops.bf16": "bf16 = 600",
    "device.attention_tflops.fp16": "fp16 = 600",
    "device.attention_tflops.fp32": "fp32 = 33",
    "links": _NODE_EXAMPLE,
    "links.node": _NODE_EXAMPLE,
    "links.network": '[links.network] with name = "InfiniBand NDR 400 Gb/s", bandwidth_gbps = 46 and '
                     "latency_us = 46",
    "links.node.name": 'name = "NVLink 4 through NVSwitch"',
    "links.node.bandwidth_gbps": "bandwidth_gbps = 360",
    "links.node.latency_us": "latency_us = 12.5",
    "links.network.name": 'name = "InfiniBand NDR 400 Gb/s, one NIC per GPU"',
    "links.network.bandwidth_gbps": "bandwidth_gbps = 46",
    "links.network.latency_us": "latency_us = 46",
}


class HardwareDescriptionError(TomlFileError):
    """A hardware description that cannot be used. The message reads
    ``"{file}: {key}: {reason}"``: the file (or name) as given, the dotted TOML key (or where
    in the file, for a syntax error) and what is wrong with what to do about it."""


@dataclass(frozen=True)
class LinkTier:
    """One tier of links between ranks, e.g. NVLink inside a node or InfiniBand between nodes."""

    name: str
    #: Bytes/s: the bus bandwidth one rank reaches for large messages (nccl-tests busbw).
    bandwidth: float
    #: Seconds: the time of one small-message collective call on this tier.
    latency: float


@dataclass(frozen=True)
class HardwareDescription:
    """A machine described in a file (see the module docstring for the format). Built by
    ``load_description``, which validates every field."""

    #: The file stem, e.g. "h100-sxm-8".
    name: str
    description: str
    #: The device's name, e.g. "NVIDIA H100 SXM5 80GB".
    device: str
    ranks_per_node: int
    nodes: int
    #: Device memory per rank in bytes (None: not given).
    memory_bytes: int | None
    #: Attention FLOP/s one device achieves (forward, dense), by dtype ("bf16", ...).
    attention_flops: dict[str, float]
    #: Links between the ranks of one node.
    node_link: LinkTier
    #: Links between nodes; None exactly when nodes == 1.
    network_link: LinkTier | None
    #: The file it was loaded from.
    source: str

    def __post_init__(self) -> None:
        # Direct construction gets the structural limits the TOML loader enforces.
        for field in ("ranks_per_node", "nodes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if (self.network_link is None) != (self.nodes == 1):
            raise ValueError(f"network_link must be given exactly when nodes > 1 (nodes = {self.nodes})")
        if "bf16" not in self.attention_flops or set(self.attention_flops) - set(DTYPES):
            raise ValueError(
                f"attention_flops needs bf16 and only {', '.join(DTYPES)}, got {sorted(self.attention_flops)}"
            )

    def __hash__(self) -> int:  # attention_flops is a dict; equal descriptions share a fingerprint
        return hash((self.fingerprint, self.source))

    @property
    def max_ranks(self) -> int:
        """Every rank of every node."""
        return self.ranks_per_node * self.nodes

    @functools.cached_property
    def fingerprint(self) -> str:
        """``"described:"`` and 12 hex digits hashing every field except ``source``, so a
        copy of the file describes the same hardware."""
        fields: dict[str, Any] = asdict(self)
        del fields["source"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return "described:" + hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def node_of(self, rank: int) -> int:
        """The node global rank ``rank`` lives on."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.max_ranks:
            raise ValueError(
                f"rank must be an integer in 0..{self.max_ranks - 1} on {self.name}, got {rank!r}"
            )
        return rank // self.ranks_per_node

    def link(self, ranks: Sequence[int]) -> LinkTier:
        """The tier a group of global ranks talks over: the node's links when all of them live
        on one node, else the network (the slowest tier the group crosses)."""
        if not ranks:
            raise ValueError("a group of ranks must not be empty")
        nodes = {self.node_of(rank) for rank in ranks}
        if len(nodes) == 1:
            return self.node_link
        assert self.network_link is not None  # nodes > 1, so the loader required it
        return self.network_link

    def describe(self) -> str:
        """One line, e.g. "8x NVIDIA H100 SXM5 80GB (h100-sxm-8), NVLink 4 through NVSwitch"."""
        head = f"{self.max_ranks}x {self.device} ({self.name})"
        if self.network_link is None:
            return f"{head}, {self.node_link.name}"
        return (
            f"{head}, {self.nodes} nodes x {self.ranks_per_node}: {self.node_link.name} within a node, "
            f"{self.network_link.name} between nodes"
        )


# --------------------------------------------------------------------------- loading


def builtin_descriptions() -> dict[str, Traversable]:
    """The descriptions shipped in ``cptune/hardware/descriptions``, by file stem."""
    folder = resources.files("cptune.hardware") / "descriptions"
    found = {
        entry.name.removesuffix(".toml"): entry
        for entry in folder.iterdir()
        if entry.name.endswith(".toml") and entry.is_file()
    }
    return dict(sorted(found.items()))


def load_description(name_or_path: str | Path) -> HardwareDescription:
    """A shipped description by name (e.g. "h100-sxm-8") or any description file by path.
    An existing file wins over a shipped name. Raises HardwareDescriptionError naming the
    file, the key and the fix for the first problem found."""
    as_path = Path(name_or_path)
    if as_path.is_file():
        return _load(str(name_or_path), as_path.stem)
    builtins = builtin_descriptions()
    if str(name_or_path) in builtins:
        # The package is a plain directory in both editable and regular installs.
        return _load(str(builtins[str(name_or_path)]), str(name_or_path))
    raise HardwareDescriptionError(str(name_or_path), "(file)", _not_found(str(name_or_path), builtins))


def _not_found(name: str, builtins: dict[str, Traversable]) -> str:
    return (
        f"no such file and no shipped hardware description of that name{_suggest(name, list(builtins))}; "
        f"give the path of a .toml file or one of the shipped descriptions: {', '.join(builtins)}"
    )


def _load(file: str, name: str) -> HardwareDescription:
    doc = _read_toml(file, HardwareDescriptionError, lambda: _not_found(file, builtin_descriptions()))
    r = _Reader(file, error=HardwareDescriptionError, examples=_EXAMPLES)

    r.check_keys(doc, TOP_KEYS, "")
    raw = r.value(doc, "description", "", required=False)
    description = "" if raw is None else r.string(raw, "description", non_empty=False)
    ranks_per_node = r.integer(r.value(doc, "ranks_per_node", "", required=True), "ranks_per_node", 1)
    raw = r.value(doc, "nodes", "", required=False)
    nodes = 1 if raw is None else r.integer(raw, "nodes", 1)

    device = r.table(doc, "device", required=True)
    assert device is not None
    r.check_keys(device, DEVICE_KEYS, "device")
    device_name = r.string(r.value(device, "name", "device", required=True), "device.name", non_empty=True)
    raw = r.value(device, "memory_gib", "device", required=False)
    memory_bytes = None if raw is None else round(r.positive_number(raw, "device.memory_gib", "GiB") * 2**30)
    attention_flops = _read_flops(r, device)

    links = r.table(doc, "links", required=True)
    assert links is not None
    r.check_keys(links, LINKS_KEYS, "links")
    node_link = _read_link(r, links, "node")
    if nodes > 1 and "network" not in links:
        raise r.fail("links.network", f"missing required table: nodes = {nodes}, so groups of ranks "
                     f"cross nodes; add {_EXAMPLES['links.network']}")
    if nodes == 1 and "network" in links:
        raise r.fail("links.network", "given but nodes = 1, so no group of ranks crosses it; remove "
                     "[links.network] or set nodes to the number of nodes")
    network_link = _read_link(r, links, "network") if nodes > 1 else None

    return HardwareDescription(
        name=name, description=description, device=device_name, ranks_per_node=ranks_per_node,
        nodes=nodes, memory_bytes=memory_bytes, attention_flops=attention_flops, node_link=node_link,
        network_link=network_link, source=file,
    )


def _read_flops(r: _Reader, device: dict[str, Any]) -> dict[str, float]:
    """``device.attention_tflops`` as FLOP/s by dtype: bf16 required, fp16 defaults to it."""
    key = "device.attention_tflops"
    table = r.table(device, "attention_tflops", required=True, prefix="device")
    assert table is not None
    for dtype in table:
        if dtype not in DTYPES:
            raise r.fail(f"{key}.{dtype}", f"unknown dtype {_show(dtype)}{_suggest(dtype, DTYPES)}; "
                         f"give throughput for {', '.join(DTYPES)}{r.example(key)}")
    flops: dict[str, float] = {}
    for dtype in DTYPES:
        raw = r.value(table, dtype, key, required=dtype == "bf16")
        if raw is not None:
            flops[dtype] = r.positive_number(raw, f"{key}.{dtype}", "TFLOP/s") * 1e12
        elif dtype == "fp16":
            flops[dtype] = flops["bf16"]  # same tensor-core rate on every device shipped
    return flops


def _read_link(r: _Reader, links: dict[str, Any], tier: str) -> LinkTier:
    """``[links.<tier>]``, which must be there."""
    prefix = f"links.{tier}"
    table = r.table(links, tier, required=True, prefix="links")
    assert table is not None
    r.check_keys(table, LINK_KEYS, prefix)
    name = r.string(r.value(table, "name", prefix, required=True), f"{prefix}.name", non_empty=True)
    gbps = r.positive_number(
        r.value(table, "bandwidth_gbps", prefix, required=True), f"{prefix}.bandwidth_gbps", "GB/s"
    )
    micros = r.positive_number(
        r.value(table, "latency_us", prefix, required=True), f"{prefix}.latency_us", "microseconds"
    )
    return LinkTier(name=name, bandwidth=gbps * 1e9, latency=micros / 1e6)
