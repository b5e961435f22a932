from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from cptune.calibration import Calibration, CollectiveFit, ComputeRate, group_sizes
from cptune.config import STRATEGIES, CPConfig
from cptune.cost import BACKWARD_FLOPS_RATIO, STREAM_KINDS
from cptune.engines import ENGINES
from cptune.engines._pool import PooledEngine
from cptune.engines.mpi import MPIEngine
from cptune.hardware import Hardware, this_host
from cptune.hostlock import LOCK_ENV
from cptune.measurement import Measurement
from cptune.reference import make_inputs, reference_attention
from cptune.store import Store
from cptune.workload import Workload
from suite_cli import IGNORE_LOAD, QUICK_CALIBRATION, ignore_load, quick_calibration

if TYPE_CHECKING:
    from cptune.model import Candidate
    from cptune.search import GuidedSampler

TESTS = Path(__file__).parent
#: ``cptune`` as a user starts it: a fresh interpreter (``-P``: neither the working directory
#: nor the script's is put on sys.path, so the installed or PYTHONPATH cptune runs, not a stray
#: module beside it), by way of tests/suite_cli.py (the guard's evidence ignored and
#: calibrations quick where ``_suite_settings`` says so).
CLI = [sys.executable, "-P", str(Path(__file__).parent / "suite_cli.py")]
#: A host other than this one, for measurements and calibrations stored under another fingerprint.
OTHER_HOST = Hardware(host="elsewhere", cpu_model="other cpu", cpu_count=64, gpu_model=None, gpu_count=0,
                      interconnect="shared memory (one host)", mpi_library="MPICH 5")


@pytest.fixture(scope="session")
def _host_lock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test process's own host lock file (each pytest-xdist worker has its own base
    folder): tests running at once in two workers do not wait for each other's searches."""
    return tmp_path_factory.getbasetemp() / "host.lock"


@pytest.fixture(autouse=True)
def _suite_settings(monkeypatch: pytest.MonkeyPatch, _host_lock: Path) -> None:
    """Here and in CLI subprocesses (tests/suite_cli.py): the contention guard off
    (``CPTUNE_GUARD=off``: no waiting for quiet) and its evidence ignored (every run judged
    clean), since the suite runs on shared hosts where other test runs would mark most runs
    disturbed; calibrations quick (small shapes); a host lock of this test process's own.
    tests/test_guard.py watches the load again for the guard's own tests;
    tests/test_cli_model.py calibrates once with the real shapes."""
    monkeypatch.setenv(LOCK_ENV, str(_host_lock))
    monkeypatch.setenv("CPTUNE_GUARD", "off")
    monkeypatch.setenv(IGNORE_LOAD, "1")
    ignore_load(monkeypatch.setattr)
    monkeypatch.setenv(QUICK_CALIBRATION, "1")
    quick_calibration(monkeypatch.setattr)


#: Every strategy and head group on 4, 3, 2 and 1 ranks, largest first (so an engine's pool
#: starts once at its full size): what the engines' reference tests run.
EVERY_CONFIG = [
    CPConfig(strategy, ranks, u)
    for ranks in (4, 3, 2, 1)
    for strategy in STRATEGIES
    for u in range(1, ranks + 1)
    if ranks % u == 0 and (strategy != "ulysses" or u == ranks)
]


def reference_cases(workloads: dict[str, dict[str, Any]]) -> Callable[[str, bool], tuple]:
    """(workload, (q, k, v), float64 reference) of each of ``workloads`` (by name) with or
    without a causal mask, made on first use and kept."""
    cache: dict[tuple[str, bool], tuple] = {}

    def case(name: str, causal: bool) -> tuple:
        if (name, causal) not in cache:
            workload = Workload(**workloads[name], causal=causal)
            q, k, v = make_inputs(workload, seed=len(cache))
            cache[name, causal] = workload, (q, k, v), reference_attention(workload, q, k, v)
        return cache[name, causal]

    return case


def migrated(path: Path, revision: str, down: bool = False) -> Any:
    """A SQLAlchemy engine on the SQLite file at ``path``, moved by cptune's own migrations up
    to schema ``revision`` (``down``: back to it), as an older cptune left it."""
    from importlib.resources import files

    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    config = Config()
    config.set_main_option("script_location", str(files("cptune.db")))
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, revision)
    return engine


def torchrun_lines(world: int, script: Path, *args: str, timeout: float = 240) -> list[str]:
    """``script`` on ``world`` gloo ranks under torchrun; the lines the ranks printed. A run
    past ``timeout`` fails the test, torchrun and its ranks killed."""
    import signal

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(script), *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as ranks:
        try:
            out, err = ranks.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(ranks.pid, signal.SIGKILL)  # torchrun and the ranks it started
            ranks.communicate()
            pytest.fail(f"{world} ranks did not finish within {timeout} s")
    assert ranks.returncode == 0, err[-6000:]
    return out.splitlines()


