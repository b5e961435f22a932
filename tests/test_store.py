"""The store: migrations, round trips, bad files, Optuna in the same file, concurrent writers."""

import csv
import dataclasses
import io
import json
import sqlite3
import subprocess
import sys
import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import cptune
from conftest import make_calibration, measurement, migrated
from cptune import CPConfig, Workload
from cptune.cli import main
from cptune.engines import NodeVerdict, ProbeResult
from cptune.hardware import Hardware, this_host
from cptune.masks import Documents
from cptune.store import RESULT_COLUMNS, VERSION_TABLE, Base, Store, StoreError, database_url
from cptune.store._store import HEAD_REVISION

HARDWARE = Hardware(host="h1", cpu_model="test cpu", cpu_count=2, gpu_model=None, gpu_count=0,
                    interconnect="shared memory (one host)", mpi_library="MPICH 5")
WORKLOAD = Workload(seq_len=64, heads=4, head_dim=16, kv_heads=2, dtype="bf16", causal=True)


def statuses(store, hardware, workload):
    """(configuration, status) of every row stored for ``workload`` on ``hardware``, oldest first."""
    return [(r.config, r.status) for r in store.results(**workload.to_dict(), hardware=hardware.fingerprint)]


@pytest.fixture
def store(tmp_path):
    with Store(str(tmp_path / "results.db")) as opened:
        yield opened


def test_migrations_build_exactly_the_models(store):
    with store.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(context, Base.metadata) == []
        assert context.get_current_revision() is not None


