"""Hardware descriptions: the shipped files, ranks and links, fingerprints, the loader's refusals."""

import dataclasses
import functools
import re
import shutil
from importlib import resources

import pytest

from conftest import refusal_of, replaced_once, write_toml
from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.hardware import (
    Figure,
    HardwareDescription,
    HardwareDescriptionError,
    LinkTier,
    builtin_descriptions,
    load_description,
)
from cptune.workload import Workload

SHIPPED = {"a100-pcie-4": 4, "a100-sxm-8": 8, "a800-sxm-8": 8, "b200-hgx-8": 8, "b300-hgx-8": 8,
           "gb200-nvl72": 72, "gb200-nvl72-4x-ib": 288, "h100-sxm-2x8-ib": 16, "h100-sxm-8": 8, "h20-8": 8,
           "h200-sxm-2x8-ib": 16, "h200-sxm-8": 8, "h800-sxm-8": 8, "l20-pcie-8": 8, "l40s-pcie-8": 8,
           "mi300x-8": 8, "mi325x-8": 8, "rtx-pro-6000-pcie-8": 8}

BASE = """\
description = "test machine"
ranks_per_node = 4
nodes = 2

[device]
name = "Test GPU"
memory_gib = 16
matmul_tflops = { bf16 = 100, fp32 = 10 }
softmax_tops = 2
memory_gbps = 1000
launch_us = 5
overlap_slowdown = 0.1

[links.node]
name = "fast"
bandwidth_gbps = 200
latency_us = 10

[links.network]
name = "slow"
bandwidth_gbps = 25
latency_us = 30
"""


write = functools.partial(write_toml, name="machine.toml")
edited = functools.partial(replaced_once, BASE)
refusal = functools.partial(refusal_of, load_description, HardwareDescriptionError)


# --------------------------------------------------------------------------- shipped files


def test_shipped_descriptions_are_package_resources():
    folder = resources.files("cptune.hardware") / "descriptions"
    assert sorted(entry.name for entry in folder.iterdir()) == sorted(f"{n}.toml" for n in SHIPPED)
    assert list(builtin_descriptions()) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_description_loads(name):
    description = load_description(name)
    assert description.name == name
    assert description.max_ranks == SHIPPED[name]
    assert description.description and description.device
    assert description.memory_bytes is not None and description.memory_bytes >= 48 * 2**30
    assert description.matmul_flops("fp16") == description.matmul_flops("bf16")
    assert 5e13 <= description.matmul_flops("bf16") <= 5e15  # a TFLOP/s figure, scaled once
    assert description.matmul_flops("fp32") < description.matmul_flops("bf16")
    assert 1e12 < description.figure("device.softmax_tops") < 5e13
    assert 5e11 < description.figure("device.memory_gbps") < 1e13  # GB/s, scaled to bytes/s
    assert 1e-6 < description.figure("device.launch_us") < 1e-4
    assert 0 < description.figure("device.overlap_slowdown") < 1
    for tier in description.tiers:
        assert 1e9 < description.bandwidth(tier, "p2p") < 1e12
        assert 1e-6 < description.figure(f"{tier.key}.latency_us") < 1e-3  # microseconds, scaled
    assert (description.network_link is None) == (description.nodes == 1)
    # every shipped figure the prior uses comes with the range its source allows
    assert all(f.low <= f.value <= f.high for f in description.figures.values())
    assert description.figures["device.matmul_tflops.bf16"].uncertain
    assert description.describe().startswith(f"{SHIPPED[name]}x {description.device} ({name}), ")
    assert description.source == str(builtin_descriptions()[name])


def test_shipped_figures_are_read_in_their_units():
    h100 = load_description("h100-sxm-8")
    assert h100.memory_bytes == 80 * 2**30
    assert h100.figures["device.matmul_tflops.bf16"] == Figure(858e12, 815e12, 959e12)
    assert h100.matmul_flops("fp32") == 33e12
    assert h100.figure("links.node.bandwidth_gbps.default") == 360e9
    assert h100.figure("links.node.latency_us") == pytest.approx(12.5e-6)
    assert h100.node_link == LinkTier("NVLink 4 through NVSwitch", "links.node", ranks=8, has_uplink=False)
    assert h100.describe() == "8x NVIDIA H100 SXM5 80GB (h100-sxm-8), NVLink 4 through NVSwitch"
    cluster = load_description("h100-sxm-2x8-ib")
    assert cluster.network_link is not None
    assert cluster.figure("links.network.bandwidth_gbps.default") == 46e9
    assert cluster.figure("links.network.latency_us") == 46e-6
    # one NIC per GPU: the node's uplink defaults to 8 flows
    assert cluster.figure("links.network.uplink_gbps.default") == 8 * 46e9
    # the cluster's nodes are the single-node file's
    node_figures = {k: v for k, v in h100.figures.items()}
    assert all(cluster.figures[k] == v for k, v in node_figures.items())


