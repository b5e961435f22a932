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


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           name: str, initializers: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """A model as the rank graphs are written: the same opsets and IR version."""
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    standard = helper.make_opsetid("", OPSET)
    return helper.make_model(graph, opset_imports=[standard, opset_import()], producer_name="cptune",
                             ir_version=helper.find_min_ir_version_for([standard]))


def group_members(ranks: int, group: int, rank: int) -> list[int]:
    """The ``group`` ranks ``rank`` belongs to: its head group of ``group`` (the ranks every
    engine calibrates a collective over, ``cptune.layout.head_group_members``)."""
    if group < 1 or ranks % group or not 0 <= rank < ranks:
        raise ValueError(f"cannot form groups of {group} among {ranks} ranks for rank {rank}")
    return head_group_members(rank, group)


def collective_graph(kind: str, ranks: int, group: int, rank: int, chunk_bytes: int) -> onnx.ModelProto:
    """Rank ``rank``'s graph of one collective ``kind`` in its group of ``group`` among
    ``ranks``, ``chunk_bytes`` per peer as the strategies use it: all_to_all sends a chunk
    to each member, all_gather one chunk to all, broadcast (the Ring's stream step on this
    engine) one chunk from the group's first member to the others. The members of a group
    get the same graph (so one engine is built for them)."""
    members = group_members(ranks, group, rank)
    elements = max(1, chunk_bytes // 2)
    if kind == "all_to_all":
        shape_in = shape_out = [group * elements]
        node = dist_collective("x", "y", "all_to_all", groups=members, nb_rank=group, name="collective")
    elif kind == "all_gather":
        shape_in, shape_out = [elements], [group * elements]
        node = dist_collective("x", "y", "all_gather", groups=members, nb_rank=group, name="collective")
    elif kind == "broadcast":
        shape_in = shape_out = [elements]
        node = dist_collective("x", "y", "broadcast", groups=members, nb_rank=group, root=members[0],
                               name="collective")
    else:
        raise ValueError(f"no calibration graph for collective {kind!r}")
    return _model([node], [helper.make_tensor_value_info("x", COLLECTIVE_DTYPE, shape_in)],
                  [helper.make_tensor_value_info("y", COLLECTIVE_DTYPE, shape_out)], f"calibration_{kind}")


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
    return _model([node], inputs, [helper.make_tensor_value_info("out", dtype, [1, h, sq, d])],
                  "attention", initializers)


def case_graphs(case: dict, ranks: int, rank: int) -> list[onnx.ModelProto]:
    """Rank ``rank``'s graphs of one calibration request: ``{"collective": kind, "group":
    g, "chunks": [bytes per peer, ...]}`` or ``{"shapes": [attention shape, ...]}``."""
    if "collective" in case:
        kind, group = case["collective"], case["group"]
        return [collective_graph(kind, ranks, group, rank, chunk) for chunk in case["chunks"]]
    return [attention_graph(shape) for shape in case["shapes"]]
