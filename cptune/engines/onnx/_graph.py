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

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

from cptune.config import CPConfig
from cptune.engines import _onnx_dialect as dialect
from cptune.layout import SequenceLayout
from cptune.strategies import run_strategy
from cptune.strategies.primitives import Group, Partial
from cptune.workload import Workload

#: The default-domain opset: the first with the fused ``Attention`` op.
OPSET = 23
#: ONNX element type of each workload dtype.
ELEMENT_TYPES: dict[str, int] = {
    "fp32": TensorProto.FLOAT,
    "fp16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
}
FLOAT = TensorProto.FLOAT
#: Additive score bias of a masked (query, key) pair in the spelled-out blocks: finite, so a
#: row that sees nothing in one block gets a log-sum-exp near -1e30 (weight 0 in the merge)
#: instead of NaN; float32 holds it, and exp(-1e30 - max) is exactly 0.
MASKED = -1e30


@dataclass(frozen=True)
class Sym:
    """A tensor of the graph under construction."""

    name: str
    shape: tuple[int, ...]
    dtype: int


@dataclass
class _Attention:
    """One ``attention`` request, expanded when the graph is finished: which tensors it
    reads, its static mask, and which of its results (in which dtype) were read."""

    q: Sym
    kv: Sym
    q_pos: np.ndarray  # token position of each query row
    k_pos: np.ndarray  # ... and of each key
    out_names: dict[int, str] = field(default_factory=dict)  # dtype -> name requested
    lse_name: str | None = None  # requested: the block must be spelled out

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (*self.q.shape[:-1], 1)


@dataclass(frozen=True)
class _Out:
    call: _Attention


@dataclass(frozen=True)
class _Lse:
    call: _Attention


Tensor = Sym | _Out | _Lse


