"""Paths a user names: read only regular files, and only up to a bound; replace only regular files.

A path on a command line may name anything: ``/dev/zero`` (endless), ``/dev/full``, a FIFO (an
open for reading waits for a writer that never comes), a socket, a directory. Checking
``st_size`` first does not help: it is 0 for all of those. So a file is opened without
blocking, checked through its descriptor to be a regular file (no race with a rename between
the check and the read), and read up to a bound; what will be replaced is checked the same way
before it is. ``FileRefused`` carries the reason in words a user reads, for each caller to put
in its own one-line error.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from cptune.errors import CPTuneError

#: What is at a path, by the file type bits of its mode, in words.
_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
)


class FileRefused(CPTuneError, OSError):
    """A path cptune will not read or replace: not a regular file, too large, or a name the
    filesystem refuses. ``reason`` says which, without the path."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a character device", "a regular file")."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode)
                else "not a regular file")


def _refusal(path: str | Path, exc: OSError) -> FileRefused | None:
    """The one-line refusal for an ``OSError`` that says what the path is, not that it is missing
    or unreadable (those each caller words itself)."""
    if exc.errno == errno.ENAMETOOLONG:
        return FileRefused(path, "the name is too long for the filesystem (at most 255 bytes a "
                                 "component); choose a shorter name")
    if exc.errno == errno.ENXIO:  # opening a socket, or a device with no driver behind it
        return FileRefused(path, "is a socket or a device, not a regular file; name a file")
    return None


def read_regular(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``; ``FileRefused`` for anything else (a device,
    FIFO, socket or directory: one line saying which), for more than ``limit`` bytes, or for a
    name too long; other ``OSError``s (missing, not permitted) as they are."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise _refusal(path, exc) or exc from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(path, f"is {kind_of(mode)}, not a regular file; name a file")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise FileRefused(path, f"more than {limit:,} bytes, too large for what cptune reads "
                                        f"here; name the right file")
        return b"".join(chunks)
    finally:
        os.close(fd)


def existing_kind(path: str | Path) -> int | None:
    """The mode of what is at ``path`` (following links), None when nothing is; ``FileRefused``
    when it cannot be told (a name too long, a folder not permitted)."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:  # a parent is a file: nothing can be at the path
            return None
        raise _refusal(path, exc) or FileRefused(path, f"cannot look there ({exc.strerror}); check the "
                                                       f"path") from None


def check_regular_or_absent(path: str | Path, how: str) -> None:
    """``FileRefused`` unless ``path`` is a regular file or nothing: what cptune may replace
    (``--force`` included) is never a device, FIFO, socket or directory. ``how`` is the fix
    offered ("write the plan elsewhere (cptune export -o PATH)")."""
    mode = existing_kind(path)
    if mode is not None and not stat.S_ISREG(mode):
        raise FileRefused(path, f"is {kind_of(mode)}, which cptune never replaces; {how}")



def write_regular(path: Path, data: bytes, how: str) -> None:
    """Write ``data`` to ``path``, a regular file or nothing (``check_regular_or_absent``): a
    file of a folder cptune fills (a report's figures) that turned out a FIFO or a device is
    refused, not written into."""
    check_regular_or_absent(path, how)
    path.write_bytes(data)


__all__ = [
    "FileRefused", "check_regular_or_absent", "existing_kind", "kind_of", "read_regular", "write_regular",
]
