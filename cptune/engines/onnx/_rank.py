"""The onnx engine on one rank: the graph the driver exported, run by ONNX's reference runtime.

``RankTask`` loads the serialized graph it was sent (never rebuilds it) and runs it with
``onnx.reference.ReferenceEvaluator``; each ``DistCollective`` node runs as the matching
MPI collective over the communicator of its ``groups`` (empty: the graph's own
communicator, here every rank of the configuration), with TensorRT's dim-0 semantics
(``_dialect``). Imported on a rank's first onnx run only.
"""

from __future__ import annotations

import numpy as np
import onnx
from mpi4py import MPI
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from cptune.config import CPConfig
from cptune.engines import _protocol as protocol
from cptune.engines.onnx._builder import ELEMENT_TYPES
from cptune.engines.onnx._dialect import DOMAIN
from cptune.engines.onnx._tensorrt import reference_ops
from cptune.layout import SequenceLayout
from cptune.workload import Workload

#: numpy dtype of each workload dtype inside the graph (bf16 is a real bfloat16 here).
GRAPH_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(helper.tensor_dtype_to_np_dtype(element)) for name, element in ELEMENT_TYPES.items()
}


def _bytes(x: np.ndarray) -> np.ndarray:
    """A contiguous array's memory as bytes, for MPI (bfloat16 has no MPI type)."""
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def collective_op(comms: dict[tuple[int, ...], MPI.Comm]) -> type[OpRun]:
    """The ``DistCollective`` op of the reference runtime, over ``comms`` (a communicator per
    ordered group of global ranks; the empty group is the whole world of the run)."""

    class DistCollective(OpRun):
        op_domain = DOMAIN

        def _run(
            self,
            x,
            collective_operation=None,
            reduce_op=None,
            root=None,
            groups=None,  # noqa: ANN001
            group_size=None,
            nb_rank=None,
        ):
            members = tuple(int(g) for g in groups)
            comm = comms[members]
            n = comm.Get_size()
            if nb_rank != n or group_size != len(members):
                raise ValueError(
                    f"DistCollective over {members}: nb_rank {nb_rank} and group_size "
                    f"{group_size} do not match the group of {n} ranks"
                )
            x = np.ascontiguousarray(x)
            if collective_operation == "all_gather":
                out = np.empty((n, *x.shape), dtype=x.dtype)
                comm.Allgather([_bytes(x), MPI.BYTE], [_bytes(out), MPI.BYTE])
                return (out.reshape((n * x.shape[0], *x.shape[1:])),)
            if collective_operation == "all_to_all":
                if x.shape[0] % n:
                    raise ValueError(f"all_to_all needs dim 0 ({x.shape[0]}) divisible by nb_rank {n}")
                out = np.empty_like(x)
                comm.Alltoall([_bytes(x), MPI.BYTE], [_bytes(out), MPI.BYTE])
                return (out,)
            if collective_operation == "broadcast":
                out = x.copy()
                local_root = members.index(root) if members else root
                comm.Bcast([_bytes(out), MPI.BYTE], root=local_root)
                return (out,)
            raise NotImplementedError(
                f"DistCollective {collective_operation!r}: cptune's graphs "
                f"use all_gather, all_to_all and broadcast only"
            )

    return DistCollective


class RankTask:
    """One configuration's graph on this rank, ready to run: the graph TensorRT builds
    (``for_tensorrt``), its rank inputs sent after the graph, in the graph's input order."""

    def __init__(self, header: dict, arrays: list[np.ndarray], comms: dict[str, MPI.Comm], rank: int) -> None:
        workload = Workload(**header["workload"])
        config = CPConfig(**header["config"])
        layout = SequenceLayout(workload, config)
        q, k, v, graph, *extra = arrays
        dtype = GRAPH_DTYPES[workload.dtype]
        model = onnx.load_from_string(graph.tobytes())
        names = [value.name for value in model.graph.input]
        self.feeds = {"q": q.astype(dtype), "k": k.astype(dtype), "v": v.astype(dtype)}
        self.feeds.update(zip(names[3:], extra, strict=True))
        groups = {
            (): comms["all"],  # a graph written for one group's communicator: here, all ranks
            tuple(range(config.ranks)): comms["all"],
            tuple(layout.head_group_ranks(rank)): comms["heads"],
            tuple(layout.context_group_ranks(rank)): comms["context"],
        }
        self.session = ReferenceEvaluator(model, new_ops=[collective_op(groups), *reference_ops()])

    def run_once(self) -> protocol.Message:
        """Run the graph once: this rank's output in float32 (peak memory is not measured:
        the reference runtime's says nothing about TensorRT's)."""
        (out,) = self.session.run(None, self.feeds)
        return {"peak_bytes": 0}, [np.asarray(out, dtype=np.float32)]

    def time(self, warmup: int, repeats: int) -> protocol.Message:
        raise RuntimeError("the onnx engine checks correctness and does not time")


#: Calibration ops: none (the onnx engine does not time).
OPS: dict[str, object] = {}
