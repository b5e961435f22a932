"""The pool folders in the temporary directory (issue 33, item 9): a run killed outright
leaves its folder behind, so the next pool removes those whose owner is gone; a run ended by
SIGTERM removes its own on the way out."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import CLI, processes_left
from cptune.engines._pool import OWNER_FILE, WorkerPool, _started


def folder(parent, name, owner=None):
    path = parent / name
    path.mkdir()
    (path / "ranks.log").write_text("")
    if owner is not None:
        (path / OWNER_FILE).write_text(owner)
    return path


def test_a_new_pool_removes_the_folders_whose_owner_is_gone_and_only_those(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    here = f"{os.getpid()} {_started(os.getpid())}"
    killed = folder(tmp_path, "cptune-pool-killed", f"{ended.pid} 1")  # its owner exited
    reused = folder(tmp_path, "cptune-pool-reused", f"{os.getpid()} 1")  # the pid now names another process
    running = folder(tmp_path, "cptune-pool-running", here)
    unknown = folder(tmp_path, "cptune-pool-unmarked")  # no owner named: not ours to judge
    other = folder(tmp_path, "unrelated-killed", f"{ended.pid} 1")
    pool = WorkerPool.__new__(WorkerPool)
    pool._prepare(2, "cptune-pool-")
    try:
        assert not killed.exists() and not reused.exists()
        assert running.exists() and unknown.exists() and other.exists()
        assert (pool.dir / OWNER_FILE).read_text() == here
    finally:
        pool.log.close()


@pytest.mark.slow
def test_a_terminated_command_stops_its_ranks_and_removes_their_folder(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    measure = ["measure", "--seq-len", "4096", "--heads", "8", "--head-dim", "64", "--strategies", "ring",
               "--ranks", "2", "--head-group", "1", "--repeats", "100000", "--timeout", "600"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    command = subprocess.Popen([*CLI, *measure], env=env, **quiet)
    deadline = time.monotonic() + 120
    while not (found := list(tmp_path.glob("cptune-pool-*"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found, "the pool should have started"
    time.sleep(1.0)
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.glob("cptune-pool-*")) == []
    assert processes_left(str(found[0]), within=15) == []
