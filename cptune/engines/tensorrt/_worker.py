"""One rank of the TensorRT engine's pool: one process per GPU (run by mpiexec, never by users).

Written after NVIDIA's Python multi-device sample (samples/python/attention_mdtrt) and
NOT YET RUN ON A GPU: nothing where cptune is developed has one. Every call below is named
as TensorRT 11, nccl4py and cuda-bindings document it; where a detail could not be
confirmed, a comment says so.

The serving loop, sockets and watchdog are the shared worker's (``cptune.engines._worker``); the
tasks differ:

- "prepare": build this rank's ONNX graph (``rank_graph``), get its engine from the disk
  cache or build it on this GPU (strongly typed network, ``OnnxParser``,
  ``build_serialized_network``), deserialize it on ``cuda:<local rank>``, give its
  execution context the NCCL communicator (all ranks at once: ``set_communicator`` is a
  collective call) and put its inputs and outputs on the device. When every rank's graph
  is the same, rank 0 builds it and broadcasts the engine over MPI, as the sample does;
  rank graphs usually differ (masks and positions are constants of each rank's graph),
  and then every rank builds its own at the same time on its own GPU.
- "run": copy the shards in, run once, copy the output back (the driver checks it
  against the reference before anything is timed).
- "time": per iteration, all ranks start at an MPI barrier; CUDA events around
  ``execute_async_v3`` give the device time. The split into compute and communication
  comes from TensorRT's per-layer profiler in a second pass of as many iterations, in a
  second execution context (a profiler serializes the layers and cannot be detached, so
  it never touches the latency): mean time in DistCollective layers vs the rest.
- "prepare_cases" / "time_cases": the calibration graphs (one collective or one
  attention op each), built and loaded first, then timed like "time".

Deadlines are the driver's: a rank stuck in NCCL never replies, the driver's wait runs
out, and it kills the pool.
"""

from __future__ import annotations

import ctypes
import re
import socket
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from mpi4py import MPI

from cptune.config import CPConfig
from cptune.engines import _protocol as protocol
from cptune.engines._worker import Worker, main
from cptune.engines.onnx import OP_TYPE, case_graphs, rank_graph
from cptune.engines.tensorrt._cache import EngineCache, engine_key, graph_digest
from cptune.workload import Workload


def _import_gpu_stack() -> tuple[Any, Any]:
    """``tensorrt`` and ``cuda.bindings.runtime``, imported on first use so this module
    imports (and its pure parts are tested) where they are not installed."""
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


def collective_layer_names(model: onnx.ModelProto) -> set[str]:
    """Names TensorRT's layers for the graph's DistCollective nodes can carry: the node's
    name, else its output's (the ONNX parser names a layer after its node; for an unnamed
    node the name is derived from its output - the exact form is not confirmed, so both
    are matched)."""
    names = set()
    for node in model.graph.node:
        if node.op_type == OP_TYPE:
            names.update(n for n in (node.name, *node.output) if n)
    return names


_LAYER_NAME_SEPARATORS = re.compile(r"\.\.\.|[\s\[\]{}(),+]+")


def split_layer_times(layer_ms: Mapping[str, float], collectives: set[str]) -> tuple[float, float]:
    """(compute, communication) milliseconds of one profiled iteration: a reported layer is
    communication when its name mentions a DistCollective node (TensorRT names fused
    layers "a + b" and Myelin regions "{ForeignNode[first...last]}"). A collective fused
    inside a region with compute is counted by that region's name only: it is
    communication if it is the region's first or last node, else compute."""
    compute = comm = 0.0
    for name, ms in layer_ms.items():
        tokens = set(_LAYER_NAME_SEPARATORS.split(name))
        if tokens & collectives:
            comm += ms
        else:
            compute += ms
    return compute, comm


