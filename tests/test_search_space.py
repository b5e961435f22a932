"""A whole space searched from Python (``cptune.search_space``) is what ``cptune search`` runs:
the same rows stored for the same space and seed, and the same refusals before anything runs."""

from collections import defaultdict

import pytest

import cptune
from conftest import measurement, replaced_once, stand_in_measuring, write_toml
from cptune.cli import main
from cptune.search import SearchProgress, SearchSetupError, search_space
from cptune.store import Store

SPACE = """
name = "tiny"
[model]
heads = 4
head_dim = 16
dtype = "fp32"
[sweep]
seq_lens = [64, 96]
ranks = [1, 2]
[measure]
warmup = 0
repeats = 2
rounds = 2
race_rounds = 2
confirm_rounds = 2
"""
#: A made-up latency per configuration, close enough between two of them that the race and
#: the second sitting run.
LATENCY_MS = {"local": 10.0, "ring": 9.0, "allgather_kv": 9.1, "ulysses": 12.0}


@pytest.fixture
def fake_runs(monkeypatch):
    """Measurements made up from the configuration and how often it ran before: the same
    sequence of results for the same sequence of visits, whoever asks."""
    seen = defaultdict(int)

    def fake(workload, config, **options):
        seen[(workload, config)] += 1
        wobble = 1 + 0.01 * (seen[(workload, config)] % 3)
        return measurement(workload, config, LATENCY_MS[config.label] * wobble * workload.seq_len / 64)

    stand_in_measuring(monkeypatch, fake)
    return seen


def stored(db):
    """Every stored row in order, its round named by sitting number and round number."""
    with Store(db, create=False) as store:
        rows = store.results()
    sittings: dict[str, int] = {}
    shown = []
    for r in rows:
        sitting, _, number = (r.round_id or "").rpartition(":")
        sittings.setdefault(sitting, len(sittings))
        shown.append((r.workload.seq_len, r.config.label, r.config.ranks, r.status, r.median_ms,
                       sittings[sitting], number))
    return shown


def test_python_and_the_command_line_store_the_same_rows_for_the_same_space_and_seed(tmp_path, fake_runs):
    path = write_toml(tmp_path, SPACE, "tiny.toml")
    run = search_space(path, str(tmp_path / "python.db"), seed=7, calibrate_first=False)
    fake_runs.clear()
    code = main(["search", str(path), "--db", str(tmp_path / "cli.db"), "--seed", "7", "--no-calibrate"])
    assert code == 0
    python, command_line = stored(str(tmp_path / "python.db")), stored(str(tmp_path / "cli.db"))
    assert python == command_line
    assert len(python) > 8  # explored, rounds, a race and a second sitting, not just a sweep
    assert {row[5] for row in python} == {0, 1, 2, 3}  # two lengths, each in two sittings
    assert set(run.verdicts) == {64, 96} and all(v is not None for v in run.verdicts.values())
    assert run.describe().splitlines() == [f"seq {n}: {run.verdicts[n].describe()}" for n in (64, 96)]
    assert run.visits == len(python) and run.failed == 0


def test_the_seed_decides_the_order_of_the_rounds(tmp_path, fake_runs):
    # the two measured rounds alone (no race or confirmation rounds): their order is the question
    path = write_toml(tmp_path, replaced_once(replaced_once(SPACE, "race_rounds = 2", "race_rounds = 0"),
                                              "confirm_rounds = 2", "confirm_rounds = 0"), "tiny.toml")
    orders = []
    for seed in (1, 1, 2):
        db = str(tmp_path / f"seed{len(orders)}.db")
        search_space(path, db, seed=seed, calibrate_first=False)
        fake_runs.clear()
        orders.append([row[:3] for row in stored(db)])
    assert orders[0] == orders[1] and orders[0] != orders[2]


def test_progress_hears_every_sitting_and_visit(tmp_path, fake_runs):
    heard = []

    class Listener(SearchProgress):
        def started(self, run):
            heard.append(("started", run.space.name))

        def sitting_started(self, search, second):
            heard.append(("sitting", search.workload.seq_len, second))

        def visited(self, search, visit, second):
            heard.append(("visit", search.workload.seq_len))

    run = cptune.search_space(write_toml(tmp_path, SPACE, "tiny.toml"), str(tmp_path / "p.db"),
                              calibrate_first=False, progress=Listener())
    assert heard[0] == ("started", "tiny")
    assert [h for h in heard if h[0] == "sitting"] == [("sitting", 64, False), ("sitting", 96, False),
                                                      ("sitting", 64, True), ("sitting", 96, True)]
    assert sum(h[0] == "visit" for h in heard) == run.visits


def test_what_cannot_run_here_is_refused_before_anything_runs(tmp_path, fake_runs):
    path = write_toml(tmp_path, SPACE.replace("ranks = [1, 2]", "ranks = [1, 4096]"), "big.toml")
    db = tmp_path / "none.db"
    with pytest.raises(SearchSetupError, match="--oversubscribe"):
        search_space(path, str(db), calibrate_first=False)
    with pytest.raises(SearchSetupError, match="order must be one of"):
        search_space(path, str(db), order="random")
    with pytest.raises(cptune.CPTuneError, match="does not time"):
        search_space(path, str(db), backend="onnx")
    assert not db.exists() and not fake_runs