@pytest.mark.parametrize(("cluster", "node"),
                         [("h100-sxm-2x8-ib", "h100-sxm-8"), ("h200-sxm-2x8-ib", "h200-sxm-8"),
                          ("gb200-nvl72-4x-ib", "gb200-nvl72")])
def test_a_cluster_s_nodes_are_its_single_node_description(cluster, node):
    single = load_description(node).figures
    assert all(load_description(cluster).figures[key] == figure for key, figure in single.items())

def test_pcie_servers_have_switch_and_socket_tiers():
    l20 = load_description("l20-pcie-8")
    assert [(d.name, d.ranks) for d in l20.domains] == [
        ("PCIe Gen4 switch", 2), ("CPU socket (root complex)", 4)]
    assert l20.between(0, 1) is l20.domains[0]
    assert l20.between(1, 2) is l20.domains[1]
    assert l20.between(3, 4) is l20.node_link
    switch, socket = l20.domains
    assert l20.bandwidth(switch, "all_to_all") > l20.bandwidth(l20.node_link, "all_to_all")


def test_a_per_kind_bandwidth_table_serves_every_other_kind_its_default():
    a100 = load_description("a100-pcie-4")  # all-to-all through the CPUs slower than send/recv
    link = a100.node_link
    assert a100.bandwidth(link, "all_to_all") < a100.bandwidth(link, "p2p")
    assert a100.bandwidth(link, "all_gather") == a100.bandwidth(link, "p2p")
    assert a100.bandwidth(link, "broadcast") == a100.bandwidth(link, "p2p")  # any new kind


@pytest.mark.parametrize("name", ["l20-pcie-8", "l40s-pcie-8", "a100-pcie-4", "rtx-pro-6000-pcie-8"])
def test_all_to_all_through_a_cpu_spans_both_of_nccls_paths(name):
    """Through a CPU, NCCL stages through host memory (all-to-all as fast as all-reduce, 18 GB/s
    busbw) or, 2.15-2.22 on AMD CPUs, goes peer to peer (all-to-all among more than two GPUs
    collapses to 2 GB/s): every PCIe description marks those tiers, its all-to-all figure there
    spans both, and a GPU pair (one flow each way, under a switch or one CPU) keeps one figure
    for every kind."""
    description = load_description(name)
    named = [tier for tier in description.tiers
             if tier.name.startswith(("CPU", "socket link")) and tier.ranks != 2]
    through_cpu = [tier for tier in description.tiers if tier.through_cpu]
    assert through_cpu and through_cpu == named
    assert description.path_figures == tuple(f"{tier.key}.bandwidth_gbps.all_to_all" for tier in through_cpu)
    for tier in through_cpu:
        figure = description.figures[f"{tier.key}.bandwidth_gbps.all_to_all"]
        assert figure.low <= 2e9 and figure.high >= 14e9
        assert figure.value < description.bandwidth(tier, "p2p")
    for tier in description.domains:
        if tier.ranks == 2:
            assert description.bandwidth(tier, "all_to_all") == description.bandwidth(tier, "p2p")


def test_nccls_path_settles_all_to_all_through_a_cpu_and_only_there():
    """Through host memory all-to-all takes the tier's send/recv figure, range and all; peer to
    peer it is closed at the collapsed end. Either path is a different machine (fingerprint,
    description line), settled once; an NVLink machine has no such tier and refuses it."""
    l20 = load_description("l20-pcie-8")
    shm, p2p = l20.with_nccl_path("shm"), l20.with_nccl_path("p2p")
    for key in l20.path_figures:
        assert shm.figures[key] == l20.figures[key.replace("all_to_all", "default")]
        assert p2p.figures[key] == Figure(2e9, 2e9, 2e9) == Figure(*(l20.figures[key].low,) * 3)
    unchanged = set(l20.figures) - set(l20.path_figures)
    assert all(shm.figures[k] == p2p.figures[k] == l20.figures[k] for k in unchanged)
    assert len({l20.fingerprint, shm.fingerprint, p2p.fingerprint}) == 3
    assert "NCCL goes through host memory (shm)" in shm.describe()
    assert "peer to peer through the CPU (p2p)" in p2p.describe() and "NCCL" not in l20.describe()
    assert shm.path_figures == () and shm.summary()["links"][1]["through_cpu"]
    with pytest.raises(ValueError, match="already settled"):
        shm.with_nccl_path("p2p")
    with pytest.raises(ValueError, match="one of shm or p2p"):
        l20.with_nccl_path("nvlink")
    with pytest.raises(ValueError, match="no GPUs of h100-sxm-8 reach each other only through a CPU"):
        load_description("h100-sxm-8").with_nccl_path("shm")


