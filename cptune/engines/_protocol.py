"""Messages between the driver and its ranks over a stream socket, and the Unix sockets they
meet on.

A message is a JSON header followed by the raw bytes of the arrays it lists (dtype and
shape in the header). Nothing is pickled: a peer can only ever send data, never code.

The driver's socket is a file in its pool's private folder (mode 0700, in the temporary
directory), so only this user's processes can connect. Ranks on other nodes reach the driver
over TCP instead (``tcp://host:port``), and prove they are the pool's with a secret token
the driver gave them through mpiexec's environment (``TOKEN_VARIABLE``). A Unix socket's
address holds at most 107 bytes, and a cluster job's TMPDIR alone can be longer: a longer
path is reached through a descriptor of its folder (``/proc/self/fd/N/name``), the same file
by a short name.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_LENGTH = struct.Struct("!I")
_MAX_HEADER = 16 * 2**20
_DTYPES = {"float16", "float32", "float64", "int32", "int64", "uint8"}  # uint8: serialized graphs

Message = tuple[dict[str, Any], list[np.ndarray]]
#: The environment variable carrying a TCP pool's token to its ranks.
TOKEN_VARIABLE = "CPTUNE_POOL_TOKEN"
#: ... and the driver's ``machine_id``: a node's first rank on another machine takes that
#: machine's host lock (``cptune.hostlock.hold_for_life``).
DRIVER_MACHINE_VARIABLE = "CPTUNE_DRIVER_MACHINE"
#: How a driver's TCP address is written where a socket path could be.
TCP_SCHEME = "tcp://"
#: The longest path a Unix socket address holds (Linux's sun_path, less its final NUL).
SOCKET_PATH_MAX = 107


def _at(path: Path, use: Callable[[str], None]) -> None:
    """Call ``use`` (a socket's bind or connect) with an address of the socket file ``path``:
    the path itself where it fits, else a short one through a descriptor of its folder."""
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        use(str(path))
        return
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        use(f"/proc/self/fd/{folder}/{path.name}")
    finally:
        os.close(folder)


def unix_listener(path: Path, backlog: int) -> socket.socket:
    """A stream socket listening at the new socket file ``path``, whatever its length."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _at(path, listener.bind)
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener


def unix_connection(path: Path) -> socket.socket:
    """A stream socket connected to the listener at socket file ``path``, whatever its length."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _at(path, sock.connect)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_address(host: str, port: int) -> str:
    """The address ranks connect to for a driver listening at ``host``:``port``."""
    return f"{TCP_SCHEME}[{host}]:{port}" if ":" in host else f"{TCP_SCHEME}{host}:{port}"


def connection(address: str) -> socket.socket:
    """A stream socket connected to the driver at ``address``: ``tcp://host:port`` or the
    path of a Unix socket file."""
    if not address.startswith(TCP_SCHEME):
        return unix_connection(Path(address))
    host, _, port = address.removeprefix(TCP_SCHEME).rpartition(":")
    return socket.create_connection((host.strip("[]"), int(port)), timeout=60.0)


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
