"""The small graphs ``cptune calibrate --backend tensorrt`` times: one collective, or one
attention op, per graph.

They are ONNX like the strategies' rank graphs, so TensorRT times exactly the layers a
configuration uses: a ``DistCollective`` node (written by ``_dialect``) in groups of
``group`` consecutive ranks, or the fused ``Attention`` op with the causal mask as a
constant, as the rank graphs carry it. Built and checked here without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cptune.engines.onnx._builder import OPSET
from cptune.engines.onnx._dialect import dist_collective, opset_import
from cptune.layout import head_group_members

#: Element type the collectives move (bytes are what is calibrated; 2 per element).
COLLECTIVE_DTYPE = TensorProto.FLOAT16
#: Element type of the attention calibration: the default workload dtype (bf16).
ATTENTION_DTYPE = TensorProto.BFLOAT16


def single_op_model(node: onnx.NodeProto, x: onnx.ValueInfoProto, y: onnx.ValueInfoProto, name: str,
                    initializers: Sequence[onnx.TensorProto] = (), inputs: Sequence[onnx.ValueInfoProto] = ()
                    ) -> onnx.ModelProto:
    """A model of one node from ``x`` (and ``inputs``) to ``y``, as the rank graphs are
    written: the same opsets and IR version."""
    graph = helper.make_graph([node], name, [x, *inputs], [y], initializer=list(initializers))
    standard = helper.make_opsetid("", OPSET)
    return helper.make_model(graph, opset_imports=[standard, opset_import()], producer_name="cptune",
                             ir_version=helper.find_min_ir_version_for([standard]))


def group_members(ranks: int, group: int, rank: int) -> list[int]:
    """The ``group`` ranks ``rank`` belongs to: its head group of ``group`` (the ranks every
    engine calibrates a collective over, ``cptune.layout.head_group_members``)."""
    if group < 1 or ranks % group or not 0 <= rank < ranks:
        raise ValueError(f"cannot form groups of {group} among {ranks} ranks for rank {rank}")
    return head_group_members(rank, group)


def collective_graph(
    kind: str, ranks: int, group: int, rank: int, chunk_bytes: int, local: bool = True
) -> onnx.ModelProto:
    """Rank ``rank``'s graph of one collective ``kind`` in its group of ``group`` among
    ``ranks``, ``chunk_bytes`` per peer as the strategies use it: all_to_all sends a chunk
    to each member, all_gather one chunk to all, broadcast (the Ring's stream step on this
    engine) one chunk from the group's first member to the others. ``local``: written for a
    communicator of the group alone (``groups`` empty, root 0), as calibration runs it, so
    every rank's graph is the same; else naming the members among all ranks, as a hybrid's
    graphs do (what ``cptune doctor`` probes)."""
    members = group_members(ranks, group, rank)
    elements = max(1, chunk_bytes // 2)
    groups, root = ([], 0) if local else (members, members[0])
    if kind == "all_to_all":
        shape_in = shape_out = [group * elements]
        node = dist_collective("x", "y", "all_to_all", groups=groups, nb_rank=group, name="collective")
    elif kind == "all_gather":
        shape_in, shape_out = [elements], [group * elements]
        node = dist_collective("x", "y", "all_gather", groups=groups, nb_rank=group, name="collective")
    elif kind == "broadcast":
        shape_in = shape_out = [elements]
        node = dist_collective("x", "y", "broadcast", groups=groups, nb_rank=group, root=root,
                               name="collective")
    else:
        raise ValueError(f"no calibration graph for collective {kind!r}")
    x = helper.make_tensor_value_info("x", COLLECTIVE_DTYPE, shape_in)
    y = helper.make_tensor_value_info("y", COLLECTIVE_DTYPE, shape_out)
    return single_op_model(node, x, y, f"calibration_{kind}")


def _chunks(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``values[c]`` all over chunk c of dim 0 of an array of ``shape``, rounded as float16
    (what the collectives move) holds it."""
    out = np.repeat(values.astype(np.float32), int(np.prod(shape)) // len(values)).reshape(shape)
    return out.astype(np.float16).astype(np.float32)


def collective_inputs(kind: str, group: int, member: int, shape: tuple[int, ...]) -> np.ndarray:
    """What member ``member`` of a group of ``group`` feeds a ``collective_graph`` of
    ``kind`` (input ``shape``) so that its output tells which peer sent which chunk: its
    chunk c (all_to_all: one per member; otherwise one) holds member * group + c + 1."""
    return _chunks(member * group + np.arange(group if kind == "all_to_all" else 1) + 1, shape)


def collective_expected(
    kind: str, group: int, member: int, shape: tuple[int, ...], root: int = 0
) -> np.ndarray:
    """The output member ``member`` must get from ``collective_inputs`` (``shape`` is the
    output's): all_to_all, chunk j is member j's chunk ``member``; all_gather, member j's
    input; broadcast, the input of the member at index ``root``."""
    if kind == "broadcast":
        return _chunks(np.array([root * group + 1]), shape)
    sent = member if kind == "all_to_all" else 0  # the chunk every member sends this one
    return _chunks(np.arange(group) * group + sent + 1, shape)


def causal_mask(seq_q: int, seq_k: int) -> np.ndarray:
    """True where query i (at key position seq_k - seq_q + i) may see key j: the queries
    are the last ``seq_q`` positions, as calibration's causal shapes are defined."""
    return np.arange(seq_k)[None, :] <= np.arange(seq_k - seq_q, seq_k)[:, None]


def attention_graph(shape: dict[str, int], dtype: int = ATTENTION_DTYPE) -> onnx.ModelProto:
    """The fused ``Attention`` op on one calibration shape (heads, seq_q, seq_k, head_dim,
    causal): q [1, heads, seq_q, head_dim], k and v [1, heads, seq_k, head_dim], output
    like q; a causal shape carries its mask as a boolean constant."""
    h, sq, sk, d = shape["heads"], shape["seq_q"], shape["seq_k"], shape["head_dim"]
    inputs = [helper.make_tensor_value_info("q", dtype, [1, h, sq, d]),
              helper.make_tensor_value_info("k", dtype, [1, h, sk, d]),
              helper.make_tensor_value_info("v", dtype, [1, h, sk, d])]
    operands, initializers = ["q", "k", "v"], []
    if shape.get("causal"):
        initializers.append(numpy_helper.from_array(causal_mask(sq, sk), "mask"))
        operands.append("mask")
    node = helper.make_node("Attention", operands, ["out"], name="attention")
    return single_op_model(node, inputs[0], helper.make_tensor_value_info("out", dtype, [1, h, sq, d]),
                           "attention", initializers, inputs[1:])


def attention_expected(shape: dict[str, int], q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """What ``attention_graph(shape)`` computes from ``q``, ``k``, ``v`` (float64, then
    float32): softmax(q k^T / sqrt(d)) v, causal as ``causal_mask`` defines it."""
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) / np.sqrt(shape["head_dim"])
    if shape.get("causal"):
        scores = np.where(causal_mask(shape["seq_q"], shape["seq_k"]), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(axis=-1, keepdims=True), v).astype(np.float32)


def case_graphs(case: dict, ranks: int, rank: int) -> list[onnx.ModelProto]:
    """Rank ``rank``'s graphs of one calibration request: ``{"collective": kind, "group":
    g, "chunks": [bytes per peer, ...]}`` or ``{"shapes": [attention shape, ...]}``."""
    if "collective" in case:
        kind, group = case["collective"], case["group"]
        return [collective_graph(kind, ranks, group, rank, chunk) for chunk in case["chunks"]]
    return [attention_graph(shape) for shape in case["shapes"]]
