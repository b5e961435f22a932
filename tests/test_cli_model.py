"""cptune recommend / fit / calibrate as a user runs them (subprocesses)."""

import json
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
    started = {
        name: subprocess.Popen(
            [*CLI, *(a.format(broken=broken) for a in args), "--db", str(tmp / f"{name}.db")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, args in RUNS.items()
    }
    done = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


def assert_usage_error(result, *fragments):
    """Exit 2 with one line "cptune: error: ..." naming ``fragments``, and no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.strip()]
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

    result = cptune("recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "256", "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pick:" in result.stdout and "(prior)" in result.stdout
    result = cptune("recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "256", "--json", "--db", db)
    data = json.loads(result.stdout)
    assert data["source"] == "prior" and data["fingerprint"] == this_host().fingerprint
    assert {c["ranks"] for c in data["candidates"]} == {1, 2}
