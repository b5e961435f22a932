"""A worker rank that misbehaves on purpose: ``python faulty_worker.py MODE [worker args]``.

Rank 1 of every "run" request fails the way MODE says: "raise" (a Python exception),
"crash" (the process dies), "hang" (never answers), "wrong" (returns a slightly wrong
output); with "launch" rank 1 exits as it starts, so no pool of two or more ranks ever
starts. All other ranks behave. Used to check that the engine turns each into one error.
"""

import os
import sys
import time

from cptune.engines import _worker
from cptune.engines.mpi import _rank

MODE = sys.argv.pop(1)
_handle = _worker.Worker.handle
_iteration = _rank.RankTask.iteration


def faulty_handle(self, header, arrays):
    if header["op"] == "run" and self.rank == 1:
        if MODE == "raise":
            raise ValueError("injected failure on rank 1")
        if MODE == "crash":
            os._exit(7)
        if MODE == "hang":
            while True:
                time.sleep(1)
    return _handle(self, header, arrays)


def wrong_iteration(self):
    out, ops = _iteration(self)
    if self.rank == 1:
        out = out * 1.01
    return out, ops


_worker.Worker.handle = faulty_handle
if MODE == "wrong":
    _rank.RankTask.iteration = wrong_iteration

if __name__ == "__main__":
    if MODE == "launch" and _worker.MPI.COMM_WORLD.Get_rank() == 1:
        os._exit(5)
    _worker.main()
