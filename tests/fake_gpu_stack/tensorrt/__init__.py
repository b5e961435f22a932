"""Stand-in for TensorRT's Python API (tests only). The "engine" is the ONNX graph itself;
``execute_async_v3`` runs it with ONNX's reference runtime, DistCollective as MPI
collectives over the groups it names. Only what cptune calls exists."""

import ctypes
import enum
import os
import time

import numpy as np
import onnx
from mpi4py import MPI
from onnx import helper
from onnx.reference import ReferenceEvaluator

from cptune.engines.onnx._rank import collective_op

__version__ = "0.0-fake"
_MAGIC = b"FAKE-TRT-ENGINE\n"


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 0


class ProfilingVerbosity(enum.IntEnum):
    DETAILED = 2


class PreviewFeature(enum.IntEnum):
    MULTIDEVICE_RUNTIME_10_16 = 3


class Logger:
    WARNING = 2

    def __init__(self, severity: int) -> None:
        self.severity = severity


class IProfiler:
    def __init__(self) -> None:
        pass


class _Network:
    graph: bytes = b""


class _Config:
    profiling_verbosity = None

    def __init__(self) -> None:
        self.preview: dict = {}

    def set_preview_feature(self, feature, enabled) -> None:
        self.preview[feature] = enabled


class Builder:
    def __init__(self, logger: Logger) -> None:
        pass

    def create_network(self, flags: int) -> _Network:
        assert flags == 1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        return _Network()

    def create_builder_config(self) -> _Config:
        return _Config()

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes:
        assert config.profiling_verbosity == ProfilingVerbosity.DETAILED
        assert config.preview.get(PreviewFeature.MULTIDEVICE_RUNTIME_10_16)
        return _MAGIC + network.graph


class OnnxParser:
    num_errors = 0

    def __init__(self, network: _Network, logger: Logger) -> None:
        self.network = network

    def parse(self, data: bytes) -> bool:
        onnx.checker.check_model(onnx.load_from_string(data))
        self.network.graph = data
        return True


class _LazyComms(dict):
    """A communicator per ordered group of world ranks, made when a collective first needs it."""

    def __missing__(self, members):
        world = MPI.COMM_WORLD
        comm = world.Create_group(world.Get_group().Incl(list(members)))
        self[members] = comm
        return comm


_COMMS = _LazyComms()


class ICudaEngine:
    device_memory_size_v2 = 0

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model

    def create_execution_context(self) -> "IExecutionContext":
        return IExecutionContext(self.model)


class Runtime:
    def __init__(self, logger: Logger) -> None:
        pass

    def deserialize_cuda_engine(self, data: bytes):
        if not data.startswith(_MAGIC):
            return None
        return ICudaEngine(onnx.load_from_string(data[len(_MAGIC):]))


class IExecutionContext:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.session = ReferenceEvaluator(model, new_ops=[collective_op(_COMMS)])
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple] = {}
        self._profiler = None
        self.enqueue_emits_profile = True
        self.communicator_set = False
        self.types = {
            v.name: (tuple(d.dim_value for d in v.type.tensor_type.shape.dim),
                     np.dtype(helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)))
            for v in [*model.graph.input, *model.graph.output]
        }

    @property
    def profiler(self):
        return self._profiler

    @profiler.setter
    def profiler(self, profiler) -> None:
        if profiler is not None:  # as TensorRT: None is refused and the old profiler stays
            self._profiler = profiler

    def set_communicator(self, capsule) -> bool:
        valid = ctypes.pythonapi.PyCapsule_IsValid
        valid.restype, valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
        assert valid(capsule, b"ncclComm_t"), "not a PyCapsule named ncclComm_t"
        self.communicator_set = True
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        assert tuple(shape) == self.types[name][0]
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream) -> bool:
        if os.environ.get("FAKE_TENSORRT_HANG_RANK") == str(MPI.COMM_WORLD.Get_rank()):
            time.sleep(3600)  # as a rank stuck in NCCL would
        has_collectives = any(n.op_type == "DistCollective" for n in self.model.graph.node)
        assert self.communicator_set or not has_collectives, "execute before set_communicator"
        feeds = {}
        for value in self.model.graph.input:
            shape, dtype = self.types[value.name]
            assert self.shapes.get(value.name) == shape, "input shape not set"
            raw = ctypes.string_at(self.addresses[value.name], int(np.prod(shape)) * dtype.itemsize)
            feeds[value.name] = np.frombuffer(raw, dtype).reshape(shape)
        outputs = self.session.run(None, feeds)
        for value, out in zip(self.model.graph.output, outputs, strict=True):
            shape, dtype = self.types[value.name]
            out = np.ascontiguousarray(out, dtype=dtype)
            assert out.shape == shape
            ctypes.memmove(self.addresses[value.name], out.ctypes.data, out.nbytes)
        if self._profiler is not None and self.enqueue_emits_profile:
            for node in self.model.graph.node:
                self._profiler.report_layer_time(node.name, 0.01)
        return True
