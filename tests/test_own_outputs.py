"""What a command may replace at a path a user names as its output (issue 54): only a file cptune
wrote, told by its content - a plan cptune export wrote (``-o``), a report's page and figures, the
graphs and manifest of export-graph. Never one of the command's own inputs (the results database,
a search space, a hardware description, a ``--plan`` file, the host lock) nor another program's
file, ``--force`` or not: one line, exit 2, every file byte for byte as it was."""

import hashlib
import json
import shutil

import pytest

from conftest import add_measurements, assert_refused, measurement
from cptune.config import CPConfig
from cptune.hardware import builtin_descriptions
from cptune.hostlock import LOCK_ENV, measuring
from cptune.plans import load_plan
from cptune.space import builtin_spaces
from cptune.workload import Workload

DEMO = Workload(seq_len=1024, heads=8, head_dim=64)
SHAPE = ["--heads", "8", "--head-dim", "64", "--seq-lens", "1024"]
DESCRIBED = ["--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128", "--seq-lens", "16896"]


def files(folder):
    """Every file under ``folder`` with the SHA-256 of its bytes: what a refusal must leave as it was."""
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def db(tmp_path):
    """Two measurements of the demo's shape at 1024 tokens on this host."""
    path = tmp_path / "c.db"
    add_measurements(str(path), measurement(DEMO, CPConfig("ring", 1), 3.0),
                     measurement(DEMO, CPConfig("ring", 2), 2.0))
    return path


@pytest.fixture
def plan(cptune_here, tmp_path):
    path = tmp_path / "plan.json"
    assert cptune_here("export", *DESCRIBED, "-o", path).returncode == 0
    return path


def own_input(kind, tmp_path, monkeypatch, db, plan):
    """(the path of one of the command's own inputs of ``kind``, the export command reading it)."""
    if kind == "database":
        return db, ["export", *SHAPE, "--db", db]
    if kind == "space":
        space = shutil.copy(builtin_spaces()["demo"], tmp_path / "space.toml")
        return space, ["export", space, "--hardware", "h100-sxm-8"]
    if kind == "hardware description":
        described = shutil.copy(builtin_descriptions()["h100-sxm-8"], tmp_path / "h100.toml")
        return described, ["export", *DESCRIBED[2:], "--hardware", described]
    if kind == "--plan file":
        return plan, ["export", "--for", "diffusers", "--plan", plan]
    assert kind == "host lock"
    lock = tmp_path / "host.lock"
    monkeypatch.setenv(LOCK_ENV, str(lock))
    with measuring():  # the lock's file, with its holder's record as a measuring command leaves it
        pass
    return lock, ["export", *DESCRIBED]


@pytest.mark.parametrize("kind", ["database", "space", "hardware description", "--plan file", "host lock"])
def test_export_force_never_replaces_one_of_its_own_inputs(cptune_here, tmp_path, monkeypatch, db, plan,
                                                           kind):
    target, command = own_input(kind, tmp_path, monkeypatch, db, plan)
    before = files(tmp_path)
    result = cptune_here(*command, "-o", target, "--force")
    assert_refused(result, str(target), "left as it is", "cptune export -o PATH")
    assert files(tmp_path) == before


def test_force_does_not_replace_another_programs_file_either(cptune_here, tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": "not a plan"}\n')
    before = files(tmp_path)
    for force in ([], ["--force"]):
        result = cptune_here("export", *DESCRIBED, "-o", notes, *force)
        assert_refused(result, f"{notes} exists and is not a plan written by cptune export",
                       "move that file away")
        assert files(tmp_path) == before


def test_a_plan_edited_since_export_is_replaced_only_with_force(cptune_here, tmp_path, plan):
    data = json.loads(plan.read_text())
    data["buckets"][0]["latency_ms"] *= 2  # a hand edit: the digest no longer matches
    plan.write_text(json.dumps(data))
    before = files(tmp_path)
    result = cptune_here("export", *DESCRIBED, "-o", plan)
    assert_refused(result, f"{plan} is a plan edited since cptune export wrote it", "--force")
    assert files(tmp_path) == before
    assert cptune_here("export", *DESCRIBED, "-o", plan, "--force").returncode == 0
    load_plan(plan, hardware="h100-sxm-8")  # cptune's own plan again


def test_a_plan_cptune_wrote_is_still_replaced_without_force(cptune_here, tmp_path, plan):
    before = plan.read_bytes()
    assert cptune_here("export", *DESCRIBED[:-1], "4096,16896", "-o", plan).returncode == 0
    assert plan.read_bytes() != before
    assert [b.seq_len for b in load_plan(plan, hardware="h100-sxm-8").buckets] == [4096, 16896]


@pytest.mark.parametrize("name", ["report.html", "8x64-bf16-latency-vs-ranks.png"])
def test_a_report_never_replaces_a_file_it_did_not_write(cptune_here, tmp_path, db, name):
    folder = tmp_path / "report"
    folder.mkdir()
    (folder / name).write_text("someone else's\n")
    before = files(tmp_path)
    result = cptune_here("report", "--db", db, "-o", folder)
    assert_refused(result, f"cannot write the report to {folder}: {folder / name}: exists and is not a file "
                           f"cptune wrote", "cptune report -o DIR")
    assert files(tmp_path) == before


def test_a_report_replaces_its_own_files(cptune_here, tmp_path, db):
    folder = tmp_path / "report"
    for _ in range(2):
        done = cptune_here("report", "--db", db, "-o", folder)
        assert done.returncode == 0, done.stderr
    assert (folder / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_a_report_never_writes_over_its_own_database(cptune_here, tmp_path, db):
    folder = tmp_path / "report"
    folder.mkdir()
    inside = shutil.move(db, folder / "report.html")
    before = files(tmp_path)
    result = cptune_here("report", "--db", inside, "-o", folder)
    assert_refused(result, "exists and is not a file cptune wrote")
    assert files(tmp_path) == before


GRAPH = ["export-graph", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--strategy", "ring",
         "--ranks", "2"]


@pytest.mark.parametrize("name", ["rank1.onnx", "manifest.json"])
def test_export_graph_never_replaces_a_file_it_did_not_write(cptune_here, tmp_path, name):
    pytest.importorskip("onnx")
    folder = tmp_path / "graphs"
    folder.mkdir()
    (folder / name).write_text('{"mine": 1}\n')
    before = files(tmp_path)
    result = cptune_here(*GRAPH, "-o", folder)
    assert_refused(result, f"{folder / name}: exists and is not a file cptune wrote",
                   "cptune export-graph -o DIR")
    assert files(tmp_path) == before  # checked before the first graph is written: none was


def test_export_graph_replaces_its_own_graphs(cptune_here, tmp_path):
    pytest.importorskip("onnx")
    folder = tmp_path / "graphs"
    for _ in range(2):
        done = cptune_here(*GRAPH, "-o", folder)
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "rank0.onnx", "rank1.onnx"]
