"""``recommend`` on described clusters gives the answers it gave before its enumeration and its
evaluation were made to follow the configurations that can run (issue 57 item 4): the pick, its
interval, the ties and the counts of benchmarks/recommend_scaling.py's workloads on 8 to 1,024
GPUs of HGX H100 nodes and GB200 NVL72 racks, forward and training, against the answers main gave
(tests/recommend_answers.json, written by ``python tests/test_recommend_scaling.py --write``: rerun
it only where the prior's values change on purpose, and say so in the commit)."""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import load_benchmark
from cptune.errors import CPTuneError
from cptune.model import Recommendation, recommend

scaling = load_benchmark("recommend_scaling")

EXPECTED = Path(__file__).with_name("recommend_answers.json")
#: (family, GPUs) of the clusters checked: one HGX node, 8 and 128 of them, one rack and 8.
CLUSTERS = [("HGX H100", 8), ("HGX H100", 64), ("HGX H100", 1024), ("GB200 NVL72", 72), ("GB200 NVL72", 576)]
#: The benchmark's forward workloads, each also in training.
NAMES = [name for name in scaling.WORKLOADS if not name.endswith(", training")]


def answer(picked: Recommendation) -> dict[str, object]:
    """What must not change of a recommendation: its pick, the pick's latency and interval,
    the ties (the configuration, the figure, its end), how many configurations it weighed and
    how many cannot run, and the reasons of the first few of them."""
    return {"pick": picked.config.to_dict(), "latency_ms": picked.latency_ms,
            "interval_ms": list(picked.interval_ms),
            "ties": [[t.other.to_dict(), t.figure, t.end] for t in picked.ties],
            "weighed": len(picked.candidates), "cannot_run": picked.infeasible_count,
            "listed": len(picked.infeasible),
            "first_reasons": [[c.to_dict(), r] for c, r in list(picked.infeasible.items())[:5]],
            "excluded": [e.to_dict() for e in picked.excluded]}


def answers(folder: Path) -> dict[str, dict[str, object]]:
    """``answer`` of every case, keyed "family GPUs mode: workload"."""
    found = {}
    for family, gpus in CLUSTERS:
        hardware = scaling.machine(family, gpus, folder)
        for name in NAMES:
            for mode in ("forward", "train"):
                workload = scaling.WORKLOADS[name](gpus).in_mode(mode)
                found[f"{family} {gpus} {mode}: {name}"] = answer(recommend(workload, hardware=hardware))
    return found


def test_answers_are_unchanged(tmp_path: Path) -> None:
    expected = json.loads(EXPECTED.read_text())
    found = json.loads(json.dumps(answers(tmp_path)))  # as the file holds them: lists, not tuples
    assert found.keys() == expected.keys()
    for case, want in expected.items():
        got = found[case]
        for key in ("latency_ms", "interval_ms"):
            assert got[key] == pytest.approx(want[key], rel=1e-9), (case, key)
        assert {k: v for k, v in got.items() if k not in ("latency_ms", "interval_ms")} == {
            k: v for k, v in want.items() if k not in ("latency_ms", "interval_ms")}, case


@pytest.mark.parametrize("enabled", [True, False])
def test_recommend_leaves_the_garbage_collector_as_it_found_it(enabled: bool) -> None:
    """``recommend`` pauses the cyclic collector while it weighs (``_collection_paused``): on or
    off before, it is the same after, and a refusal restores it too."""
    (gc.enable if enabled else gc.disable)()
    try:
        recommend(scaling.WORKLOADS[NAMES[0]](8), hardware="h100-sxm-8")
        assert gc.isenabled() is enabled
        with pytest.raises(CPTuneError, match="ranks must be between 1 and 8"):
            recommend(scaling.WORKLOADS[NAMES[0]](8), ranks=9, hardware="h100-sxm-8")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    with tempfile.TemporaryDirectory() as scratch:
        EXPECTED.write_text(json.dumps(answers(Path(scratch)), indent=1) + "\n")
