"""Each rank's attention layer as an ONNX graph, written by the strategies themselves.

``OnnxOps`` is one more ``Primitives`` implementation: instead of computing, it appends
graph nodes, and ``run_strategy`` drives it exactly as it drives the MPI engine. The
result, ``rank_graph(workload, config, rank)``, is what TensorRT 11's ONNX parser builds a
multi-device engine from (standard ONNX ops, opset ``OPSET``, plus ``DistCollective``
nodes in ``cptune.engines._onnx_dialect``) and what the onnx engine runs on real ranks with
ONNX's reference runtime, so the graph that is checked is the graph that is exported.

Graph contract (every rank): inputs ``q`` [batch, tokens of this rank, heads, head_dim] and
``k``, ``v`` [batch, tokens of this rank, kv_heads, head_dim]; output ``out`` [batch, tokens
of this rank, heads, head_dim]; all in the workload's dtype (fp32 FLOAT, fp16 FLOAT16, bf16
BFLOAT16: a real bfloat16 graph, unlike the MPI engine's bf16, which travels as float16).
A rank holds the tokens ``SequenceLayout.rank_positions(rank)`` (zigzag for causal
workloads over several context blocks; padded at the end). Collectives move the workload's
dtype.

One graph for every rank: what differs by rank is an input, never a constant or a node,
so every rank runs the same engine (built once, cached once, and no chance of two ranks'
engines ordering their collectives differently). Those inputs, with this rank's values
from ``rank_inputs``: ``query_positions`` (int32 [queries, 1], the positions of a causal
workload's queries where there are several context blocks; the masks are computed from
them in the graph) and ``ring_member`` (int32 [1], the rank's index in its Ring). Key
positions and padding are the same block on every rank, so they stay constants.
Collectives are written for a communicator of exactly their group (``groups`` empty,
roots group-local). The exception is by design: a hybrid (Ulysses inside a head group,
Ring or AllGather-KV across groups) exchanges in two groups, which one communicator of
all ranks serves only with the global ranks in ``groups``, so each rank's graph names
its own groups.

Attention is written two ways, chosen when the graph is finished, not when the strategy
asks for it: ``attention`` returns a ``Partial`` whose parts are placeholders, and only if
some node reads a placeholder's log-sum-exp (the Ring's merge) is that block spelled out:
Q pre-scaled by 1/sqrt(head_dim) in the workload dtype (TensorRT's "Method 2" fusion wants
it so), MatMul, ReduceMax, Exp, ReduceSum, MatMul, with the scores, row statistics and
merge in float32 (flash attention's split: 16-bit GEMMs, float32 softmax). Otherwise
(AllGather-KV, Ulysses, one rank, a one-block Ring) it is the fused ONNX ``Attention`` op,
which TensorRT maps to its fused attention layer; a causal mask that is the plain
lower-triangle becomes ``is_causal``, any other mask a boolean computed from positions.

The Ring's stream step: TensorRT has no point-to-point layer, so each context block reaches
the others by one ``broadcast`` per step with that step's source as root (steps in member
order, identical on every rank, each non-root's input chained to the previous step's
output by a ``Where`` on ``ring_member``, so the steps cannot be reordered against each
other). A broadcast moves exactly one
block per step, like the send/recv it replaces, where an all-gather would hold every block
at once and an all-to-all would move c times the data. ``analytic_cost(..., engine=...)``
counts it so ("broadcast": c steps of one block). A graph states data flow, not schedule:
whether TensorRT overlaps a step with the previous block's attention is its choice.

GQA/MQA keep their KV heads through every exchange; the spelled-out blocks map query head
h to KV head h // group by reshaping Q to [batch, kv_heads, group, ...] (no repeat), the
fused op does the same itself. Ulysses replicates KV heads (its all-to-all's ``repeat``) only where
the MPI engine does.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from cptune.config import CPConfig
from cptune.engines.onnx import _dialect as dialect
from cptune.engines.onnx._builder import OPSET, GraphBuilder, Sym
from cptune.engines.onnx._ops import OnnxOps
from cptune.engines.onnx._tensorrt import for_tensorrt
from cptune.layout import SequenceLayout
from cptune.strategies import run_strategy
from cptune.workload import Workload


def _io(name: str, dtype: int, shape: tuple[int, ...]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(shape))


def io_shapes(workload: Workload, config: CPConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every rank's graph inputs and output (the same on every rank)."""
    wl = workload
    tokens = SequenceLayout(workload, config).padded_len // config.ranks
    return {
        "q": (wl.batch, tokens, wl.heads, wl.head_dim),
        "k": (wl.batch, tokens, wl.kv_heads, wl.head_dim),
        "v": (wl.batch, tokens, wl.kv_heads, wl.head_dim),
        "out": (wl.batch, tokens, wl.heads, wl.head_dim),
    }


