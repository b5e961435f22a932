"""cptune.report on temporary databases of hand-made measurements and a hand-built
calibration (no MPI): what gather reads, what write_report and text_tables show."""

import base64
import re
import subprocess
import sys

import pytest
from rich.console import Console

from conftest import make_calibration, measurement
from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.feasibility import enumerate_configs
from cptune.hardware import Hardware, this_host
from cptune.report import ReportData, gather, text_tables, write_report
from cptune.report._data import ONE_RANK, family
from cptune.report._figures import strategy_map_figure
from cptune.store import Store
from cptune.workload import Workload

LENGTHS = (1024, 2048, 4096)
SHAPE = dict(heads=8, head_dim=64)
OTHER_HOST = Hardware(host="elsewhere", cpu_model="other cpu", cpu_count=64, gpu_model=None, gpu_count=0,
                      interconnect="shared memory (one host)", mpi_library="MPICH 5")
PNG = b"\x89PNG\r\n\x1a\n"


def named(config: CPConfig) -> str:
    """How the report names a configuration: "local" on one rank, else its label."""
    return "local" if config.ranks == 1 else config.label


def fake_ms(seq_len: int, config: CPConfig) -> float:
    """Plausible and distinct: quadratic compute shared by the ranks, plus communication that
    grows with the length and the rank count and differs by strategy; 3 significant digits."""
    scale = seq_len / 1024
    compute = 4.0 * scale**2 / config.ranks
    per_token = {"allgather_kv": 0.21, "ring": 0.17, "ulysses": 0.25}[config.strategy]
    comm = per_token * scale * (config.ranks - 1) / config.ranks + 0.013 * config.head_group
    return float(f"{compute + comm:.3g}")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """This host, calibrated, with every feasible config on 1..4 ranks at three lengths; one
    config measured twice (the later one counts) and one failure (ignored)."""
    path = str(tmp_path_factory.mktemp("report") / "report.db")
    host = this_host()
    with Store(path) as store:
        store.add_calibration(host, make_calibration(4))
        store.add_measurement(host, measurement(Workload(1024, **SHAPE), CPConfig("ring", 2), 99.9))
        for seq_len in LENGTHS:
            workload = Workload(seq_len, **SHAPE)
            for config in enumerate_configs(workload, 4):
                store.add_measurement(host, measurement(workload, config, fake_ms(seq_len, config)))
        store.add_failure(host, Workload(4096, **SHAPE), CPConfig("ring", 4), "timeout", "too slow", "mpi")
    return path


@pytest.fixture(scope="module")
def stored(db):
    """The latest successful measurement of each (workload, config), read without the report."""
    with Store(db) as store:
        return {(r.workload.seq_len, r.config): r for r in store.results(status="ok")}


@pytest.fixture(scope="module")
def data(db) -> ReportData:
    return gather(db)


@pytest.fixture(scope="module")
def written(data, tmp_path_factory):
    return write_report(data, tmp_path_factory.mktemp("out"))


def fastest(stored, seq_len: int, ranks: int):
    return min((r for (s, c), r in stored.items() if s == seq_len and c.ranks == ranks),
               key=lambda r: r.median_ms)


def test_latency_series_are_the_latest_stored_medians(data, stored):
    (hardware,) = data.hardware
    assert hardware.fingerprint == this_host().fingerprint and hardware.calibrated
    (shape,) = hardware.shapes
    assert [panel.seq_len for panel in shape.latency] == list(LENGTHS)
    by_id = {r.id: r for r in stored.values()}
    shown = 0
    for panel in shape.latency:
        assert panel.series[0].family == ONE_RANK
        assert [p.ranks for p in panel.series[0].points] == [1]
        for series in panel.series:
            assert [p.ranks for p in series.points] == sorted(p.ranks for p in series.points)
            for p in series.points:
                result = by_id[p.measurement_id]
                assert (result.workload.seq_len, named(result.config), result.config.ranks) == (
                    panel.seq_len, p.label, p.ranks)
                assert family(result.config) == series.family
                assert (p.median_ms, p.p10_ms, p.p90_ms, p.measurement_id) == (
                    result.median_ms, result.p10_ms, result.p90_ms, result.id)
                shown += 1
    assert shown == len(stored)  # every latest measurement once; the superseded 99.9 nowhere
    families = {s.family for panel in shape.latency for s in panel.series}
    assert families == {ONE_RANK, "allgather_kv", "ring", "ulysses", "ulysses2xallgather_kv", "ulysses2xring"}


