"""Reading hardware description files: the TOML format's keys, their checks and the shipped
descriptions. Each problem is one ``HardwareDescriptionError`` naming the file, the key and the
fix (the format itself is ``cptune.hardware._description``'s docstring)."""

from __future__ import annotations

import stat
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from cptune._files import FileRefused, existing_kind
from cptune._toml import TableReader, TomlFileError, read_toml, show, suggest
from cptune.cost import COLLECTIVES
from cptune.hardware._description import (
    DEFAULT_KIND,
    DTYPES,
    Figure,
    HardwareDescription,
    LinkTier,
    _size_problem,
    _unit,
    figure_range_problem,
)

#: Allowed keys of each table, in the order the file format documents them.
TOP_KEYS = ("description", "ranks_per_node", "nodes", "device", "links")
DEVICE_KEYS = ("name", "memory_gib", "matmul_tflops", "softmax_tops", "memory_gbps", "launch_us",
               "attention_call_us", "overlap_slowdown", "backward_speed")
LINKS_KEYS = ("node", "domains", "network")
LINK_KEYS = ("name", "bandwidth_gbps", "latency_us", "through_cpu", "mesh", "aggregate_gbps")
DOMAIN_KEYS = ("name", "ranks", "bandwidth_gbps", "latency_us", "uplink_gbps", "through_cpu")
NETWORK_KEYS = ("name", "bandwidth_gbps", "latency_us", "uplink_gbps")
FIGURE_KEYS = ("value", "low", "high")
_NODE_EXAMPLE = (
    '[links.node] with name = "NVLink 4 through NVSwitch", bandwidth_gbps = 360 and latency_us = 12.5'
)
_DOMAIN_EXAMPLE = ('[[links.domains]] with name = "PCIe switch", ranks = 2, bandwidth_gbps = 22, '
                   "latency_us = 20 and uplink_gbps = 22")
#: A line the user can copy for each key, shown when the key is missing or mistyped.
_EXAMPLES = {
    "description": 'description = "8x H100 SXM5 80GB in one node"',
    "ranks_per_node": "ranks_per_node = 8",
    "nodes": "nodes = 1",
    "device": '[device] with name = "NVIDIA H100 SXM5 80GB" and matmul_tflops = { bf16 = 700 }',
    "device.name": 'name = "NVIDIA H100 SXM5 80GB"',
    "device.memory_gib": "memory_gib = 80",
    "device.matmul_tflops": "matmul_tflops = { bf16 = { value = 700, low = 620, high = 760 } }",
    "device.matmul_tflops.bf16": "bf16 = 700",
    "device.matmul_tflops.fp16": "fp16 = 700",
    "device.matmul_tflops.fp32": "fp32 = 33",
    "device.softmax_tops": "softmax_tops = { value = 3.9, low = 2.0, high = 3.9 }",
    "device.memory_gbps": "memory_gbps = { value = 2900, low = 2600, high = 3100 }",
    "device.launch_us": "launch_us = { value = 10, low = 5, high = 20 }",
    "device.attention_call_us": "attention_call_us = { value = 27, low = 20, high = 35 }",
    "device.overlap_slowdown": "overlap_slowdown = { value = 0.1, low = 0.05, high = 0.3 }",
    "device.backward_speed": "backward_speed = { value = 0.85, low = 0.75, high = 0.95 }",
    "links": _NODE_EXAMPLE,
    "links.node": _NODE_EXAMPLE,
    "links.domains": _DOMAIN_EXAMPLE,
    "links.network": '[links.network] with name = "InfiniBand NDR 400 Gb/s", bandwidth_gbps = 46 and '
                     "latency_us = 46",
    "links.node.name": 'name = "NVLink 4 through NVSwitch"',
    "links.node.bandwidth_gbps": "bandwidth_gbps = 360",
    "links.node.latency_us": "latency_us = 12.5",
    "links.domains.name": 'name = "PCIe switch"',
    "links.domains.ranks": "ranks = 2",
    "links.domains.bandwidth_gbps": "bandwidth_gbps = { default = 22, all_to_all = 10 }",
    "links.domains.latency_us": "latency_us = 20",
    "links.domains.uplink_gbps": "uplink_gbps = 22",
    "links.domains.through_cpu": "through_cpu = true",
    "links.node.through_cpu": "through_cpu = true",
    "links.node.mesh": "mesh = true",
    "links.node.aggregate_gbps": "aggregate_gbps = { value = 318, low = 280, high = 336 }",
    "links.network.name": 'name = "InfiniBand NDR 400 Gb/s, one NIC per GPU"',
    "links.network.bandwidth_gbps": "bandwidth_gbps = 46",
    "links.network.latency_us": "latency_us = 46",
    "links.network.uplink_gbps": "uplink_gbps = 368",
}