def to_device_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``array`` as the contiguous bytes a graph tensor of ``dtype`` holds (bfloat16 by
    round-to-nearest-even, as ml_dtypes casts)."""
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32).astype(dtype))


class GpuRank:
    """This rank's GPU (``cuda:<local rank>``), TensorRT runtime, stream, events and its NCCL
    communicators, one per task size (made on first use, collectively)."""

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
        self.nccl: dict[int, Any] = {}

    def cuda(self, result: tuple) -> Any:
        """The value(s) of a cuda-bindings call, which returns (error, values...); raises on error."""
        error, *values = result
        if error != self.cudart.cudaError_t.cudaSuccess:
            _, text = self.cudart.cudaGetErrorString(error)
            text = text.decode() if isinstance(text, bytes) else text
            raise RuntimeError(f"CUDA error on cuda:{self.device}: {text}")
        return values[0] if len(values) == 1 else tuple(values)

    def communicator(self, comm: MPI.Comm) -> Any:
        """The NCCL communicator of ``comm``'s ranks (nccl4py): rank 0 makes the unique id,
        MPI broadcasts its bytes, every rank joins. Collective over ``comm``."""
        size = comm.Get_size()
        if size not in self.nccl:
            import nccl.core as nccl

            uid = nccl.get_unique_id().as_bytes if comm.Get_rank() == 0 else None
            uid = comm.bcast(uid, root=0)
            self.nccl[size] = nccl.Communicator.init(
                nranks=size, rank=comm.Get_rank(), unique_id=nccl.UniqueId.from_bytes(uid)
            )
        return self.nccl[size]

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
        # Layer names in the engine, so the profiler can tell DistCollective layers apart.
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        # TensorRT 10.16+ refuses a network with IDistCollectiveLayer unless this preview
        # feature is on (as Torch-TensorRT and Polygraphy's tests set it); a 11.x that has
        # dropped the flag (reported, not confirmed) needs nothing.
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
        (or loads) it and broadcasts the engine, as NVIDIA's sample does; otherwise each
        rank builds its own, all at once."""
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
        for communicator in self.nccl.values():
            communicator.destroy()
        self.nccl.clear()


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
    """One engine ready to run on this rank: its execution context (with the NCCL
    communicator when the graph communicates) and a device buffer per input and output."""

    def __init__(self, gpu: GpuRank, engine_bytes: bytes, model: onnx.ModelProto, communicator: Any) -> None:
        self.gpu = gpu
        self.specs = io_specs(model)
        self.inputs = [value.name for value in model.graph.input]
        self.outputs = [value.name for value in model.graph.output]
        self.collectives = collective_layer_names(model)
        self.communicator = communicator
        self.engine = gpu.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise RuntimeError("TensorRT could not deserialize the engine")
        self.buffers = {name: gpu.cuda(gpu.cudart.cudaMalloc(max(1, int(np.prod(shape)) * dtype.itemsize)))
                        for name, (shape, dtype) in self.specs.items()}
        self.io_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in self.specs.values())
        self.context = self._new_context()

    def _new_context(self) -> Any:
        """An execution context on the graph's device buffers, with the NCCL communicator
        when the graph communicates: a collective call, as ``set_communicator`` blocks until
        every rank of the communicator has made it."""
        context = self.engine.create_execution_context()
        if self.collectives and not context.set_communicator(_communicator_capsule(self.communicator)):
            raise RuntimeError("IExecutionContext.set_communicator refused the NCCL communicator")
        for name, (shape, _) in self.specs.items():
            if name in self.inputs:
                context.set_input_shape(name, shape)
            context.set_tensor_address(name, self.buffers[name])
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

    def fill_ones(self) -> None:
        """Every input set to ones (calibration: the values do not matter, their size does)."""
        self.fill({name: np.ones(self.specs[name][0], np.float32) for name in self.inputs})

    def read(self, name: str) -> np.ndarray:
        """Output ``name`` copied back, as float32."""
        cudart = self.gpu.cudart
        shape, dtype = self.specs[name]
        host = np.empty(shape, dtype)
        self.gpu.cuda(cudart.cudaMemcpy(host.ctypes.data, self.buffers[name], host.nbytes,
                                        cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return host.astype(np.float32)

    def execute(self, context: Any = None) -> float:
        """Run once (in ``context``, default the graph's own); the device milliseconds
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
        split by ``split_layer_times``, the same for every row. The profiled iterations run
        in a second execution context, dropped afterwards: a profiler serializes the layers
        and cannot be detached (``context.profiler = None`` is refused and the old one stays,
        as NVIDIA's TensorRT cookbook shows), so the timed context never carries one."""
        trt = self.gpu.trt
        layers: dict[str, list[float]] = {}

        class LayerTimes(trt.IProfiler):  # type: ignore[name-defined,misc]
            def __init__(self) -> None:
                trt.IProfiler.__init__(self)

            def report_layer_time(self, layer_name: str, ms: float) -> None:
                layers.setdefault(layer_name, []).append(ms)

        profiled = self._new_context()
        profiled.profiler = LayerTimes()  # reports every execution (enqueue_emits_profile is on)
        try:
            for _ in range(repeats):
                barrier.Barrier()
                self.execute(profiled)
        finally:
            del profiled
        mean_ms = {name: sum(times) / len(times) for name, times in layers.items()}
        compute_ms, comm_ms = split_layer_times(mean_ms, self.collectives)
        return np.tile([compute_ms / 1e3, comm_ms / 1e3], (repeats, 1))

    def close(self) -> None:
        """Free the context, then the engine, then the device buffers."""
        self.context = None
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
        self.barrier: MPI.Comm | None = None

    @property
    def gpu(self) -> GpuRank:
        if self._gpu is None:
            self._gpu = GpuRank(self.local_rank)
        return self._gpu

    def _load(self, model: onnx.ModelProto, comm: MPI.Comm) -> tuple[LoadedGraph, float | None]:
        """``model``'s engine on this rank, every step collective over ``comm``. The NCCL
        communicator comes first, as in NVIDIA's sample: nccl4py then loads libnccl before
        TensorRT looks it up by name, so both use the same library (as they must)."""
        communicator = self.gpu.communicator(comm) if collective_layer_names(model) else None
        engine, build_seconds = self.gpu.engine_for(serialize(model), comm)
        return LoadedGraph(self.gpu, engine, model, communicator), build_seconds

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
            self.graph, build_seconds = self._load(rank_graph(workload, config, self.rank), self.barrier)
            return {"build_seconds": build_seconds, "gpu": self.gpu.gpu_name,
                    "tensorrt": self.gpu.trt.__version__}, []
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
            self._drop()
            self.barrier = self.prefix[header["ranks"] - 1]
            models = case_graphs(header["case"], header["ranks"], self.rank)
            loaded = [self._load(model, self.barrier) for model in models]
            self.cases = [graph for graph, _ in loaded]
            for graph in self.cases:
                graph.fill_ones()
            built = [s for _, s in loaded if s is not None]
            return {"build_seconds": sum(built) if built else None}, []
        if op == "time_cases":
            if not self.cases or self.barrier is None:
                raise RuntimeError("'time_cases' before 'prepare_cases'")
            barrier = self.barrier
            return {}, [np.stack([g.time(barrier, header["warmup"], header["repeats"]) for g in self.cases])]
        raise RuntimeError(f"unknown op {op!r}")

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
