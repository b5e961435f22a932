"""The TensorRT engine: each rank's ONNX graph built into a TensorRT 11 engine, run on one GPU
per rank, the ranks' DistCollective layers talking over NCCL. Written for GPU nodes and not
yet run on one; ``preflight`` says in one line what a node lacks."""

from cptune.engines.tensorrt._engine import BUILD_TIMEOUT_S, TensorRTEngine
from cptune.engines.tensorrt._preflight import (
    GPU_MODULES,
    INSTALL_HINT,
    MIN_COMPUTE_CAPABILITY,
    NodeProbe,
    preflight,
    probe_node,
)

__all__ = [
    "BUILD_TIMEOUT_S",
    "GPU_MODULES",
    "INSTALL_HINT",
    "MIN_COMPUTE_CAPABILITY",
    "NodeProbe",
    "TensorRTEngine",
    "preflight",
    "probe_node",
]
