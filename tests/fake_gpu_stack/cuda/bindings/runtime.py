"""Stand-in for ``cuda.bindings.runtime`` (tests only): (error, value) tuples over host memory."""

import ctypes
import enum
import time
from types import SimpleNamespace


class cudaError_t(enum.IntEnum):  # noqa: N801 - the real name
    cudaSuccess = 0


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


_memory: dict[int, ctypes.Array] = {}
OK = cudaError_t.cudaSuccess


def cudaSetDevice(device):  # noqa: N802
    return (OK,)


def cudaGetDeviceProperties(device):  # noqa: N802
    return OK, SimpleNamespace(name=b"Fake GPU" + b"\x00" * 8, major=9, minor=0)


def cudaGetErrorString(error):  # noqa: N802
    return OK, b"fake error"


def cudaStreamCreate():  # noqa: N802
    return OK, SimpleNamespace(handle=1)


def cudaStreamSynchronize(stream):  # noqa: N802
    return (OK,)


def cudaEventCreate():  # noqa: N802
    return OK, SimpleNamespace(at=0.0)


def cudaEventRecord(event, stream):  # noqa: N802
    event.at = time.perf_counter()
    return (OK,)


def cudaEventElapsedTime(start, end):  # noqa: N802
    return OK, (end.at - start.at) * 1e3


def cudaMalloc(nbytes):  # noqa: N802
    buffer = ctypes.create_string_buffer(nbytes)
    _memory[ctypes.addressof(buffer)] = buffer
    return OK, ctypes.addressof(buffer)


def cudaFree(pointer):  # noqa: N802
    del _memory[pointer]
    return (OK,)


def cudaMemcpy(dst, src, count, kind):  # noqa: N802
    device = dst if kind == cudaMemcpyKind.cudaMemcpyHostToDevice else src
    assert device in _memory and count <= len(_memory[device]), "copy outside a device allocation"
    ctypes.memmove(dst, src, count)
    return (OK,)