def test_a_tier_through_a_cpu_needs_its_own_all_to_all_figure(tmp_path):
    marked = edited('name = "fast"\n', 'name = "fast"\nthrough_cpu = true\n')
    message = refusal(write(tmp_path, marked))
    assert "links.node.through_cpu" in message and "all_to_all = { value = 6, low = 2, high = 18 }" in message
    given = marked.replace("bandwidth_gbps = 200", "bandwidth_gbps = { default = 200, all_to_all = 50 }")
    assert load_description(write(tmp_path, given)).path_figures == ("links.node.bandwidth_gbps.all_to_all",)
    message = refusal(write(tmp_path, given.replace("through_cpu = true", "through_cpu = 1")))
    assert "links.node.through_cpu" in message and "expected a boolean" in message
    network = given.replace('name = "slow"\n', 'name = "slow"\nthrough_cpu = true\n')
    assert "links.network" in refusal(write(tmp_path, network))


def test_fingerprints_differ_between_files_and_survive_a_copy(tmp_path):
    prints = {name: load_description(name).fingerprint for name in SHIPPED}
    assert len(set(prints.values())) == len(SHIPPED)
    for name, fingerprint in prints.items():
        assert fingerprint.startswith("described:") and len(fingerprint) == len("described:") + 12
        int(fingerprint.removeprefix("described:"), 16)
        copy = tmp_path / f"{name}.toml"
        shutil.copyfile(str(builtin_descriptions()[name]), copy)
        copied = load_description(copy)
        assert copied.source == str(copy) != load_description(name).source
        assert copied.fingerprint == fingerprint
        assert len({copied, load_description(name)}) == 2  # hashable; equal only with the same source


def test_fingerprint_changes_with_any_figure(tmp_path):
    base = load_description(write(tmp_path, BASE)).fingerprint
    changed = load_description(write(tmp_path, edited("latency_us = 30", "latency_us = 31"))).fingerprint
    assert changed != base


def test_link_is_the_node_tier_inside_a_node_and_the_network_across():
    cluster = load_description("h100-sxm-2x8-ib")
    assert cluster.link(range(8)) is cluster.node_link
    assert cluster.link([8, 15, 12]) is cluster.node_link  # all on node 1
    assert cluster.link([3]) is cluster.node_link
    assert cluster.network_link is not None
    assert cluster.link([7, 8]) is cluster.network_link
    assert cluster.link(range(16)) is cluster.network_link
    single = load_description("h100-sxm-8")
    assert single.link(range(8)) is single.node_link


def test_exchange_is_limited_by_the_share_crossing_a_shared_uplink(tmp_path):
    """Two ranks per switch behind one uplink: a Ring whose two streams leave the switch
    shares the uplink; one stream gets it alone."""
    domain = ('[[links.domains]]\nname = "switch"\nranks = 2\nbandwidth_gbps = 40\nlatency_us = 5\n'
              "uplink_gbps = 10\n")
    text = BASE.replace("[links.network]", domain + "[links.network]")
    machine = load_description(write(tmp_path, text))
    one_stream = machine.exchange("p2p", ((0, 2),))  # 0 -> 2 and 2 -> 0 leave their switches once each
    two_streams = machine.exchange("p2p", ((0, 2), (1, 3)))  # 0 -> 2 and 1 -> 3 share switch 0's uplink
    inside = machine.exchange("p2p", ((0, 1),))
    assert inside == pytest.approx((5e-6, 1 / 40e9))
    assert one_stream == pytest.approx((10e-6, 1 / 10e9))  # the node tier's 200 GB/s flow, a 10 GB/s uplink
    assert two_streams == pytest.approx((10e-6, 2 / 10e9))


@pytest.mark.parametrize("ranks", [[], [16], [-1], [0, True], [0.5]])
def test_link_refuses_ranks_the_machine_does_not_have(ranks):
    with pytest.raises(ValueError):
        load_description("h100-sxm-2x8-ib").link(ranks)


# --------------------------------------------------------------------------- loading


def test_full_file_is_read_with_every_unit(tmp_path):
    path = write(tmp_path, BASE)
    description = load_description(path)
    assert (description.name, description.description, description.device) == ("machine", "test machine",
                                                                                "Test GPU")
    assert (description.ranks_per_node, description.nodes, description.memory_bytes) == (4, 2, 16 * 2**30)
    assert {k: v.value for k, v in description.figures.items()} == pytest.approx({
        "device.matmul_tflops.bf16": 100e12, "device.matmul_tflops.fp32": 10e12, "device.softmax_tops": 2e12,
        "device.memory_gbps": 1000e9, "device.launch_us": 5e-6, "device.attention_call_us": 5e-6,
        "device.overlap_slowdown": 0.1, "links.node.bandwidth_gbps.default": 200e9,
        "links.node.latency_us": 10e-6,
        "links.network.bandwidth_gbps.default": 25e9, "links.network.latency_us": 30e-6,
        "links.network.uplink_gbps.default": 4 * 25e9,
    })
    assert description.matmul_flops("fp16") == 100e12
    assert description.node_link == LinkTier("fast", "links.node", 4, has_uplink=False)
    assert description.network_link == LinkTier("slow", "links.network", 8, has_uplink=True)
    assert description.max_ranks == 8


