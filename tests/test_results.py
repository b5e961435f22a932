"""``cptune results``: the stored rows with their rounds and marks, and ``--combined``: each
configuration's clean rounds combined by cptune.estimate, and each workload's verdict."""

import csv
import dataclasses
import io
import json
import math

import pytest

from conftest import measurement
from cptune.cli import main
from cptune.cli._results import COMBINED_COLUMNS
from cptune.config import CPConfig
from cptune.estimate import combine, verdicts
from cptune.hardware import this_host
from cptune.store import RESULT_COLUMNS, Store
from cptune.workload import Workload

CLEAR = Workload(seq_len=512, heads=4, head_dim=16)  # ring clearly faster than ulysses
CLOSE = Workload(seq_len=1024, heads=4, head_dim=16)  # ring and ulysses within the noise
RING, ULYSSES, LOCAL = CPConfig("ring", 2), CPConfig("ulysses", 2), CPConfig("ring", 1)
#: Three interleaved rounds, (workload, config, ms) each; a round's drift hits all alike.
ROUNDS = [
    [(CLEAR, RING, 10.0), (CLEAR, ULYSSES, 13.0), (CLEAR, LOCAL, 19.0), (CLOSE, RING, 40.0),
     (CLOSE, ULYSSES, 40.4)],
    [(CLEAR, RING, 11.0), (CLEAR, ULYSSES, 14.2), (CLEAR, LOCAL, 20.5), (CLOSE, RING, 44.0),
     (CLOSE, ULYSSES, 43.6)],
    [(CLEAR, RING, 9.5), (CLEAR, ULYSSES, 12.4), (CLEAR, LOCAL, 18.4), (CLOSE, RING, 38.0),
     (CLOSE, ULYSSES, 38.5)],
]
DISTURBANCE = "load average 5.2 on 2 cores"


@pytest.fixture
def db(tmp_path):
    """First a disturbed run of ring that would be the fastest of all, an excluded one and an
    oversubscribed one (all three count for nothing); then three rounds of two workloads and
    a failure."""
    path = str(tmp_path / "r.db")
    host = this_host()
    with Store(path) as store:
        disturbed = dataclasses.replace(measurement(CLEAR, RING, 1.0), disturbed=DISTURBANCE)
        store.add_measurement(host, disturbed, round_id="warm")
        excluded = store.add_measurement(host, measurement(CLEAR, ULYSSES, 2.0))
        store.set_excluded([excluded])
        store.add_measurement(host, dataclasses.replace(measurement(CLEAR, CPConfig("ring", 4), 3.0),
                                                        oversubscribed=True))
        for i, measured in enumerate(ROUNDS):
            for workload, config, ms in measured:
                store.add_measurement(host, measurement(workload, config, ms), round_id=f"round-{i}")
        store.add_failure(host, CLEAR, CPConfig("allgather_kv", 2), "crash", "rank 1 died", "mpi")
    return path


def results(capsys, *args: str) -> str:
    assert main(["results", *args]) == 0
    return capsys.readouterr().out


def expected(db):
    """What cptune.estimate makes of the rows the combined view counts (oversubscribed left out)."""
    with Store(db) as store:
        rows = [r for r in store.results() if not r.oversubscribed]
    return rows, combine(rows), verdicts(rows)


def test_the_combined_view_is_estimate_combine_of_the_clean_rounds(db, capsys):
    rows, estimates, judged = expected(db)
    shown = json.loads(results(capsys, "--db", db, "--combined", "--json"))
    assert [(w["workload"]["seq_len"], len(w["estimates"])) for w in shown] == [(512, 3), (1024, 2)]
    disturbed = next(r.id for r in rows if r.disturbed)
    excluded = next(r.id for r in rows if r.excluded)
    for workload in shown:
        key = (workload["hardware"], Workload(**workload["workload"]))
        assert workload["verdict"] == judged[key].describe()
        for record in workload["estimates"]:
            estimate = estimates[(*key, CPConfig(record["strategy"], record["ranks"], record["head_group"]))]
            assert (record["median_ms"], record["low_ms"], record["high_ms"], record["rounds"]) == (
                estimate.median_ms, estimate.low_ms, estimate.high_ms, 3)
            assert record["measurement_ids"] == list(estimate.ids)
            assert disturbed not in record["measurement_ids"] and excluded not in record["measurement_ids"]
    ring = shown[0]["estimates"][0]
    assert (ring["label"], ring["role"], ring["vs_fastest"]) == ("ring", "fastest", None)
    # measured three times: the rounds combined (their median), not the newest 9.5 ms
    assert ring["median_ms"] == pytest.approx(10.0)
    ulysses = shown[0]["estimates"][1]
    assert ulysses["role"] == "slower" and ulysses["vs_fastest_low"] > 1 and ulysses["paired_rounds"] == 3
    assert shown[0]["winner"] == "ring" and shown[0]["tied"] == []
    assert shown[0]["verdict"].startswith("Ring on 2 ranks, faster than Ulysses on 2 ranks by 29.9% (95% ")


