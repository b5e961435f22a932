import os
import sys
from pathlib import Path

import pytest

from cptune.engines.mpi import MPIEngine

TESTS = Path(__file__).parent


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


@pytest.fixture
def faulty_engine():
    """Make an MPI engine whose rank 1 misbehaves as asked; closed after the test."""
    engines = []

    def make(mode: str) -> MPIEngine:
        engine = MPIEngine(worker=[sys.executable, str(TESTS / "faulty_worker.py"), mode])
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
