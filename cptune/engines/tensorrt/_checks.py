"""The check of a calibration graph's output on a rank: did its collective or attention do
what the graph says? Calibration (``_worker``) and the doctor's probes (``_probes``) both
run it, so it sits below them both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from cptune.engines.onnx._calibration import attention_expected, collective_expected, collective_inputs
from cptune.layout import head_group_members
from cptune.reference import REAL_BF16_TOLERANCE


class CheckedGraph(Protocol):
    """What the check needs of a loaded graph (``_worker.LoadedGraph``)."""

    #: Shape and numpy dtype of every input and output, by name.
    specs: dict[str, tuple[tuple[int, ...], np.dtype]]

    def fill(self, arrays: Mapping[str, np.ndarray]) -> None: ...

    def execute(self) -> float: ...

    def read(self, name: str) -> np.ndarray: ...


def check_case(graph: CheckedGraph, case: dict, point: int | dict, rank: int) -> None:
    """Run a calibration graph (``point``: its chunk bytes or attention shape) once with
    inputs whose output shows what the layer did, and raise unless it did what the graph
    says: a collective's chunks from the right members of the right group, an attention's
    output within the bf16 tolerance runs are held to."""
    if "collective" in case:
        kind, group = case["collective"], case["group"]
        member = head_group_members(rank, group).index(rank)
        graph.fill({"x": collective_inputs(kind, group, member, graph.specs["x"][0])})
        graph.execute()
        got, expected = graph.read("y"), collective_expected(kind, group, member, graph.specs["y"][0])
        if not np.array_equal(got, expected):
            raise RuntimeError(
                f"calibration's {kind} over groups of {group} gave rank {rank} wrong values "
                f"({int(np.count_nonzero(got != expected))} of {got.size}): TensorRT did not run this "
                f"collective in its group as written; nothing was timed")
        return
    assert isinstance(point, dict)
    rng = np.random.default_rng(rank)
    q, k, v = (rng.standard_normal(graph.specs[name][0], dtype=np.float32) for name in ("q", "k", "v"))
    graph.fill({"q": q, "k": k, "v": v})
    graph.execute()
    rounded = (x.astype(graph.specs["q"][1]).astype(np.float32) for x in (q, k, v))  # as the graph holds them
    expected = attention_expected(point, *rounded)
    error = float(np.max(np.abs(graph.read("out") - expected)) / np.max(np.abs(expected)))
    if error > REAL_BF16_TOLERANCE["bf16"]:
        raise RuntimeError(f"calibration's attention on {point} is off by {error:.2g} of its largest "
                           f"value on rank {rank}: TensorRT did not compute attention as written; "
                           f"nothing was timed")
