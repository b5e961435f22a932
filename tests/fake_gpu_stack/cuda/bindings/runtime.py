"""Stand-in for ``cuda.bindings.runtime`` (tests only): (error, value) tuples over host memory,
under the real API's names, so the rank module calls them as it would on a GPU."""

import ctypes
import enum
import time
from types import SimpleNamespace


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


_memory: dict[int, ctypes.Array] = {}
OK = cudaError_t.cudaSuccess


def cudaSetDevice(device):
    return (OK,)


def cudaGetDeviceProperties(device):
    return OK, SimpleNamespace(name=b"Fake GPU" + b"\x00" * 8, major=9, minor=0)


def cudaGetErrorString(error):
    return OK, b"fake error"


def cudaStreamCreate():
    return OK, SimpleNamespace(handle=1)


def cudaStreamSynchronize(stream):
    return (OK,)


def cudaEventCreate():
    return OK, SimpleNamespace(at=0.0)


def cudaEventRecord(event, stream):
    event.at = time.perf_counter()
    return (OK,)


def cudaEventElapsedTime(start, end):
    return OK, (end.at - start.at) * 1e3


def cudaMalloc(nbytes):
    buffer = ctypes.create_string_buffer(nbytes)
    _memory[ctypes.addressof(buffer)] = buffer
    return OK, ctypes.addressof(buffer)


def cudaFree(pointer):
    del _memory[pointer]
    return (OK,)


def cudaMemcpy(dst, src, count, kind):
    device = dst if kind == cudaMemcpyKind.cudaMemcpyHostToDevice else src
    assert device in _memory and count <= len(_memory[device]), "copy outside a device allocation"
    ctypes.memmove(dst, src, count)
    return (OK,)
