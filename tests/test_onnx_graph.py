"""Each rank's ONNX graph: valid ONNX, shapes inferred end to end, DistCollective nodes as
TensorRT 11's parser takes them, the same collectives in the same order on every member of
a group, and the traffic ``analytic_cost(..., engine="onnx")`` counts. No ranks run here
(tests/test_onnx_engine.py runs the graphs)."""

from collections import defaultdict

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, helper

from cptune import CPConfig, Workload, analytic_cost
from cptune.engines import ENGINES
from cptune.engines.onnx import (
    OP_TYPE,
    collective_attributes,
    dist_collective,
    io_shapes,
    rank_graph,
    rank_graphs,
    rank_inputs,
)
from cptune.engines.onnx._builder import ELEMENT_TYPES, OPSET
from cptune.engines.onnx._dialect import DOMAIN
from cptune.feasibility import enumerate_configs, kv_replication
from cptune.layout import SequenceLayout

#: TensorRT 11's rules for a DistCollective node (../shared/notes/tensorrt-11.md, "The ONNX
#: route", and the DistCollective operator page): per operation, whether it reduces (then
#: reduce_op is a reduction, else "none"), whether it has a root (then a rank of the group,
#: else -1), and how it changes dim 0 (x nb_rank, / nb_rank, or kept).
TRT_RULES = {
    "all_gather": {"reduces": False, "rooted": False, "dim0": "multiply"},
    "all_reduce": {"reduces": True, "rooted": False, "dim0": "keep"},
    "broadcast": {"reduces": False, "rooted": True, "dim0": "keep"},
    "reduce": {"reduces": True, "rooted": True, "dim0": "keep"},
    "reduce_scatter": {"reduces": True, "rooted": False, "dim0": "divide"},
    "all_to_all": {"reduces": False, "rooted": False, "dim0": "keep_divisible"},
    "gather": {"reduces": False, "rooted": True, "dim0": "multiply"},
    "scatter": {"reduces": False, "rooted": True, "dim0": "divide"},
}
REDUCTIONS = {"sum", "prod", "max", "min", "avg"}
ATTRIBUTE_TYPES = {
    "collective_operation": AttributeProto.STRING, "reduce_op": AttributeProto.STRING,
    "root": AttributeProto.INT, "groups": AttributeProto.INTS, "group_size": AttributeProto.INT,
    "nb_rank": AttributeProto.INT,
}

HEADS = 12  # divisible by every head group up to 4 ranks
SHAPES = {"mha": 12, "gqa": 4, "mqa": 1}


def matrix():
    """(workload, config) for every feasible configuration on 1-4 ranks, MHA/GQA/MQA, causal
    or not, at odd lengths (padding everywhere but on one rank)."""
    cases = []
    for name, kv_heads in SHAPES.items():
        for causal in (False, True):
            workload = Workload(13 if causal else 7, HEADS, 8, kv_heads=kv_heads, causal=causal, dtype="fp32")
            for config in enumerate_configs(workload, 4):
                cases.append(pytest.param(workload, config, id=f"{name}-{'causal' if causal else 'full'}-"
                                          f"{config.label}-{config.ranks}"))
    return cases


MATRIX = matrix()


def collectives(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_TYPE]


def shapes_of(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape after strict shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    shapes = {}
    for info in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output):
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    for init in inferred.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