def rank_graph(workload: Workload, config: CPConfig, rank: int) -> onnx.ModelProto:
    """Rank ``rank``'s graph of ``config`` on ``workload`` (see the module docstring)."""
    return _build(workload, config, rank)[0]


def rank_inputs(workload: Workload, config: CPConfig, rank: int) -> dict[str, np.ndarray]:
    """The values rank ``rank`` feeds its graph's inputs beyond q, k and v (its query
    positions, its index in the Ring; none for most configurations)."""
    return _build(workload, config, rank)[1]


def tensorrt_rank_graph(
    workload: Workload, config: CPConfig, rank: int, cast_boundary: bool = False
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Rank ``rank``'s graph as TensorRT builds it (``for_tensorrt``) and its rank inputs:
    what the TensorRT rank builds, the onnx engine runs and ``export_graphs`` writes."""
    model, feeds = _build(workload, config, rank)
    return for_tensorrt(model, cast_boundary), feeds


def _build(workload: Workload, config: CPConfig, rank: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    if not 0 <= rank < config.ranks:
        raise ValueError(f"rank must be in 0..{config.ranks - 1}, got {rank}")
    layout = SequenceLayout(workload, config)
    builder = GraphBuilder()
    ops = OnnxOps(layout, rank, builder)
    dtype, shapes = ops.dtype, io_shapes(workload, config)
    g = builder
    q_in, k_in, v_in = (Sym(name, shapes[name], dtype) for name in ("q", "k", "v"))
    q = g.node(
        "Transpose",
        ["q"],
        "q_heads_first",
        (q_in.shape[0], q_in.shape[2], q_in.shape[1], q_in.shape[3]),
        dtype,
        perm=[0, 2, 1, 3],
    )
    stacked = [
        g.node("Unsqueeze", [x.name, g.ints([0], "axes")], "kv_part", (1, *x.shape), dtype)
        for x in (k_in, v_in)
    ]
    packed = g.node("Concat", [s.name for s in stacked], "kv_packed", (2, *k_in.shape), dtype, axis=0)
    b, s, k, d = k_in.shape
    kv = g.node("Transpose", [packed.name], "kv", (2, b, k, s, d), dtype, perm=[0, 1, 3, 2, 4])
    out = ops.wire(run_strategy(ops, layout, rank, q, kv))
    g.node("Transpose", [out.name], "out", shapes["out"], dtype, output="out", perm=[0, 2, 1, 3])
    nodes = builder.finish(ops.expand)
    graph = helper.make_graph(
        nodes,
        f"cptune_{config.label}" if ops.local else f"cptune_{config.label}_rank{rank}",
        [_io(name, dtype, shapes[name]) for name in ("q", "k", "v")] + builder.inputs,
        [_io("out", dtype, shapes["out"])],
        initializer=builder.initializers,
        value_info=builder.value_info,
    )
    opsets = [helper.make_opsetid("", OPSET), dialect.opset_import()]
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        producer_name="cptune",
        ir_version=helper.find_min_ir_version_for(opsets[:1]),
    )
    model.doc_string = f"{config.describe()} for {workload.describe()}"
    return model, builder.feeds


def rank_graphs(workload: Workload, config: CPConfig) -> list[onnx.ModelProto]:
    """Every rank's graph, rank 0 first."""
    return [rank_graph(workload, config, rank) for rank in range(config.ranks)]
