"""Paths a user names: read only regular files, and only up to a bound; replace only regular files
cptune wrote.

A path on a command line may name anything: ``/dev/zero`` (endless), ``/dev/full``, a FIFO (an
open for reading waits for a writer that never comes), a socket, a directory. Checking
``st_size`` first does not help: it is 0 for all of those. So a file is opened without
blocking, checked through its descriptor to be a regular file (no race with a rename between
the check and the read), and read up to a bound; what will be replaced is checked the same way
before it is, and its content must say cptune wrote it (``check_ours``): a path a user names as
an output may be another program's file, or one of the command's own inputs. ``FileRefused``
carries the reason in words a user reads, for each caller to put in its own one-line error.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
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


def _open_regular(path: str | Path) -> int:
    """A descriptor of the regular file at ``path``, opened to read without blocking;
    ``FileRefused`` for anything else or a name too long, other ``OSError``s as they are."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise _refusal(path, exc) or exc from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(path, f"is {kind_of(mode)}, not a regular file; name a file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``; ``FileRefused`` for anything else (a device,
    FIFO, socket or directory: one line saying which), for more than ``limit`` bytes, or for a
    name too long; other ``OSError``s (missing, not permitted) as they are."""
    fd = _open_regular(path)
    try:
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


def read_head(path: str | Path, size: int) -> bytes:
    """The first ``size`` bytes (or fewer) of the regular file at ``path``: enough to tell by
    its content what a file is; ``FileRefused`` as ``read_regular``."""
    fd = _open_regular(path)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def same_file(first: str | Path, second: str | Path) -> bool:
    """Whether ``first`` and ``second`` name one existing file (through links too)."""
    try:
        return os.path.samefile(first, second)
    except (OSError, ValueError):
        return False


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



#: How many leading bytes ``check_ours`` reads to tell whether cptune wrote a file.
HEAD_BYTES = 4096


def check_ours(path: str | Path, ours: Callable[[bytes], bool], how: str) -> None:
    """``FileRefused`` unless ``path`` holds nothing or a regular file cptune wrote, told by its
    content (``ours`` of its first ``HEAD_BYTES`` bytes): a file of a folder cptune fills that
    turned out a FIFO, a device, a database or another program's file is left as it is.
    ``how`` is the fix offered ("write the report elsewhere (cptune report -o DIR)")."""
    check_regular_or_absent(path, how)
    if existing_kind(path) is None:
        return
    try:
        head = read_head(path, HEAD_BYTES)
    except FileNotFoundError:  # removed since: nothing there
        return
    if not ours(head):
        raise FileRefused(path, f"exists and is not a file cptune wrote, so it is left as it is; {how}, or "
                                f"move that file away first")


def write_regular(path: Path, data: bytes, how: str, ours: Callable[[bytes], bool]) -> None:
    """Write ``data`` to ``path``, where nothing is or a regular file cptune wrote
    (``check_ours``)."""
    check_ours(path, ours, how)
    path.write_bytes(data)


__all__ = [
    "HEAD_BYTES", "FileRefused", "check_ours", "check_regular_or_absent", "existing_kind", "kind_of",
    "read_head", "read_regular", "same_file", "write_regular",
]
