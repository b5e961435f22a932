"""``--share-db``: the explicit way to keep cptune's tables in a database that holds another
program's (issue 33, item 2's flag). Without it such a database is refused untouched, and the
refusal names the flag."""

import hashlib
import sqlite3

import pytest

from conftest import assert_refused, measurement, stand_in_measuring

SEARCH = ["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--ranks", "1,2",
          "--no-calibrate", "--rounds", "1", "--race-rounds", "0", "--confirm-rounds", "0"]


@pytest.fixture
def other_app(tmp_path):
    """Another program's SQLite file: two tables, a row of data."""
    path = tmp_path / "other-app.db"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        connection.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)")
        connection.execute("INSERT INTO users (name) VALUES ('ada')")
    connection.close()
    return path


@pytest.mark.parametrize("command", [SEARCH, ["results"], ["calibrate", "--max-ranks", "1"]])
def test_the_refusal_names_the_flag_that_shares(cptune_here, other_app, command):
    before = hashlib.sha256(other_app.read_bytes()).hexdigest()
    assert_refused(cptune_here(*command, "--db", other_app), "holds another program's tables (orders, users)",
                   "or add --share-db to cptune search, calibrate or doctor to keep cptune's tables beside "
                   "theirs")
    assert hashlib.sha256(other_app.read_bytes()).hexdigest() == before


def test_with_the_flag_a_search_keeps_its_results_beside_the_other_programs_tables(
        cptune_here, other_app, monkeypatch):
    stand_in_measuring(monkeypatch, lambda workload, config, **_: measurement(workload, config, 10.0))
    searched = cptune_here(*SEARCH, "--db", other_app, "--share-db")
    assert searched.returncode == 0, searched.stdout + searched.stderr
    listed = cptune_here("results", "--db", other_app)  # cptune's schema is there now: no flag needed
    assert listed.returncode == 0 and "4 stored result(s)" in listed.stdout, listed.stdout + listed.stderr
    with sqlite3.connect(other_app) as connection:
        assert connection.execute("SELECT name FROM users").fetchall() == [("ada",)]
    connection.close()


def test_the_commands_that_create_cptunes_tables_take_the_flag(cptune_here):
    from cptune.cli import build_parser

    parser = build_parser()
    for command in (["search"], ["calibrate"], ["doctor"]):
        assert parser.parse_args([*command, "--share-db"]).share_db is True
