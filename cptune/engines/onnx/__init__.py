"""The ONNX lowering and the onnx engine.

Every configuration as per-rank ONNX graphs written by the strategies themselves
(``rank_graph``: standard ops plus TensorRT's ``DistCollective``, the graphs a TensorRT
deployment builds), the small graphs TensorRT's calibration times (``case_graphs``), the
graphs written to files for a deployment (``export_graphs``), and ``OnnxEngine``, which runs
each rank's graph on real MPI ranks with ONNX's reference runtime to check it computes the
right attention (it does not time).
"""

from cptune.engines.onnx._calibration import case_graphs
from cptune.engines.onnx._dialect import OP_TYPE, collective_attributes, dist_collective
from cptune.engines.onnx._engine import MANIFEST, OnnxEngine, export_graphs
from cptune.engines.onnx._graph import (
    io_shapes,
    rank_graph,
    rank_graphs,
    rank_inputs,
    tensorrt_rank_graph,
)
from cptune.engines.onnx._tensorrt import for_tensorrt, reference_ops

__all__ = [
    "MANIFEST",
    "OP_TYPE",
    "OnnxEngine",
    "case_graphs",
    "collective_attributes",
    "dist_collective",
    "export_graphs",
    "for_tensorrt",
    "io_shapes",
    "rank_graph",
    "rank_graphs",
    "rank_inputs",
    "reference_ops",
    "tensorrt_rank_graph",
]