class HardwareDescriptionError(TomlFileError):
    """A hardware description that cannot be used. The message reads
    ``"{file}: {key}: {reason}"``: the file (or name) as given, the dotted TOML key (or where
    in the file, for a syntax error) and what is wrong with what to do about it."""




def builtin_descriptions() -> dict[str, Traversable]:
    """The descriptions shipped in ``cptune/hardware/descriptions``, by file stem."""
    folder = resources.files("cptune.hardware") / "descriptions"
    found = {
        entry.name.removesuffix(".toml"): entry
        for entry in folder.iterdir()
        if entry.name.endswith(".toml") and entry.is_file()
    }
    return dict(sorted(found.items()))


def shipped_descriptions() -> list[HardwareDescription]:
    """Every description shipped with cptune, loaded, by name (what ``cptune hardware`` lists)."""
    return [load_description(name) for name in builtin_descriptions()]


def load_description(name_or_path: str | Path) -> HardwareDescription:
    """A shipped description by name (e.g. "h100-sxm-8") or any description file by path.
    An existing file wins over a shipped name. Raises HardwareDescriptionError naming the
    file, the key and the fix for the first problem found."""
    as_path = Path(name_or_path)
    try:  # anything there but a folder is read, and a device or FIFO refused in one line
        if (mode := existing_kind(as_path)) is not None and not stat.S_ISDIR(mode):
            return _load(str(name_or_path), as_path.stem)
    except FileRefused as refused:
        raise HardwareDescriptionError(str(name_or_path), "(file)", refused.reason) from None
    builtins = builtin_descriptions()
    if str(name_or_path) in builtins:
        # The package is a plain directory in both editable and regular installs.
        return _load(str(builtins[str(name_or_path)]), str(name_or_path))
    raise HardwareDescriptionError(str(name_or_path), "(file)", _not_found(str(name_or_path), builtins))


def _not_found(name: str, builtins: dict[str, Traversable]) -> str:
    return (
        f"no such file and no shipped hardware description of that name{suggest(name, list(builtins))}; "
        f"give the path of a .toml file or one of the shipped descriptions: {', '.join(builtins)}"
    )


def _load(file: str, name: str) -> HardwareDescription:
    doc = read_toml(file, HardwareDescriptionError, lambda: _not_found(file, builtin_descriptions()))
    r = TableReader(file, error=HardwareDescriptionError, examples=_EXAMPLES)
    figures: dict[str, Figure] = {}

    r.check_keys(doc, TOP_KEYS, "")
    raw = r.value(doc, "description", "", required=False)
    description = "" if raw is None else r.string(raw, "description", non_empty=False)
    ranks_per_node = r.integer(r.value(doc, "ranks_per_node", "", required=True), "ranks_per_node", 1)
    raw = r.value(doc, "nodes", "", required=False)
    nodes = 1 if raw is None else r.integer(raw, "nodes", 1)
    if reason := _size_problem(ranks_per_node, nodes):
        raise r.fail(*reason)

    device = r.table(doc, "device", required=True)
    assert device is not None
    r.check_keys(device, DEVICE_KEYS, "device")
    device_name = r.string(r.value(device, "name", "device", required=True), "device.name", non_empty=True)
    raw = r.value(device, "memory_gib", "device", required=False)
    memory_bytes = None if raw is None else round(
        _in_range(r, r.positive_number(raw, "device.memory_gib", "GiB"), "device.memory_gib") * 2**30)
    _read_matmul(r, device, figures)
    for key in ("softmax_tops", "memory_gbps", "launch_us", "overlap_slowdown"):
        figures[f"device.{key}"] = _figure(r, r.value(device, key, "device", required=True), f"device.{key}")
    raw = r.value(device, "attention_call_us", "device", required=False)
    # an attention call is at least one launched kernel
    figures["device.attention_call_us"] = (figures["device.launch_us"] if raw is None
                                           else _figure(r, raw, "device.attention_call_us"))
    raw = r.value(device, "backward_speed", "device", required=False)
    if raw is not None:  # without it the description predicts no training step
        figures["device.backward_speed"] = _figure(r, raw, "device.backward_speed")
    if figures["device.overlap_slowdown"].high >= 1:
        raise r.fail("device.overlap_slowdown", "out of range: a share of compute speed must be below 1"
                     f"{r.example('device.overlap_slowdown')}")

    links = r.table(doc, "links", required=True)
    assert links is not None
    r.check_keys(links, LINKS_KEYS, "links")
    domains = _read_domains(r, links, ranks_per_node, figures)
    node_link = _read_tier(r, links, "node", ranks_per_node, figures, LINK_KEYS)
    if node_link.mesh and domains:
        raise r.fail("links.node.mesh", "a mesh joins every pair of the node's ranks by a link of its "
                     "own, so no switch or socket groups them: remove [[links.domains]] or mesh")
    if nodes > 1 and "network" not in links:
        raise r.fail("links.network", f"missing required table: nodes = {nodes}, so groups of ranks "
                     f"cross nodes; add {_EXAMPLES['links.network']}")
    if nodes == 1 and "network" in links:
        raise r.fail("links.network", "given but nodes = 1, so no group of ranks crosses it; remove "
                     "[links.network] or set nodes to the number of nodes")
    network_link = None
    if nodes > 1:
        network_link = _read_tier(r, links, "network", ranks_per_node * nodes, figures, NETWORK_KEYS,
                                  ranks_per_node)

    return HardwareDescription(
        name=name, description=description, device=device_name, ranks_per_node=ranks_per_node,
        nodes=nodes, memory_bytes=memory_bytes, domains=domains, node_link=node_link,
        network_link=network_link, figures=figures, source=file,
    )


