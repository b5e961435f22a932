"""The pool folders in the temporary directory (issue 33, item 9): a run killed outright
leaves its folder behind, so the next pool removes those whose owner is gone; a run ended by
SIGTERM removes its own on the way out; a pool that cannot start leaves none. A TMPDIR longer
than a Unix socket's address holds (issue 41, item 4) measures all the same."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import CLI, cptune, processes_left
from cptune.engines import _pool
from cptune.engines._pool import OWNER_FILE, WorkerPool, _started, worker_command
from cptune.engines._protocol import SOCKET_PATH_MAX, receive, send, unix_connection, unix_listener
from cptune.errors import EngineError


def long_folder(parent):
    """A folder under ``parent`` whose path is far longer than a socket address holds."""
    path = parent.joinpath(*["d" * 200] * 3)
    path.mkdir(parents=True)
    return path


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
               "--ranks", "2", "--head-group", "1", "--repeats", "10000", "--timeout", "600"]
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


def test_a_socket_file_at_a_path_longer_than_an_address_holds_listens_and_connects(tmp_path):
    path = long_folder(tmp_path) / "driver.sock"
    assert len(str(path)) > SOCKET_PATH_MAX
    with unix_listener(path, 1) as listener, unix_connection(path) as rank:
        send(rank, {"hello": 1})
        driver, _ = listener.accept()
        with driver:
            assert receive(driver) == ({"hello": 1}, [])
    assert path.is_socket()  # the very file in the folder, not one elsewhere


def test_a_pool_that_cannot_start_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_mpiexec():
        raise EngineError("launch", "no mpiexec found")

    monkeypatch.setattr(_pool, "find_mpiexec", no_mpiexec)
    with pytest.raises(EngineError, match="no mpiexec found"):
        WorkerPool(2, worker_command("cptune.engines._worker"), 10)
    assert list(tmp_path.iterdir()) == []


def test_a_socket_that_cannot_be_opened_is_one_launch_error_and_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def refused(path, backlog):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(_pool.protocol, "unix_listener", refused)
    with pytest.raises(EngineError, match="cannot open the pool's socket .* point TMPDIR at a") as failure:
        WorkerPool(2, worker_command("cptune.engines._worker"), 10)
    assert failure.value.kind == "launch" and len(str(failure.value).splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_a_tmpdir_longer_than_a_socket_address_holds_measures_and_leaves_no_folder(tmp_path, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    tmpdir = long_folder(tmp_path)
    done = cptune("measure", "--seq-len", "64", "--heads", "4", "--head-dim", "8", "--strategies", "ring",
                  "--ranks", "2", "--head-group", "1", "--warmup", "0", "--repeats", "1", "--json",
                  "--backend", backend, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmpdir.glob("cptune-pool-*")) == []
