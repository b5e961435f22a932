"""``cptune doctor``'s probes, on the ranks: tiny graphs with rank-dependent values, each
answering one question only a GPU can (``cptune.engines._verdict.PROBES``).

Each probe runs on every rank at once, through the rank's own ``load`` (so it meets the
engine cache, the shared build, the fused-collective check and the communicators exactly
as runs do), and returns ``{"passed", "seen", "answer"}``. A wrong value is an answer; an
exception is the rank's failure, which the driver records as the probe's; a hang is the
driver's deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import onnx
from mpi4py import MPI
from onnx import TensorProto, helper

from cptune.config import CPConfig
from cptune.engines import UNTRIED
from cptune.engines.onnx import dist_collective, for_tensorrt, tensorrt_rank_graph
from cptune.engines.onnx._calibration import (
    COLLECTIVE_DTYPE,
    attention_graph,
    collective_graph,
    single_op_model,
)
from cptune.engines.tensorrt._checks import CheckedGraph, check_case
from cptune.workload import Workload

Answer = dict[str, Any]
#: Bytes per peer the collective probes move: small, and a multiple of every chunk size.
PROBE_BYTES = 4096
#: The attention the dtype probes build: causal (a mask), GQA-free, head size 64.
ATTENTION_SHAPE = {"heads": 4, "seq_q": 128, "seq_k": 128, "head_dim": 64, "causal": 1}
KINDS = ("all_to_all", "all_gather", "broadcast")


class ProbeGraph(CheckedGraph, Protocol):
    """What a probe needs of a graph its rank loaded (``_worker.LoadedGraph``)."""

    #: Whether it was rebuilt with a float32 Cast around each collective.
    cast_boundary: bool

    def close(self) -> None: ...


class ProbeRank(Protocol):
    """What a probe needs of the rank it runs on (``_worker.TensorRTWorker``)."""

    rank: int

    def load(self, make: Callable[[bool], tuple[onnx.ModelProto, dict[str, np.ndarray]]],
             comm: MPI.Comm) -> tuple[ProbeGraph, float | None]: ...


def _answer(passed: bool, seen: str, answer: str = "") -> Answer:
    return {"passed": passed, "seen": seen, "answer": answer}


def _checked(rank: ProbeRank, comm: MPI.Comm, case: dict, model: Any, point: Any) -> str | None:
    """Load ``model`` on a communicator of all of ``comm``'s ranks, run it once and check
    its values as calibration does: None when right, else what was wrong (one line)."""
    graph = _loaded(rank, comm, model)
    try:
        check_case(graph, case, point, rank.rank)
    except RuntimeError as wrong:
        return str(wrong)
    finally:
        graph.close()
    return None


def collectives(rank: ProbeRank, comm: MPI.Comm) -> Answer:
    """Each collective kind over every rank, on a communicator of them all."""
    n = comm.Get_size()
    wrong = [problem for kind in KINDS if (problem := _checked(
        rank, comm, {"collective": kind, "group": n}, collective_graph(kind, n, n, rank.rank, PROBE_BYTES),
        PROBE_BYTES))]
    return _answer(not wrong, wrong[0] if wrong else f"{', '.join(KINDS)} on {n} GPU(s): values right")


def subgroups(rank: ProbeRank, comm: MPI.Comm) -> Answer:
    """Each collective kind in two halves of the ranks named in ``groups``, on one
    communicator of all ranks: how a hybrid's graphs are written."""
    n = comm.Get_size()
    if n < 4:
        return _answer(True, f"not tried: two groups of 2 need 4 GPUs, {n} here (hybrids need 4 too)",
                       UNTRIED)
    half = n // 2
    wrong = [problem for kind in KINDS if (problem := _checked(
        rank, comm, {"collective": kind, "group": half},
        collective_graph(kind, n, half, rank.rank, PROBE_BYTES, local=False), PROBE_BYTES))]
    return _answer(not wrong, wrong[0] if wrong else f"groups of {half} named among {n} GPUs: values right")