def test_the_head_revision_a_store_opens_without_alembic_is_alembics_head(store):
    """``HEAD_REVISION`` (a database at it opens without loading Alembic) is the head of the
    migrations that ship, and what a new database is migrated to."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from cptune._shipped import shipped
    from cptune.store._store import HEAD_REVISION

    config = Config()
    config.set_main_option("script_location", str(shipped("cptune.db")))
    assert ScriptDirectory.from_config(config).get_current_head() == HEAD_REVISION
    with store.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        assert context.get_current_revision() == HEAD_REVISION


def test_sqlite_runs_in_wal_mode(store):
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_new_file_opened_while_another_process_creates_it_waits_for_it(tmp_path):
    """Two searches starting on one new file: while one holds it to create the tables, the
    other's switch to WAL cannot take the file and SQLite does not wait for it; the store
    waits (it failed with "database is locked" about once in 50 such starts)."""
    path = tmp_path / "new.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # what creating the tables holds
    other.execute("CREATE TABLE t (x)")
    release = threading.Timer(0.5, other.execute, ["COMMIT"])
    release.start()
    try:
        store = Store(str(path))
    finally:
        release.join()
        other.close()
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    store.close()


@pytest.mark.slow
def test_real_measurement_round_trip(store):
    m = cptune.measure(WORKLOAD, CPConfig("ring", 2), warmup=0, repeats=3)
    hardware = this_host()
    row_id = store.add_measurement(hardware, m)
    (result,) = store.results()
    assert result.id == row_id and result.status == "ok" and result.error is None
    assert result.workload == WORKLOAD and result.config == CPConfig("ring", 2)
    assert (result.median_ms, result.p10_ms, result.p90_ms) == (m.median_ms, m.p10_ms, m.p90_ms)
    assert (result.compute_ms, result.comm_ms, result.peak_bytes) == (m.compute_ms, m.comm_ms, m.peak_bytes)
    assert result.max_error == m.max_error and result.engine == "mpi"
    assert result.hardware == hardware.fingerprint
    assert statuses(store, hardware, WORKLOAD) == [(CPConfig("ring", 2), "ok")]


def test_failures_are_kept_with_their_reason(store):
    store.add_failure(HARDWARE, WORKLOAD, CPConfig("ulysses", 2), "timeout", "rank 1 hung", "mpi")
    store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "rank 0 died", "mpi")
    results = store.results(status="timeout")
    assert [(r.config, r.error, r.median_ms) for r in results] == [
        (CPConfig("ulysses", 2), "rank 1 hung", None)
    ]
    assert statuses(store, HARDWARE, WORKLOAD) == [(CPConfig("ulysses", 2), "timeout"),
                                                   (CPConfig("ring", 2), "crash")]
    with pytest.raises(ValueError, match="status"):
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "ok", "", "mpi")


def test_results_filter_by_workload_and_hardware(store):
    other = Workload(seq_len=128, heads=4, head_dim=16)
    other_host = dataclasses.replace(HARDWARE, host="h2")
    store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
    store.add_failure(HARDWARE, other, CPConfig("ring", 2), "crash", "y", "mpi")
    store.add_failure(other_host, other, CPConfig("ring", 2), "crash", "z", "mpi")
    assert [r.error for r in store.results(seq_len=128)] == ["y", "z"]
    assert [r.error for r in store.results(hardware=other_host.fingerprint)] == ["z"]
    assert statuses(store, HARDWARE, other) == [(CPConfig("ring", 2), "crash")]
    with pytest.raises(ValueError, match="unknown filter"):
        store.results(colour="red")


def test_reopening_keeps_everything(tmp_path):
    path = str(tmp_path / "results.db")
    with Store(path) as first:
        first.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
    with Store(path) as second:
        assert len(second.results()) == 1


def test_a_file_that_is_not_a_database_is_refused_untouched(tmp_path):
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database" * 100)
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a database") as refused:
        Store(str(path))
    assert "move it away or pass another --db" in str(refused.value)
    assert path.read_bytes() == before


def test_bad_url_is_a_clear_error():
    with pytest.raises(StoreError, match="cannot use database"):
        Store("nosuchdialect://somewhere/db")


def test_database_url(monkeypatch, tmp_path):
    monkeypatch.delenv("CPTUNE_DB", raising=False)
    monkeypatch.chdir(tmp_path)
    assert database_url() == f"sqlite:///{tmp_path / 'cptune.db'}"
    monkeypatch.setenv("CPTUNE_DB", "postgresql://u@h/cptune")
    assert database_url() == "postgresql+psycopg://u@h/cptune"
    assert database_url("x.db") == f"sqlite:///{tmp_path / 'x.db'}"


@pytest.mark.parametrize("optuna_first", [True, False], ids=["optuna-first", "cptune-first"])
def test_optuna_tables_share_the_file(tmp_path, optuna_first):
    import optuna

    url = database_url(str(tmp_path / "shared.db"))

    def make_study():
        storage = optuna.storages.RDBStorage(url)
        study = optuna.create_study(storage=storage, study_name="s")
        study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
        return optuna.load_study(study_name="s", storage=storage)

    if optuna_first:
        make_study()
    with Store(url) as store:
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
    study = make_study() if not optuna_first else optuna.load_study(study_name="s", storage=url)
    assert len(study.trials) == 2
    with Store(url) as store:
        assert len(store.results()) == 1


WRITER = """
import sys
from cptune import CPConfig, Workload
from cptune.hardware import Hardware
from cptune.store import Store
hardware = Hardware(host=sys.argv[2], cpu_model="c", cpu_count=2, gpu_model=None, gpu_count=0,
                    interconnect="i", mpi_library=None)
with Store(sys.argv[1]) as store:
    for n in range(60):
        store.add_failure(hardware, Workload(seq_len=64 + n % 3, heads=4, head_dim=8),
                          CPConfig("ring", 2), "crash", f"{sys.argv[2]}-{n}", "mpi")
