"""cptune recommend / fit / calibrate as a user runs them: in this process where only what
the command prints counts, as a subprocess where real ranks run."""

import json

import pytest

from conftest import assert_refused, cptune, make_calibration, measurement
from cptune.hardware import builtin_descriptions, this_host
from cptune.store import Store
from suite_cli import QUICK_CALIBRATION

H100 = ["--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128"]

#: Bad input that starts no MPI ranks, by name.
BAD_INPUT = {
    "unknown-hardware": ["recommend", "--hardware", "h300-sxm-8", "--heads", "24", "--head-dim", "128",
                         "--seq-len", "4096"],
    "malformed-description": ["recommend", "--hardware", "{broken}", "--heads", "8", "--head-dim", "64",
                              "--seq-len", "1024"],
    "nothing-feasible": ["recommend", *H100, "--seq-len", "1", "--ranks", "2"],
    "too-many-ranks": ["recommend", *H100, "--seq-len", "4096", "--ranks", "9"],
    "fit-empty": ["fit"],
}


@pytest.fixture
def no_database(tmp_path, monkeypatch):
    """A working directory without a database and no $CPTUNE_DB: the default, ./cptune.db, is
    absent (and reading commands must not create it)."""
    monkeypatch.delenv("CPTUNE_DB", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cptune.db"


def test_recommend_on_a_shipped_description_prints_json(cptune_here, no_database):
    result = cptune_here("recommend", *H100, "--seq-len", "16896", "--json")
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
    assert not no_database.exists()


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
def test_bad_input_is_one_line(cptune_here, no_database, tmp_path, name, fragments):
    broken = tmp_path / "broken.toml"
    broken.write_text('ranks_per_node = 8\n[device\nname = "x"\n')
    assert_refused(cptune_here(*(a.format(broken=broken) for a in BAD_INPUT[name])), *fragments)
    assert not no_database.exists()


# --------------------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_the_shipped_attention_shapes_and_steps_calibrate_on_a_rank(tmp_path, monkeypatch):
    """The suite's one calibration of the shapes cptune ships (up to 34 GFLOP a call; the others
    time small ones: conftest), on one rank: every shape and step timed and stored."""
    monkeypatch.delenv(QUICK_CALIBRATION)
    db = str(tmp_path / "cal.db")
    result = cptune("calibrate", "--max-ranks", "1", "--repeats", "1", "--rounds", "1", "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    with Store(db) as store:
        calibration = store.calibration(this_host().fingerprint)
    assert calibration is not None and calibration.collectives == ()
    shapes = {(r.seq_q, r.seq_k, r.head_dim, r.causal) for r in calibration.compute}
    assert shapes == {(q, 4 * q, d, causal)
                      for q in (128, 256, 512, 1024, 2048) for d in (64, 128) for causal in (False, True)}
    assert all(r.ranks == 1 and r.seconds > 0 for r in calibration.compute) and len(calibration.steps) == 3
    # the numpy backward, on the three smaller sizes of each head_dim and mask, read against the forward
    assert {(r.seq_q, r.head_dim, r.causal) for r in calibration.backward} == {
        (q, d, causal) for q in (128, 256, 512) for d in (64, 128) for causal in (False, True)}
    # a ratio of two single timings (one repeat, one round) taken while other tests run beside
    # them: the bounds catch a unit slip (ms against s: 1000x), not the load (which put one outside
    # 0.05-5 in a CI run)
    assert all(0.01 < calibration.backward_speed(d, causal, flops) < 100
               for d in (64, 128) for causal in (False, True) for flops in (None, 1e7, 1e8, 1e9, 1e10))
    assert "backward" in result.stdout


@pytest.mark.slow
def test_calibrate_then_recommend_from_the_prior(tmp_path):
    db = str(tmp_path / "cal.db")
    result = cptune("calibrate", "--max-ranks", "2", "--repeats", "1", "--rounds", "1", "--db", db)
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
    # a training step, from the same calibration's backward: each configuration costs more than its
    # forward (the backward's size against the forward is the measured backward speed, so no fixed factor)
    result = cptune("recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "256", "--json", "--db", db,
                    "--mode", "train")
    assert result.returncode == 0, result.stdout + result.stderr
    train = json.loads(result.stdout)
    assert train["latency_ms"] > data["latency_ms"]
    forward_ms = {c["label"]: c["latency_ms"] for c in data["candidates"]}
    train_ms = {c["label"]: c["latency_ms"] for c in train["candidates"]}
    assert train_ms.keys() == forward_ms.keys()
    assert all(train_ms[label] > forward_ms[label] for label in forward_ms)


def test_fit_shows_the_baselines_the_coverage_and_the_verdict_recommend_follows(cptune_here, tmp_path):
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
    fit = cptune_here("fit", "--db", db)
    out = fit.stdout
    assert fit.returncode == 0, out + fit.stderr
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
    workload = ["--heads", "8", "--head-dim", "64", "--seq-len", "1024", "--db", db]
    rec = cptune_here("recommend", *workload, "--json")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    data = json.loads(rec.stdout)
    assert data["correction"]["applied"] is True and data["source"] == "model"
    said = cptune_here("recommend", *workload)
    assert said.returncode == 0, said.stdout + said.stderr
    assert "learned correction applied: held out" in said.stdout, said.stdout


def test_recommend_says_a_measured_tie_in_text_and_json(cptune_here, tmp_path):
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
    text = cptune_here(*args)
    assert text.returncode == 0, text.stdout + text.stderr
    said = " ".join(text.stdout.split())  # the line may wrap
    assert "measured verdict:" in said and "tied within the noise of this hardware" in said
    verdict = said.split("measured verdict:")[-1]
    assert "AllGather-KV" in verdict and "Ring" in verdict
    data = json.loads(cptune_here(*args, "--json").stdout)
    assert data["source"] == "measured" and "tied within the noise of this hardware" in data["verdict"]
    assert {(t["strategy"], t["ranks"]) for t in data["tied"]} | {(data["config"]["strategy"], 2)} == {
        ("ring", 2), ("allgather_kv", 2)}