@pytest.mark.parametrize(("workload", "config"), MATRIX)
def test_every_rank_graph_is_valid_onnx_with_inferred_shapes(workload, config):
    io = io_shapes(workload, config)
    for rank, model in enumerate(rank_graphs(workload, config)):
        onnx.checker.check_model(model, full_check=True)
        assert {o.domain: o.version for o in model.opset_import}[""] == OPSET
        feeds = rank_inputs(workload, config, rank)  # what differs by rank is an input
        assert [i.name for i in model.graph.input] == ["q", "k", "v", *feeds]
        assert [o.name for o in model.graph.output] == ["out"]
        shapes = shapes_of(model)
        for name in ("q", "k", "v", "out"):
            assert shapes[name] == io[name], (rank, name)
        # shape inference reaches every node's output, through the custom op too
        produced = {out for node in model.graph.node for out in node.output}
        assert all(None not in shapes.get(name, (None,)) for name in produced), rank
        element = ELEMENT_TYPES[workload.dtype]
        data = [*model.graph.input[:3], *model.graph.output]
        assert all(i.type.tensor_type.elem_type == element for i in data)
        assert all(i.type.tensor_type.elem_type == onnx.TensorProto.INT32 for i in model.graph.input[3:])


@pytest.mark.parametrize(("workload", "config"), MATRIX)
def test_dist_collective_nodes_follow_the_tensorrt_parser_rules(workload, config):
    for rank, model in enumerate(rank_graphs(workload, config)):
        assert {o.domain: o.version for o in model.opset_import}.get(DOMAIN) == 1
        shapes = shapes_of(model)
        for node in collectives(model):
            assert node.domain == DOMAIN and len(node.input) == len(node.output) == 1
            types = {a.name: a.type for a in node.attribute}
            assert types == ATTRIBUTE_TYPES, node.name  # all six, always written, right types
            attrs = collective_attributes(node)
            rule = TRT_RULES[attrs["collective_operation"]]
            if rule["reduces"]:
                assert attrs["reduce_op"] in REDUCTIONS
            else:
                assert attrs["reduce_op"] == "none"
            groups = attrs["groups"]
            assert attrs["group_size"] == len(groups)
            assert attrs["nb_rank"] == (len(groups) if groups else config.ranks) > 1
            n = attrs["nb_rank"]
            members = groups or list(range(config.ranks))
            assert rank in members and len(set(members)) == len(members)
            assert all(0 <= g < config.ranks for g in members)
            if rule["rooted"]:  # a group-local root where the graph has its group's communicator
                assert attrs["root"] in (members if groups else range(n))
            else:
                assert attrs["root"] == -1
            x, y = shapes[node.input[0]], shapes[node.output[0]]
            assert x[1:] == y[1:]
            expected = {"multiply": x[0] * n, "divide": x[0] // n, "keep": x[0], "keep_divisible": x[0]}
            assert y[0] == expected[rule["dim0"]]
            if rule["dim0"] in ("divide", "keep_divisible"):
                assert x[0] % n == 0


@pytest.mark.parametrize(("workload", "config"), MATRIX)
def test_every_member_of_a_group_issues_the_same_collectives_in_the_same_order(workload, config):
    """NCCL requires it: a rank that reaches its collectives in another order deadlocks."""
    sequences = defaultdict(dict)  # group -> rank -> [(operation, root, input shape), ...]
    for rank, model in enumerate(rank_graphs(workload, config)):
        shapes = shapes_of(model)
        per_group = defaultdict(list)
        for node in collectives(model):
            attrs = collective_attributes(node)
            per_group[tuple(attrs["groups"] or range(config.ranks))].append(
                (attrs["collective_operation"], attrs["root"], shapes[node.input[0]]))
        for group, sequence in per_group.items():
            sequences[group][rank] = sequence
    for group, by_rank in sequences.items():
        assert sorted(by_rank) == list(group)  # every member has this group's collectives
        assert len({tuple(s) for s in by_rank.values()}) == 1, group


@pytest.mark.parametrize(("workload", "config"), MATRIX)
def test_analytic_cost_counts_what_the_graphs_move(workload, config):
    """Bytes each rank sends per kind, read off the DistCollective nodes: an all-to-all keeps
    1/n of its input, an all-gather sends its input to n - 1 others, a broadcast moves one
    block per step (bus-bandwidth factor 1); and KV tensors keep their KV heads."""
    cost = analytic_cost(workload, config, ENGINES["onnx"].stream)
    width = workload.wire_dtype.itemsize
    u = config.head_group
    kv_heads = workload.kv_heads * (kv_replication(workload, u) if u > 1 else 1) // (u if u > 1 else 1)
    for model in rank_graphs(workload, config):
        shapes = shapes_of(model)
        sent = defaultdict(int)
        steps = defaultdict(int)
        for node in collectives(model):
            attrs = collective_attributes(node)
            kind, n = attrs["collective_operation"], attrs["nb_rank"]
            nbytes = int(np.prod(shapes[node.input[0]])) * width
            share = {"all_to_all": nbytes * (n - 1) // n, "all_gather": nbytes * (n - 1)}
            sent[kind] += share.get(kind, nbytes)
            steps[kind] += 1
            if kind in ("all_gather", "broadcast"):  # K/V: [2 or seq, batch, kv heads, seq or 2, d]
                assert shapes[node.input[0]][2] == kv_heads
        assert sent["all_to_all"] == cost.bytes_sent["all_to_all"]
        assert sent["all_gather"] == cost.bytes_sent["all_gather"]
        assert sent["broadcast"] == cost.bytes_sent["broadcast"]
        assert cost.bytes_sent["p2p"] == 0
        assert steps["broadcast"] == cost.comm_steps["broadcast"]
        assert steps["all_to_all"] == cost.comm_steps["all_to_all"]


@pytest.mark.parametrize(("workload", "config"), MATRIX)
def test_fused_attention_unless_the_ring_needs_the_log_sum_exp(workload, config):
    for model in rank_graphs(workload, config):
        ops = [n.op_type for n in model.graph.node]
        blocks = config.context_degree if config.strategy == "ring" else 1
        if blocks > 1:  # spelled out, one block per context member, merged by log-sum-exp
            assert "Attention" not in ops
            assert ops.count("ReduceMax") == ops.count("ReduceSum") == blocks
            assert ops.count("MatMul") == 2 * blocks
            assert ops.count("Log") == blocks + (blocks - 1)  # each block's lse, each merge's
        else:
            assert ops.count("Attention") == 1
            assert "ReduceMax" not in ops and "MatMul" not in ops


def mask_of(model, attention, feeds):
    """The boolean mask input of ``attention``, evaluated: LessOrEqual of two position
    vectors, constants or the rank's ``query_positions`` input (never [q, k] tables)."""
    (node,) = [n for n in model.graph.node if n.output[0] == attention.input[3]]
    assert node.op_type == "LessOrEqual"
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer} | feeds
    keys, limits = (values[name] for name in node.input)
    assert keys.shape[0] == 1 and limits.shape[1] == 1
    return keys <= limits


def test_a_plain_causal_mask_is_is_causal_and_any_other_a_boolean_mask():
    unpadded = Workload(16, 4, 8, causal=True, dtype="fp16")
    (attention,) = [n for n in rank_graph(unpadded, CPConfig("ulysses", 2), 0).graph.node
                    if n.op_type == "Attention"]
    assert helper.get_attribute_value(next(a for a in attention.attribute if a.name == "is_causal")) == 1
    assert len(attention.input) == 3
    # zigzag AllGather-KV: queries at two chunks, keys in position order: a real mask
    model = rank_graph(unpadded, CPConfig("allgather_kv", 2), 0)
    (attention,) = [n for n in model.graph.node if n.op_type == "Attention"]
    layout = SequenceLayout(unpadded, CPConfig("allgather_kv", 2))
    q_pos, k_pos = layout.block_positions(0), layout.gathered_positions
    feeds = rank_inputs(unpadded, CPConfig("allgather_kv", 2), 0)
    assert np.array_equal(mask_of(model, attention, feeds), k_pos[None, :] <= q_pos[:, None])
    # padding keys (seq 13 padded to 16) are never visible, causal or not
    for causal in (False, True):
        padded = Workload(13, 4, 8, causal=causal, dtype="fp16")
        model = rank_graph(padded, CPConfig("allgather_kv", 2), 1)
        (attention,) = [n for n in model.graph.node if n.op_type == "Attention"]
        layout = SequenceLayout(padded, CPConfig("allgather_kv", 2))
        q_pos, k_pos = layout.block_positions(1), layout.gathered_positions
        expected = (k_pos[None, :] < 13) & ((k_pos[None, :] <= q_pos[:, None]) | (not causal))
        feeds = rank_inputs(padded, CPConfig("allgather_kv", 2), 1)
        assert np.array_equal(mask_of(model, attention, feeds), expected)
    # no mask at all without causality or padding
    full = Workload(16, 4, 8, dtype="fp16")
    (attention,) = [n for n in rank_graph(full, CPConfig("allgather_kv", 2), 1).graph.node
                    if n.op_type == "Attention"]
    assert len(attention.input) == 3 and not attention.attribute


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_graph_dtype_is_the_workloads_and_the_softmax_statistics_are_float32(dtype):
    workload = Workload(13, 4, 8, kv_heads=2, causal=True, dtype=dtype)
    model = rank_graph(workload, CPConfig("ring", 4, 2), 1)
    shapes_of(model)  # strict inference passes
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    element = ELEMENT_TYPES[dtype]
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert matmuls and all(types[n.output[0]] == element for n in matmuls)  # 16-bit GEMMs stay 16-bit
    stats = [n for n in model.graph.node if n.op_type in ("ReduceMax", "ReduceSum", "Exp", "Log")]
    assert stats and all(types[n.output[0]] == onnx.TensorProto.FLOAT for n in stats)
    for node in collectives(model):
        assert types[node.output[0]] == element  # collectives move the workload dtype


@pytest.mark.parametrize(("workload", "config"), MATRIX)
def test_every_rank_runs_the_same_graph_but_a_hybrid(workload, config):
    """What differs by rank is fed as an input, so every rank's graph is the same bytes (one
    engine for all); a hybrid's name their own two groups, by design."""
    graphs = {model.SerializeToString(deterministic=True) for model in rank_graphs(workload, config)}
    hybrid = config.head_group > 1 and config.context_degree > 1
    assert len(graphs) == (config.ranks if hybrid else 1)
    feeds = [rank_inputs(workload, config, rank) for rank in range(config.ranks)]
    assert len({tuple((k, v.shape, v.dtype) for k, v in f.items()) for f in feeds}) == 1
    if workload.causal and config.context_degree > 1:  # the queries' positions differ by rank
        layout = SequenceLayout(workload, config)
        for rank, values in enumerate(feeds):
            group = layout.head_group_of(rank)
            assert values["query_positions"].ravel().tolist() == layout.block_positions(group).tolist()


def test_rank_outside_the_configuration_is_refused():
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        rank_graph(Workload(8, 2, 8), CPConfig("ring", 2), 2)


@pytest.mark.parametrize(
    ("operation", "kwargs", "problem"),
    [
        ("all_gather", {"reduce_op": "sum"}, "needs reduce_op 'none'"),
        ("all_reduce", {}, "needs a reduction"),
        ("broadcast", {}, "needs a root among ranks"),
        ("broadcast", {"root": 5}, "needs a root among ranks"),
        ("all_to_all", {"root": 0}, "has no root"),
        ("all_gather", {"nb_rank": 3}, "does not match groups"),
        ("send", {}, "collective_operation must be one of"),
    ],
)
def test_the_dialect_refuses_what_the_parser_rejects(operation, kwargs, problem):
    arguments = {"groups": [1, 3], "nb_rank": 2, **kwargs}
    with pytest.raises(ValueError, match=problem):
        dist_collective("x", "y", operation, **arguments)


def test_empty_groups_are_written_as_an_empty_ints_attribute():
    node = dist_collective("x", "y", "all_gather", groups=[], nb_rank=4)
    groups = next(a for a in node.attribute if a.name == "groups")
    assert groups.type == AttributeProto.INTS and list(groups.ints) == []
    assert collective_attributes(node)["group_size"] == 0