"""


@pytest.mark.slow
def test_two_writers_on_one_sqlite_file(tmp_path):
    """Two processes open a fresh file at once (both migrate) and write in parallel: no
    'database is locked', no lost rows."""
    path = str(tmp_path / "shared.db")
    # -P: import the installed cptune, not the source tree in the working directory
    writers = [subprocess.Popen([sys.executable, "-P", "-c", WRITER, path, name],
                                stderr=subprocess.PIPE, text=True)
               for name in ("a", "b")]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    with Store(path) as store:
        rows = store.results()
    assert len(rows) == 120
    assert {r.error for r in rows} == {f"{w}-{n}" for w in "ab" for n in range(60)}


STUDY_WRITER = """
import sys
import optuna
from cptune.store import Store
with Store(sys.argv[1]) as store:
    study = optuna.create_study(storage=store.optuna_storage(), study_name="shared", load_if_exists=True)
    for n in range(40):
        study.add_trial(optuna.trial.create_trial(
            value=float(n), params={"x": n}, distributions={"x": optuna.distributions.IntDistribution(0, 99)},
            user_attrs={"writer": sys.argv[2]}))
"""


@pytest.mark.slow
def test_two_study_writers_on_one_sqlite_file(tmp_path):
    """Optuna's storage from the store queues writers as cptune's engine does (Optuna's own
    engine, without the busy timeout and BEGIN IMMEDIATE, loses trials to 'database is locked')."""
    import optuna

    path = str(tmp_path / "studies.db")
    writers = [subprocess.Popen([sys.executable, "-P", "-c", STUDY_WRITER, path, name],
                                stderr=subprocess.PIPE, text=True)
               for name in ("a", "b")]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    trials = optuna.load_study(study_name="shared", storage=database_url(path)).trials
    assert sorted((t.user_attrs["writer"], t.value) for t in trials) == sorted(
        (w, float(n)) for w in "ab" for n in range(40))


# --------------------------------------------------------------------------- marks, refusals


def test_migration_0003_marks_old_rows_that_ran_more_ranks_than_cores(tmp_path):
    path = tmp_path / "old.db"
    engine = migrated(path, "0002")
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO hardware (id, fingerprint, host, cpu_model, cpu_count, gpu_count, interconnect, "
            "created_at) VALUES (1, 'f1', 'h', 'cpu', 2, 0, 'shm', '2026-01-01 00:00:00')")
        connection.exec_driver_sql(
            "INSERT INTO workloads (id, seq_len, heads, kv_heads, head_dim, batch, dtype, causal) "
            "VALUES (1, 64, 4, 4, 16, 1, 'bf16', 0)")
        for row_id, ranks in ((1, 2), (2, 4)):
            connection.exec_driver_sql(
                "INSERT INTO measurements (id, hardware_id, workload_id, strategy, ranks, head_group, "
                "status, median_ms, engine, cptune_version, measured_at) VALUES "
                f"({row_id}, 1, 1, 'ring', {ranks}, 1, 'ok', 1.0, 'mpi', '0.1.0', '2026-01-01 00:00:00')")
    engine.dispose()
    with Store(str(path)) as store:
        marks = {r.config.ranks: (r.oversubscribed, r.excluded) for r in store.results()}
    assert marks == {2: (False, False), 4: (True, False)}


def test_a_measurement_records_whether_it_was_oversubscribed(store):
    store.add_measurement(HARDWARE, measurement(WORKLOAD, CPConfig("ring", 2), 1.0))
    store.add_measurement(HARDWARE, dataclasses.replace(measurement(WORKLOAD, CPConfig("ring", 4), 9.0),
                                                        oversubscribed=True))
    assert [r.oversubscribed for r in store.results()] == [False, True]
    assert [r.config.ranks for r in store.results(oversubscribed=False)] == [2]


def test_excluded_rows_are_kept_reversibly_and_deleted_rows_are_gone(store):
    ids = [store.add_measurement(HARDWARE, measurement(WORKLOAD, CPConfig("ring", n), n)) for n in (1, 2)]
    assert store.set_excluded([ids[1]]) == [ids[1]]
    assert store.set_excluded([ids[1]]) == []  # already excluded: nothing changes
    assert [r.excluded for r in store.results()] == [False, True]
    assert [r.config for r in store.results(excluded=False)] == [CPConfig("ring", 1)]  # what counts
    assert store.set_excluded([ids[1]], excluded=False) == [ids[1]]
    assert len(store.results(excluded=False)) == 2
    (gone,) = store.delete([ids[0]])
    assert gone.id == ids[0] and gone.config == CPConfig("ring", 1)
    assert [r.id for r in store.results()] == [ids[1]]


@pytest.mark.parametrize("change", ["exclude", "delete"])
def test_unknown_ids_change_nothing(store, change):
    kept = store.add_measurement(HARDWARE, measurement(WORKLOAD, CPConfig("ring", 1), 1.0))
    ids = [kept, kept + 5, kept + 1]
    with pytest.raises(StoreError, match=f"no measurement with id {kept + 1}, {kept + 5} in .*nothing was"):
        store.set_excluded(ids) if change == "exclude" else store.delete(ids)
    (result,) = store.results()
    assert result.id == kept and not result.excluded


def test_reading_never_creates_a_database(tmp_path):
    with pytest.raises(StoreError, match="no database at .*nope.db: check the path"):
        Store(str(tmp_path / "nope.db"), create=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("reading", [False, True], ids=["writing", "reading"])
def test_a_database_of_a_newer_cptune_is_refused_untouched(tmp_path, reading):
    path = tmp_path / "newer.db"
    with Store(str(path)) as store:
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
        with store.engine.begin() as connection:
            connection.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = '0042'")
    before = path.read_bytes()
    with pytest.raises(StoreError, match=r"by a newer cptune \(schema revision '0042'.*Nothing was changed"):
        Store(str(path), reading=reading)
    assert path.read_bytes() == before


def test_a_read_only_database_is_refused_before_any_write(tmp_path):
    path = tmp_path / "ro.db"
    with Store(str(path)) as store:
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
    with Store(f"sqlite:///file:{path}?mode=ro&uri=true") as read_only:
        assert len(read_only.results()) == 1  # reading works
        with pytest.raises(StoreError, match="cannot write to database .*Nothing was changed"):
            read_only.require_writable()
    with Store(str(path)) as writable:
        writable.require_writable()
        assert len(writable.results()) == 1
def test_results_csv_has_a_header_even_when_empty_and_plain_line_ends(tmp_path, capsys):
    db = str(tmp_path / "empty.db")
    Store(db).close()
    assert main(["results", "--db", db, "--csv"]) == 0
    assert capsys.readouterr().out == ",".join(RESULT_COLUMNS) + "\n"


def test_results_csv_gives_utc_timestamps_with_their_offset(tmp_path, capsys):
    """Measured at 14:00 in UTC+2: stored and listed as 12:00+00:00 (SQLite keeps no offset)."""
    db = str(tmp_path / "r.db")
    made = dataclasses.replace(measurement(WORKLOAD, CPConfig("ring", 2), 2.0),
                               measured_at="2026-01-01T14:00:00+02:00")
    with Store(db) as store:
        store.add_measurement(HARDWARE, made)
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ulysses", 2), "crash", "rank 1 died", "mpi")
        assert list(store.results()[0].to_dict()) == list(RESULT_COLUMNS)
    assert main(["results", "--db", db, "--csv"]) == 0
    out = capsys.readouterr().out
    assert "\r" not in out and out.endswith("\n")
    ok, failed = csv.DictReader(io.StringIO(out))
    assert ok["measured_at"] == "2026-01-01T12:00:00+00:00" and ok["median_ms"] == "2.0"
    assert failed["measured_at"].endswith("+00:00") and failed["error"] == "rank 1 died"


# --------------------------------------------------------------------------- node checks

GPU_NODE = Hardware(host="g1", cpu_model="test cpu", cpu_count=32, gpu_model="NVIDIA H100 (SM90)",
                    gpu_count=4, interconnect="NVLink (NV18)", mpi_library="MPICH 5", nccl_version="2.27",
                    tensorrt_version="11.0")
SUBGROUPS_FAIL = NodeVerdict(4, (
    ProbeResult("collectives", True, "all_to_all, all_gather, broadcast right on 4 ranks"),
    ProbeResult("subgroups", False, "ranks 2-3 got rank 0's values", "hybrids are left out"),
))


def test_a_node_verdict_round_trips_per_hardware_and_engine(store):
    assert store.node_verdict(GPU_NODE.fingerprint, "tensorrt") is None
    store.add_node_verdict(GPU_NODE, "tensorrt", SUBGROUPS_FAIL)
    assert store.node_verdict(GPU_NODE.fingerprint, "tensorrt") == SUBGROUPS_FAIL
    assert store.node_verdict(GPU_NODE.fingerprint, "torch") is None  # another engine: its own
    assert store.node_verdict(HARDWARE.fingerprint, "tensorrt") is None  # another host: its own
    assert GPU_NODE.fingerprint in store.hardware()


def test_a_new_node_verdict_replaces_the_one_before(store):
    store.add_node_verdict(GPU_NODE, "tensorrt", SUBGROUPS_FAIL)
    healthy = NodeVerdict(2, (ProbeResult("subgroups", True, "right in both groups"),))
    store.add_node_verdict(GPU_NODE, "tensorrt", healthy)
    store.add_node_verdict(HARDWARE, "tensorrt", SUBGROUPS_FAIL)
    assert store.node_verdict(GPU_NODE.fingerprint, "tensorrt") == healthy
    assert store.node_verdict(HARDWARE.fingerprint, "tensorrt") == SUBGROUPS_FAIL
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT count(*) FROM node_checks").scalar() == 2


def test_a_damaged_node_verdict_is_named_with_the_fix(store):
    store.add_node_verdict(GPU_NODE, "tensorrt", SUBGROUPS_FAIL)
    with store.engine.begin() as connection:
        connection.exec_driver_sql("UPDATE node_checks SET verdict = '{\"results\": []}'")
    with pytest.raises(StoreError, match="node check of .* is damaged .*run cptune doctor"):
        store.node_verdict(GPU_NODE.fingerprint, "tensorrt")


def test_migrations_from_0005_keep_its_rows_one_node_each(tmp_path):
    path = tmp_path / "old.db"
    engine = migrated(path, "0005")
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO hardware (id, fingerprint, host, cpu_model, cpu_count, gpu_count, interconnect, "
            f"created_at) VALUES (1, '{GPU_NODE.fingerprint}', 'g1', 'cpu', 2, 0, 'shm', "
            "'2026-01-01 00:00:00')")
        connection.exec_driver_sql(
            "INSERT INTO workloads (id, seq_len, heads, kv_heads, head_dim, batch, dtype, causal) "
            "VALUES (1, 64, 4, 4, 16, 1, 'bf16', 0)")
        connection.exec_driver_sql(
            "INSERT INTO measurements (id, hardware_id, workload_id, strategy, ranks, head_group, status, "
            "median_ms, engine, cptune_version, measured_at, oversubscribed, excluded, round_id, disturbed) "
            "VALUES (1, 1, 1, 'ring', 2, 1, 'ok', 1.5, 'mpi', '0.1.0', '2026-01-01 00:00:00', 0, 0, 'r:1', "
            "NULL)")
        connection.exec_driver_sql(
            "INSERT INTO calibrations (id, hardware_id, engine, data, cptune_version, measured_at) VALUES "
            "(1, 1, 'mpi', '{}', '0.1.0', '2026-01-01 00:00:00')")
        assert "node_checks" not in {row[0] for row in connection.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    engine.dispose()
    with Store(str(path)) as upgraded:
        (row,) = upgraded.results()
        assert (row.config, row.median_ms, row.round_id) == (CPConfig("ring", 2), 1.5, "r:1")
        with upgraded.engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT count(*) FROM calibrations").scalar() == 1
            context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
            assert context.get_current_revision() == HEAD_REVISION
        assert upgraded.node_verdict(GPU_NODE.fingerprint, "tensorrt") is None
        host = upgraded.hardware()[GPU_NODE.fingerprint]  # 0007: every older host is one node
        assert (host.nodes, host.ranks_per_node, host.network) == (1, None, None)
        upgraded.add_node_verdict(GPU_NODE, "tensorrt", SUBGROUPS_FAIL)  # the stored hardware row
        assert upgraded.node_verdict(GPU_NODE.fingerprint, "tensorrt") == SUBGROUPS_FAIL
        assert list(upgraded.hardware()) == [GPU_NODE.fingerprint]


# --------------------------------------------------------------------------- what a run ran with

#: What a torch run on a GPU reports beside its timings (``Measurement.host``), as it is kept.
GPU_RUN = {"hostname": "g1", "engine": "torch", "torch": "2.13.0", "kernel": "cuda_cudnn, cuda_flash",
           "process_group": "nccl", "cudnn": "91002", "nccl": "2.27.3"}


def test_a_measurement_keeps_what_it_ran_with_and_results_json_shows_the_kernel_per_row(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    ran = dataclasses.replace(measurement(WORKLOAD, CPConfig("ring", 2), 2.0), host=GPU_RUN)
    with Store(db) as store:
        store.add_measurement(GPU_NODE, ran)
        store.add_failure(GPU_NODE, WORKLOAD, CPConfig("ulysses", 2), "crash", "rank 1 died", "torch")
        kept, failed = store.results()
    assert kept.facts == GPU_RUN and kept.kernel == "cuda_cudnn, cuda_flash"
    assert kept.ran_with == "cuda_cudnn, cuda_flash; process group nccl; cuDNN 91002; NCCL 2.27.3"
    assert failed.facts == {} and failed.kernel is None  # a failure ran nothing to report
    assert main(["results", "--db", db, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["kernel"] for row in rows] == ["cuda_cudnn, cuda_flash", None]
    assert rows[0]["facts"] == GPU_RUN and rows[1]["facts"] == {}
    assert main(["results", "--db", db, "--csv"]) == 0
    ok, _ = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert ok["kernel"] == "cuda_cudnn, cuda_flash" and json.loads(ok["facts"]) == GPU_RUN  # JSON in a cell
    assert main(["results", "--db", db]) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert "ran with" in table and "process group nccl" in table and "NCCL 2.27.3" in table


def test_facts_are_kept_as_bounded_json_whatever_a_run_reports(store):
    """A run reporting too many facts, or a value too long, keeps the first ``MAX_FACTS``, each
    cut; values that are not strings are dropped; the column is plain JSON; a row whose column
    holds something else (damaged, or written by another program) reads as no facts."""
    from cptune.store._facts import MAX_FACTS, MAX_VALUE_CHARS

    host = {f"fact{i:03d}": f"value {i}" for i in range(3 * MAX_FACTS)}
    host = {"kernel": "k" * 10_000, "count": 3, **host}
    row_id = store.add_measurement(HARDWARE, dataclasses.replace(
        measurement(WORKLOAD, CPConfig("ring", 2), 1.0), host=host))
    (result,) = store.results()
    assert len(result.facts) == MAX_FACTS and "count" not in result.facts
    assert len(result.kernel) == MAX_VALUE_CHARS and result.kernel.endswith("…")
    with store.engine.begin() as connection:
        (raw,) = connection.exec_driver_sql(f"SELECT facts FROM measurements WHERE id = {row_id}").one()
        assert json.loads(raw) == dict(result.facts)  # JSON, never a pickle
        assert len(raw.encode()) < 16 * 1024
        connection.exec_driver_sql(f"UPDATE measurements SET facts = '[1, 2]' WHERE id = {row_id}")
    (damaged,) = store.results()
    assert damaged.facts == {} and damaged.median_ms == 1.0


def test_a_calibration_keeps_what_it_was_timed_with_in_a_column_of_its_own(store):
    """Its facts go to the calibrations' facts column, not into its data; read back, the prior
    that reads it says which kernel its rates describe."""
    from cptune.model import CalibratedProfile

    timed = dataclasses.replace(make_calibration(2), facts=GPU_RUN)
    store.add_calibration(GPU_NODE, timed)
    back = store.calibration(GPU_NODE.fingerprint)
    assert back == timed and back.timed_kernels == "cuda_cudnn, cuda_flash"
    with store.engine.begin() as connection:
        data, facts = connection.exec_driver_sql("SELECT data, facts FROM calibrations").one()
    assert "facts" not in json.loads(data) and json.loads(facts) == GPU_RUN
    assert "attention timed with cuda_cudnn, cuda_flash" in CalibratedProfile(GPU_NODE, back).describe()


def test_migration_0010_reads_older_rows_as_having_no_facts_and_keeps_them(tmp_path):
    """A database of revision 0009: read as it is (a reader's copy migrated in memory) and
    upgraded by a writer, its rows and calibration have no facts and keep everything else;
    rows stored after the upgrade keep theirs; taken back to 0009 the older rows are kept."""
    path = tmp_path / "old.db"
    engine = migrated(path, "0009")
    stored = make_calibration(2).to_dict()
    del stored["facts"]  # what a cptune of revision 0008 stored
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO hardware (id, fingerprint, host, cpu_model, cpu_count, gpu_count, interconnect, "
            f"created_at, nodes) VALUES (1, '{GPU_NODE.fingerprint}', 'g1', 'cpu', 2, 0, 'shm', "
            "'2026-01-01 00:00:00', 1)")
        connection.exec_driver_sql(
            "INSERT INTO workloads (id, seq_len, heads, kv_heads, head_dim, batch, dtype, causal, mode) "
            "VALUES (1, 64, 4, 4, 16, 1, 'bf16', 0, 'forward')")
        connection.exec_driver_sql(
            "INSERT INTO measurements (id, hardware_id, workload_id, strategy, ranks, head_group, status, "
            "median_ms, engine, cptune_version, measured_at, oversubscribed, excluded) VALUES "
            "(1, 1, 1, 'ring', 2, 1, 'ok', 1.5, 'torch', '0.1.0', '2026-01-01 00:00:00', 0, 0)")
        connection.exec_driver_sql(
            "INSERT INTO calibrations (id, hardware_id, engine, data, cptune_version, measured_at) VALUES "
            "(1, 1, 'mpi', ?, '0.1.0', '2026-01-01 00:00:00')", (json.dumps(stored),))
    engine.dispose()
    with Store(str(path), reading=True) as reader:
        (old,) = reader.results()
        assert (old.median_ms, old.facts, old.kernel) == (1.5, {}, None)
        assert reader.calibration(GPU_NODE.fingerprint) == make_calibration(2)  # no facts
    with Store(str(path)) as writer:
        writer.add_measurement(GPU_NODE, dataclasses.replace(
            measurement(Workload(seq_len=64, heads=4, head_dim=16, dtype="bf16"), CPConfig("ring", 2), 1.0),
            host=GPU_RUN))
        assert [r.kernel for r in writer.results()] == [None, "cuda_cudnn, cuda_flash"]
        with writer.engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
            assert context.get_current_revision() == HEAD_REVISION
    back = migrated(path, "0009", down=True)
    with back.connect() as connection:
        assert connection.exec_driver_sql("SELECT count(*) FROM measurements").scalar() == 2
        columns = {row[1] for row in connection.exec_driver_sql("PRAGMA table_info(calibrations)")}
        assert "facts" not in columns and "data" in columns
    back.dispose()


def test_migration_0011_reads_older_rows_as_plain_and_default_laid_out_and_keeps_them(tmp_path):
    """A database of revision 0010: its rows read as full or causal attention in the
    workload's default layout (by a reader's copy and after a writer's upgrade); masked
    workloads and layouts stored after it round-trip, each mask a workload of its own; taken
    back to 0010 the older rows are kept and what 0010 cannot name goes."""
    path = tmp_path / "old.db"
    engine = migrated(path, "0010")
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO hardware (id, fingerprint, host, cpu_model, cpu_count, gpu_count, interconnect, "
            f"created_at, nodes) VALUES (1, '{HARDWARE.fingerprint}', 'h1', 'cpu', 2, 0, 'shm', "
            "'2026-01-01 00:00:00', 1)")
        connection.exec_driver_sql(
            "INSERT INTO workloads (id, seq_len, heads, kv_heads, head_dim, batch, dtype, causal, mode) "
            "VALUES (1, 64, 4, 4, 16, 1, 'bf16', 1, 'forward')")
        connection.exec_driver_sql(
            "INSERT INTO measurements (id, hardware_id, workload_id, strategy, ranks, head_group, status, "
            "median_ms, engine, cptune_version, measured_at, oversubscribed, excluded) VALUES "
            "(1, 1, 1, 'ring', 2, 1, 'ok', 1.5, 'mpi', '0.1.0', '2026-01-01 00:00:00', 0, 0)")
    engine.dispose()
    plain = Workload(seq_len=64, heads=4, head_dim=16, causal=True)
    with Store(str(path), reading=True) as reader:
        (old,) = reader.results()
        assert (old.workload, old.config, old.median_ms) == (plain, CPConfig("ring", 2), 1.5)
        assert not old.workload.masked and old.config.layout is None
    packed = dataclasses.replace(plain, documents=Documents(lengths=(16, 48)))
    windowed = Workload(seq_len=64, heads=4, head_dim=16, causal=True, window=(8, 0), sinks=2)
    joint = Workload(seq_len=64, heads=4, head_dim=16, text=8)
    with Store(str(path)) as writer:
        writer.add_measurement(HARDWARE, measurement(plain, CPConfig("ring", 2), 1.4))
        writer.add_measurement(HARDWARE, measurement(packed, CPConfig("ring", 2, layout="doc_whole"), 0.5))
        writer.add_measurement(HARDWARE, measurement(packed, CPConfig("ring", 2, layout="zigzag"), 0.7))
        writer.add_measurement(HARDWARE, measurement(windowed, CPConfig("ring", 2), 0.4))
        writer.add_failure(HARDWARE, joint, CPConfig("ring", 2, layout="replicated_text"), "error", "x",
                           "mpi")
        found = writer.results()
        assert [(r.workload, r.config) for r in found] == [
            (plain, CPConfig("ring", 2)), (plain, CPConfig("ring", 2)),
            (packed, CPConfig("ring", 2, layout="doc_whole")),
            (packed, CPConfig("ring", 2)),  # zigzag is a causal mask's default: stored as none
            (windowed, CPConfig("ring", 2)), (joint, CPConfig("ring", 2, layout="replicated_text"))]
        assert [r.id for r in writer.results(workload=plain)] == [1, 2]  # masks are workloads of their own
        assert [r.id for r in writer.results(workload=packed)] == [3, 4]
        assert [r.id for r in writer.results(documents=[16, 48])] == [3, 4]
        assert [r.id for r in writer.results(window=(8, 0), sinks=2)] == [5]
        assert [r.id for r in writer.results(layout="doc_whole")] == [3]
        assert found[2].to_dict()["documents"] == [16, 48] and found[2].to_dict()["layout"] == "doc_whole"
        assert (found[0].to_dict()["documents"], found[0].to_dict()["layout"]) == (None, None)
        with writer.engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT count(*) FROM workloads").scalar() == 4
    back = migrated(path, "0010", down=True)
    with back.connect() as connection:
        kept = connection.exec_driver_sql("SELECT id FROM measurements ORDER BY id").scalars().all()
        assert kept == [1, 2]  # the plain rows; masked workloads and layouts 0010 cannot name are gone
        columns = {row[1] for row in connection.exec_driver_sql("PRAGMA table_info(workloads)")}
        assert "mask_key" not in columns and "window_left" not in columns
    back.dispose()
