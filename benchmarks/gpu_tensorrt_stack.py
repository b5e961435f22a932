"""Prepared GPU-node check of the TensorRT engine's stack, without TensorRT: what a node with
one GPU, PyTorch's CUDA libraries, cuda-bindings, cuda-pathfinder and nccl4py can tell about
the runtime's calls before TensorRT itself is there (it cannot be installed where cptune is
developed or on the lent GPU machine).

Each check runs in a fresh interpreter (what a library loads first is the question):

- nccl_bare_name: what ``dlopen("libnccl.so.2")`` finds by bare name, as TensorRT looks NCCL
  up, when nothing loaded it first (the risk ``load_nccl`` answers).
- nccl_load_order: ``load_nccl()`` (cuda-pathfinder, as nccl4py finds NCCL), then the bare-name
  lookup: the same library, loaded once?
- nccl4py_communicators: a real one-rank NCCL communicator (nccl4py), a communicator split from
  it as every execution context gets one, the "ncclComm_t" PyCapsule ``set_communicator``
  takes, which NCCL nccl4py loaded, and both destroyed. (One GPU: NCCL refuses two ranks on
  it, so no collective between ranks runs.)
- cuda_runtime_path: the rank's own CUDA calls with real cuda-bindings (``GpuRank``,
  ``LoadedGraph``: device properties, stream, events, malloc, copies both ways in bf16, the
  timing events around an execute, free), TensorRT replaced by a stub that runs nothing.
- preflight: what ``cptune doctor`` says on this node (TensorRT missing: one line, exit 2).

Usage on a GPU node, from the repository root (nccl4py and the CLI's packages carried as
wheels where missing):

    python benchmarks/gpu_tensorrt_stack.py --out gpu_tensorrt_stack.txt

Where there is no GPU, each check says why it cannot run.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

from _provenance import ROOT, command, commit

#: Each check: a program for a fresh interpreter that prints its findings, one per line.
CHECKS: dict[str, str] = {
    "nccl_bare_name": """
        import ctypes
        try:
            ctypes.CDLL("libnccl.so.2")
        except OSError as missing:
            print("not found by bare name:", missing)
        else:
            print("found:", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l}))
    """,
    "nccl_load_order": """
        import ctypes
        from cptune.engines.tensorrt._preflight import load_nccl
        path = load_nccl()
        print("load_nccl:", path)
        ctypes.CDLL("libnccl.so.2")
        mapped = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l})
        print("mapped after the bare-name lookup:", mapped)
        print("verdict:", "one NCCL, nccl4py's" if len(mapped) == 1 and mapped[0] == path else "TWO NCCLs")
    """,
    "nccl4py_communicators": """
        import ctypes
        from cptune.engines.tensorrt._preflight import load_nccl
        path = load_nccl()
        import nccl.core as nccl
        from cptune.engines.tensorrt._worker import _communicator_capsule
        world = nccl.Communicator.init(nranks=1, rank=0, unique_id=nccl.get_unique_id())
        split = world.split(color=0, key=0)
        capsule = _communicator_capsule(split)
        pointer = ctypes.pythonapi.PyCapsule_GetPointer
        pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        print("world ptr:", hex(world.ptr), "split ptr:", hex(split.ptr),
              "capsule points at the split:", pointer(capsule, b"ncclComm_t") == split.ptr)
        mapped = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l})
        print("NCCL mapped:", mapped, "same as load_nccl's:", mapped == [path])
        print("nccl4py versions:", nccl.get_version())
        split.destroy()
        world.destroy()
        print("destroyed:", split.ptr == 0 and world.ptr == 0)
    """,
    "cuda_runtime_path": """
        import sys, types
        import numpy as np
        from mpi4py import MPI
        stub = types.ModuleType("tensorrt")  # TensorRT's absent: a stub whose engine runs nothing
        stub.__version__ = "stub"
        class Logger:
            WARNING = 2
            def __init__(self, severity): pass
        class Context:
            def set_input_shape(self, name, shape): return True
            def set_tensor_address(self, name, address): return True
            def execute_async_v3(self, stream): return True
        class Engine:
            device_memory_size_v2 = 0
            def create_execution_context(self): return Context()
        class Runtime:
            def __init__(self, logger): pass
            def deserialize_cuda_engine(self, data): return Engine()
        stub.Logger, stub.Runtime = Logger, Runtime
        sys.modules["tensorrt"] = stub
        from cptune.engines.onnx._calibration import attention_graph
        from cptune.engines.tensorrt._worker import GpuRank, LoadedGraph
        gpu = GpuRank(0)
        print("GPU:", gpu.gpu_name, "compute capability", gpu.compute_capability)
        shape = {"heads": 4, "seq_q": 256, "seq_k": 256, "head_dim": 64, "causal": 1}
        graph = LoadedGraph(gpu, b"", attention_graph(shape), {}, MPI.COMM_SELF, None)
        q = np.random.default_rng(0).standard_normal(graph.specs["q"][0], dtype=np.float32)
        graph.fill({"q": q})
        back = graph.read("q")
        rounded = q.astype(graph.specs["q"][1]).astype(np.float32)
        print("bf16 round trip exact:", np.array_equal(back, rounded))
        graph.open()
        ms = [graph.execute() for _ in range(3)]
        print("events around an empty execute (ms):", [round(m, 4) for m in ms], "all >= 0:", min(ms) >= 0)
        graph.close()
        print("freed:", graph.buffers == {})
    """,
    "preflight": """
        import subprocess, sys
        from cptune.engines.tensorrt import preflight, probe_node
        from cptune.engines import BackendUnavailableError
        probe = probe_node()
        print("GPUs:", [(g.name, g.compute_capability) for g in probe.gpus], "missing:", probe.missing,
              "NCCL problem:", probe.nccl_problem)
        try:
            preflight(1, probe)
            print("preflight: passes")
        except BackendUnavailableError as why:
            print("preflight:", why)
        done = subprocess.run([sys.executable, "-m", "cptune.cli", "doctor"], capture_output=True, text=True)
        print("cptune doctor: exit", done.returncode, "| stdout:", done.stdout.strip()[:300], "| stderr:",
              done.stderr.strip()[-600:])
    """,
}


def run(name: str, program: str, timeout: float) -> str:
    """One check in a fresh interpreter: its output, or why it failed."""
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout:.0f} s"
    said = done.stdout.strip()
    if done.returncode:
        said += f"\nFAILED (exit {done.returncode}): " + "\n".join(done.stderr.strip().splitlines()[-4:])
    return said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per check")
    args = parser.parse_args()
    lines = [
        "# TensorRT engine's stack on a GPU node, without TensorRT (benchmarks/gpu_tensorrt_stack.py)",
        f"# code: {commit()}; command: {command('gpu_tensorrt_stack.py', sys.argv[1:])}",
        f"# ran: {datetime.now(UTC).isoformat(timespec='seconds')}",
    ]
    smi = shutil.which("nvidia-smi")
    nvidia = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True) if smi else None
    lines.append(f"# GPU: {nvidia.stdout.strip() if nvidia else 'none (nvidia-smi not found)'}")
    for name, program in CHECKS.items():
        lines += ["", f"## {name}", run(name, program, args.timeout)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
