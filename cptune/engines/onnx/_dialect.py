"""The ``DistCollective`` node of TensorRT's ONNX parser, written one way for every graph.

TensorRT 11's ONNX parser turns a node of op_type ``DistCollective`` into an
``IDistCollectiveLayer``; it picks the importer by op_type alone. Polygraphy writes the node
in the default domain, which ``onnx.checker`` rejects, so cptune puts it in its own domain
(``DOMAIN``) and every graph imports that domain (``OPSET_IMPORT``): the checker then
accepts the node as a custom op. That TensorRT accepts the custom domain is read from its
parser source, not tried on a GPU.

Attributes, all written on every node (the importer has no defaults for them):
- ``collective_operation``: one of ``OPERATIONS``. Every operation works on dim 0:
  all_gather/gather multiply it by ``nb_rank``, reduce_scatter/scatter divide it,
  all_to_all cuts it into ``nb_rank`` equal chunks (chunk j to member j) and concatenates
  what arrives in member order.
- ``reduce_op``: one of ``REDUCE_OPS``; "none" exactly for the non-reducing operations, as
  TensorRT 11's operator page requires ("For ALL_GATHER, BROADCAST, ALL_TO_ALL, GATHER, and
  SCATTER, reduce_op must be NONE"; Polygraphy's shard.py writes "sum" on its all_gathers).
- ``root``: -1 for rootless operations; for broadcast/reduce/gather/scatter a rank of the
  communicator the graph runs on. With ``groups`` empty (every rank of that communicator takes
  part: how cptune writes a graph whose collectives run in one group, on a communicator of
  that group alone) it is plainly the root's rank there. With ``groups`` given (a hybrid's
  graphs, on one communicator of all ranks) cptune writes the root's **global** rank, one of
  ``groups``. Sources: the operator page (docs.nvidia.com/deeplearning/tensorrt/11.0.0/
  _static/operators/DistCollective.html) calls ``root`` "the root rank" and ``groups`` an
  "array of rank IDs defining a communication group", one rank space for both; the 11.4
  Python bindings describe ``groups`` as ordered, "its order defines the group-local rank,
  used to remap root", i.e. TensorRT turns the given root into its index in ``groups``.
  Neither says it in so many words and no public example builds a grouped rooted
  collective, so that reading is unverified on a GPU: ``cptune doctor``'s broadcast_root
  probe asks the node, and where it reads otherwise the hybrids are refused. The onnx engine
  executes the reading written here (``_rank``).
- ``groups`` (INTS): the ordered ranks taking part; empty means every rank of the
  communicator. Always written, as INTS even when empty (``make_node`` cannot type an empty
  list).
- ``group_size``: ``len(groups)`` (0 when empty).
- ``nb_rank``: how many ranks take part (``len(groups)`` when groups are given, else the
  communicator's size); sets the output shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx import AttributeProto, NodeProto, OperatorSetIdProto, helper

#: The custom domain cptune writes ``DistCollective`` in, and its version.
DOMAIN = "cptune.tensorrt"
DOMAIN_VERSION = 1
OP_TYPE = "DistCollective"

OPERATIONS: tuple[str, ...] = (
    "all_gather", "all_reduce", "broadcast", "reduce", "reduce_scatter", "all_to_all", "gather", "scatter",
)
REDUCE_OPS: tuple[str, ...] = ("sum", "max", "min", "prod", "avg", "none")
#: Operations that reduce (``reduce_op`` must not be "none") and that have a root.
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})


def opset_import() -> OperatorSetIdProto:
    """The ``opset_import`` entry every graph with ``DistCollective`` nodes needs."""
    return helper.make_opsetid(DOMAIN, DOMAIN_VERSION)


def dist_collective(
    source: str,
    result: str,
    operation: str,
    *,
    groups: Sequence[int],
    nb_rank: int,
    root: int = -1,
    reduce_op: str = "none",
    name: str | None = None,
) -> NodeProto:
    """One ``DistCollective`` node from tensor ``source`` to tensor ``result``.

    ``groups`` are the global ranks taking part, in order (empty: all ``nb_rank`` ranks of
    the world); ``root`` is a global rank (see the module docstring). Raises ``ValueError``
    for a combination TensorRT's parser rejects, so no graph is written with one."""
    if operation not in OPERATIONS:
        raise ValueError(f"collective_operation must be one of {', '.join(OPERATIONS)}, got {operation!r}")
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op must be one of {', '.join(REDUCE_OPS)}, got {reduce_op!r}")
    if (operation in REDUCING) == (reduce_op == "none"):
        need = "a reduction" if operation in REDUCING else "reduce_op 'none'"
        raise ValueError(f"{operation} needs {need}, got reduce_op {reduce_op!r}")
    members = [int(g) for g in groups]
    if len(set(members)) != len(members) or any(g < 0 for g in members):
        raise ValueError(f"groups must be distinct non-negative ranks, got {members}")
    if nb_rank < 1 or (members and nb_rank != len(members)):
        raise ValueError(f"nb_rank {nb_rank} does not match groups {members}")
    if operation in ROOTED:
        valid_roots = members or range(nb_rank)
        if root not in valid_roots:
            raise ValueError(f"{operation} needs a root among ranks {list(valid_roots)}, got {root}")
    elif root != -1:
        raise ValueError(f"{operation} has no root: root must be -1, got {root}")
    node = helper.make_node(
        OP_TYPE, [source], [result], name=name, domain=DOMAIN,
        collective_operation=operation, reduce_op=reduce_op, root=int(root),
        group_size=len(members), nb_rank=int(nb_rank),
    )
    node.attribute.append(helper.make_attribute("groups", members, attr_type=AttributeProto.INTS))
    return node


def collective_attributes(node: NodeProto) -> dict[str, object]:
    """The attributes of a ``DistCollective`` node as Python values (strings decoded,
    ``groups`` a list)."""
    values: dict[str, object] = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        values[attribute.name] = value.decode() if isinstance(value, bytes) else value
    if "groups" in values:
        values["groups"] = [int(g) for g in values["groups"]]  # type: ignore[attr-defined]
    return values
