"""cptune on a real PostgreSQL server: the store's round trip, concurrent writers and searches,
resume, and no password in anything the commands print or write.

The server comes from $CPTUNE_TEST_POSTGRES_URL, a role with a password that may create
databases (e.g. postgresql://cptune:secret@127.0.0.1:5432/postgres); each test makes a
database of its own and drops it. .ci/run starts a server and sets the variable. Without it,
or without the driver (psycopg, the postgres extra's; the test extra has it too), these tests
skip, except in CI (CI=true), where a missing server or driver is a failure.
"""

import csv
import io
import json
import os
import subprocess
import sys
import threading
import uuid
from collections import Counter
from typing import NoReturn

import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import make_url

from conftest import CLI, cptune, make_calibration, measurement
from cptune import CPConfig, Workload
from cptune.hardware import Hardware
from cptune.search import WorkloadSearch
from cptune.store import VERSION_TABLE, Base, Store, StoreError, database_url

SERVER = os.environ.get("CPTUNE_TEST_POSTGRES_URL")
HARDWARE = Hardware(host="pg1", cpu_model="test cpu", cpu_count=2, gpu_model=None, gpu_count=0,
                    interconnect="shared memory (one host)", mpi_library="MPICH 5")
WORKLOAD = Workload(seq_len=64, heads=4, head_dim=16, kv_heads=2, causal=True)
TINY = ["--heads", "4", "--head-dim", "16", "--ranks", "1,2", "--no-calibrate"]
ONE_VISIT = ["--rounds", "1", "--race-rounds", "0", "--confirm-rounds", "0"]  # what is stored, not its rounds


def libpq(url: str) -> str:
    """``url`` as psycopg itself takes it (no SQLAlchemy driver suffix)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def skip_or_fail(reason: str) -> NoReturn:
    """Skip with ``reason``; in CI (CI=true), where every PostgreSQL test must run, fail with it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture
def postgres_url():
    """A URL (plain postgresql://, with the role's password) of a new, empty database whose
    server keeps time in a zone other than UTC; dropped after the test."""
    if not SERVER:
        skip_or_fail("no PostgreSQL server: set CPTUNE_TEST_POSTGRES_URL to a role that may create "
                     "databases, e.g. postgresql://cptune:secret@127.0.0.1:5432/postgres")
    try:
        import psycopg
    except ImportError:
        skip_or_fail("psycopg is not installed: pip install '.[postgres]' (or '.[test]')")

    name = f"cptune_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(libpq(SERVER), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        admin.execute(f"ALTER DATABASE \"{name}\" SET timezone TO 'America/New_York'")
    yield make_url(libpq(SERVER)).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(libpq(SERVER), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture
def password(postgres_url):
    secret = make_url(postgres_url).password
    assert secret, "CPTUNE_TEST_POSTGRES_URL must carry a password: the tests check it is never shown"
    return secret


def test_a_peak_above_2_gib_is_kept(postgres_url):
    """A rank's peak at long sequences passes 2**31 bytes: a 32-bit column refused it."""
    import dataclasses

    made = dataclasses.replace(measurement(WORKLOAD, CPConfig("ring", 2), 3.0), peak_bytes=3 * 2**30)
    with Store(postgres_url) as store:
        store.add_measurement(HARDWARE, made)
        (result,) = store.results()
    assert result.peak_bytes == 3 * 2**30


def test_round_trip(postgres_url):
    made = measurement(WORKLOAD, CPConfig("ring", 2, 2), 3.0)
    calibration = make_calibration(2)
    with Store(postgres_url) as store:
        assert store.engine.dialect.driver == "psycopg"  # plain postgresql:// gets the extra's driver
        with store.engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
            assert compare_metadata(context, Base.metadata) == []
        ok_id = store.add_measurement(HARDWARE, made)
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ulysses", 2), "timeout", "rank 1 hung", "mpi")
        store.add_calibration(HARDWARE, calibration)
    with Store(postgres_url) as store:  # reopened: already at head, nothing lost
        ok, failed = store.results()
        assert store.calibration(HARDWARE.fingerprint) == calibration
        assert store.hardware() == {HARDWARE.fingerprint: HARDWARE}
    assert ok.id == ok_id and ok.workload == WORKLOAD and ok.config == CPConfig("ring", 2, 2)
    assert (ok.status, ok.median_ms, ok.p10_ms, ok.p90_ms) == ("ok", made.median_ms, made.p10_ms, made.p90_ms)
    assert (ok.compute_ms, ok.comm_ms, ok.peak_bytes, ok.max_error) == (
        made.compute_ms, made.comm_ms, made.peak_bytes, made.max_error)
    assert (failed.status, failed.error, failed.median_ms) == ("timeout", "rank 1 hung", None)
    # the server answers in New York time; results are in UTC whatever the backend
    assert ok.measured_at == made.measured_at and made.measured_at.endswith("+00:00")
    assert failed.measured_at.endswith("+00:00")


def test_a_row_added_by_another_writer_meanwhile_is_shared(postgres_url):
    """Writer A adds the hardware and workload rows and has not committed; writer B, adding
    the same ones, waits on the unique constraint and then must use A's rows, not fail."""
    outcome: list[object] = []

    def writer_b() -> None:
        try:
            outcome.append(store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "b", "mpi"))
        except Exception as exc:  # reported below, in the test's thread
            outcome.append(exc)

    waiting = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
               "AND wait_event_type = 'Lock'")
    with Store(postgres_url) as store:
        b = threading.Thread(target=writer_b)
        with store.session() as session:  # writer A
            store._hardware_row(session, HARDWARE)
            store._workload_row(session, WORKLOAD)
            b.start()
            with store.engine.connect() as watcher:  # until B waits on A's uncommitted rows
                while b.is_alive() and not watcher.exec_driver_sql(waiting).scalar():
                    watcher.rollback()
        b.join(timeout=60)  # A has committed
        assert len(outcome) == 1 and isinstance(outcome[0], int), outcome
        (row,) = store.results()
    assert row.error == "b" and row.hardware == HARDWARE.fingerprint


