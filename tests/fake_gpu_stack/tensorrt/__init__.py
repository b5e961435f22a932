"""Stand-in for TensorRT's Python API (tests only). The "engine" is the ONNX graph itself;
``execute_async_v3`` runs it with ONNX's reference runtime, DistCollective as MPI
collectives on the context's communicator (groups named in the node: subgroups of it).
Only what cptune calls exists. It behaves as TensorRT is documented or reported to:

- the ONNX importer builds ``Attention`` non-decomposable unless ``TRT_decomposable=1``,
  and no fused fp32 kernel exists, so such a build fails;
- TensorRT finds NCCL by bare name when its runtime starts: unless nccl4py's copy was
  loaded first, it has another, and ``set_communicator`` with nccl4py's fails;
- ``set_communicator`` blocks holding the GIL until the communicator's ranks all call it;
  a communicator serves one execution context (cptune gives each its own).

``FAKE_TENSORRT_FAULT`` (comma-separated) fakes what a real node may do wrong:
"subgroups_ignored" (groups named in a node are ignored for the communicator's first
ranks, and the others fail "Did not properly set the child communicator", as
pytorch/TensorRT#4380 reports), "root_local" (a grouped broadcast's root read as an index
into groups), "fused" (a collective without a Cast on each side is fused into a Myelin
region, pytorch/TensorRT#4381), "fused_always" (even with one). ``FAKE_TENSORRT_HANG_RANK=r``:
rank r's execute never returns, as a rank stuck in NCCL; ``FAKE_TENSORRT_HANG_COMMUNICATOR=r,...``:
these ranks' set_communicator never returns, holding the GIL (each touches
``$FAKE_TENSORRT_HANG_MARK.<rank>`` first)."""

import ctypes
import enum
import json
import os
import time
from pathlib import Path

import numpy as np
import onnx
from cuda import pathfinder
from mpi4py import MPI
from nccl import core as nccl
from onnx import helper
from onnx.reference import ReferenceEvaluator

from cptune.engines.onnx import reference_ops
from cptune.engines.onnx._rank import collective_op

__version__ = "0.0-fake"
_MAGIC = b"FAKE-TRT-ENGINE\n"
FAULTS = set(filter(None, os.environ.get("FAKE_TENSORRT_FAULT", "").split(",")))


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 0


class ProfilingVerbosity(enum.IntEnum):
    DETAILED = 2


class PreviewFeature(enum.IntEnum):  # 11.4's has no MULTIDEVICE_RUNTIME_10_16
    RUNTIME_ACTIVATION_RESIZE_10_10 = 2


class LayerInformationFormat(enum.IntEnum):
    ONELINE = 0
    JSON = 1


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
    max_aux_streams = -1  # TensorRT's default: it decides


class Builder:
    def __init__(self, logger: Logger) -> None:
        pass

    def create_network(self, flags: int) -> _Network:
        assert flags == 1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        return _Network()

    def create_builder_config(self) -> _Config:
        return _Config()

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes | None:
        assert config.profiling_verbosity == ProfilingVerbosity.DETAILED
        assert config.max_aux_streams == 0, "auxiliary streams could reorder collectives across ranks"
        model = onnx.load_from_string(network.graph)
        for node in model.graph.node:
            decomposable = any(a.name == "TRT_decomposable" and a.i == 1 for a in node.attribute)
            if node.op_type == "Attention" and not decomposable and _dtype_of(model, node.input[0]) == 1:
                print("[E] IAttention: no fused kernel for FLOAT and the layer is not decomposable",
                      flush=True)
                return None
        return _MAGIC + network.graph


def _dtype_of(model: onnx.ModelProto, name: str) -> int:
    for value in [*model.graph.input, *model.graph.value_info]:
        if value.name == name:
            return value.type.tensor_type.elem_type
    return 0


class OnnxParser:
    num_errors = 0

    def __init__(self, network: _Network, logger: Logger) -> None:
        self.network = network

    def parse(self, data: bytes) -> bool:
        self.network.graph = data
        return True


def _layers(model: onnx.ModelProto) -> list[str]:
    """Layer names of the engine: one per node, but under "fused", a DistCollective whose
    producer is not a Cast is one Myelin region with its producer and consumer."""
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers = {i: node for node in model.graph.node for i in node.input}
    layers, taken = [], set()
    for node in model.graph.node:
        if node.name in taken:
            continue
        before, after = producers.get(node.input[0]) if node.input else None, consumers.get(node.output[0])
        behind_casts = all(n is not None and n.op_type == "Cast" for n in (before, after))
        if node.op_type == "DistCollective" and before is not None and after is not None and (
                "fused_always" in FAULTS or ("fused" in FAULTS and not behind_casts)):
            layers.append(f"{{ForeignNode[{before.name}...{after.name}]}}")
            taken.update({before.name, node.name, after.name})
            layers = [layer for layer in layers if layer != before.name]
        else:
            layers.append(node.name)
    return layers


