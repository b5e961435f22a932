"""``OnnxOps``: the ``Primitives`` that write one rank's graph, and how each attention request
is spelled out when the graph is finished (see ``cptune.engines.onnx._graph``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from onnx import TensorProto

from cptune.engines.onnx._builder import (
    ELEMENT_TYPES,
    FLOAT,
    MASKED,
    AttentionCall,
    GraphBuilder,
    LseOf,
    OutOf,
    Sym,
    Tensor,
    transpose_perm,
)
from cptune.layout import SequenceLayout
from cptune.strategies.primitives import Group, Partial


class OnnxOps:
    """``Primitives`` that write graph nodes for rank ``rank`` of ``layout``."""

    def __init__(self, layout: SequenceLayout, rank: int, builder: GraphBuilder) -> None:
        self.layout = layout
        self.workload = layout.workload
        self.rank = rank
        self.g = builder
        self.dtype = ELEMENT_TYPES[self.workload.dtype]
        #: A graph whose collectives all run in one group (every configuration but the
        #: hybrids) writes them for a communicator of that group (``groups`` empty, roots
        #: group-local), so every rank's graph is the same; a hybrid's run in two groups
        #: over one communicator of all ranks, named by their global ranks.
        self.local = not (layout.head_group > 1 and layout.context_degree > 1)

    # ---- tensors in a given dtype -------------------------------------------------------

    def as_dtype(self, x: Tensor, dtype: int) -> Sym:
        """``x`` in ``dtype``: a placeholder's result is requested from its attention call,
        anything else cast once if needed."""
        if isinstance(x, LseOf):
            if x.call.lse_name is None:
                x.call.lse_name = self.g.fresh("lse")
            assert dtype == FLOAT, "the log-sum-exp is float32"
            return Sym(x.call.lse_name, x.call.lse_shape, FLOAT)
        if isinstance(x, OutOf):
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

    def attention(self, q: Tensor, kv: Tensor, q_pos: np.ndarray, k_pos: np.ndarray,
                  into: Partial | None = None) -> Partial:
        call = AttentionCall(self.wire(q), self.wire(kv), np.asarray(q_pos), np.asarray(k_pos))
        self.g.request(call)
        part = Partial(OutOf(call), LseOf(call))
        return part if into is None else self._merge(into, part)

    def _merge(self, acc: Partial, part: Partial) -> Partial:
        """The online-softmax merge of two partials over disjoint keys, as graph nodes."""
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

    def _repeat_heads(self, kv: Sym, times: int) -> Sym:
        """Each KV head of ``kv`` [2, batch, kv_heads, seq, head_dim] repeated ``times`` times."""
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

    def all_gather(self, x: Tensor, group: Group, axis: int,
                   order: Sequence[tuple[int, int, int]] | None = None) -> Sym:
        """Axis to dim 0, all_gather (concatenates dim 0 in member order), and back; then,
        given ``order``, its ranges sliced and joined in that order."""
        x = self.wire(x)
        members = self._members(group)
        n = len(members)
        if n == 1:
            return x
        axis %= len(x.shape)
        perm = transpose_perm(len(x.shape), 0, axis)
        front = self._transpose(x, perm)
        grown = (front.shape[0] * n, *front.shape[1:])
        stacked = self.g.collective(front, "all_gather", members, grown, local=self.local)
        gathered = self._transpose(stacked, perm)
        if order is None:
            return gathered
        g, length = self.g, x.shape[axis]
        pieces = []
        for member, start, stop in order:
            shape = tuple(stop - start if a == axis else size for a, size in enumerate(gathered.shape))
            pieces.append(g.node("Slice", [gathered.name, g.ints([member * length + start]),
                                           g.ints([member * length + stop]), g.ints([axis])],
                                 "gathered_piece", shape, x.dtype))
        names = [piece.name for piece in pieces]
        return g.node("Concat", names, "gathered_in_order", gathered.shape, x.dtype, axis=axis)

    def all_to_all(self, x: Tensor, group: Group, split_axis: int, concat_axis: int, repeat: int = 1) -> Sym:
        """Split axis to dim 0, all_to_all (chunk j of dim 0 to member j, arrivals in member
        order along dim 0), then the member index moved in front of the concat axis. ``repeat``
        repeats the KV heads of a [2, batch, kv_heads, seq, head_dim] tensor (Ulysses')."""
        x = self.wire(x)
        members = self._members(group)
        n = len(members)
        if n == 1:
            return x
        if repeat > 1:
            x = self._repeat_heads(x, repeat)
        ndim = len(x.shape)
        split, concat = split_axis % ndim, concat_axis % ndim
        perm = transpose_perm(ndim, 0, split)
        front = self._transpose(x, perm)
        exchanged = self.g.collective(front, "all_to_all", members, front.shape, local=self.local)
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

    def narrow(self, x: Tensor, axis: int, start: int, stop: int) -> Sym:
        x = self.wire(x)
        axis %= len(x.shape)
        shape = tuple(stop - start if a == axis else size for a, size in enumerate(x.shape))
        return self.g.node("Slice", [x.name, self.g.ints([start]), self.g.ints([stop]), self.g.ints([axis])],
                           "narrowed", shape, x.dtype)

    def pad(self, x: Tensor, axis: int, size: int) -> Sym:
        x = self.wire(x)
        axis %= len(x.shape)
        shape = tuple(size - n if a == axis else n for a, n in enumerate(x.shape))
        zeros = Sym(self.g.constant(np.zeros(shape, dtype=np.float32), "zero_heads", x.dtype), shape, x.dtype)
        return self.concat([x, zeros], axis)

    def concat(self, parts: Sequence[Tensor], axis: int) -> Sym:
        syms = [self.wire(part) for part in parts]
        axis %= len(syms[0].shape)
        shape = tuple(sum(p.shape[axis] for p in syms) if a == axis else size
                      for a, size in enumerate(syms[0].shape))
        return self.g.node("Concat", [p.name for p in syms], "joined", shape, syms[0].dtype, axis=axis)

    def kv_stream(self, kv: Tensor, group: Group, steps: int | None = None) -> Iterator[tuple[int, Tensor]]:
        """One broadcast per member, in member order, rooted at that member, and the blocks
        yielded in member order: the same nodes on every rank (see the module docstring); every
        member's, whatever ``steps`` (a broadcast reaches every rank alike).
        Each step's input is this rank's block where it is the root, else the previous
        step's output (a ``Where`` on the rank input ``ring_member``), so the steps stay in
        order on every rank."""
        kv = self.wire(kv)
        members = self._members(group)
        if len(members) == 1:
            yield 0, kv
            return
        g = self.g
        me = g.rank_input("ring_member", np.asarray([members.index(self.rank)], np.int32), TensorProto.INT32)
        blocks: list[Sym] = []
        for step, root in enumerate(members):
            source = kv
            if step:
                is_root = g.node("Equal", [me.name, g.constant(np.asarray([step], np.int32), "step")],
                                 "is_root", (1,), TensorProto.BOOL)
                source = g.node("Where", [is_root.name, kv.name, blocks[-1].name], "stream_in", kv.shape,
                                kv.dtype)
            blocks.append(g.collective(source, "broadcast", members, kv.shape, root=root, local=self.local))
        yield from enumerate(blocks)

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

    def expand(self, call: AttentionCall) -> None:
        """Write ``call``'s nodes: fused if its log-sum-exp was never read, else spelled out;
        then a cast for any other dtype its output was read in."""
        made = self._fused(call) if call.lse_name is None else self._spelled_out(call)
        for dtype, name in call.out_names.items():
            if dtype != made.dtype:
                self.g.node("Cast", [made.name], "cast", made.shape, dtype, output=name, to=dtype)

    def _mask_kind(self, q_pos: np.ndarray, k_pos: np.ndarray) -> str:
        """What masking the real queries at ``q_pos`` need over keys at ``k_pos`` (padding
        queries' rows are dropped, so they may see anything): "none"; "causal", the plain
        lower triangle (queries and keys the same consecutive positions); or "mask". Decided
        the same way on every rank: where the queries' positions differ by rank (several
        context blocks), a causal block is always masked by position."""
        wl = self.workload
        real_keys = k_pos < wl.seq_len
        if not wl.causal:
            return "none" if real_keys.all() else "mask"
        if self.layout.context_degree > 1:
            return "mask"
        real_queries = q_pos[q_pos < wl.seq_len]
        if real_keys.all() and k_pos.max() <= real_queries.min():
            return "none"
        if np.array_equal(q_pos, k_pos) and bool(np.all(np.diff(q_pos) == 1)):
            return "causal"
        return "mask"

    def _visible(self, q_pos: np.ndarray, k_pos: np.ndarray) -> Sym:
        """The [queries, keys] boolean mask, computed in the graph from two position vectors
        (not their product): a key is visible if it is a real token at or before the query
        (causal) or any real token. Key positions are constants (the same block on every
        rank); causal query positions are the rank input ``query_positions`` where they
        differ by rank, else constants."""
        wl = self.workload
        never = np.iinfo(np.int32).max  # a padding key's stand-in position
        keys = np.where(k_pos < wl.seq_len, k_pos, never).astype(np.int32)[None, :]
        limits = (q_pos if wl.causal else np.full(len(q_pos), wl.seq_len - 1)).astype(np.int32)[:, None]
        key_name = self.g.constant(keys, "key_positions")
        if wl.causal and self.layout.context_degree > 1:
            limit_name = self.g.rank_input("query_positions", limits, TensorProto.INT32).name
        else:
            limit_name = self.g.constant(limits, "query_limits")
        return self.g.memo(
            ("visible", key_name, limit_name),
            lambda: self.g.node(
                "LessOrEqual", [key_name, limit_name], "visible", (len(q_pos), len(k_pos)), TensorProto.BOOL
            ),
        )

    def _fused(self, call: AttentionCall) -> Sym:
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

    def _spelled_out(self, call: AttentionCall) -> Sym:
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
                        g.constant(np.array(0, np.float32), "zero"),
                        g.constant(np.array(MASKED, np.float32), "masked"),
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