def torchrun_summary(world: int, script: Path, *args: str, timeout: float = 240) -> dict:
    """``script`` on ``world`` gloo ranks under torchrun (``torchrun_lines``); rank 0's JSON
    summary (the last line)."""
    import json

    summary: dict = json.loads(torchrun_lines(world, script, *args, timeout=timeout)[-1])
    return summary


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py imported as the module ``name``, with benchmarks/ on the path as
    when the script runs (for the helpers it imports)."""
    folder = TESTS.parent / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def pool_processes(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(s for s in (entry / "status").read_text().splitlines() if s.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if marker in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


def processes_left(marker: str, within: float = 10.0) -> list[int]:
    """``pool_processes(marker)`` once none is left or ``within`` seconds have passed: a rank
    the pool SIGKILLed takes a moment to die."""
    deadline = time.monotonic() + within
    while (found := pool_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def cptune(*args: object, **kwargs: Any) -> subprocess.CompletedProcess:
    """``cptune *args`` in a subprocess (each argument passed as ``str``), its output captured as
    text; ``kwargs`` go to ``subprocess.run`` (``cwd``, ``env``, ``timeout``). For what needs a
    process of its own: real ranks end to end, signals, a fresh interpreter."""
    kwargs.setdefault("timeout", 300)
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, **kwargs)


@pytest.fixture
def cptune_here(capsys: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess]:
    """``cptune *args`` run in this process by ``cptune.cli.main``, answered like ``cptune()``
    (returncode, stdout, stderr): a flag error's exit (argparse's ``SystemExit``) is its code.
    For bad flags and databases, where a subprocess would only pay for the imports."""
    from cptune.cli import main

    def run(*args: object) -> subprocess.CompletedProcess:
        argv = [str(arg) for arg in args]
        capsys.readouterr()  # only what this command prints
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = 0 if exit_.code is None else exit_.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["cptune", *argv], code, out, err)

    return run


def assert_refused(result: subprocess.CompletedProcess, *fragments: str,
                   prefix: str = "cptune: error: ") -> None:
    """Exit 2, nothing on stdout, one line on stderr (so no traceback) starting ``prefix`` and
    naming every one of ``fragments``."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(prefix), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_pool_gone(pool_dir: Path, pids: list[int]) -> None:
    """Within 10 s, no process of the pool in ``pool_dir`` (nor any of ``pids``) is left and
    its directory is removed."""
    deadline = time.monotonic() + 10
    while (pool_processes(str(pool_dir)) or any(os.path.exists(f"/proc/{p}") for p in pids)) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool_processes(str(pool_dir)) == []
    assert not pool_dir.exists()


#: ``make_calibration``'s backward rate over its forward's.
BACKWARD_SPEED = 0.8


class StandInCalibrationEngine:
    """The parts of an in-process stand-in for ``calibrate`` that stand-ins share: the mpi
    engine's spec with no steps and no exchange waits to time (a subclass that times waits
    says so), collectives 1 ms plus 1 ns per byte each rank sends, no node readings and no
    rank processes. Subclasses give ``time_attention``."""

    name, spec = "mpi", dataclasses.replace(ENGINES["mpi"], times_steps=False, times_waits=False)

    def time_collective(self, kind, ranks, group, chunks, warmup, repeats, timeout, along="heads"):
        return np.array([[1e-3 + 1e-9 * chunk * (1 if kind in STREAM_KINDS else group - 1)] * repeats
                         for chunk in chunks])

    def describe(self):
        return {"engine": self.name}

    def node_readings(self):
        return {}

    def process_ids(self):
        return []


def make_calibration(max_ranks: int = 4) -> Calibration:
    """A hand-built calibration of 1..``max_ranks`` ranks: no MPI run needed."""
    fits = tuple(
        CollectiveFit(kind=kind, ranks=n, group=g, latency_s=30e-6, bandwidth=1e9, bus_bandwidth=1e9,
                      sizes=(1024,), times_s=(31e-6,))
        for n in range(2, max_ranks + 1) for g in group_sizes(n) for kind in ENGINES["mpi"].collectives
    )
    compute = tuple(
        ComputeRate(ranks=n, heads=4, seq_q=512, seq_k=2048, head_dim=d,
                    seconds=4 * 4 * 512 * 2048 * d / (20e9 / n**0.5))
        for n in range(1, max_ranks + 1) for d in (64, 128)
    )
    # the backward at BACKWARD_SPEED of the forward's rate on the same shapes
    backward = tuple(dataclasses.replace(rate, seconds=rate.seconds * BACKWARD_FLOPS_RATIO / BACKWARD_SPEED)
                     for rate in compute)
    return Calibration("mpi", fits, compute, "2025-01-01T00:00:00+00:00", backward=backward)