class _Inspector:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model

    def get_engine_information(self, fmt: LayerInformationFormat) -> str:
        assert fmt == LayerInformationFormat.JSON
        return json.dumps({"Layers": [{"Name": name} for name in _layers(self.model)]})


class ICudaEngine:
    device_memory_size_v2 = 0

    def __init__(self, model: onnx.ModelProto, nccl_copy: str) -> None:
        self.model, self.nccl_copy = model, nccl_copy

    def create_execution_context(self) -> "IExecutionContext":
        return IExecutionContext(self.model, self.nccl_copy)

    def create_engine_inspector(self) -> _Inspector:
        return _Inspector(self.model)


class Runtime:
    def __init__(self, logger: Logger) -> None:
        # TensorRT dlopens "libnccl.so.2" by bare name: nccl4py's copy only if it is loaded.
        self.nccl_copy = "nccl4py's" if "nccl" in pathfinder.LOADED else "another on the library path"

    def deserialize_cuda_engine(self, data: bytes):
        if not data.startswith(_MAGIC):
            return None
        return ICudaEngine(onnx.load_from_string(data[len(_MAGIC):]), self.nccl_copy)


class _Groups(dict):
    """The context communicator's groups: () is all of it; named ranks a subgroup of it."""

    def __init__(self, comm: MPI.Comm) -> None:
        super().__init__({(): comm})
        self.comm = comm

    def __missing__(self, members):
        if "subgroups_ignored" in FAULTS:  # as TensorRT 11.2: the first len(members) ranks
            if self.comm.Get_rank() >= len(members):
                raise RuntimeError("Did not properly set the child communicator")
            members = tuple(range(len(members)))
        comm = self.comm.Create_group(self.comm.Get_group().Incl(list(members)))
        self[members] = comm
        return comm


def _collective(groups: _Groups):
    base = collective_op(groups)

    class DistCollective(base):
        def _run(self, x, collective_operation=None, reduce_op=None, root=None, groups=None, group_size=None,
                 nb_rank=None):
            members = [int(g) for g in groups]
            if "root_local" in FAULTS and members and collective_operation == "broadcast":
                root = members[root]  # so that collective_op's members.index(root) is the index given
            return super()._run(x, collective_operation, reduce_op, root, groups, group_size, nb_rank)

    return DistCollective


class IExecutionContext:
    def __init__(self, model: onnx.ModelProto, nccl_copy: str) -> None:
        self.model, self.nccl_copy = model, nccl_copy
        self.session = None
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple] = {}
        self._profiler = None
        self.enqueue_emits_profile = True
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
        if profiler is not None:  # as TensorRT: None is refused and the old one stays
            self._profiler = profiler

    def set_communicator(self, capsule) -> bool:
        valid = ctypes.pythonapi.PyCapsule_IsValid
        valid.restype, valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
        assert valid(capsule, b"ncclComm_t"), "not a PyCapsule named ncclComm_t"
        pointer = ctypes.pythonapi.PyCapsule_GetPointer
        pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        communicator = nccl.LIVE[pointer(capsule, b"ncclComm_t")]
        if getattr(communicator, "context", None) is not None:
            raise RuntimeError("this NCCL communicator already serves another execution context")
        communicator.context = self
        if self.nccl_copy != "nccl4py's":
            raise RuntimeError(f"the communicator comes from nccl4py's libnccl, TensorRT loaded "
                               f"{self.nccl_copy}")
        rank = MPI.COMM_WORLD.Get_rank()
        if str(rank) in os.environ.get("FAKE_TENSORRT_HANG_COMMUNICATOR", "").split(","):
            Path(f"{os.environ['FAKE_TENSORRT_HANG_MARK']}.{rank}").touch()
            ctypes.PyDLL(None).sleep(3600)  # blocked in native code, the GIL held, as TensorRT waits
        communicator.mpi.Barrier()  # collective, as TensorRT's
        self.session = ReferenceEvaluator(self.model, new_ops=[_collective(_Groups(communicator.mpi)),
                                                               *reference_ops()])
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
        assert self.session is not None or not has_collectives, "execute before set_communicator"
        session = self.session or ReferenceEvaluator(self.model, new_ops=reference_ops())
        feeds = {}
        for value in self.model.graph.input:
            shape, dtype = self.types[value.name]
            assert self.shapes.get(value.name) == shape, "input shape not set"
            raw = ctypes.string_at(self.addresses[value.name], int(np.prod(shape)) * dtype.itemsize)
            feeds[value.name] = np.frombuffer(raw, dtype).reshape(shape)
        outputs = session.run(None, feeds)
        for value, out in zip(self.model.graph.output, outputs, strict=True):
            shape, dtype = self.types[value.name]
            out = np.ascontiguousarray(out, dtype=dtype)
            assert out.shape == shape
            ctypes.memmove(self.addresses[value.name], out.ctypes.data, out.nbytes)
        if self._profiler is not None and self.enqueue_emits_profile:
            for layer in _layers(self.model):
                self._profiler.report_layer_time(layer, 0.01)
        return True