def _figure(r: TableReader, raw: object, key: str) -> Figure:
    """A figure: a positive number, or a table ``{ value, low, high }`` with low <= value <= high."""
    unit, scale = _unit(key)
    if not isinstance(raw, dict):
        value = _in_range(r, r.positive_number(raw, key, unit), key) * scale
        return Figure(value, value, value)
    r.check_keys(raw, FIGURE_KEYS, key)
    value, low, high = (
        _in_range(r, r.positive_number(r.value(raw, part, key, required=True), f"{key}.{part}", unit),
                  f"{key}.{part}") * scale
        for part in FIGURE_KEYS
    )
    if not low <= value <= high:
        raise r.fail(key, f"the range must hold the value: expected low <= value <= high, got low = "
                     f"{show(low / scale)}, value = {show(value / scale)}, high = {show(high / scale)}")
    return Figure(value, low, high)


def _in_range(r: TableReader, value: float, key: str) -> float:
    """``value`` (in the file's units) of figure ``key``, refused outside the figure's range."""
    if problem := figure_range_problem(key, value):
        raise r.fail(key, f"{problem}{r.example(key)}")
    return value


def _read_matmul(r: TableReader, device: dict[str, Any], figures: dict[str, Figure]) -> None:
    """``device.matmul_tflops`` by dtype: bf16 required, fp16 defaults to it."""
    key = "device.matmul_tflops"
    table = r.table(device, "matmul_tflops", required=True, prefix="device")
    assert table is not None
    for dtype in table:
        if dtype not in DTYPES:
            raise r.fail(f"{key}.{dtype}", f"unknown dtype {show(dtype)}{suggest(dtype, DTYPES)}; "
                         f"give throughput for {', '.join(DTYPES)}{r.example(key)}")
    for dtype in DTYPES:
        raw = r.value(table, dtype, key, required=dtype == "bf16")
        if raw is not None:
            figures[f"{key}.{dtype}"] = _figure(r, raw, f"{key}.{dtype}")


def _read_by_kind(r: TableReader, raw: object, key: str, figures: dict[str, Figure]) -> None:
    """A bandwidth: one figure for every collective kind, or a table by kind with a default."""
    if isinstance(raw, dict) and not set(raw) <= set(FIGURE_KEYS):
        r.check_keys(raw, (DEFAULT_KIND, *COLLECTIVES), key)
        if DEFAULT_KIND not in raw:
            raise r.fail(f"{key}.{DEFAULT_KIND}", "missing required key: a table by collective kind needs "
                         f"a default for the kinds it does not list{r.example(key)}")
        for kind, figure in raw.items():
            figures[f"{key}.{kind}"] = _figure(r, figure, f"{key}.{kind}")
        return
    figures[f"{key}.{DEFAULT_KIND}"] = _figure(r, raw, key)


