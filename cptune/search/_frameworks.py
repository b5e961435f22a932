"""A framework's own attention timed beside cptune's configurations (``time_framework``,
``cptune search --for F --time-framework``): one interleaved round of both on this machine's
torch ranks, every output checked against the float64 reference first, every row stored; a
framework's rows name its implementation in their facts and are stored excluded (kept, shown
by ``cptune results``, left out of the model and the picks: they time the framework's code,
not the configuration cptune would run).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from cptune.config import STRATEGIES, CPConfig
from cptune.engines import get_engine
from cptune.errors import CPTuneError, EngineError
from cptune.execute import measure_round
from cptune.feasibility import enumerate_configs
from cptune.measurement import Measurement
from cptune.store import Store
from cptune.workload import Workload


class FrameworkTimingError(CPTuneError):
    """A framework's implementation that cannot be timed here, in one line."""


@dataclass(frozen=True)
class Timed:
    """One configuration of a round: cptune's own (``implementation`` None) or a framework's
    implementation in its place; its measurement, or the ``EngineError`` that ended it; the
    stored row's id."""

    config: CPConfig
    implementation: str | None
    result: Measurement | EngineError
    row_id: int | None


def time_framework(
    framework: str, workload: Workload, ranks: int, db: str | None = None, backend: str = "torch",
    warmup: int = 2, repeats: int = 10, seed: int | None = None, share: bool = False,
    own: Sequence[CPConfig] | None = None, keep: bool = True,
) -> list[Timed]:
    """Time ``framework``'s own attention (``TIMED_FRAMEWORKS``) in each configuration it
    runs on ``ranks`` ranks, and cptune's own feasible configurations on them (``own``, default
    every one), interleaved in one round (``measure_round``); store every row in ``db`` (None:
    the default database; ``keep`` False: none stored), the framework's excluded and named.
    ``FrameworkTimingError`` before anything runs where the framework has no implementation that runs here."""
    from cptune.engines.torch import TIMED_FRAMEWORKS, framework_configs

    if backend != "torch":
        raise FrameworkTimingError(f"a framework's implementation is timed by the torch engine: "
                                   f"--backend torch, not {backend}")
    if framework not in TIMED_FRAMEWORKS:
        raise FrameworkTimingError(f"{framework}: its attention is read and priced, not timed; timed are "
                                   f"{', '.join(TIMED_FRAMEWORKS)}")
    name = TIMED_FRAMEWORKS[framework]
    theirs = framework_configs(name, workload, ranks)
    if not theirs:
        from cptune.engines.torch._implementations import refusal

        why = refusal(name, workload, CPConfig("ring", ranks, 1, "contiguous"))
        raise FrameworkTimingError(f"{framework} ({name}) cannot be timed for {workload.describe()} on "
                                   f"{ranks} ranks: {why or 'no configuration of it divides the heads'}")
    mine = list(own) if own is not None else [c for c in enumerate_configs(workload, ranks, STRATEGIES)
                                               if c.ranks == ranks and c not in theirs]
    engine = get_engine(backend)
    results = measure_round(workload, [*mine, *theirs], backend=engine, warmup=warmup, repeats=repeats,
                            rng=random.Random(seed), implementations=dict.fromkeys(theirs, name))
    timed = [Timed(c, name if c in theirs else None, results[c], None) for c in [*mine, *theirs]]
    if not keep:
        return timed
    round_id = f"framework-{uuid.uuid4().hex[:12]}:0"
    hardware = engine.hardware()
    stored = []
    with Store(db, share=share) as store:
        store.require_writable()
        for t in timed:
            if isinstance(t.result, Measurement):
                row = store.add_measurement(hardware, t.result, round_id)
            else:
                label = f"{t.implementation} as " if t.implementation else ""
                row = store.add_failure(hardware, workload, t.config, t.result.kind, f"{label}{t.result}",
                                        engine.name, round_id=round_id)
            if t.implementation:  # the framework's code, not the configuration cptune runs
                store.set_excluded([row])
            stored.append(Timed(t.config, t.implementation, t.result, row))
    return stored
