"""Messages between the driver and its ranks over a stream socket.

A message is a JSON header followed by the raw bytes of the arrays it lists (dtype and
shape in the header). Nothing is pickled: a peer can only ever send data, never code.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

_LENGTH = struct.Struct("!I")
_MAX_HEADER = 16 * 2**20
_DTYPES = {"float16", "float32", "float64", "int32", "int64", "uint8"}  # uint8: serialized graphs

Message = tuple[dict[str, Any], list[np.ndarray]]


def send(sock: socket.socket, header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    specs = [{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays]
    body = json.dumps({**header, "arrays": specs}).encode()
    sock.sendall(_LENGTH.pack(len(body)) + body)
    for a in arrays:
        if a.nbytes:
            sock.sendall(a.data.cast("B"))


def _read_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed the connection")
        view = view[got:]


def receive(sock: socket.socket) -> Message:
    """Read one message; ``ConnectionError`` when the peer is gone or speaks nonsense."""
    length = bytearray(_LENGTH.size)
    _read_into(sock, memoryview(length))
    (size,) = _LENGTH.unpack(length)
    if size > _MAX_HEADER:
        raise ConnectionError(f"message header of {size} bytes is not a cptune message")
    body = bytearray(size)
    _read_into(sock, memoryview(body))
    header = json.loads(body)
    arrays = []
    for spec in header.pop("arrays"):
        if spec["dtype"] not in _DTYPES:
            raise ConnectionError(f"unexpected array dtype {spec['dtype']!r}")
        a = np.empty(tuple(int(n) for n in spec["shape"]), dtype=spec["dtype"])
        if a.nbytes:
            _read_into(sock, a.data.cast("B"))
        arrays.append(a)
    return header, arrays
