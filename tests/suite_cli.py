"""``cptune`` as the suite's subprocesses start it (``conftest.CLI``): the command line, with
two of the suite's settings carried into the subprocess.

- ``$CPTUNE_TEST_IGNORE_LOAD``: the contention guard's evidence ignored. The suite runs on
  shared hosts, where other test runs load the cores: there the guard marks most runs
  disturbed (as it must), and tests of what a search does with clean runs would see none. So
  ``conftest._suite_settings`` sets the variable and ignores the evidence the same way in
  process, for every test but those of the guard itself (tests/test_guard.py) and of a search
  beside another (tests/test_hostlock.py).
- ``$CPTUNE_TEST_QUICK_CALIBRATION``: a calibration times small attention shapes and
  messages (``quick_calibration``): the suite checks what a calibration does and stores, not
  this host's rates, and the real shapes take two minutes of a 2-core CI host per calibration.
  tests/test_cli_model.py calibrates once with the real ones.

cptune has no such switches: a timing taken under load is never stored as clean, and a
calibration always times the shapes ``cptune.calibration`` names.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

IGNORE_LOAD = "CPTUNE_TEST_IGNORE_LOAD"
QUICK_CALIBRATION = "CPTUNE_TEST_QUICK_CALIBRATION"
Setter = Callable[[str, Any], None]  # monkeypatch.setattr's form: ("module.name", value)


class Unwatched:
    """A contention guard's ``Watch`` that finds every run clean."""

    def __init__(self, process_ids: Callable[[], Sequence[int]], nodes: object = None) -> None:
        pass

    def host_disturbance(self, ranks: int) -> None:
        return None

    def disturbance(self, ranks: int, samples_ms: Sequence[float]) -> None:
        return None


def ignore_load(set_to: Setter) -> None:
    """Every measurement and calibration step judged clean, whatever the host's load."""
    set_to("cptune.execute.Watch", Unwatched)
    set_to("cptune.execute.own_spread", lambda ranks, samples_ms: None)
    set_to("cptune.calibration._calibrate.Watch", Unwatched)


def watch_load(set_to: Setter) -> None:
    """The contention guard's own evidence again (undoes ``ignore_load``)."""
    from cptune import guard

    set_to("cptune.execute.Watch", guard.Watch)
    set_to("cptune.execute.own_spread", guard.own_spread)
    set_to("cptune.calibration._calibrate.Watch", guard.Watch)


def quick_calibration(set_to: Setter) -> None:
    """Calibrations time the real shapes' structure (sizes 4x apart, both head_dims, with and
    without a causal mask; messages 4x apart) at a 64th of their work and a fraction of their
    bytes."""
    set_to("cptune.calibration._calibrate.MESSAGE_SIZES", tuple(2**e for e in range(10, 19, 2)))
    set_to("cptune.calibration._calibrate.ATTENTION_SHAPES", tuple(
        {"heads": 2, "seq_q": seq_q, "seq_k": 4 * seq_q, "head_dim": head_dim, "causal": causal}
        for head_dim in (64, 128) for causal in (0, 1) for seq_q in (32, 64, 128)
    ))


def _set(target: str, value: Any) -> None:
    module, name = target.rsplit(".", 1)
    setattr(importlib.import_module(module), name, value)


if __name__ == "__main__":
    if os.environ.get(IGNORE_LOAD):
        ignore_load(_set)
    if os.environ.get(QUICK_CALIBRATION):
        quick_calibration(_set)
    from cptune.cli import main

    sys.argv[0] = "cptune"  # as the installed command names itself
    sys.exit(main())