def test_speedup_and_efficiency_against_the_fastest_one_rank_run(data, stored):
    (shape,) = data.hardware[0].shapes
    curve = next(c for c in shape.speedup if c.seq_len == 2048)
    one = fastest(stored, 2048, 1).median_ms
    assert curve.one_rank_ms == one
    assert [p.ranks for p in curve.points] == [1, 2, 3, 4]
    for p in curve.points:
        best = fastest(stored, 2048, p.ranks)
        assert (p.label, p.latency_ms, p.measurement_id) == (named(best.config), best.median_ms, best.id)
        assert p.speedup == pytest.approx(one / best.median_ms)
        assert p.efficiency == pytest.approx(one / best.median_ms / p.ranks)
    assert curve.points[0].speedup == 1.0 and curve.points[-1].speedup > 1.5


def test_map_is_measured_where_every_rival_was_and_predicted_elsewhere(data, stored):
    (shape,) = data.hardware[0].shapes
    grid = shape.map_grid()
    assert shape.measured_lengths == LENGTHS
    assert {8192, 16384, 1472, 2944} <= set(shape.map_lengths)  # 2x, 4x the longest, midpoints
    for seq_len in shape.map_lengths:
        for n in shape.rank_counts:
            cell = grid[(seq_len, n)]
            if seq_len in LENGTHS:
                best = fastest(stored, seq_len, n)
                assert cell.measured and cell.source == "measured"
                assert (cell.label, cell.latency_ms, cell.measurement_id) == (
                    named(best.config), best.median_ms, best.id)
            else:
                assert cell.status == "predicted" and cell.source == "model"  # 33 samples: corrected
                assert cell.measurement_id is None
    assert not data.hardware[0].notes


def test_predicted_against_measured_holds_every_latest_measurement(data, stored):
    accuracy = data.hardware[0].accuracy
    assert accuracy is not None
    by_id = {r.id: r for r in stored.values()}
    assert sorted(p.measurement_id for p in accuracy.points) == sorted(by_id)
    for p in accuracy.points:
        assert p.measured_ms == pytest.approx(by_id[p.measurement_id].median_ms)
        assert p.model_ms > 0 and p.prior_ms > 0
    errors = [abs(p.prior_ms - p.measured_ms) / p.measured_ms * 100 for p in accuracy.points]
    assert accuracy.prior_mape == pytest.approx(sum(errors) / len(errors))
    assert [row[0] for row in accuracy.by_seq_len()] == list(LENGTHS)


def test_write_report_writes_the_figures_and_a_self_contained_page(written, data, stored):
    names = [p.name for p in written]
    assert names == ["8x64-bf16-latency-vs-ranks.png", "8x64-bf16-speedup.png", "8x64-bf16-strategy-map.png",
                     "predicted-vs-measured.png", "report.html"]
    page = written[-1].read_text()
    for png in written[:-1]:
        content = png.read_bytes()
        assert content.startswith(PNG) and len(content) > 10_000
        assert f"data:image/png;base64,{base64.b64encode(content).decode()}" in page
    assert page.count("data:image/png;base64,") == 4
    assert not re.search(r"https?://|<script", page, re.IGNORECASE)
    assert data.hardware[0].fingerprint in page and data.url in page
    for result in stored.values():
        assert f">{result.median_ms:.3g}</td>" in page  # every median in the latency table
    assert "99.9" not in page
    assert 'class="predicted">' in page and "* predicted" in page


def test_figures_are_deterministic(data):
    hardware = data.hardware[0]
    shape = hardware.shapes[0]
    assert strategy_map_figure(hardware, shape) == strategy_map_figure(hardware, shape)


