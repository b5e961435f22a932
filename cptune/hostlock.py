"""One measuring process per host at a time: the host lock.

Two processes that time ranks on one host at once time each other: each sees the other's
ranks as foreign load, and the contention guard marks (or, in a calibration, refuses) what
either measures. So every library call that starts ranks to time them (``search_space``,
``calibrate_host``, ``calibrate``, ``measure_all``, ``measure``, ``measure_round``, a
``WorkloadSearch``) holds this lock while it runs, and a second one waits for it, saying on
stderr who holds it (``cptune._waiting.WaitLine``), instead of both failing.

The lock is ``fcntl.flock`` on a file (``lock_path``: ``$CPTUNE_LOCK``, else
``cptune-<uid>.lock`` in the temporary directory). The kernel drops it when its holder's
process ends, however it ends, so a killed holder never blocks the next one. The holder
writes its pid, command line and start time into the file for those who wait. Within one
process the lock is re-entrant: a search that calibrates first takes it once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cptune._passwords import display_url
from cptune._waiting import WaitLine
from cptune.errors import CPTuneError

#: The environment variable naming the lock file (several GPU sets of one host measured at
#: once: one file each).
LOCK_ENV = "CPTUNE_LOCK"
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

    def describe(self, now: float) -> str:
        started = datetime.fromtimestamp(self.since).strftime("%H:%M:%S")
        return f"pid {self.pid}, {self.command}, since {started} ({_duration(now - self.since)} ago)"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def lock_path() -> Path:
    """The lock file: ``$CPTUNE_LOCK``, else ``cptune-<uid>.lock`` in the temporary directory."""
    named = os.environ.get(LOCK_ENV)
    return Path(named) if named else Path(tempfile.gettempdir()) / f"cptune-{os.getuid()}.lock"


def read_holder(path: Path) -> Holder | None:
    """Who the lock file says holds it (None: nobody wrote it yet, or it is unreadable)."""
    try:
        written = json.loads(path.read_text())
        return Holder(pid=int(written["pid"]), command=str(written["command"]), since=float(written["since"]))
    except (OSError, ValueError, KeyError, TypeError):
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
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise HostLockError(f"cannot open the host lock {path} ({exc.strerror}): set {LOCK_ENV} to a "
                                f"file this user may write") from None
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
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": _command_line(),
                                      "since": time.time()}).encode(), 0)
        except BaseException:
            line.end()
            os.close(fd)  # closing drops the lock too, should it be held
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)


_LOCK = _HostLock()


@contextmanager
def measuring(
    sleep: Callable[[float], None] = time.sleep,
    line: WaitLine | None = None,
) -> Iterator[None]:
    """Hold the host lock for the block, waiting for it while another process holds it (``line``,
    default one on stderr, says who; ``sleep`` between tries). Re-entrant within the process."""
    with _LOCK.mutex:
        if _LOCK.depth == 0:
            _LOCK.acquire(sleep, line or WaitLine())
        _LOCK.depth += 1
        try:
            yield
        finally:
            _LOCK.depth -= 1
            if _LOCK.depth == 0:
                _LOCK.release()
