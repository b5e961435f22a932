"""One measuring process per host at a time: the host lock.

Two processes that time ranks on one host at once time each other: each sees the other's
ranks as foreign load, and the contention guard marks (or, in a calibration, refuses) what
either measures. So every library call that starts ranks to time them (``search_space``,
``calibrate_host``, ``calibrate``, ``measure_all``, ``measure``, ``measure_round``, a
``WorkloadSearch``) holds this lock while it runs, and a second one waits for it, saying on
stderr who holds it (``cptune._waiting.WaitLine``), instead of both failing.

The lock is ``fcntl.flock`` on a file (``lock_path``: ``$CPTUNE_LOCK``, else
``/tmp/cptune-<uid>.lock``: one place per host whatever ``TMPDIR`` says, so processes
started with different temporary directories, a cluster job's and a user's, still take
turns). The kernel drops it when its holder's process ends, however it ends, so a killed
holder never blocks the next one. The holder writes its pid, command line and start time
into the file for those who wait, and leaves them there. The file is only ever written when
it is the lock's own: new, empty, or holding such a record; a ``$CPTUNE_LOCK`` naming
anything else (a database, a device, a folder) is refused in one line and left as it is.
Within one process the lock is re-entrant: a search that calibrates first takes it once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cptune._files import kind_of, read_regular
from cptune._passwords import display_url
from cptune._waiting import WaitLine
from cptune.errors import CPTuneError
from cptune.measurement import machine_id

#: The environment variable naming the lock file (several GPU sets of one host measured at
#: once: one file each).
LOCK_ENV = "CPTUNE_LOCK"
#: The most a holder's record takes (its command line included).
MAX_RECORD_BYTES = 1 << 16
#: Where the default lock file lives: a fixed folder, not the temporary directory, which
#: ``TMPDIR`` moves (a cluster job's own, a user's), and with it the lock, so two measuring
#: processes of one host would not see each other.
LOCK_DIR = Path("/tmp")
#: Seconds between tries of a lock another process holds.
POLL_S = 0.5


class HostLockError(CPTuneError, OSError):
    """The host lock's file cannot be opened."""


@dataclass(frozen=True)
class Holder:
    """Who holds the lock, as its holder wrote it."""

    pid: int
    command: str
    since: float  # seconds since the epoch
    #: The holder's ``cptune.measurement.machine_id`` ("" in records written before it was kept).
    machine: str = ""

    def describe(self, now: float) -> str:
        started = datetime.fromtimestamp(self.since).strftime("%H:%M:%S")
        return f"pid {self.pid}, {self.command}, since {started} ({_duration(now - self.since)} ago)"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def lock_path() -> Path:
    """The lock file: ``$CPTUNE_LOCK``, else ``cptune-<uid>.lock`` in ``LOCK_DIR`` (whatever
    ``TMPDIR`` says)."""
    named = os.environ.get(LOCK_ENV)
    return Path(named) if named else _default_path()


def _default_path() -> Path:
    return LOCK_DIR / f"cptune-{os.getuid()}.lock"


def read_holder(path: Path) -> Holder | None:
    """Who the lock file says holds it (None: nobody wrote it yet, or it is unreadable)."""
    try:
        return _holder_from(read_regular(path, MAX_RECORD_BYTES))
    except OSError:
        return None


def _holder_from(content: bytes) -> Holder | None:
    """The holder a lock file's bytes record (None: they are no holder's record)."""
    try:
        written = json.loads(content)
        return Holder(pid=int(written["pid"]), command=str(written["command"]), since=float(written["since"]),
                      machine=str(written.get("machine", "")))
    except (ValueError, KeyError, TypeError):
        return None


def _command_line() -> str:
    """This process's command line, as a user would type it (the command line's own program
    as ``cptune``), any password in a database URL among it shown as ``***``."""
    program, *args = [display_url(arg) for arg in sys.argv] or [""]
    started_cli = Path(program).name in ("-c", "__main__.py") and "cptune.cli" in sys.modules
    if Path(program).name == "cptune" or started_cli:
        program = "cptune"
    elif program in ("-c", ""):
        program = "python -c ..."
    else:
        program = shlex.quote(program)
    return " ".join([program, *map(shlex.quote, args)])


