"""A rank graph as TensorRT builds it: the two things TensorRT needs said that standard ONNX
cannot say, and the reference runtime's op that runs them, so the graph the onnx engine
checks is the graph TensorRT builds.

- ``TRT_decomposable=1`` on every ``Attention`` node. onnx-tensorrt's importer builds
  ``IAttention`` non-decomposable unless this attribute says otherwise (its default is 0),
  and a non-decomposable attention fails to build wherever no fused kernel exists (fp32,
  some masks and GQA shapes). ``onnx.checker`` rejects the attribute (it is not in the
  standard schema), so it is added after the graph is checked; the reference runtime runs
  it through ``reference_ops``' ``Attention``, which accepts and ignores it.
- Optionally (``cast_boundary``), a dtype-changing ``Cast`` on each side of every 16-bit
  ``DistCollective``: the collective then moves float32. TensorRT's Myelin optimizer can
  fuse a collective with its neighbours into one region, where it fails to build or
  silently stops communicating (pytorch/TensorRT#4381); a genuine precision change is a
  boundary it does not fuse across, while a same-dtype cast is folded away
  (pytorch/TensorRT#4388). It doubles the bytes moved, so the TensorRT rank asks for it
  only when an engine built without it has its collectives fused away. An fp32 collective
  has no lossless dtype to change to and gets none.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_attention import Attention as _ReferenceAttention

from cptune.engines.onnx._dialect import OP_TYPE

#: The attribute onnx-tensorrt reads to let IAttention decompose where no fused kernel fits.
DECOMPOSABLE = "TRT_decomposable"
#: What a 16-bit collective moves behind a Cast boundary.
BOUNDARY_DTYPE = TensorProto.FLOAT
_SIXTEEN_BIT = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def for_tensorrt(model: onnx.ModelProto, cast_boundary: bool = False) -> onnx.ModelProto:
    """A copy of rank graph ``model`` as TensorRT builds it (see the module docstring)."""
    built = onnx.ModelProto()
    built.CopyFrom(model)
    graph = built.graph
    for node in graph.node:
        if node.op_type == "Attention" and node.domain == "":
            node.attribute.append(helper.make_attribute(DECOMPOSABLE, 1))
    if cast_boundary:
        _add_cast_boundaries(graph)
    return built


def _add_cast_boundaries(graph: onnx.GraphProto) -> None:
    """Each 16-bit DistCollective x -> y becomes Cast(x) -> DistCollective -> Cast -> y, the
    collective in float32 (its output's recorded type follows)."""
    types = {v.name: v for v in graph.value_info}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        out = types.get(node.output[0]) if node.op_type == OP_TYPE else None
        dtype = out.type.tensor_type.elem_type if out is not None else None
        if out is None or dtype not in _SIXTEEN_BIT:
            nodes.append(node)
            continue
        wide_in, wide_out = f"{node.input[0]}_wide_{node.name}", f"{node.output[0]}_wide"
        nodes.append(helper.make_node("Cast", [node.input[0]], [wide_in], name=f"{node.name}_cast_in",
                                      to=BOUNDARY_DTYPE))
        collective = onnx.NodeProto()
        collective.CopyFrom(node)
        collective.input[0], collective.output[0] = wide_in, wide_out
        nodes.append(collective)
        nodes.append(helper.make_node("Cast", [wide_out], [node.output[0]], name=f"{node.name}_cast_out",
                                      to=dtype))
        shape = [d.dim_value for d in out.type.tensor_type.shape.dim]
        graph.value_info.append(helper.make_tensor_value_info(wide_out, BOUNDARY_DTYPE, shape))
    del graph.node[:]
    graph.node.extend(nodes)


class Attention(_ReferenceAttention):
    """ONNX's reference ``Attention``, taking (and ignoring) ``TRT_decomposable``: whether
    TensorRT may decompose the op changes how it computes, not what."""

    op_domain = ""

    def _run(self, *inputs, TRT_decomposable=None, **attributes):  # noqa: ANN002, ANN003, N803
        return super()._run(*inputs, **attributes)


def reference_ops() -> list[type[OpRun]]:
    """The ops ``ReferenceEvaluator`` needs beyond its own to run a ``for_tensorrt`` graph
    (``DistCollective`` comes with its communicators, from the rank)."""
    return [Attention]