def test_a_range_is_read_in_the_figures_unit(tmp_path):
    text = edited("memory_gbps = 1000", "memory_gbps = { value = 1000, low = 900, high = 1100 }")
    description = load_description(write(tmp_path, text))
    assert description.figures["device.memory_gbps"] == Figure(1000e9, 900e9, 1100e9)
    assert description.with_figure("device.memory_gbps", 900e9).figure("device.memory_gbps") == 900e9
    assert description.with_figure("device.memory_gbps", 900e9).fingerprint != description.fingerprint


def test_minimal_file_gets_the_documented_defaults(tmp_path):
    text = (
        'ranks_per_node = 2\n[device]\nname = "g"\nmatmul_tflops = { bf16 = 1.5 }\nsoftmax_tops = 1\n'
        'memory_gbps = 100\nlaunch_us = 5\noverlap_slowdown = 0.1\n'
        '[links.node]\nname = "n"\nbandwidth_gbps = 1\nlatency_us = 2\n'
    )
    description = load_description(write(tmp_path, text))
    assert (description.nodes, description.description, description.memory_bytes) == (1, "", None)
    assert description.matmul_flops("bf16") == description.matmul_flops("fp16") == 1.5e12
    assert description.matmul_flops("fp32") is None  # no fp32 figure
    assert description.network_link is None and description.domains == ()


def test_a_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, BASE, name="h100-sxm-8")  # a file named like a shipped description
    assert load_description("h100-sxm-8").device == "Test GPU"


