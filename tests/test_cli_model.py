"""cptune recommend / fit / calibrate as a user runs them (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

from cptune.hardware import builtin_descriptions, this_host
from cptune.store import Store

CLI = [sys.executable, "-P", "-c", "import sys; from cptune.cli import main; sys.exit(main())"]
H100 = ["--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128"]


def cptune(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


#: The runs that start no MPI ranks, by name: each gets its own database.
RUNS = {
    "json": ["recommend", *H100, "--seq-len", "16896", "--json"],
    "unknown-hardware": ["recommend", "--hardware", "h300-sxm-8", "--heads", "24", "--head-dim", "128",
                         "--seq-len", "4096"],
    "malformed-description": ["recommend", "--hardware", "{broken}", "--heads", "8", "--head-dim", "64",
                              "--seq-len", "1024"],
    "nothing-feasible": ["recommend", *H100, "--seq-len", "1", "--ranks", "2"],
    "too-many-ranks": ["recommend", *H100, "--seq-len", "4096", "--ranks", "9"],
    "fit-empty": ["fit"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run in RUNS, started at once (each mostly pays Python imports) and finished."""
    tmp = tmp_path_factory.mktemp("cli")
    broken = tmp / "broken.toml"
    broken.write_text('ranks_per_node = 8\n[device\nname = "x"\n')
    env = {k: v for k, v in os.environ.items() if k != "CPTUNE_DB"}  # the default database, absent
    started = {
        name: subprocess.Popen(
            [*CLI, *(a.format(broken=broken) for a in args)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, env=env,
        )
        for name, args in RUNS.items()
    }
    done = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    assert not (tmp / "cptune.db").exists()  # reading commands create no database
    return done


def assert_usage_error(result, *fragments):
    """Exit 2 with one line "cptune: error: ..." on stderr naming ``fragments``, and no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("cptune: error: ")
    for fragment in fragments:
        assert fragment in lines[0], output


def test_recommend_on_a_shipped_description_prints_json(runs):
    result = runs["json"]
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["source"] == "prior" and data["latency_ms"] > 0
    assert set(data["config"]) == {"strategy", "ranks", "head_group"}
    assert 1 <= data["config"]["ranks"] <= 8
    assert len(data["candidates"]) > 1 and all(c["source"] == "prior" for c in data["candidates"])
    latencies = [c["latency_ms"] for c in data["candidates"]]
    assert latencies == sorted(latencies) and latencies[0] == data["latency_ms"]
    assert data["fingerprint"].startswith("described:")
    assert data["workload"]["seq_len"] == 16896 and data["workload"]["heads"] == 24


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("unknown-hardware", ["h300-sxm-8", *builtin_descriptions()]),
        ("malformed-description", ["broken.toml"]),
        ("nothing-feasible", ["no configuration can run"]),
        ("too-many-ranks", ["between 1 and 8"]),
        ("fit-empty", ["cptune search"]),
    ],
)
def test_bad_input_is_one_line(runs, name, fragments):
    assert_usage_error(runs[name], *fragments)


# --------------------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_calibrate_then_recommend_from_the_prior(tmp_path):
    db = str(tmp_path / "cal.db")
    result = cptune("calibrate", "--max-ranks", "2", "--repeats", "2", "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "collectives" in result.stdout and "attention compute rate" in result.stdout
    for kind in ("all_to_all", "all_gather", "p2p"):
        assert kind in result.stdout

    with Store(db) as store:
        calibration = store.calibration(this_host().fingerprint)
    assert calibration is not None and calibration.max_ranks == 2
    assert {(f.kind, f.ranks, f.group) for f in calibration.collectives} == {
        ("all_to_all", 2, 2), ("all_gather", 2, 2), ("p2p", 2, 2)
    }
    assert all(f.latency_s >= 0 and f.bandwidth > 0 and f.bus_bandwidth > 0 for f in calibration.collectives)
    assert any(f.latency_s > 0 for f in calibration.collectives)
    assert {r.ranks for r in calibration.compute} == {1, 2}
    assert all(r.seconds > 0 and r.flops_per_s > 0 for r in calibration.compute)
    # the numpy kernel's per-step work, timed on every rank count and shown
    assert {(s.ranks, s.kind, s.wire) for s in calibration.steps} == {
        (n, kind, wire) for n in (1, 2)
        for kind, wire in (("query", "float16"), ("query", "float32"), ("merge", "float32"))
    }
    assert all(s.seconds > 0 and s.elements > 0 for s in calibration.steps)
    assert "memory-bound steps" in result.stdout

    result = cptune("recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "256", "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pick:" in result.stdout and "(prior)" in result.stdout
    result = cptune("recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "256", "--json", "--db", db)
    data = json.loads(result.stdout)
    assert data["source"] == "prior" and data["fingerprint"] == this_host().fingerprint
    assert {c["ranks"] for c in data["candidates"]} == {1, 2}


def test_fit_shows_the_baselines_the_coverage_and_the_verdict_recommend_follows(tmp_path):
    from conftest import make_calibration, measurement
    from cptune.feasibility import enumerate_configs
    from cptune.model import CalibratedProfile, Case
    from cptune.workload import Workload

    db = str(tmp_path / "fit.db")
    profile = CalibratedProfile(this_host(), make_calibration())
    factor = {"ring": 1.6, "ulysses": 0.6, "allgather_kv": 1.0}
    with Store(db) as store:
        store.add_calibration(profile.hardware, profile.calibration)
        for seq_len in (512, 768, 1536, 2048):
            workload = Workload(seq_len=seq_len, heads=8, head_dim=64)
            for config in enumerate_configs(workload, 4):
                ms = Case(workload, config, profile).prior().total_s * 1e3 * factor[config.strategy]
                store.add_measurement(profile.hardware, measurement(workload, config, ms))
    fit = subprocess.Popen([*CLI, "fit", "--db", db], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    workload = ["--heads", "8", "--head-dim", "64", "--seq-len", "1024", "--db", db]
    said = subprocess.Popen([*CLI, "recommend", *workload], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    rec = cptune("recommend", *workload, "--json")
    out, err = fit.communicate(timeout=300)
    assert fit.returncode == 0, out + err
    # the summary's rows: a two-word method and its eight scores
    methods = ("cost model", "prior alone", "recommend's pick", "fixed rule")
    rows = {" ".join(words[:2]): words[2:] for words in map(str.split, out.splitlines())
            if len(words) == 10 and " ".join(words[:2]) in methods}
    model, prior, advised, rule = (rows[method] for method in methods)
    # top-1, regret, worst, regret and worst with ties as ties, rho, MAPE, cover
    assert len(model) == len(prior) == len(advised) == len(rule) == 8
    assert float(model[6]) < float(prior[6]) and 0 <= int(model[7]) <= 100 and int(prior[7]) == 100
    assert rule[6] == rule[7] == "-"  # a rule predicts no latency: no MAPE, no coverage
    # one visit each, no noise beyond the iterations': ties as ties never charges more than plain
    assert all(float(row[3]) <= float(row[1]) and float(row[4]) <= float(row[2]) for row in rows.values())
    assert "ties as ties: median" in " ".join(out.split()) and "regret*" in out  # the caption wraps
    assert "cover%" in out and "recommend applies the learned correction" in out
    assert rec.returncode == 0, rec.stdout + rec.stderr
    data = json.loads(rec.stdout)
    assert data["correction"]["applied"] is True and data["source"] == "model"
    out, err = said.communicate(timeout=300)
    assert said.returncode == 0 and "learned correction applied: held out" in out, out + err


def test_recommend_says_a_measured_tie_in_text_and_json(tmp_path):
    from conftest import make_calibration, measurement
    from cptune.config import CPConfig
    from cptune.workload import Workload

    db = str(tmp_path / "tie.db")
    workload = Workload(seq_len=1024, heads=8, head_dim=64)
    # three interleaved rounds in which ring and allgather_kv trade places; ulysses is far behind
    rounds = {CPConfig("ring", 2): (1.00, 1.05, 0.98), CPConfig("allgather_kv", 2): (1.03, 0.99, 1.02),
              CPConfig("ulysses", 2): (3.0, 3.1, 2.9)}
    with Store(db) as store:
        store.add_calibration(this_host(), make_calibration())
        for config, figures in rounds.items():
            for i, ms in enumerate(figures):
                store.add_measurement(this_host(), measurement(workload, config, ms), round_id=f"r{i}")
    args = ["recommend", "--heads", "8", "--head-dim", "64", "--seq-len", "1024", "--ranks", "2", "--db", db]
    text = cptune(*args)
    assert text.returncode == 0, text.stdout + text.stderr
    said = " ".join(text.stdout.split())  # the line may wrap
    assert "measured verdict:" in said and "tied within the noise of this hardware" in said
    verdict = said.split("measured verdict:")[-1]
    assert "AllGather-KV" in verdict and "Ring" in verdict
    data = json.loads(cptune(*args, "--json").stdout)
    assert data["source"] == "measured" and "tied within the noise of this hardware" in data["verdict"]
    assert {(t["strategy"], t["ranks"]) for t in data["tied"]} | {(data["config"]["strategy"], 2)} == {
        ("ring", 2), ("allgather_kv", 2)}