def test_text_tables_render_the_same_data(data, stored):
    console = Console(record=True, width=120)
    for table in text_tables(data):
        console.print(table)
    text = console.export_text()
    for name in ("1 rank", "allgather_kv", "ulysses2xring", "seq_len held out", "(not measured)"):
        assert name in text
    assert re.search(r"\w\*", text) and "* predicted" in text
    assert f"{fastest(stored, 4096, 4).median_ms:.3g}" in text


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """This host measured but never calibrated; another host calibrated on 1..2 ranks but
    measured at one length only, and not allgather_kv there."""
    path = str(tmp_path_factory.mktemp("two") / "two.db")
    workload = Workload(512, **SHAPE)
    with Store(path) as store:
        store.add_calibration(OTHER_HOST, make_calibration(2))
        for host in (this_host(), OTHER_HOST):
            for config in (CPConfig("ring", 1), CPConfig("ring", 2), CPConfig("ulysses", 2)):
                store.add_measurement(host, measurement(workload, config, fake_ms(512, config)))
    return path


def test_missing_calibration_and_single_length_are_noted(two_hosts, tmp_path):
    data = gather(two_hosts)
    assert data.several_hardware
    sections = {h.fingerprint: h for h in data.hardware}
    assert set(sections) == {this_host().fingerprint, OTHER_HOST.fingerprint}
    mine, other = sections[this_host().fingerprint], sections[OTHER_HOST.fingerprint]
    assert not mine.calibrated and mine.accuracy is None
    assert any("cptune calibrate" in note for note in mine.notes)
    assert all(c.measured for c in mine.shapes[0].strategy_map)
    assert other.accuracy is None and any("at least two groups" in note for note in other.notes)
    predicted = [c for c in other.shapes[0].strategy_map if not c.measured]
    assert {c.source for c in predicted if c.seq_len != 512} == {"prior"}  # too few samples for the model
    grid = other.shapes[0].map_grid()
    assert grid[(512, 1)].measured  # ring on 1 rank has no rival
    two = grid[(512, 2)]  # ring measured and fastest, but allgather_kv only predicted
    assert (two.status, two.source, two.label) == ("predicted", "measured", "ring")

    only = gather(two_hosts, hardware=OTHER_HOST.fingerprint[:6].upper())
    assert [h.fingerprint for h in only.hardware] == [OTHER_HOST.fingerprint] and only.several_hardware
    paths = write_report(only, tmp_path)
    prefix = f"{OTHER_HOST.fingerprint[:8]}-8x64-bf16"
    assert [p.name for p in paths] == [f"{prefix}-latency-vs-ranks.png", f"{prefix}-speedup.png",
                                       f"{prefix}-strategy-map.png", "report.html"]
    page = paths[-1].read_text()
    assert "at least two groups" in page and "ms, prior</small>" in page
    assert page.count("data:image/png;base64,") == 3


@pytest.mark.parametrize("prefix", ["zzzz", "ab", ""])
def test_an_unknown_or_short_hardware_prefix_names_the_known_ones(two_hosts, prefix):
    with pytest.raises(CPTuneError) as caught:
        gather(two_hosts, hardware=prefix)
    assert this_host().fingerprint in str(caught.value) and OTHER_HOST.fingerprint in str(caught.value)


def test_an_empty_database_says_to_search_first(tmp_path):
    path = tmp_path / "empty.db"
    with Store(str(path)) as store:  # a failure alone is nothing to report
        store.add_failure(this_host(), Workload(512, **SHAPE), CPConfig("ring", 2), "crash", "boom", "mpi")
    with pytest.raises(CPTuneError, match=r"no measurements in sqlite:///.*empty\.db: run cptune search"):
        gather(str(path))


# --------------------------------------------------------------------------- command line


def cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-P", "-c", "import sys; from cptune.cli import main; sys.exit(main())"]
    return subprocess.run([*command, "report", *args], capture_output=True, text=True, timeout=120)


def test_cli_report_text_prints_tables_and_writes_nothing(db, tmp_path):
    done = cli("--db", db, "--text", "-o", str(tmp_path / "unused"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fastest configuration" in done.stdout and "speedup over 1 rank" in done.stdout
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("args, message", [
    (["--hardware", "ffff"], "names no single fingerprint"),
    (["-o", "{file}"], "cannot write the report to"),
])
def test_cli_report_bad_input_exits_2_in_one_line(db, tmp_path, args, message):
    occupied = tmp_path / "a-file"
    occupied.write_text("not a directory")
    done = cli("--db", db, *(a.format(file=occupied) for a in args))
    assert done.returncode == 2 and done.stdout == ""  # errors go to stderr, in one line
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert message in done.stderr
    assert occupied.read_text() == "not a directory"