def measurement(workload: Workload, config: CPConfig, ms: float) -> Measurement:
    """A made-up successful measurement of median ``ms`` (p10 0.9x, p90 1.2x)."""
    return Measurement(
        workload=workload, config=config, median_ms=ms, p10_ms=0.9 * ms, p90_ms=1.2 * ms,
        compute_ms=0.8 * ms, comm_ms=0.2 * ms, peak_bytes=2**20, max_error=1e-3, engine="mpi", host={},
        warmup=1, repeats=3, samples_ms=[0.9 * ms, ms, 1.2 * ms],
    )


def add_measurements(db: str, *measurements: Measurement, hardware: Hardware | None = None) -> None:
    """Store ``measurements`` in ``db``, taken on ``hardware`` (this host unless given)."""
    with Store(db) as store:
        for m in measurements:
            store.add_measurement(hardware or this_host(), m)


def stand_in_measuring(monkeypatch: pytest.MonkeyPatch, measure: Callable[..., Measurement]) -> None:
    """Make ``measure`` (the signature of ``cptune.measure``) what the search measures with,
    in its visits and, one call per configuration, in its interleaved rounds."""
    from cptune.errors import EngineError

    def measure_round(workload: Workload, configs: list[CPConfig], **options: Any
                      ) -> dict[CPConfig, Measurement | EngineError]:
        options = {key: value for key, value in options.items() if key not in ("rng", "deadline")}
        outcomes: dict[CPConfig, Measurement | EngineError] = {}
        for config in configs:
            try:
                outcomes[config] = measure(workload, config, **options)
            except EngineError as error:
                outcomes[config] = error
        return outcomes

    monkeypatch.setattr("cptune.search._workload.measure", measure)
    monkeypatch.setattr("cptune.search._workload.measure_round", measure_round)


def write_toml(tmp_path: Path, text: str, name: str) -> Path:
    """``text`` written to ``tmp_path / name``; the file's path."""
    path = tmp_path / name
    path.write_text(text)
    return path


def replaced_once(base: str, old: str, new: str) -> str:
    """``base`` with one exact piece replaced (the piece must be there)."""
    assert old in base, old
    return base.replace(old, new, 1)


def refusal_of(load: Callable[[Any], object], error: type[Exception], source: object) -> str:
    """The message of the ``error`` that ``load(source)`` must raise."""
    with pytest.raises(error) as raised:
        load(source)
    return str(raised.value)


@pytest.fixture
def faulty_engine():
    """Make an engine (default the mpi engine) whose rank 1 misbehaves as asked
    (tests/faulty_worker.py); closed after the test."""
    engines = []

    def make(mode: str, kind: type[PooledEngine] = MPIEngine) -> PooledEngine:
        loop = "torch" if kind.spec.name == "torch" else "shared"
        engine = kind(worker=[sys.executable, str(TESTS / "faulty_worker.py"), loop, mode])
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def candidate(config: CPConfig, ms: float, low: float, high: float) -> Candidate:
    """The model's prediction for ``config``: ``ms``, its interval ``low``..``high`` ms."""
    from cptune.model import Candidate

    return Candidate(config, ms, low, high, "model")


def replay(truth: dict[CPConfig, float], predictions: dict[CPConfig, Candidate],
           stop_probability: float = 0.1) -> tuple[list[CPConfig], GuidedSampler, list[list[CPConfig]]]:
    """``GuidedSampler`` over ``truth``'s configurations, each valued at its ``truth`` (ms),
    the model fixed at ``predictions``: the order it tried them in, the sampler (its
    ``early_stop``), and the configurations it asked the model about, call by call."""
    import optuna

    from cptune.search import GuidedSampler, suggest, tree_of

    configs, asked = list(truth), []

    def predict(pending: list[CPConfig]) -> list[Candidate]:
        asked.append(list(pending))
        return [predictions[c] for c in pending]

    sampler = GuidedSampler(configs, predict, stop_probability)
    tree, order = tree_of(configs), []

    def objective(trial: optuna.Trial) -> float:
        config = suggest(trial, tree)
        order.append(config)
        return truth[config]

    optuna.create_study(sampler=sampler).optimize(objective, n_trials=len(configs))
    return order, sampler, asked
