"""One rank of the TensorRT engine's pool: one process per GPU (run by mpiexec, never by users).

Written after NVIDIA's Python multi-device sample (samples/python/attention_mdtrt) and
NOT YET RUN ON A GPU: nothing where cptune is developed has one. Every call below is named
as TensorRT 11, nccl4py and cuda-bindings document it (a test checks the names against the
published bindings); where a detail could not be confirmed, a comment says so.

The serving loop, sockets and watchdog are the shared worker's (``cptune.engines._worker``);
the tasks differ:

- "prepare": the configuration's graph as TensorRT builds it (``tensorrt_rank_graph``: the
  same bytes on every rank but a hybrid's, what differs by rank fed as inputs), its engine
  from the disk cache or built on this GPU (strongly typed network, ``OnnxParser``, no
  auxiliary streams, ``build_serialized_network``) - by rank 0 alone and broadcast when
  every rank's graph is the same, as NVIDIA's sample does - then deserialized on
  ``cuda:<local rank>`` and inspected: if TensorRT fused any ``DistCollective`` into a
  region with compute (where it fails or stops communicating, pytorch/TensorRT#4381),
  every rank rebuilds with a float32 Cast on each side of each collective, and if they
  are still fused the configuration fails with that reason. An execution context gets its
  own NCCL communicator (``set_communicator`` is collective: all ranks at once), and the
  inputs and outputs live on the device.
- "run": copy the shards in, run once, copy the output back (the driver checks it
  against the reference before anything is timed).
- "time": per iteration, all ranks start at an MPI barrier; CUDA events around
  ``execute_async_v3`` give the device time. The split into compute and communication
  comes from TensorRT's per-layer profiler in a second pass of as many iterations, in a
  second execution context (a profiler serializes the layers and cannot be detached, so
  it never touches the latency): mean time in DistCollective layers vs the rest, NaN
  (unavailable) where a collective is not a layer of its own in the report.
- "prepare_cases" / "time_cases": the calibration graphs (one collective or one
  attention op each), built and loaded first; each is then run once with rank-dependent
  values and its output checked (a collective that ran in the wrong group, or not at
  all, fails calibration instead of timing the wrong thing), then timed like "time".
- "probe": one of ``cptune doctor``'s probes (``_probes``).

NCCL is loaded before TensorRT is imported (``load_nccl``), so TensorRT's own lookup of
"libnccl.so.2" finds the copy nccl4py uses. Communicators: one NCCL communicator over the
task's ranks, made with nccl4py from a unique id MPI broadcasts, and for every execution
context a communicator split from it - of the task's ranks, or of this rank's group where
a calibration graph is written for its group alone.

Deadlines are the driver's: a rank stuck in NCCL never replies, the driver's wait runs
out, and it kills the pool.
"""

from __future__ import annotations

import ctypes
import json
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import onnx
from mpi4py import MPI

from cptune.config import CPConfig
from cptune.engines import _protocol as protocol
from cptune.engines._worker import Worker, main
from cptune.engines.onnx import OP_TYPE, case_graphs, for_tensorrt, tensorrt_rank_graph
from cptune.engines.tensorrt import _probes
from cptune.engines.tensorrt._cache import EngineCache, engine_key, graph_digest
from cptune.engines.tensorrt._checks import check_case
from cptune.engines.tensorrt._preflight import load_nccl
from cptune.workload import Workload

#: How a graph is made for TensorRT, with or without the Cast boundary around collectives:
#: (model, this rank's input values beyond q, k, v).
GraphMaker = Callable[[bool], tuple[onnx.ModelProto, dict[str, np.ndarray]]]


def _import_gpu_stack() -> tuple[Any, Any]:
    """``tensorrt`` and ``cuda.bindings.runtime``, imported on first use so this module
    imports (and its pure parts are tested) where they are not installed; NCCL's library
    first, so that TensorRT's lookup of it finds nccl4py's copy."""
    load_nccl()
    import tensorrt as trt
    from cuda.bindings import runtime as cudart

    return trt, cudart


def serialize(model: onnx.ModelProto) -> bytes:
    """The graph's bytes, the same for the same graph (the engine cache keys on them)."""
    return model.SerializeToString(deterministic=True)