def broadcast_root(rank: ProbeRank, comm: MPI.Comm) -> Answer:
    """A broadcast over every rank named in reverse order with root 0: rank 0's value
    everywhere if ``root`` is read as a global rank (as cptune writes it), the last rank's
    if it is read as an index into ``groups``."""
    n = comm.Get_size()
    if n < 2:
        return _answer(True, "not tried: needs 2 GPUs", UNTRIED)
    node = dist_collective("x", "y", "broadcast", groups=list(range(n))[::-1], nb_rank=n, root=0,
                           name="collective")
    shape = [PROBE_BYTES // 2]
    model = single_op_model(node, helper.make_tensor_value_info("x", COLLECTIVE_DTYPE, shape),
                            helper.make_tensor_value_info("y", COLLECTIVE_DTYPE, shape), "root_probe")
    graph = _loaded(rank, comm, model)
    try:
        graph.fill({"x": np.full(shape, rank.rank + 1, np.float32)})
        graph.execute()
        got = set(np.unique(graph.read("y")).tolist())
    finally:
        graph.close()
    if got == {1.0}:
        return _answer(True, "root read as a global rank, as cptune writes it", "global")
    if got == {float(n)}:
        return _answer(False, "root read as an index into groups, not the global rank cptune writes", "local")
    return _answer(False, f"the broadcast's output held {sorted(got)}, from no single root", "neither")


def _loaded(rank: ProbeRank, comm: MPI.Comm, model: Any) -> ProbeGraph:
    return rank.load(lambda boundary: (for_tensorrt(model, boundary), {}), comm)[0]


def _attention(dtype: int, name: str) -> Any:
    def probe(rank: ProbeRank, comm: MPI.Comm) -> Answer:
        wrong = _checked(rank, comm, {"shapes": [ATTENTION_SHAPE]}, attention_graph(ATTENTION_SHAPE, dtype),
                         ATTENTION_SHAPE)
        return _answer(not wrong, wrong or f"causal {name} attention built (decomposable) and right")

    return probe


def standalone(rank: ProbeRank, comm: MPI.Comm) -> Answer:
    """A real rank graph (Ulysses over every rank, bf16, causal: Transposes around each
    all_to_all, attention between them) built and inspected: do its collectives stay
    layers of their own, or only behind a Cast boundary, or not at all?"""
    n = comm.Get_size()
    if n < 2:
        return _answer(True, "not tried: one GPU has no collectives", UNTRIED)
    workload = Workload(seq_len=128 * n, heads=2 * n, head_dim=64, dtype="bf16", causal=True)
    config = CPConfig("ulysses", n)
    try:
        graph, _ = rank.load(lambda cast: tensorrt_rank_graph(workload, config, rank.rank, cast), comm)
    except RuntimeError as fused:
        return _answer(False, str(fused).split(";")[0], "fused")
    boundary = graph.cast_boundary
    graph.close()
    if boundary:
        return _answer(False, "collectives fused away as written; layers of their own behind a Cast "
                       "boundary", "boundary")
    return _answer(True, f"every DistCollective a layer of its own in a {config.describe()} engine", "alone")


PROBE_RUNS = {
    "collectives": collectives,
    "subgroups": subgroups,
    "broadcast_root": broadcast_root,
    "attention_fp32": _attention(TensorProto.FLOAT, "fp32"),
    "attention_bf16": _attention(TensorProto.BFLOAT16, "bf16"),
    "standalone": standalone,
}


def run(probe: str, rank: ProbeRank, comm: MPI.Comm) -> Answer:
    """Probe ``probe`` on this rank, collectively over ``comm``."""
    if probe not in PROBE_RUNS:
        raise RuntimeError(f"unknown probe {probe!r}")
    return PROBE_RUNS[probe](rank, comm)
