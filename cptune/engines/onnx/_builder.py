"""The graph under construction: its tensors, nodes and constants, with attention requests
kept as placeholders until the graph is finished (``cptune.engines.onnx._graph``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

from cptune.engines.onnx import _dialect as dialect

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
class AttentionCall:
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
class OutOf:
    call: AttentionCall


@dataclass(frozen=True)
class LseOf:
    call: AttentionCall


Tensor = Sym | OutOf | LseOf


class GraphBuilder:
    """Nodes, constants and value infos of one graph; attention requests stay placeholders
    until ``finish``."""

    def __init__(self) -> None:
        self._items: list[NodeProto | AttentionCall] = []
        self._sink: list[NodeProto | AttentionCall] = self._items
        self.initializers: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._ids = itertools.count()
        self._constants: dict[tuple[object, ...], str] = {}
        self._memo: dict[tuple[object, ...], Sym] = {}
        #: Inputs beyond q, k, v whose values differ by rank, and this rank's values.
        self.inputs: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}

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
        **attributes: Any,
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
        self, x: Sym, operation: str, members: list[int], shape: tuple[int, ...], root: int = -1,
        local: bool = False,
    ) -> Sym:
        """A ``DistCollective`` among ``members`` (global ranks, in member order; ``root`` one
        of them). ``local``: written for a communicator of exactly these ranks (``groups``
        empty, ``root`` its index among them), so the node is the same on every member;
        else with the global ranks in ``groups``, for a communicator over all ranks. Its
        output's shape is recorded so shape inference sees through the custom op."""
        out = Sym(self.fresh(operation), tuple(shape), x.dtype)
        if local and root != -1:
            root = members.index(root)
        self._sink.append(
            dialect.dist_collective(
                x.name,
                out.name,
                operation,
                groups=[] if local else members,
                nb_rank=len(members),
                root=root,
                name=self.fresh(f"DistCollective_{operation}"),
            )
        )
        self.value_info.append(helper.make_tensor_value_info(out.name, out.dtype, out.shape))
        return out

    def rank_input(self, name: str, value: np.ndarray, dtype: int) -> Sym:
        """A graph input whose value differs by rank (positions, a member index): the graph
        stays the same on every rank, and this rank's ``value`` is kept in ``feeds``. Asked
        again under the same name, it must be the same value."""
        if name in self.feeds:
            if not np.array_equal(self.feeds[name], value):
                raise ValueError(f"rank input {name!r} asked for with two different values")
        else:
            self.feeds[name] = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
            self.inputs.append(helper.make_tensor_value_info(name, dtype, list(value.shape)))
        return Sym(name, tuple(value.shape), dtype)

    def request(self, call: AttentionCall) -> None:
        self._sink.append(call)

    def finish(self, expand: Callable[[AttentionCall], None]) -> list[NodeProto]:
        """The final node list: each attention placeholder replaced, in place, by the nodes
        ``expand(call)`` appends."""
        nodes: list[NodeProto | AttentionCall] = []
        self._sink = nodes
        for item in self._items:
            if isinstance(item, AttentionCall):
                expand(item)
            else:
                nodes.append(item)
        self._sink = self._items
        return [node for node in nodes if isinstance(node, NodeProto)]


def transpose_perm(ndim: int, a: int, b: int) -> list[int]:
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