def io_specs(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and numpy dtype of every graph input and output (bfloat16 as ml_dtypes'), as
    the strongly typed network keeps them. Shapes must be static: the graph layer bakes
    every size into each rank's graph."""
    specs = {}
    for value in [*model.graph.input, *model.graph.output]:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value for d in tensor.shape.dim)
        if any(d.HasField("dim_param") or d.dim_value <= 0 for d in tensor.shape.dim):
            raise ValueError(f"graph tensor {value.name!r} has a dynamic shape; rank graphs must be static")
        specs[value.name] = (dims, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)))
    return specs


def collective_layer_names(model: onnx.ModelProto) -> dict[str, set[str]]:
    """For each DistCollective node, the names TensorRT's layer for it can carry: the
    node's name and its output's (the ONNX parser names a layer after its node; for an
    unnamed node the name is derived from its output - the exact form is not confirmed,
    so both are matched)."""
    return {node.name or node.output[0]: {n for n in (node.name, *node.output) if n}
            for node in model.graph.node if node.op_type == OP_TYPE}


_LAYER_NAME_SEPARATORS = re.compile(r"\.\.\.|[\s\[\]{}(),+]+")


def _tokens(layer: str) -> set[str]:
    return {token for token in _LAYER_NAME_SEPARATORS.split(layer) if token}


def fused_collectives(layers: Iterable[str], collectives: Mapping[str, set[str]]) -> list[str]:
    """The DistCollective nodes no layer stands for alone. TensorRT names a fused layer
    "a + b" and a Myelin region "{ForeignNode[first...last]}"; a layer stands for a node
    alone when every name in it is one of that node's."""
    alone = {node for layer in layers for node, names in collectives.items() if _tokens(layer) <= names}
    return sorted(set(collectives) - alone)


def split_layer_times(
    layer_ms: Mapping[str, float], collectives: Mapping[str, set[str]]
) -> tuple[float, float]:
    """(compute, communication) milliseconds of one profiled iteration: the layers that
    are DistCollective nodes alone, and the rest. NaN for both where some collective is
    not a layer of its own in the report: its time is mixed with compute's there, and no
    split of it would be honest."""
    if fused_collectives(layer_ms, collectives):
        return float("nan"), float("nan")
    names = set().union(*collectives.values()) if collectives else set()
    comm = sum(ms for layer, ms in layer_ms.items() if _tokens(layer) and _tokens(layer) <= names)
    return sum(layer_ms.values()) - comm, comm