BAD = [
    # unknown and misspelt keys, with the allowed ones listed
    ("nodes = 2", "nodes = 2\nnode = 2", "node", ["unknown key", "did you mean 'nodes'", "ranks_per_node"]),
    ('name = "Test GPU"', 'name = "Test GPU"\nmemory_gb = 16', "device.memory_gb",
     ["unknown key", "did you mean 'memory_gib'", "name, memory_gib, matmul_tflops, softmax_tops"]),
    ("latency_us = 10", "latency_us = 10\nbandwith_gbps = 1", "links.node.bandwith_gbps",
     ["unknown key", "did you mean 'bandwidth_gbps'"]),
    ("[links.network]", "[links.netwrok]", "links.netwrok", ["unknown key", "did you mean 'network'"]),
    # wrong types, expected and given both named
    ("ranks_per_node = 4", 'ranks_per_node = "4"', "ranks_per_node",
     ["expected a positive integer", 'got a string ("4")']),
    ("nodes = 2", "nodes = 2.0", "nodes", ["expected a positive integer", "got a float"]),
    ("bandwidth_gbps = 200", 'bandwidth_gbps = "200"', "links.node.bandwidth_gbps",
     ["expected a positive number of GB/s", "got a string"]),
    ("latency_us = 30", "latency_us = true", "links.network.latency_us",
     ["expected a positive number of microseconds", "got a boolean"]),
    ('name = "Test GPU"', "name = 3", "device.name", ["expected a string", "got an integer"]),
    ("matmul_tflops = { bf16 = 100, fp32 = 10 }", "matmul_tflops = 100", "device.matmul_tflops",
     ["expected a table", "got an integer"]),
    ('[device]\nname = "Test GPU"\nmemory_gib = 16\nmatmul_tflops = { bf16 = 100, fp32 = 10 }\n'
     'softmax_tops = 2\nmemory_gbps = 1000\nlaunch_us = 5\noverlap_slowdown = 0.1\n',
     "device = 3\n", "device", ["expected a table ([device] section)", "got an integer (3)"]),
    # non-positive numbers
    ("ranks_per_node = 4", "ranks_per_node = 0", "ranks_per_node", ["out of range", "got 0"]),
    ("nodes = 2", "nodes = -1", "nodes", ["out of range", "got -1"]),
    ("bandwidth_gbps = 25", "bandwidth_gbps = 0", "links.network.bandwidth_gbps",
     ["out of range", "positive number of GB/s", "got 0"]),
    ("latency_us = 10", "latency_us = -2.5", "links.node.latency_us", ["out of range", "got -2.5"]),
    ("memory_gib = 16", "memory_gib = 0", "device.memory_gib", ["out of range", "GiB"]),
    ("bf16 = 100", "bf16 = -100", "device.matmul_tflops.bf16", ["out of range", "TFLOP/s"]),
    ("latency_us = 10", "latency_us = inf", "links.node.latency_us", ["out of range", "inf"]),
    ('name = "fast"', 'name = " "', "links.node.name", ["must not be empty"]),
    # dtypes: unknown, and bf16 required
    ("bf16 = 100", "bf16 = 100, bf61 = 3", "device.matmul_tflops.bf61",
     ["unknown dtype", "did you mean 'bf16'", "bf16, fp16, fp32"]),
    ("bf16 = 100", "fp8 = 100", "device.matmul_tflops.fp8", ["unknown dtype", "bf16, fp16, fp32"]),
    ("bf16 = 100, fp32 = 10", "fp16 = 100", "device.matmul_tflops.bf16",
     ["missing required key", "bf16 = 700"]),
    # the physics figures: required, positive, ranges that hold their value
    ("launch_us = 5\n", "", "device.launch_us", ["missing required key", "launch_us = { value = 10"]),
    ("softmax_tops = 2", "softmax_tops = 0", "device.softmax_tops", ["out of range", "exponentials"]),
    ("overlap_slowdown = 0.1", "overlap_slowdown = 1.5", "device.overlap_slowdown",
     ["out of range", "below 1"]),
    ("memory_gbps = 1000", "memory_gbps = { value = 1000, low = 1100, high = 1200 }", "device.memory_gbps",
     ["the range must hold the value", "low = 1100"]),
    ("memory_gbps = 1000", "memory_gbps = { value = 1000, low = 900 }", "device.memory_gbps.high",
     ["missing required key"]),
    ("memory_gbps = 1000", "memory_gbps = { value = 1000, low = 900, hi = 1 }", "device.memory_gbps.hi",
     ["unknown key", "value, low, high"]),
    ("bandwidth_gbps = 200", "bandwidth_gbps = { all_to_all = 50 }", "links.node.bandwidth_gbps.default",
     ["missing required key", "default"]),
    ("bandwidth_gbps = 200", "bandwidth_gbps = { default = 200, alltoall = 50 }",
     "links.node.bandwidth_gbps.alltoall",
     ["unknown key", "did you mean 'all_to_all'", "default, all_to_all, all_gather, p2p"]),
    ("bandwidth_gbps = 200", "bandwidth_gbps = { default = 200, all_to_all = -1 }",
     "links.node.bandwidth_gbps.all_to_all", ["out of range", "GB/s"]),
    # domains inside a node: sizes that nest and divide the node
    ("[links.network]", '[[links.domains]]\nname = "switch"\nranks = 3\nbandwidth_gbps = 20\nlatency_us = 5\n'
     "[links.network]", "links.domains[0].ranks", ["out of range", "divide it", "got 3"]),
    ("[links.network]", '[[links.domains]]\nname = "switch"\nranks = 2\nbandwidth_gbps = 20\nlatency_us = 5\n'
     'uplink_gbps = 20\nspeed = 1\n[links.network]', "links.domains[0].speed",
     ["unknown key", "uplink_gbps"]),
    ("[links.network]", '[[links.domains]]\nname = "switch"\nranks = 2\nlatency_us = 5\n[links.network]',
     "links.domains[0].bandwidth_gbps", ["missing required key"]),
    # missing required keys and tables, with an example to copy
    ("ranks_per_node = 4\n", "", "ranks_per_node", ["missing required key", "ranks_per_node = 8"]),
    ('name = "Test GPU"\n', "", "device.name", ["missing required key"]),
    ("latency_us = 10\n", "", "links.node.latency_us", ["missing required key", "latency_us = 12.5"]),
    ('[links.node]\nname = "fast"\nbandwidth_gbps = 200\nlatency_us = 10\n', "", "links.node",
     ["missing required table", "[links.node]"]),
    # the network tier: required for several nodes, refused for one
    ('[links.network]\nname = "slow"\nbandwidth_gbps = 25\nlatency_us = 30\n', "", "links.network",
     ["missing required table", "nodes = 2", "[links.network]"]),
    ("nodes = 2", "nodes = 1", "links.network", ["given but nodes = 1", "remove [links.network]"]),
]


@pytest.mark.parametrize("old, new, key, fragments", BAD, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD)])
def test_bad_description_is_refused_naming_file_key_and_problem(tmp_path, old, new, key, fragments):
    path = write(tmp_path, edited(old, new))
    message = refusal(path)
    assert message.startswith(f"{path}: {key}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_toml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, edited("nodes = 2", "nodes = "))
    message = refusal(path)
    assert message.startswith(f"{path}: line 3, column "), message
    assert "invalid TOML" in message


def test_unknown_name_lists_the_shipped_ones():
    message = refusal("h100-sxm8")
    assert message.startswith("h100-sxm8: (file): no such file and no shipped hardware description"), message
    assert "did you mean 'h100-sxm-8'" in message
    assert "path of a .toml file" in message
    assert all(name in message for name in SHIPPED)


def test_missing_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "nope.toml"
    message = refusal(path)
    assert message.startswith(f"{path}: (file): no such file"), message
    assert all(name in message for name in SHIPPED)


def test_error_is_a_cptune_error_and_a_value_error_with_its_parts(tmp_path):
    path = write(tmp_path, edited("nodes = 2", "nodes = 0"))
    with pytest.raises(HardwareDescriptionError) as raised:
        load_description(str(path))
    error = raised.value
    assert isinstance(error, CPTuneError) and isinstance(error, ValueError)
    assert (error.file, error.key) == (str(path), "nodes")
    assert str(error) == f"{error.file}: {error.key}: {error.reason}"


def test_direct_construction_checks_the_structure():
    good = load_description("h100-sxm-2x8-ib")
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good)}
    HardwareDescription(**fields)  # the baseline is accepted
    no_bf16 = {k: v for k, v in good.figures.items() if not k.endswith(".bf16")}
    no_latency = {k: v for k, v in good.figures.items() if k != "links.node.latency_us"}
    bad_fields = (
        dict(nodes=0), dict(ranks_per_node=True), dict(network_link=None), dict(nodes=1),
        dict(figures=no_bf16), dict(figures={**good.figures, "device.matmul_tflops.x": Figure(1, 1, 1)}),
        dict(figures=no_latency),
    )
    for bad in bad_fields:
        with pytest.raises(ValueError):
            HardwareDescription(**{**fields, **bad})