class _HostLock:
    """This process's hold on the lock: the open file and how deep the holds nest."""

    def __init__(self) -> None:
        self.mutex = threading.RLock()  # threads of this process take turns
        self.depth = 0
        self.fd: int | None = None

    def acquire(self, sleep: Callable[[float], None], line: WaitLine) -> None:
        path = lock_path()
        fd = _open_lock(path)
        try:
            waited = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = read_holder(path)
                    who = holder.describe(time.time()) if holder else "another process"
                    line.show(f"waiting for the other cptune measuring on this host to finish ({who}): one "
                              f"measures at a time, so neither disturbs the other's timings; Ctrl-C stops "
                              f"waiting")
                    waited = True
                    sleep(POLL_S)
            if waited:
                line.end()
            _check_is_lock(fd, path)
            os.ftruncate(fd, 0)  # the previous holder's record: this file is the lock's own
            os.pwrite(fd, _record(_command_line()), 0)
        except BaseException:
            line.end()
            os.close(fd)  # closing drops the lock too, should it be held
            raise
        self.fd = fd

    def release(self) -> None:
        """Drop the lock; the file keeps the last holder's record (a lock file, not emptied, so it
        is never mistaken for another program's empty file)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def _open_lock(path: Path) -> int:
    """The lock file at ``path`` open for reading and writing: ``HostLockError`` (the file
    closed again) unless it is a regular file, new, empty or holding a holder's record."""
    try:
        # no O_TRUNC: what the path names is checked (a regular file, empty or a lock's) before any write
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise HostLockError(f"cannot open the host lock {path} ({exc.strerror}): set {LOCK_ENV} to a "
                            f"file this user may write") from None
    try:
        if not stat.S_ISREG(mode := os.fstat(fd).st_mode):
            raise HostLockError(f"the host lock {path} is {kind_of(mode)}, not a file: set {LOCK_ENV} to "
                                f"a new file's path (say {_default_path()})")
        _check_is_lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_is_lock(fd: int, path: Path) -> None:
    """``HostLockError`` unless the file open at ``fd`` is empty (new) or holds a holder's record:
    a lock that names another program's file (a database, a search space) leaves it untouched."""
    content = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
    if not content or _holder_from(content) is not None:
        return
    raise HostLockError(f"{LOCK_ENV} names {path}, which is not cptune's host lock file (it holds other "
                        f"data, left as it is): set {LOCK_ENV} to a new file's path (say {_default_path()})")


_LOCK = _HostLock()


def _record(command: str) -> bytes:
    """What a holder writes into the lock file."""
    return json.dumps({"pid": os.getpid(), "command": command, "since": time.time(),
                       "machine": machine_id()}).encode()


def hold_for_life(driver_machine: str) -> str | None:
    """Take this host's lock without waiting and keep it until this process ends (the first
    rank of a node of a cluster: no other cptune measures there while it serves); None once
    held, or when the driver on ``driver_machine`` (``cptune.measurement.machine_id``) holds
    this very file (one file system shared by the nodes); else who holds it."""
    path = lock_path()
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_holder(path)
        os.close(fd)
        if holder is not None and holder.machine == driver_machine:
            return None
        return holder.describe(time.time()) if holder else "another process"
    os.ftruncate(fd, 0)
    os.pwrite(fd, _record(f"a rank of {_command_line()}"), 0)
    return None  # fd stays open: the lock lasts as long as this process


@contextmanager
def measuring(
    sleep: Callable[[float], None] = time.sleep,
    line: WaitLine | None = None,
    lazy: bool = False,
) -> Iterator[None]:
    """Hold the host lock for the block, waiting for it while another process holds it (``line``,
    default one on stderr, says who; ``sleep`` between tries). Re-entrant within the process.
    ``lazy``: the block may have nothing to measure (a search whose results are all stored), so
    it takes the lock only when a hold inside it does, then keeps it to the block's end."""
    with _LOCK.mutex:
        if _LOCK.fd is None and not lazy:
            _LOCK.acquire(sleep, line or WaitLine())
        elif _LOCK.fd is None and _LOCK.depth == 0:
            os.close(_open_lock(lock_path()))  # a lock file it cannot use: refused now, not at the first run
        _LOCK.depth += 1
        try:
            yield
        finally:
            _LOCK.depth -= 1
            if _LOCK.depth == 0:
                _LOCK.release()