def test_a_tie_is_shown_as_a_tie(db, capsys):
    (close,) = json.loads(results(capsys, "--db", db, "--combined", "--json", "--seq-len", "1024"))
    assert close["winner"] is None and sorted(close["tied"]) == ["ring", "ulysses"]
    assert [e["role"] for e in close["estimates"]] == ["fastest", "tied"]
    assert close["estimates"][1]["vs_fastest_low"] < 1 < close["estimates"][1]["vs_fastest_high"]
    assert "tied within the noise of this hardware" in close["verdict"]

    text = results(capsys, "--db", db, "--combined", "--seq-len", "1024")
    assert f"verdict: {close['verdict']}\n" in text
    marks = {line.split()[0]: line.split()[-1] for line in text.splitlines() if " x2 " in line}
    assert marks == {"ring": "fastest", "ulysses": "tied"}
    assert "left out" not in text  # what was left out is all at seq_len 512

    every = results(capsys, "--db", db, "--combined")
    assert "verdict: Ring on 2 ranks, faster than Ulysses on 2 ranks by" in every
    assert "left out: 1 disturbed, 1 excluded, 1 oversubscribed run(s)" in every


def test_a_configuration_filter_picks_what_is_judged_not_the_estimates(db, capsys):
    every = json.loads(results(capsys, "--db", db, "--combined", "--json", "--seq-len", "512"))
    one = json.loads(results(capsys, "--db", db, "--combined", "--json", "--seq-len", "512", "--ranks", "1"))
    (local,) = one[0]["estimates"]
    assert local == {**next(e for e in every[0]["estimates"] if e["label"] == "local"),
                     "role": "fastest", "vs_fastest": None, "vs_fastest_low": None, "vs_fastest_high": None,
                     "paired_rounds": None}
    assert one[0]["verdict"] == "local attention on 1 rank (the only configuration measured)"


def test_the_combined_csv_has_one_row_per_configuration(db, capsys):
    _, estimates, _ = expected(db)
    table = list(csv.DictReader(io.StringIO(results(capsys, "--db", db, "--combined", "--csv"))))
    assert tuple(table[0]) == COMBINED_COLUMNS and len(table) == len(estimates) == 5
    for row in table:
        estimate = next(e for e in estimates.values() if ";".join(map(str, e.ids)) == row["measurement_ids"])
        assert math.isclose(float(row["median_ms"]), estimate.median_ms, rel_tol=1e-12)
        assert row["label"] == estimate.config.label and row["rounds"] == "3"


def test_the_row_table_numbers_the_rounds_and_marks_disturbed_runs(db, capsys):
    text = results(capsys, "--db", db, "--seq-len", "512", "--strategy", "ring")
    rows = [row for row in map(str.split, text.splitlines()) if row[1:2] == ["512"]]
    # id, seq_len, heads, config, ranks, round, status: the disturbed run had a round of its
    # own, the first at this workload; the three interleaved rounds follow
    ring_two = [(row[5], "disturbed" in row) for row in rows if row[3] == "ring" and row[4] == "2"]
    assert ring_two == [("1", True), ("2", False), ("3", False), ("4", False)]
    assert [row[5] for row in rows if row[4] == "4"] == ["-"]  # the oversubscribed run had no round
    assert "disturbed = the contention guard saw other load" in text
    assert "cptune results --combined" in text


def test_the_raw_rows_keep_their_round_and_disturbance(db, capsys):
    rows = json.loads(results(capsys, "--db", db, "--json"))
    assert (rows[0]["disturbed"], rows[0]["round_id"]) == (DISTURBANCE, "warm")
    assert {r["round_id"] for r in rows[3:-1]} == {"round-0", "round-1", "round-2"}
    table = list(csv.DictReader(io.StringIO(results(capsys, "--db", db, "--csv"))))
    assert tuple(table[0]) == RESULT_COLUMNS and len(table) == len(rows)
    assert (table[0]["round_id"], table[0]["disturbed"]) == ("warm", DISTURBANCE)
    assert (table[4]["round_id"], table[4]["disturbed"]) == ("round-0", "")


@pytest.mark.parametrize("args, message", [
    (["--combined", "--status", "crash"], "--combined combines successful runs only"),
    (["--combined", "--exclude", "4"], "--combined lists estimates and changes nothing"),
])
def test_combined_refuses_what_it_cannot_do_in_one_line(db, capsys, args, message):
    with Store(db) as store:
        before = store.results()
    assert main(["results", "--db", db, *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err
    with Store(db) as store:
        assert store.results() == before


def test_combined_says_when_nothing_matches(db, capsys):
    assert "no clean successful measurement matches: nothing to combine" in results(
        capsys, "--db", db, "--combined", "--seq-len", "99")
    assert json.loads(results(capsys, "--db", db, "--combined", "--json", "--strategy", "allgather_kv")) == []