def _exchange_flow_by_flow(machine, kind: str, groups) -> tuple[float, float]:
    """The exchange as the description defines it, one flow at a time (what ``exchange``
    computes with numpy): each rank's flows add up on its link, each domain's leaving flows
    on its uplink; the slowest limits."""
    order = machine.tiers
    flows = []
    for group in groups:
        for i, src in enumerate(group):
            if len(group) < 2:
                continue
            if kind == "all_to_all":
                flows += [(src, dst, 1 / (len(group) - 1)) for dst in group if dst != src]
            else:
                flows.append((src, group[(i + 1) % len(group)], 1.0))
    if not flows:
        return 0.0, 0.0
    per_rank, per_domain = {}, {}
    for src, dst, share in flows:
        tier = machine.between(src, dst)
        per_rank[src] = per_rank.get(src, 0.0) + share / machine.bandwidth(tier, kind)
        for index, level in enumerate(order):
            network = level is machine.network_link
            crossed = order.index(tier)
            if level.has_uplink and (crossed >= index if network else crossed > index):
                size = machine.ranks_per_node if network else level.ranks
                key = (index, src // size)
                per_domain[key] = per_domain.get(key, 0.0) + share / machine.uplink(level, kind)
    outermost = max((machine.between(s, d) for s, d, _ in flows), key=order.index)
    return machine.figure(f"{outermost.key}.latency_us"), max([*per_rank.values(), *per_domain.values()])


@pytest.mark.parametrize("name", ["l20-pcie-8", "h100-sxm-2x8-ib", "a100-sxm-8"])
def test_exchange_equals_the_flow_by_flow_definition(name):
    """Every configuration's groups on 1..all ranks, each collective kind: the vectorized
    exchange is the per-flow definition (to rounding)."""
    from cptune import CPConfig
    from cptune.layout import rank_groups

    machine = load_description(name)
    for ranks in range(2, machine.max_ranks + 1):
        for u in [d for d in range(1, ranks + 1) if ranks % d == 0]:
            config = CPConfig("ring", ranks, u) if u < ranks else CPConfig("ulysses", ranks)
            heads, context = rank_groups(config)
            for kind, groups in (("all_to_all", heads), ("all_gather", context), ("p2p", context)):
                expected = _exchange_flow_by_flow(machine, kind, groups)
                assert machine.exchange(kind, groups) == pytest.approx(expected, rel=1e-12), (ranks, u, kind)
    with pytest.raises(ValueError, match="rank must be an integer"):
        machine.exchange("p2p", ((0, machine.max_ranks),))


#: Clusters of the shipped nodes: PCIe switches and sockets, NVSwitch nodes, 4-GPU nodes; the
#: network's uplink below its flows' sum where the file gives none, so the uplink binds.
CLUSTERS = [("l20-pcie-8", 6), ("h100-sxm-2x8-ib", 7), ("a100-pcie-4", 13)]
NETWORK = '\n[links.network]\nname = "InfiniBand"\nbandwidth_gbps = 40\nlatency_us = 40\nuplink_gbps = 120\n'


def _cluster(tmp_path, base: str, nodes: int):
    text = builtin_descriptions()[base].read_text()
    if "\nnodes = 1\n" in text:
        text = text.replace("\nnodes = 1\n", f"\nnodes = {nodes}\n") + NETWORK
    else:
        text = replaced_once(text, "\nnodes = 2\n", f"\nnodes = {nodes}\n")
    return load_description(write(tmp_path, text))


@pytest.mark.parametrize(("base", "nodes"), CLUSTERS)
def test_groups_by_rule_move_what_every_listed_flow_moves(tmp_path, base, nodes):
    """The fast path (a configuration's groups as a rule: a window of their flows, and
    configurations whose windows match sharing one answer) equals the reference path (every
    group listed, every flow) for every configuration of a multi-node cluster, each kind."""
    from cptune.layout import RankGroups

    machine = _cluster(tmp_path, base, nodes)
    for ranks in range(2, machine.max_ranks + 1):
        for u in [d for d in range(1, ranks + 1) if ranks % d == 0]:
            for along in ("heads", "context"):
                groups = RankGroups(along, ranks, u)
                for kind in ("all_to_all", "all_gather", "p2p", "broadcast"):
                    expected = machine.exchange(kind, tuple(groups))
                    assert machine.exchange(kind, groups) == pytest.approx(expected, rel=1e-12), \
                        (ranks, u, along, kind)


def test_groups_by_rule_on_a_thousand_ranks_move_what_their_flows_move(tmp_path):
    from cptune.layout import RankGroups

    machine = _cluster(tmp_path, "l20-pcie-8", 128)
    for ranks, u in [(1024, 1), (1024, 8), (1008, 24), (1000, 5), (776, 8), (990, 3), (1024, 64), (96, 32)]:
        for along, kind in (("heads", "all_to_all"), ("context", "all_gather"), ("context", "p2p")):
            groups = RankGroups(along, ranks, u)
            assert machine.exchange(kind, groups) == pytest.approx(
                _exchange_flow_by_flow(machine, kind, groups), rel=1e-12), (ranks, u, kind)
    with pytest.raises(ValueError, match="rank must be an integer"):
        machine.exchange("p2p", RankGroups("context", 2048, 2))


def test_cptune_hardware_lists_every_shipped_description_with_its_gpu_ranks_and_links(cptune_here):
    """Issue 33: the shipped descriptions were listed nowhere but prose and --help."""
    import json

    listed = cptune_here("hardware", "--json")
    assert listed.returncode == 0, listed.stderr
    data = {d["name"]: d for d in json.loads(listed.stdout)}
    assert list(data) == list(SHIPPED)
    for name, ranks in SHIPPED.items():
        machine = load_description(name)
        assert data[name]["ranks"] == ranks and data[name]["gpu"] == machine.device
        assert data[name]["ranks_per_node"] == machine.ranks_per_node
        assert [link["key"] for link in data[name]["links"]] == [tier.key for tier in machine.tiers]
    two_nodes = data["h100-sxm-2x8-ib"]["links"]
    assert [link["tier"] for link in two_nodes] == ["node", "network"]
    assert two_nodes[0]["bandwidth_gbps"]["default"]["value"] == pytest.approx(360)
    assert two_nodes[1]["bandwidth_gbps"]["default"] == pytest.approx({"value": 46, "low": 40, "high": 48})
    socket = data["l20-pcie-8"]["links"][1]
    assert socket["tier"] == "domain" and socket["ranks"] == 4 and "default" in socket["bandwidth_gbps"]
    assert "all_to_all" in data["a100-pcie-4"]["links"][-1]["bandwidth_gbps"]  # a per-kind table
    text = " ".join(cptune_here("hardware").stdout.split())
    for name, summary in data.items():
        assert name in text and summary["gpu"] in text
    assert "InfiniBand NDR 400 Gb/s" in text and "46 GB/s (40-48)" in text and "360 GB/s (290-370)" in text
    assert socket["through_cpu"] and not data["l20-pcie-8"]["links"][0]["through_cpu"]
    assert text.count("through a CPU: all-to-all by NCCL's path (--nccl-path)") == 7  # L20, L40S, RTX PRO: 2
    mesh = data["mi300x-8"]["links"][0]
    assert mesh["mesh"] and mesh["aggregate_gbps"]["default"]["value"] == pytest.approx(318)
    assert "a link per pair of GPUs, 46.5 GB/s (40-48) each; all links at once 318 GB/s (280-336)" in text
    assert not any(link["mesh"] for name, summary in data.items() if not name.startswith("mi3")
                   for link in summary["links"])


@pytest.mark.parametrize("name", sorted(builtin_descriptions()))
def test_every_shipped_figure_has_its_source_written_above_it(name):
    """Issue 32: every figure cites where it comes from. In the files, each figure line is directly
    below a comment (its source, its arithmetic, or "Assumption")."""
    text = (resources.files("cptune.hardware") / "descriptions" / f"{name}.toml").read_text()
    lines = text.splitlines()
    figure = re.compile(r"^(memory_gib|matmul_tflops|softmax_tops|memory_gbps|launch_us|attention_call_us"
                        r"|overlap_slowdown|backward_speed|bandwidth_gbps|latency_us|uplink_gbps|aggregate_gbps)\s*=")
    uncited = [line for above, line in zip(lines, lines[1:], strict=False)
               if figure.match(line) and not above.startswith("#")]
    assert uncited == []


# --------------------------------------------------------------------------- a mesh: a link per pair of GPUs

MESH = BASE.replace('name = "fast"\nbandwidth_gbps = 200\n',
                    'name = "Infinity Fabric mesh"\nmesh = true\nbandwidth_gbps = 48\naggregate_gbps = 318\n')


@pytest.mark.parametrize(("along", "ranks", "head_group", "links"), [
    ("heads", 4, 4, 3), ("heads", 4, 2, 1), ("context", 4, 1, 3), ("context", 4, 2, 1)])
def test_a_mesh_moves_a_pair_over_its_link_and_a_collective_over_as_many_as_it_has_peers(
        tmp_path, along, ranks, head_group, links):
    """Issue 57: on a mesh (MI300X: eight GPUs, a link per pair, no switch) a send/recv reaches one
    link's bandwidth however many ranks run, while an all-to-all, and RCCL's ring all-gather and
    reduce-scatter laid over every link, reach one link per peer in the node - up to what a rank
    sends over all its links. A switched node gives every collective its one bandwidth."""
    from cptune.layout import RankGroups

    mesh = load_description(write(tmp_path, MESH.replace("ranks_per_node = 4", "ranks_per_node = 8")))
    switched = load_description(write(tmp_path, BASE, name="switched.toml"))
    assert mesh.node_link.mesh and not switched.node_link.mesh
    groups = RankGroups(along, ranks, head_group)
    assert mesh.exchange("p2p", groups) == pytest.approx((10e-6, 1 / 48e9))
    for kind in ("all_to_all", "all_gather", "reduce_scatter"):
        assert mesh.exchange(kind, groups) == pytest.approx((10e-6, 1 / (links * 48e9)))
        assert switched.exchange(kind, groups) == pytest.approx((10e-6, 1 / 200e9))
    everyone = RankGroups("heads", 8, 8)
    assert mesh.exchange("all_to_all", everyone)[1] == pytest.approx(1 / 318e9)  # 7 links would be 336
    assert mesh.exchange("all_gather", RankGroups("context", 8, 1))[1] == pytest.approx(1 / 318e9)


def test_mesh_clusters_groups_by_rule_move_what_their_listed_flows_move(tmp_path):
    """Across nodes of meshes each configuration's groups given by rule price as the same groups
    listed, every collective kind (the nodes' flows inside a mesh, the network's between)."""
    from cptune.layout import RankGroups

    machine = load_description(write(tmp_path, MESH.replace("nodes = 2", "nodes = 3")))
    for ranks in range(2, machine.max_ranks + 1):
        for u in [d for d in range(1, ranks + 1) if ranks % d == 0]:
            for along in ("heads", "context"):
                groups = RankGroups(along, ranks, u)
                for kind in ("all_to_all", "all_gather", "p2p", "reduce_scatter"):
                    assert machine.exchange(kind, groups) == pytest.approx(
                        machine.exchange(kind, tuple(groups)), rel=1e-12), (ranks, u, along, kind)


@pytest.mark.parametrize(("old", "new", "key", "fragment"), [
    ("aggregate_gbps = 318\n", "", "links.node.aggregate_gbps", "missing required key"),
    ("mesh = true\n", "", "links.node.aggregate_gbps", "given but the node is no mesh"),
    ("mesh = true\n", "mesh = true\nthrough_cpu = true\n", "links.node.mesh", "not through a CPU"),
    ("mesh = true\n", "mesh = 1\n", "links.node.mesh", "expected a boolean"),
    ("[links.network]", '[[links.domains]]\nname = "switch"\nranks = 2\nbandwidth_gbps = 20\nlatency_us = 5\n'
     "[links.network]", "links.node.mesh", "remove [[links.domains]] or mesh"),
])
def test_a_mesh_is_refused_without_its_aggregate_or_beside_switches(tmp_path, old, new, key, fragment):
    path = write(tmp_path, replaced_once(MESH, old, new))
    message = refusal(path)
    assert message.startswith(f"{path}: {key}: ") and fragment in message, message


def test_a_switched_description_keeps_its_fingerprint_beside_the_mesh_field():
    """A mesh is a new kind of node; a description without one hashes as it did before (so plans
    and results named by it keep naming it)."""
    assert load_description("h100-sxm-2x8-ib").fingerprint == "described:ad70c2ceb93d"  # as before meshes


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_description_predicts_a_training_step(name):
    """Issue 57: a100-sxm-8 and five others gave no backward speed, so recommend refused every
    training layer on them. Each now gives one, with the range its source allows."""
    from cptune.model import DescribedProfile, prior_time
    from cptune.model._profiles import check_predicts

    description = load_description(name)
    speed = description.figures["device.backward_speed"]
    assert 0.5 <= speed.low <= speed.value <= speed.high <= 1.0 and speed.uncertain
    profile = DescribedProfile(description)
    training = Workload(seq_len=8192, heads=32, kv_heads=8, head_dim=128, causal=True, mode="train")
    check_predicts(training, profile)
    step = prior_time(training, CPConfig("ring", 2), profile).total_s
    assert step > prior_time(training.in_mode("forward"), CPConfig("ring", 2), profile).total_s * 2
