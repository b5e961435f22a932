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
dtype. Everything about positions is static, so masks (causal, padding, zigzag) are
constants baked into each rank's graph, and blocks no real query of a rank can see are not
computed at all.

Attention is written two ways, chosen when the graph is finished, not when the strategy
asks for it: ``attention`` returns a ``Partial`` whose parts are placeholders, and only if
some node reads a placeholder's log-sum-exp (the Ring's merge) is that block spelled out:
Q pre-scaled by 1/sqrt(head_dim) in the workload dtype (TensorRT's "Method 2" fusion wants
it so), MatMul, ReduceMax, Exp, ReduceSum, MatMul, with the scores, row statistics and
merge in float32 (flash attention's split: 16-bit GEMMs, float32 softmax). Otherwise
(AllGather-KV, Ulysses, one rank, a one-block Ring) it is the fused ONNX ``Attention`` op,
which TensorRT maps to its fused attention layer; a causal mask that is the plain
lower-triangle becomes ``is_causal``, any other mask a boolean constant.

The Ring's stream step: TensorRT has no point-to-point layer, so each context block reaches
the others by one ``broadcast`` per step with that step's source as root (steps in member
order, identical on every rank, each non-root's input chained to the previous step's
output so the steps cannot be reordered against each other). A broadcast moves exactly one
block per step, like the send/recv it replaces, where an all-gather would hold every block
at once and an all-to-all would move c times the data. ``analytic_cost(..., engine=...)``
counts it so ("broadcast": c steps of one block). A graph states data flow, not schedule:
whether TensorRT overlaps a step with the previous block's attention is its choice.

GQA/MQA keep their KV heads through every exchange; the spelled-out blocks map query head
h to KV head h // group by reshaping Q to [batch, kv_heads, group, ...] (no repeat), the
fused op does the same itself. Ulysses replicates KV heads (``repeat_heads``) only where
the MPI engine does.
"""

from __future__ import annotations

import onnx
from onnx import helper

from cptune.config import CPConfig
from cptune.engines.onnx import _dialect as dialect
from cptune.engines.onnx._builder import OPSET, GraphBuilder, Sym
from cptune.engines.onnx._ops import OnnxOps
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
        f"cptune_{config.label}_rank{rank}",
        [_io(name, dtype, shapes[name]) for name in ("q", "k", "v")],
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
    model.doc_string = f"{config.describe()} for {workload.describe()}: rank {rank} of {config.ranks}"
    return model


def rank_graphs(workload: Workload, config: CPConfig) -> list[onnx.ModelProto]:
    """Every rank's graph, rank 0 first."""
    return [rank_graph(workload, config, rank) for rank in range(config.ranks)]
