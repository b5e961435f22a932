"""A worker rank that misbehaves on purpose: ``python faulty_worker.py LOOP MODE [worker args]``.

LOOP is "shared" (the rank loop of the mpi and onnx engines) or "torch" (the torch engine's
ranks). Rank 1 fails every request, a run or a calibration op, the way MODE says: "raise" (a
Python exception), "crash" (the process exits), "kill" (the process is SIGKILLed), "hang"
(never answers), "wrong" (returns a slightly wrong output; a run on the shared loop only);
with "launch" rank 1 exits as it starts, so no pool of two or more ranks ever starts. All
other ranks behave. Used to check that the engine turns each into one error, on any machine
however fast: nothing here depends on how long a run takes.
"""

import os
import signal
import sys
import time

LOOP, MODE = sys.argv.pop(1), sys.argv.pop(1)
if LOOP == "torch":
    from cptune.engines.torch import _worker as tasks

    Rank, main = tasks.TorchRank, tasks.main
else:
    from cptune.engines import _worker
    from cptune.engines.mpi import _rank as tasks

    Rank, main = _worker.Worker, _worker.main
_handle = Rank.handle
_iteration = tasks.RankTask.iteration


def faulty_handle(self, header, arrays):
    if self.rank == 1:
        if MODE == "raise":
            raise ValueError("injected failure on rank 1")
        if MODE == "crash":
            os._exit(7)
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE == "hang":
            while True:
                time.sleep(1)
    return _handle(self, header, arrays)


def wrong_iteration(self):
    outputs, ops, forward_s = _iteration(self)
    if self.rank == 1:
        outputs = [outputs[0] * 1.01, *outputs[1:]]
    return outputs, ops, forward_s


Rank.handle = faulty_handle
if MODE == "wrong":
    tasks.RankTask.iteration = wrong_iteration

if __name__ == "__main__":
    if MODE == "launch" and os.environ.get("PMI_RANK") == "1":
        os._exit(5)
    main()