WRITER = """
import sys
from cptune import CPConfig, Workload
from cptune.hardware import Hardware
from cptune.store import Store
hardware = Hardware(host="shared", cpu_model="c", cpu_count=2, gpu_model=None, gpu_count=0,
                    interconnect="i", mpi_library=None)
with Store(sys.argv[1]) as store:
    for n in range(40):
        store.add_failure(hardware, Workload(seq_len=64 + n % 5, heads=4, head_dim=8),
                          CPConfig("ring", 2), "crash", f"{sys.argv[2]}-{n}", "mpi")
"""


@pytest.mark.slow
def test_two_writers_on_one_new_database(postgres_url):
    """Two processes open a new database at once (both migrate) and add rows naming the same
    hardware and workloads in parallel: no error, no lost row, no duplicate."""
    writers = [subprocess.Popen([sys.executable, "-P", "-c", WRITER, postgres_url, name],
                                stderr=subprocess.PIPE, text=True)
               for name in ("a", "b")]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    with Store(postgres_url) as store:
        rows = store.results()
        assert len(store.hardware()) == 1
    assert sorted(r.error for r in rows) == sorted(f"{w}-{n}" for w in "ab" for n in range(40))
    assert len({r.workload for r in rows}) == 5


@pytest.mark.slow
def test_two_searches_share_one_database(postgres_url, password, tmp_path):
    race = ["--race-rounds", "2"]
    runs = [subprocess.Popen([*CLI, "search", "--db", postgres_url, "--seq-lens", seq_lens, *TINY, *race],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "CPTUNE_LOCK": str(tmp_path / f"host-{seq_lens}.lock")})
            for seq_lens in ("64,96", "80,112")]  # at once, as two hosts: a lock each
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert all("8 configuration(s) measured now" in out and password not in out for out in outputs)
    with Store(postgres_url) as store:
        rows = store.results()
    assert all(r.status == "ok" and r.median_ms > 0 for r in rows)
    assert {r.workload.seq_len for r in rows} == {64, 80, 96, 112}
    visits = Counter((r.workload, r.config) for r in rows if r.clean)  # each its rounds, at most the cap
    rounds = WorkloadSearch.rounds  # the default; the cap: a race of 2 and a second sitting
    cap = WorkloadSearch.rounds + 2 + WorkloadSearch.confirm_rounds
    assert len(visits) == 16 and all(rounds <= n <= cap for n in visits.values()), visits
    # the studies both searches kept beside the rows: one per length, a trial per row
    studies = optuna.get_all_study_summaries(database_url(postgres_url))
    per_length = Counter(r.workload.seq_len for r in rows)
    assert sorted(s.n_trials for s in studies) == sorted(per_length.values())