def _read_tier(r: TableReader, table_of: dict[str, Any], tier: str, ranks: int, figures: dict[str, Figure],
               allowed: tuple[str, ...], ranks_per_node: int = 0, prefix: str | None = None) -> LinkTier:
    """One tier's table: name, bandwidth (by kind), latency and, where allowed, the uplink
    (the network's defaults to ``ranks_per_node`` flows: one NIC per rank)."""
    prefix = prefix or f"links.{tier}"
    table = table_of if tier == "" else r.table(table_of, tier, required=True, prefix="links")
    assert table is not None
    r.check_keys(table, allowed, prefix)
    name = r.string(r.value(table, "name", prefix, required=True), f"{prefix}.name", non_empty=True)
    _read_by_kind(r, r.value(table, "bandwidth_gbps", prefix, required=True), f"{prefix}.bandwidth_gbps",
                  figures)
    figures[f"{prefix}.latency_us"] = _figure(r, r.value(table, "latency_us", prefix, required=True),
                                              f"{prefix}.latency_us")
    raw = r.value(table, "uplink_gbps", prefix, required=False) if "uplink_gbps" in allowed else None
    if raw is not None:
        _read_by_kind(r, raw, f"{prefix}.uplink_gbps", figures)
    elif tier == "network":  # one NIC per rank, none shared: the node sends ranks_per_node flows
        for key in [k for k in figures if k.startswith(f"{prefix}.bandwidth_gbps.")]:
            flow = figures[key]
            figures[key.replace("bandwidth_gbps", "uplink_gbps")] = Figure(
                *(ranks_per_node * x for x in (flow.value, flow.low, flow.high)))
    has_uplink = f"{prefix}.uplink_gbps.{DEFAULT_KIND}" in figures
    raw = r.value(table, "through_cpu", prefix, required=False) if "through_cpu" in allowed else None
    through_cpu = raw is not None and r.boolean(raw, f"{prefix}.through_cpu")
    mesh = _read_mesh(r, table, prefix, figures) if "mesh" in allowed else False
    if mesh and through_cpu:
        raise r.fail(f"{prefix}.mesh", "a mesh's GPUs reach each other over their own links, not through a "
                     "CPU: remove through_cpu or mesh")
    if through_cpu and f"{prefix}.bandwidth_gbps.all_to_all" not in figures:
        raise r.fail(f"{prefix}.through_cpu", "all-to-all through a CPU runs as fast as the other "
                     "collectives or collapses, by the path NCCL takes: give it its own figure spanning "
                     "both, e.g. bandwidth_gbps = { default = 11, all_to_all = "
                     "{ value = 6, low = 2, high = 18 } }")
    return LinkTier(name=name, key=prefix, ranks=ranks, has_uplink=has_uplink, through_cpu=through_cpu,
                    mesh=mesh)


def _read_mesh(r: TableReader, table: dict[str, Any], prefix: str, figures: dict[str, Figure]) -> bool:
    """Whether the tier is a mesh (every pair of ranks on a link of its own), and its
    ``aggregate_gbps``, which a mesh needs and nothing else takes."""
    raw = r.value(table, "mesh", prefix, required=False)
    mesh = raw is not None and r.boolean(raw, f"{prefix}.mesh")
    raw = r.value(table, "aggregate_gbps", prefix, required=False)
    if mesh and raw is None:
        raise r.fail(f"{prefix}.aggregate_gbps", "missing required key: on a mesh bandwidth_gbps is one "
                     "pair's link, and everything one rank sends over all its links at once needs its own "
                     f"figure{r.example(f'{prefix}.aggregate_gbps')}")
    if raw is not None and not mesh:
        raise r.fail(f"{prefix}.aggregate_gbps", "given but the node is no mesh: it is what one rank "
                     "sends over all its own links; add mesh = true, or remove aggregate_gbps")
    if raw is not None:
        _read_by_kind(r, raw, f"{prefix}.aggregate_gbps", figures)
    return mesh


def _read_domains(r: TableReader, links: dict[str, Any], ranks_per_node: int,
                  figures: dict[str, Figure]) -> tuple[LinkTier, ...]:
    """``[[links.domains]]``, innermost first: sizes that divide each other and the node."""
    raw = r.value(links, "domains", "links", required=False)
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
        raise r.fail("links.domains",
                     f"expected an array of tables ([[links.domains]] sections){r.example('links.domains')}")
    domains: list[LinkTier] = []
    for i, table in enumerate(raw):
        prefix = f"links.domains[{i}]"
        size = r.integer(r.value(table, "ranks", prefix, required=True), f"{prefix}.ranks", 2)
        inner = domains[-1].ranks if domains else 1
        if size <= inner or size >= ranks_per_node or size % inner or ranks_per_node % size:
            raise r.fail(f"{prefix}.ranks", f"out of range: domains go innermost first and each size must be "
                         f"a multiple of the one before ({inner}), below ranks_per_node ({ranks_per_node}) "
                         f"and "
                         f"divide it, got {size}")
        domains.append(_read_tier(r, table, "", size, figures, DOMAIN_KEYS, prefix=prefix))
    return tuple(domains)