def to_device_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``array`` as the contiguous bytes a graph tensor of ``dtype`` holds (bfloat16 by
    round-to-nearest-even, as ml_dtypes casts; integer inputs as they are)."""
    if np.issubdtype(dtype, np.integer):
        return np.ascontiguousarray(np.asarray(array).astype(dtype))
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32).astype(dtype))


class GpuRank:
    """This rank's GPU (``cuda:<local rank>``), TensorRT runtime, stream, events and NCCL
    communicators: one over each task size's ranks (made on first use, collectively), and
    one split from it for every execution context."""

    def __init__(self, local_rank: int) -> None:
        self.trt, self.cudart = _import_gpu_stack()
        self.device = local_rank
        self.cuda(self.cudart.cudaSetDevice(local_rank))
        properties = self.cuda(self.cudart.cudaGetDeviceProperties(local_rank))
        name = properties.name
        self.gpu_name = (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")
        self.compute_capability = f"{properties.major}.{properties.minor}"
        self.logger = self.trt.Logger(self.trt.Logger.WARNING)
        self.runtime = self.trt.Runtime(self.logger)
        self.stream = self.cuda(self.cudart.cudaStreamCreate())
        self.start = self.cuda(self.cudart.cudaEventCreate())
        self.end = self.cuda(self.cudart.cudaEventCreate())
        self.cache = EngineCache()
        self.worlds: dict[int, Any] = {}

    def cuda(self, result: tuple) -> Any:
        """The value(s) of a cuda-bindings call, which returns (error, values...); raises on error."""
        error, *values = result
        if error != self.cudart.cudaError_t.cudaSuccess:
            _, text = self.cudart.cudaGetErrorString(error)
            text = text.decode() if isinstance(text, bytes) else text
            raise RuntimeError(f"CUDA error on cuda:{self.device}: {text}")
        return values[0] if len(values) == 1 else tuple(values)

    def world(self, comm: MPI.Comm) -> Any:
        """The NCCL communicator of ``comm``'s ranks (nccl4py): rank 0 makes the unique id,
        MPI broadcasts its bytes, every rank joins. Collective over ``comm``."""
        size = comm.Get_size()
        if size not in self.worlds:
            import nccl.core as nccl

            uid = nccl.get_unique_id().as_bytes if comm.Get_rank() == 0 else None
            uid = comm.bcast(uid, root=0)
            self.worlds[size] = nccl.Communicator.init(
                nranks=size, rank=comm.Get_rank(), unique_id=nccl.UniqueId.from_bytes(uid)
            )
        return self.worlds[size]

    def communicator(self, comm: MPI.Comm, group: int | None = None) -> Any:
        """A new NCCL communicator for one execution context, split from ``comm``'s: all
        of its ranks, or (``group``) this rank's group of ``group`` consecutive ranks, in
        rank order. Contexts never share one. Collective over ``comm``."""
        rank = comm.Get_rank()
        return self.world(comm).split(color=0 if group is None else rank // group, key=rank)

    def build(self, graph: bytes) -> bytes:
        """Build a serialized engine from ONNX ``graph`` on this GPU."""
        trt = self.trt
        builder = trt.Builder(self.logger)
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, self.logger)
        if not parser.parse(graph):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT's ONNX parser rejected the graph: {errors}")
        config = builder.create_builder_config()
        # Layer names in the engine, so the profiler and the inspector tell DistCollective
        # layers apart.
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        # Everything on the one stream the rank enqueues on: with auxiliary streams,
        # independent collectives could run in a different order on different ranks, and
        # NCCL hangs.
        config.max_aux_streams = 0
        # TensorRT 10.16+ refuses a network with IDistCollectiveLayer unless this preview
        # feature is on (as Torch-TensorRT and Polygraphy's tests set it); 11.4 has dropped
        # the flag and needs nothing.
        if (multidevice := getattr(trt.PreviewFeature, "MULTIDEVICE_RUNTIME_10_16", None)) is not None:
            config.set_preview_feature(multidevice, True)
        # Every input has a static shape (``io_specs`` refuses others), so the network needs
        # no optimization profile; one with min = opt = max would say nothing more.
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RuntimeError("TensorRT could not build an engine from the graph (see the log above)")
        return bytes(serialized)

    def engine_for(self, graph: bytes, comm: MPI.Comm) -> tuple[bytes, float | None]:
        """The serialized engine of ``graph`` and the seconds its build took (None: from the
        cache). Collective over ``comm``: when all ranks hold the same graph, rank 0 builds
        (or loads) it and broadcasts the engine, as NVIDIA's sample does; otherwise (a
        hybrid's graphs) each rank builds its own, all at once."""
        digests = comm.allgather(graph_digest(graph))
        if len(set(digests)) == 1 and comm.Get_size() > 1:
            found = self._cached_or_built(graph) if comm.Get_rank() == 0 else None
            engine, seconds = comm.bcast(found, root=0)
            return engine, seconds
        return self._cached_or_built(graph)

    def _cached_or_built(self, graph: bytes) -> tuple[bytes, float | None]:
        key = engine_key(graph, self.trt.__version__, self.gpu_name, self.compute_capability)
        if (cached := self.cache.load(key)) is not None:
            return cached, None
        start = time.perf_counter()
        engine = self.build(graph)
        seconds = time.perf_counter() - start
        self.cache.store(key, engine, seconds)
        return engine, seconds

    def close(self) -> None:
        for communicator in self.worlds.values():
            communicator.destroy()
        self.worlds.clear()