@pytest.mark.slow
def test_resume_and_every_command_hides_the_password(postgres_url, password, tmp_path, cptune_here):
    """The loop a team runs on a shared database, with a password in the URL: calibrate,
    search, search again (only what is missing runs), results, recommend, export, report, fit.
    The password appears in no output and no file; the URL is shown with *** instead. The
    commands that start ranks run as a user runs them, those that only read in this process."""
    shown = make_url(postgres_url).set(drivername="postgresql+psycopg").render_as_string()
    outputs = []

    def run(*args: str, reads: bool = False) -> subprocess.CompletedProcess:
        done = cptune_here(*args) if reads else cptune(*args)
        assert done.returncode == 0, done.stdout + done.stderr
        outputs.append(done.stdout + done.stderr)
        return done

    assert shown in run("calibrate", "--db", postgres_url, "--max-ranks", "2", "--repeats", "1",
                        "--rounds", "1").stdout
    first = run("search", "--db", postgres_url, "--seq-lens", "64", *TINY, *ONE_VISIT).stdout
    assert shown in first and "4 configuration(s) measured now" in first
    assert f"--db {make_url(postgres_url).render_as_string()}" in first  # the closing hint, hidden too
    again = run("search", "--db", postgres_url, "--seq-lens", "64,96", *TINY, *ONE_VISIT).stdout
    assert "4 configuration(s) measured now" in again  # seq 64 was stored: only 96 ran

    listed = run("results", "--db", postgres_url, "--csv", reads=True).stdout
    assert "\r" not in listed
    rows = list(csv.DictReader(io.StringIO(listed)))
    configs = {(r["seq_len"], r["strategy"], r["ranks"], r["head_group"]) for r in rows}
    assert len(configs) == 8 and {r["seq_len"] for r in rows} == {"64", "96"}
    assert all(r["measured_at"].endswith("+00:00") for r in rows)  # the server keeps New York time
    as_json = json.loads(run("results", "--db", postgres_url, "--json", reads=True).stdout)
    assert all(r["measured_at"].endswith("+00:00") for r in as_json)

    run("recommend", "--db", postgres_url, "--heads", "4", "--head-dim", "16", "--seq-len", "128", reads=True)
    plan = tmp_path / "plan.json"
    run("export", "--db", postgres_url, "--heads", "4", "--head-dim", "16", "--seq-lens", "64,96",
        "-o", str(plan), reads=True)
    run("report", "--db", postgres_url, "-o", str(tmp_path / "report"), reads=True)
    run("fit", "--db", postgres_url, reads=True)
    html = (tmp_path / "report" / "report.html").read_text()
    assert shown in html
    for text in [*outputs, plan.read_text(), html]:
        assert password not in text


def test_another_programs_database_is_refused_and_a_schema_of_cptunes_own_shares_it(postgres_url, password):
    """Another program's tables in the database's public schema: refused untouched, naming
    the way to share it; with a schema of cptune's own first in the search_path, cptune's
    tables and Optuna's live there, and theirs stay as they were."""
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute("CREATE TABLE customers (id integer)")
        connection.execute("CREATE SCHEMA cptune")
    with pytest.raises(StoreError, match=r"holds another program's tables \(customers\) and no cptune data.*"
                                         r"CREATE SCHEMA cptune") as refused:
        Store(postgres_url)
    assert password not in str(refused.value)
    with Store(f"{postgres_url}?options=-csearch_path%3Dcptune") as store:
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
        store.optuna_storage()
    with psycopg.connect(postgres_url) as connection:
        tables = connection.execute("SELECT table_schema, table_name FROM information_schema.tables "
                                    "WHERE table_schema IN ('public', 'cptune')").fetchall()
    assert ("public", "customers") in tables and ("cptune", "measurements") in tables
    assert {schema for schema, name in tables if name != "customers"} == {"cptune"}


def test_an_older_database_is_left_as_it_is_by_a_command_that_reads(postgres_url, password):
    """It cannot be copied to be read as SQLite's is: reading refuses it in one line naming
    what upgrades it, and its schema stays as the older cptune left it."""
    from importlib.resources import files

    import psycopg
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    config = Config()
    config.set_main_option("script_location", str(files("cptune.db")))
    engine = create_engine(database_url(postgres_url))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0005")
    engine.dispose()
    done = cptune("results", "--db", postgres_url)
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert "holds cptune's schema revision '0005', older than this cptune" in done.stderr
    assert "upgrade it once with a command that writes to it (cptune search or cptune" in done.stderr
    assert password not in done.stderr
    with psycopg.connect(postgres_url) as connection:
        assert connection.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone() == ("0005",)
    with Store(postgres_url) as store:  # a command that writes upgrades it
        assert store.results() == []
    assert cptune("results", "--db", postgres_url).returncode == 0