class GraphBuilder:
    """Nodes, constants and value infos of one graph; attention requests stay placeholders
    until ``finish``."""

    def __init__(self) -> None:
        self._items: list[NodeProto | _Attention] = []
        self._sink: list[NodeProto | _Attention] = self._items
        self.initializers: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._ids = itertools.count()
        self._constants: dict[tuple[object, ...], str] = {}
        self._memo: dict[tuple[object, ...], Sym] = {}

    def fresh(self, stem: str) -> str:
        return f"{stem}_{next(self._ids)}"

    def node(
        self,
        op: str,
        inputs: Sequence[str],
        stem: str,
        shape: tuple[int, ...],
        dtype: int,
        output: str | None = None,
        **attributes: object,
    ) -> Sym:
        """Append one single-output node (its output named ``output`` if given, else after
        ``stem``); returns its output."""
        out = Sym(output or self.fresh(stem), tuple(shape), dtype)
        self._sink.append(helper.make_node(op, list(inputs), [out.name], name=self.fresh(op), **attributes))
        return out

    def memo(self, key: tuple[object, ...], make: Callable[[], Sym]) -> Sym:
        """The value ``make()`` built once per ``key`` (a cast, a scaled Q, a K/V split)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def constant(self, array: np.ndarray, stem: str, dtype: int | None = None) -> str:
        """An initializer holding ``array`` (in ``dtype`` if given), shared between uses."""
        key = (array.dtype.str, array.shape, array.tobytes(), dtype)
        if key not in self._constants:
            name = self.fresh(stem)
            if dtype is None:
                tensor = numpy_helper.from_array(array, name)
            else:
                tensor = helper.make_tensor(
                    name, dtype, array.shape, array.astype(np.float32).ravel().tolist()
                )
            self.initializers.append(tensor)
            self._constants[key] = name
        return self._constants[key]

    def ints(self, values: Sequence[int], stem: str = "shape") -> str:
        return self.constant(np.asarray(values, dtype=np.int64), stem)

    def collective(
        self, x: Sym, operation: str, groups: list[int], shape: tuple[int, ...], root: int = -1
    ) -> Sym:
        """A ``DistCollective`` over ``groups`` (global ranks, in member order); its output's
        shape is recorded so shape inference sees through the custom op."""
        out = Sym(self.fresh(operation), tuple(shape), x.dtype)
        self._sink.append(
            dialect.dist_collective(
                x.name,
                out.name,
                operation,
                groups=groups,
                nb_rank=len(groups),
                root=root,
                name=self.fresh(f"DistCollective_{operation}"),
            )
        )
        self.value_info.append(helper.make_tensor_value_info(out.name, out.dtype, out.shape))
        return out

    def request(self, call: _Attention) -> None:
        self._sink.append(call)

    def finish(self, expand: Callable[[_Attention], None]) -> list[NodeProto]:
        """The final node list: each attention placeholder replaced, in place, by the nodes
        ``expand(call)`` appends."""
        nodes: list[NodeProto | _Attention] = []
        self._sink = nodes
        for item in self._items:
            if isinstance(item, _Attention):
                expand(item)
            else:
                nodes.append(item)
        self._sink = self._items
        return [node for node in nodes if isinstance(node, NodeProto)]


def _transpose_perm(ndim: int, a: int, b: int) -> list[int]:
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


class OnnxOps:
    """``Primitives`` that write graph nodes for rank ``rank`` of ``layout``."""

    def __init__(self, layout: SequenceLayout, rank: int, builder: GraphBuilder) -> None:
        self.layout = layout
        self.workload = layout.workload
        self.rank = rank
        self.g = builder
        self.dtype = ELEMENT_TYPES[self.workload.dtype]

    # ---- tensors in a given dtype -------------------------------------------------------

    def as_dtype(self, x: Tensor, dtype: int) -> Sym:
        """``x`` in ``dtype``: a placeholder's result is requested from its attention call,
        anything else cast once if needed."""
        if isinstance(x, _Lse):
            if x.call.lse_name is None:
                x.call.lse_name = self.g.fresh("lse")
            assert dtype == FLOAT, "the log-sum-exp is float32"
            return Sym(x.call.lse_name, x.call.lse_shape, FLOAT)
        if isinstance(x, _Out):
            name = x.call.out_names.setdefault(dtype, self.g.fresh("attention"))
            return Sym(name, x.call.out_shape, dtype)
        if x.dtype == dtype:
            return x
        return self.g.memo(
            ("cast", x.name, dtype), lambda: self.g.node("Cast", [x.name], "cast", x.shape, dtype, to=dtype)
        )

    def wire(self, x: Tensor) -> Sym:
        return self.as_dtype(x, self.dtype)

    # ---- Primitives ---------------------------------------------------------------------

    def attention(self, q: Tensor, kv: Tensor, q_pos: np.ndarray, k_pos: np.ndarray) -> Partial:
        call = _Attention(self.wire(q), self.wire(kv), np.asarray(q_pos), np.asarray(k_pos))
        self.g.request(call)
        return Partial(_Out(call), _Lse(call))

    def merge(self, acc: Partial | None, part: Partial) -> Partial:
        if acc is None:
            return part
        g = self.g
        a_out, a_lse = self.as_dtype(acc.out, FLOAT), self.as_dtype(acc.lse, FLOAT)
        b_out, b_lse = self.as_dtype(part.out, FLOAT), self.as_dtype(part.lse, FLOAT)
        stat = a_lse.shape
        top = g.node("Max", [a_lse.name, b_lse.name], "lse_max", stat, FLOAT)
        weights = []
        for lse in (a_lse, b_lse):
            shifted = g.node("Sub", [lse.name, top.name], "lse_shift", stat, FLOAT)
            weights.append(g.node("Exp", [shifted.name], "lse_weight", stat, FLOAT))
        total = g.node("Add", [weights[0].name, weights[1].name], "lse_total", stat, FLOAT)
        lse = g.node(
            "Add", [top.name, g.node("Log", [total.name], "lse_log", stat, FLOAT).name], "lse", stat, FLOAT
        )
        scaled = [
            g.node("Mul", [o.name, w.name], "merge_part", o.shape, FLOAT)
            for o, w in ((a_out, weights[0]), (b_out, weights[1]))
        ]
        summed = g.node("Add", [scaled[0].name, scaled[1].name], "merge_sum", a_out.shape, FLOAT)
        out = g.node("Div", [summed.name, total.name], "merged", a_out.shape, FLOAT)
        return Partial(out, lse)

    def repeat_heads(self, kv: Tensor, times: int) -> Sym:
        kv = self.wire(kv)
        two, b, k, s, d = kv.shape
        g = self.g
        lifted = g.node(
            "Unsqueeze", [kv.name, g.ints([3], "axes")], "kv_lift", (two, b, k, 1, s, d), kv.dtype
        )
        spread = g.node(
            "Expand",
            [lifted.name, g.ints([two, b, k, times, s, d])],
            "kv_spread",
            (two, b, k, times, s, d),
            kv.dtype,
        )
        return g.node(
            "Reshape",
            [spread.name, g.ints([two, b, k * times, s, d])],
            "kv_repeated",
            (two, b, k * times, s, d),
            kv.dtype,
        )

    def _members(self, group: Group) -> list[int]:
        if group == "heads":
            return self.layout.head_group_ranks(self.rank)
        return self.layout.context_group_ranks(self.rank)

    def all_gather(self, x: Tensor, group: Group, axis: int) -> Sym:
        """Axis to dim 0, all_gather (concatenates dim 0 in member order), and back."""
        x = self.wire(x)
        members = self._members(group)
        n = len(members)
        if n == 1:
            return x
        axis %= len(x.shape)
        perm = _transpose_perm(len(x.shape), 0, axis)
        front = self._transpose(x, perm)
        grown = (front.shape[0] * n, *front.shape[1:])
        gathered = self.g.collective(front, "all_gather", members, grown)
        return self._transpose(gathered, perm)

    def all_to_all(self, x: Tensor, group: Group, split_axis: int, concat_axis: int) -> Sym:
        """Split axis to dim 0, all_to_all (chunk j of dim 0 to member j, arrivals in member
        order along dim 0), then the member index moved in front of the concat axis."""
        x = self.wire(x)
        members = self._members(group)
        n = len(members)
        if n == 1:
            return x
        ndim = len(x.shape)
        split, concat = split_axis % ndim, concat_axis % ndim
        perm = _transpose_perm(ndim, 0, split)
        front = self._transpose(x, perm)
        exchanged = self.g.collective(front, "all_to_all", members, front.shape)
        # Dims of ``exchanged`` viewed as [n, chunk, the rest of ``front``], labelled by the
        # axis of ``x`` each came from (the member index as "n").
        chunk = x.shape[split] // n
        labels = ["n", split] + [perm[i] for i in range(1, ndim)]
        sizes = [n, chunk] + [front.shape[i] for i in range(1, ndim)]
        split_view = self.g.node(
            "Reshape", [exchanged.name, self.g.ints(sizes)], "a2a_chunks", tuple(sizes), x.dtype
        )
        order: list[int | str] = []
        for a in range(ndim):
            order += ["n", a] if a == concat else [a]
        moved = self._transpose(split_view, [labels.index(a) for a in order])
        out_shape = list(x.shape)
        out_shape[split] = chunk
        out_shape[concat] *= n
        return self.g.node(
            "Reshape", [moved.name, self.g.ints(out_shape)], "a2a_out", tuple(out_shape), x.dtype
        )

    def kv_stream(self, kv: Tensor, group: Group) -> Iterator[tuple[int, Tensor]]:
        """One broadcast per member, in member order, rooted at that member (see the module
        docstring); yields this rank's own block first, then the others in ring order."""
        kv = self.wire(kv)
        members = self._members(group)
        n, me = len(members), members.index(self.rank)
        if n == 1:
            yield 0, kv
            return
        blocks: list[Sym] = []
        for step, root in enumerate(members):
            source = kv if step == me or step == 0 else blocks[-1]
            blocks.append(self.g.collective(source, "broadcast", members, kv.shape, root=root))
        for offset in range(n):  # every output is read (this rank's own too), so none is pruned
            member = (me - offset) % n
            yield member, blocks[member]

    # ---- helpers --------------------------------------------------------------------------

    def _transpose(self, x: Sym, perm: list[int]) -> Sym:
        if perm == sorted(perm):
            return x
        shape = tuple(x.shape[p] for p in perm)
        return self.g.node("Transpose", [x.name], "transpose", shape, x.dtype, perm=perm)

    def _key_value(self, kv: Sym) -> tuple[Sym, Sym]:
        """K and V of a packed [2, B, K, S, D] tensor."""

        def pick(index: int) -> Sym:
            return self.g.node(
                "Gather",
                [kv.name, self.g.constant(np.asarray(index, np.int64), "index")],
                "kv_part",
                kv.shape[1:],
                kv.dtype,
                axis=0,
            )

        return (
            self.g.memo(("key", kv.name), lambda: pick(0)),
            self.g.memo(("value", kv.name), lambda: pick(1)),
        )

    def expand(self, call: _Attention) -> None:
        """Write ``call``'s nodes: fused if its log-sum-exp was never read, else spelled out;
        then a cast for any other dtype its output was read in."""
        made = self._fused(call) if call.lse_name is None else self._spelled_out(call)
        for dtype, name in call.out_names.items():
            if dtype != made.dtype:
                self.g.node("Cast", [made.name], "cast", made.shape, dtype, output=name, to=dtype)

    def _mask_kind(self, q_pos: np.ndarray, k_pos: np.ndarray) -> str:
        """What masking the real queries at ``q_pos`` need over keys at ``k_pos`` (padding
        queries' rows are dropped, so they may see anything): "none"; "causal", the plain
        lower triangle (queries and keys the same consecutive positions); or "mask"."""
        wl = self.workload
        real_queries = q_pos[q_pos < wl.seq_len]
        real_keys = k_pos < wl.seq_len
        if real_queries.size == 0:
            return "none"
        if not wl.causal:
            return "none" if real_keys.all() else "mask"
        if real_keys.all() and k_pos.max() <= real_queries.min():
            return "none"
        if np.array_equal(q_pos, k_pos) and bool(np.all(np.diff(q_pos) == 1)):
            return "causal"
        return "mask"

    def _visible(self, q_pos: np.ndarray, k_pos: np.ndarray) -> Sym:
        """The [queries, keys] boolean mask, computed in the graph from two position vectors
        (constants of the two lengths, not of their product): a key is visible if it is a
        real token at or before the query (causal) or any real token."""
        wl = self.workload
        never = np.iinfo(np.int32).max  # a padding key's stand-in position
        keys = np.where(k_pos < wl.seq_len, k_pos, never).astype(np.int32)[None, :]
        limits = (q_pos if wl.causal else np.full(len(q_pos), wl.seq_len - 1)).astype(np.int32)[:, None]
        key_name, limit_name = self.g.constant(keys, "key_positions"), self.g.constant(limits, "query_limits")
        return self.g.memo(
            ("visible", key_name, limit_name),
            lambda: self.g.node(
                "LessOrEqual", [key_name, limit_name], "visible", (len(q_pos), len(k_pos)), TensorProto.BOOL
            ),
        )

    def _fused(self, call: _Attention) -> Sym:
        """The ONNX ``Attention`` op: no statistics out, the default 1/sqrt(d) scale."""
        g = self.g
        key, value = self._key_value(call.kv)
        inputs = [call.q.name, key.name, value.name]
        attributes: dict[str, object] = {}
        kind = self._mask_kind(call.q_pos, call.k_pos)
        if kind == "causal":
            attributes["is_causal"] = 1
        elif kind == "mask":
            inputs.append(self._visible(call.q_pos, call.k_pos).name)
        return g.node(
            "Attention",
            inputs,
            "attention",
            call.q.shape,
            call.q.dtype,
            output=call.out_names.get(call.q.dtype),
            **attributes,
        )

    def _spelled_out(self, call: _Attention) -> Sym:
        """Scores, float32 softmax statistics and the normalised output of one block; writes
        the log-sum-exp under ``call.lse_name``."""
        g = self.g
        q, (key, value) = call.q, self._key_value(call.kv)
        b, h, sq, d = q.shape
        kv_heads, sk = key.shape[1], key.shape[2]
        group = h // kv_heads
        scale = 1.0 / math.sqrt(d)
        scaled = g.memo(
            ("scaled", q.name),
            lambda: g.node(
                "Mul", [q.name, g.constant(np.asarray(scale), "scale", q.dtype)], "q_scaled", q.shape, q.dtype
            ),
        )
        keys_t = g.memo(
            ("keys_t", key.name),
            lambda: g.node(
                "Transpose", [key.name], "keys_t", (b, kv_heads, d, sk), key.dtype, perm=[0, 1, 3, 2]
            ),
        )
        lead: tuple[int, ...] = (b, h)
        if group > 1:  # query head h reads KV head h // group: [B, K, G, ...] against [B, K, 1, ...]
            lead = (b, kv_heads, group)
            scaled = g.memo(
                ("grouped", scaled.name),
                lambda: g.node(
                    "Reshape",
                    [scaled.name, g.ints([b, kv_heads, group, sq, d])],
                    "q_grouped",
                    (*lead, sq, d),
                    q.dtype,
                ),
            )

            def lifted(x: Sym, name: str, shape: tuple[int, ...]) -> Sym:
                """``x`` with a unit group axis at 2, made once per tensor."""
                return g.memo(("lifted", x.name), lambda: g.node(
                    "Unsqueeze", [x.name, g.ints([2], "axes")], name, shape, key.dtype))

            keys_t = lifted(keys_t, "keys_lifted", (b, kv_heads, 1, d, sk))
            value = lifted(value, "values_lifted", (b, kv_heads, 1, sk, d))
        scores = self.as_dtype(
            g.node("MatMul", [scaled.name, keys_t.name], "scores", (*lead, sq, sk), q.dtype), FLOAT
        )
        if self._mask_kind(call.q_pos, call.k_pos) != "none":
            visible = self._visible(call.q_pos, call.k_pos)
            bias = g.memo(
                ("bias", visible.name),
                lambda: g.node(
                    "Where",
                    [
                        visible.name,
                        g.constant(np.float32(0), "zero"),
                        g.constant(np.float32(MASKED), "masked"),
                    ],
                    "mask_bias",
                    visible.shape,
                    FLOAT,
                ),
            )
            scores = g.node("Add", [scores.name, bias.name], "scores_masked", scores.shape, FLOAT)
        axes = g.ints([-1], "axes")
        row_max = g.node("ReduceMax", [scores.name, axes], "row_max", (*lead, sq, 1), FLOAT, keepdims=1)
        shifted = g.node("Sub", [scores.name, row_max.name], "scores_shifted", scores.shape, FLOAT)
        weights = g.node("Exp", [shifted.name], "weights", scores.shape, FLOAT)
        row_sum = g.node("ReduceSum", [weights.name, axes], "row_sum", row_max.shape, FLOAT, keepdims=1)
        mixed = g.node(
            "MatMul", [self.as_dtype(weights, q.dtype).name, value.name], "weighted", (*lead, sq, d), q.dtype
        )
        out_name = call.out_names.get(FLOAT)
        out = g.node(
            "Div",
            [self.as_dtype(mixed, FLOAT).name, row_sum.name],
            "block_out",
            mixed.shape,
            FLOAT,
            output=None if group > 1 else out_name,
        )
        log_sum = g.node("Log", [row_sum.name], "row_log", row_max.shape, FLOAT)
        lse = g.node(
            "Add",
            [row_max.name, log_sum.name],
            "lse",
            row_max.shape,
            FLOAT,
            output=None if group > 1 else call.lse_name,
        )
        if group > 1:
            g.node(
                "Reshape",
                [lse.name, g.ints(call.lse_shape)],
                "lse",
                call.lse_shape,
                FLOAT,
                output=call.lse_name,
            )
            out = g.node("Reshape", [out.name, g.ints(q.shape)], "block_out", q.shape, FLOAT, output=out_name)
        return out


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