def _communicator_capsule(communicator: Any) -> object:
    """The ``ncclComm_t`` of an nccl4py communicator as the PyCapsule named "ncclComm_t"
    that ``IExecutionContext.set_communicator`` takes (as NVIDIA's sample makes it)."""
    if not communicator.ptr:
        raise RuntimeError("the NCCL communicator was destroyed")
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return capsule_new(ctypes.c_void_p(communicator.ptr), b"ncclComm_t", None)


class LoadedGraph:
    """One engine on this rank: deserialized, a device buffer per input and output (the
    rank inputs filled once), and its execution contexts - each with an NCCL communicator of
    its own when the graph communicates, over ``comm``'s ranks or this rank's ``group``."""

    def __init__(self, gpu: GpuRank, engine_bytes: bytes, model: onnx.ModelProto,
                 feeds: Mapping[str, np.ndarray], comm: MPI.Comm, group: int | None) -> None:
        self.gpu, self.comm, self.group = gpu, comm, group
        self.specs = io_specs(model)
        self.inputs = [value.name for value in model.graph.input]
        self.outputs = [value.name for value in model.graph.output]
        self.collectives = collective_layer_names(model)
        self.cast_boundary = False
        self.engine = gpu.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise RuntimeError("TensorRT could not deserialize the engine")
        self.buffers = {name: gpu.cuda(gpu.cudart.cudaMalloc(max(1, int(np.prod(shape)) * dtype.itemsize)))
                        for name, (shape, dtype) in self.specs.items()}
        self.io_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in self.specs.values())
        self.fill(feeds)
        self._contexts: list[tuple[Any, Any]] = []  # (context, its communicator or None)
        self.context: Any = None

    def layers(self) -> list[str]:
        """The built engine's layer names, from TensorRT's engine inspector."""
        inspector = self.engine.create_engine_inspector()
        info = json.loads(inspector.get_engine_information(self.gpu.trt.LayerInformationFormat.JSON))
        return [layer["Name"] if isinstance(layer, dict) else str(layer) for layer in info.get("Layers", [])]

    def fused(self) -> list[str]:
        """The graph's DistCollective nodes that are not layers of their own in the engine."""
        return fused_collectives(self.layers(), self.collectives) if self.collectives else []

    def open(self) -> Any:
        """A new execution context on the graph's device buffers, with its own NCCL
        communicator when the graph communicates: a collective call, as ``set_communicator``
        blocks until every rank of the communicator has made it."""
        context = self.engine.create_execution_context()
        communicator = self.gpu.communicator(self.comm, self.group) if self.collectives else None
        self._contexts.append((context, communicator))
        if communicator is not None and not context.set_communicator(_communicator_capsule(communicator)):
            raise RuntimeError("IExecutionContext.set_communicator refused the NCCL communicator "
                               "(TensorRT answers so for an engine it does not count as multi-device)")
        for name, (shape, _) in self.specs.items():
            if name in self.inputs:
                context.set_input_shape(name, shape)
            context.set_tensor_address(name, self.buffers[name])
        if self.context is None:
            self.context = context
        return context

    @property
    def peak_bytes(self) -> int:
        """Device bytes this rank holds for the graph: inputs, outputs and the context's
        scratch memory (``device_memory_size_v2``, TensorRT 10+; not confirmed on 11)."""
        return self.io_bytes + int(self.engine.device_memory_size_v2)

    def fill(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Copy host arrays into the named inputs, converted to each input's dtype."""
        cudart = self.gpu.cudart
        for name, array in arrays.items():
            shape, dtype = self.specs[name]
            host = to_device_dtype(array, dtype)
            if host.shape != shape:
                raise ValueError(f"input {name!r} has shape {host.shape}, the graph needs {shape}")
            self.gpu.cuda(cudart.cudaMemcpy(self.buffers[name], host.ctypes.data, host.nbytes,
                                            cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def read(self, name: str) -> np.ndarray:
        """Output ``name`` copied back, as float32."""
        cudart = self.gpu.cudart
        shape, dtype = self.specs[name]
        host = np.empty(shape, dtype)
        self.gpu.cuda(cudart.cudaMemcpy(host.ctypes.data, self.buffers[name], host.nbytes,
                                        cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return host.astype(np.float32)

    def execute(self, context: Any = None) -> float:
        """Run once (in ``context``, default the graph's first); the device milliseconds
        between CUDA events around ``execute_async_v3``."""
        gpu, cudart = self.gpu, self.gpu.cudart
        gpu.cuda(cudart.cudaEventRecord(gpu.start, gpu.stream))
        # The cuda-bindings stream goes in as it is, as Polygraphy's multi-device tests pass it.
        if not (context or self.context).execute_async_v3(gpu.stream):
            raise RuntimeError("IExecutionContext.execute_async_v3 failed (see the log above)")
        gpu.cuda(cudart.cudaEventRecord(gpu.end, gpu.stream))
        gpu.cuda(cudart.cudaStreamSynchronize(gpu.stream))
        return float(gpu.cuda(cudart.cudaEventElapsedTime(gpu.start, gpu.end)))

    def time(self, barrier: MPI.Comm, warmup: int, repeats: int) -> np.ndarray:
        """Device seconds of ``repeats`` iterations after ``warmup``, each started with
        every rank at a barrier."""
        seconds = np.zeros(repeats)
        for i in range(warmup + repeats):
            barrier.Barrier()
            elapsed_ms = self.execute()
            if i >= warmup:
                seconds[i - warmup] = elapsed_ms / 1e3
        return seconds

    def profile(self, barrier: MPI.Comm, repeats: int) -> np.ndarray:
        """Seconds [iteration, (compute, comm)] from TensorRT's per-layer profiler over
        ``repeats`` more iterations (each started at a barrier): every layer's mean time,
        split by ``split_layer_times`` (NaN: unavailable), the same for every row. The
        profiled iterations run in a second execution context, dropped afterwards: a
        profiler serializes the layers and cannot be detached (``context.profiler = None``
        is refused and the old one stays, as NVIDIA's TensorRT cookbook shows), so the timed
        context never carries one."""
        trt = self.gpu.trt
        layers: dict[str, list[float]] = {}

        class LayerTimes(trt.IProfiler):  # type: ignore[name-defined]
            def __init__(self) -> None:
                trt.IProfiler.__init__(self)

            def report_layer_time(self, layer_name: str, ms: float) -> None:
                layers.setdefault(layer_name, []).append(ms)

        profiled = self.open()
        profiled.profiler = LayerTimes()  # reports every execution (enqueue_emits_profile is on)
        try:
            for _ in range(repeats):
                barrier.Barrier()
                self.execute(profiled)
        finally:
            self._close_context(profiled)
        mean_ms = {name: sum(times) / len(times) for name, times in layers.items()}
        compute_ms, comm_ms = split_layer_times(mean_ms, self.collectives)
        return np.tile([compute_ms / 1e3, comm_ms / 1e3], (repeats, 1))

    def _close_context(self, context: Any) -> None:
        for i, (held, communicator) in enumerate(self._contexts):
            if held is context:
                del self._contexts[i]
                if communicator is not None:
                    communicator.destroy()
                return

    def close(self) -> None:
        """Free the contexts (then their communicators), the engine, then the device buffers."""
        self.context = None
        while self._contexts:
            self._close_context(self._contexts[-1][0])
        self.engine = None
        for pointer in self.buffers.values():
            self.gpu.cuda(self.gpu.cudart.cudaFree(pointer))
        self.buffers.clear()


class TensorRTWorker(Worker):
    """The serving loop of one rank, on ``cuda:<local rank>``."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.local_rank = self.world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        self._gpu: GpuRank | None = None
        self.graph: LoadedGraph | None = None
        self.cases: list[LoadedGraph] = []
        self.case: dict = {}
        self.barrier: MPI.Comm | None = None

    @property
    def gpu(self) -> GpuRank:
        if self._gpu is None:
            self._gpu = GpuRank(self.local_rank)
        return self._gpu

    def load(
        self, make: GraphMaker, comm: MPI.Comm, group: int | None = None
    ) -> tuple[LoadedGraph, float | None]:
        """The engine of ``make``'s graph on this rank, every step collective over ``comm``,
        with its first execution context open. Built as written; rebuilt by every rank with
        the Cast boundary where any rank's engine has a collective fused away; refused if one
        still is (it would not communicate)."""
        loaded, seconds = self._built(*make(False), comm, group)
        if comm.allreduce(bool(loaded.fused()), op=MPI.LOR):
            loaded.close()
            loaded, more = self._built(*make(True), comm, group)
            seconds = None if seconds is None and more is None else (seconds or 0.0) + (more or 0.0)
            still = loaded.fused()
            if comm.allreduce(bool(still), op=MPI.LOR):
                loaded.close()
                raise RuntimeError(
                    f"TensorRT fused DistCollective layer(s) {', '.join(still) or 'on another rank'} into "
                    f"regions with compute even with a float32 Cast on each side, where they do not "
                    f"communicate (pytorch/TensorRT#4381); see cptune doctor's 'standalone' probe")
            loaded.cast_boundary = True
        loaded.open()
        return loaded, seconds

    def _built(self, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], comm: MPI.Comm,
               group: int | None) -> tuple[LoadedGraph, float | None]:
        engine, seconds = self.gpu.engine_for(serialize(model), comm)
        return LoadedGraph(self.gpu, engine, model, feeds, comm, group), seconds

    def _drop(self) -> None:
        for loaded in [self.graph, *self.cases]:
            if loaded is not None:
                loaded.close()
        self.graph, self.cases = None, []

    def handle(self, header: dict, arrays: list[np.ndarray]) -> protocol.Message:
        op = header["op"]
        if op == "prepare":
            self._drop()
            workload, config = Workload(**header["workload"]), CPConfig(**header["config"])
            self.barrier = self.prefix[config.ranks - 1]
            self.graph, build_seconds = self.load(
                lambda boundary: tensorrt_rank_graph(workload, config, self.rank, boundary), self.barrier)
            return {"build_seconds": build_seconds, "gpu": self.gpu.gpu_name,
                    "tensorrt": self.gpu.trt.__version__, "cast_boundary": self.graph.cast_boundary}, []
        if op == "run":
            graph = self._prepared(self.graph)
            graph.fill(dict(zip(("q", "k", "v"), arrays, strict=True)))
            graph.execute()
            return {"peak_bytes": graph.peak_bytes}, [graph.read("out")]
        if op == "time":
            graph = self._prepared(self.graph)
            assert self.barrier is not None
            wall = graph.time(self.barrier, header["warmup"], header["repeats"])
            split = graph.profile(self.barrier, header["repeats"])
            return {}, [np.column_stack([wall, split])]
        if op == "prepare_cases":
            return self._prepare_cases(header["ranks"], header["case"])
        if op == "time_cases":
            if not self.cases or self.barrier is None:
                raise RuntimeError("'time_cases' before 'prepare_cases'")
            barrier = self.barrier
            return {}, [np.stack([g.time(barrier, header["warmup"], header["repeats"]) for g in self.cases])]
        if op == "probe":
            self._drop()
            size = header["ranks"]
            return _probes.run(header["probe"], self, self.prefix[size - 1]), []
        raise RuntimeError(f"unknown op {op!r}")

    def _prepare_cases(self, ranks: int, case: dict) -> protocol.Message:
        """Load one calibration request's graphs, run each once and check its values."""
        self._drop()
        self.barrier = self.prefix[ranks - 1]
        group = case.get("group")
        points = case.get("chunks") or case["shapes"]
        built = []
        for point, model in zip(points, case_graphs(case, ranks, self.rank), strict=True):
            graph, seconds = self.load(lambda boundary, m=model: (for_tensorrt(m, boundary), {}),  # type: ignore[misc]
                                       self.barrier, group)
            self.cases.append(graph)
            built.append(seconds)
            check_case(graph, case, point, self.rank)
        timed = [s for s in built if s is not None]
        return {"build_seconds": sum(timed) if timed else None}, []

    def _prepared(self, graph: LoadedGraph | None) -> LoadedGraph:
        if graph is None:
            raise RuntimeError("'run' or 'time' before 'prepare'")
        return graph

    def close(self) -> None:
        self._drop()
        if self._gpu is not None:
            self._gpu.close()


if __name__ == "__main__":
    main(worker=TensorRTWorker)
