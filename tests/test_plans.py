"""Plans: exported from recommendations, validated against the shipped schema, refused with the
line and the reason when broken, and refused on other hardware or shapes unless forced."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from conftest import OTHER_HOST, add_measurements, assert_refused, make_calibration, measurement
from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.feasibility import candidate_configs, feasibility
from cptune.hardware import load_description, this_host
from cptune.model import recommend
from cptune.plans import PlanError, PlanMismatchError, load_plan, plan_schema
from cptune.plans._plan import digest
from cptune.plans.export import bucket_bounds, export_plan
from cptune.store import Store
from cptune.workload import Workload

SHAPE = {"heads": 8, "head_dim": 64}
SHORT, LONG = 1024, 4096
FAST_SHORT, FAST_LONG = CPConfig("ring", 2), CPConfig("ulysses", 4)


def at(seq_len: int, **shape) -> Workload:
    return Workload(seq_len=seq_len, **(SHAPE | shape))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """This host calibrated, every config measured at SHORT and LONG (FAST_SHORT and FAST_LONG
    win), and the plan exported from it: made once, each test gets copies (``db``, ``plan_file``)."""
    folder = tmp_path_factory.mktemp("plans")
    path = str(folder / "p.db")
    with Store(path) as store:
        store.add_calibration(this_host(), make_calibration())
    for seq_len, fastest in ((SHORT, FAST_SHORT), (LONG, FAST_LONG)):
        configs = [c for c in candidate_configs(4) if not feasibility(at(seq_len), c)]
        add_measurements(path, *(measurement(at(seq_len), c,
                                             (5.0 if c == fastest else 9.0 + i) * seq_len / SHORT)
                                 for i, c in enumerate(configs)))
    return Path(path), export_plan([at(SHORT), at(LONG)], db=path).write(folder / "plan.json")


@pytest.fixture
def db(measured, tmp_path):
    return str(shutil.copy(measured[0], tmp_path / "p.db"))


@pytest.fixture
def plan_file(measured, tmp_path):
    return Path(shutil.copy(measured[1], tmp_path / "plan.json"))


def ids_of(db, seq_len, config):
    with Store(db) as store:
        return [r.id for r in store.results(**at(seq_len).to_dict()) if r.config == config]


# --------------------------------------------------------------------------- buckets and selection


@pytest.mark.parametrize("lengths, bounds", [
    ([4096], [(1, 4096)]),
    ([1024, 4096], [(1, 2048), (2049, 4096)]),
    ([4608, 16896], [(1, 8823), (8824, 16896)]),
    ([1000, 1001, 5000], [(1, 1000), (1001, 2237), (2238, 5000)]),
])
def test_buckets_are_contiguous_from_1_and_split_at_the_geometric_mean(lengths, bounds):
    assert bucket_bounds(lengths) == bounds


def test_export_picks_the_fastest_measured_config_with_its_measurement(db):
    plan = export_plan([at(LONG), at(SHORT)], db=db)
    short, long = plan.buckets
    assert (short.seq_len, short.config, short.source) == (SHORT, FAST_SHORT, "measured")
    assert (long.seq_len, long.config, long.source) == (LONG, FAST_LONG, "measured")
    assert short.latency_ms == pytest.approx(5.0) and long.latency_ms == pytest.approx(20.0)  # one visit each
    assert short.measurement_ids[0] == ids_of(db, SHORT, FAST_SHORT)[-1]
    assert len(short.measurement_ids) == len(set(short.measurement_ids)) > 1  # the pick and those it beat
    assert plan.launch.ranks == 4 and plan.launch.mpiexec == ("mpiexec", "-n", "4")
    assert [d.device for d in plan.launch.devices] == ["cpu"] * 4
    assert plan.hardware.kind == "host" and plan.hardware.fingerprint == this_host().fingerprint


def test_select_takes_the_bucket_nearer_by_ratio(plan_file):
    plan = load_plan(plan_file)
    assert plan.select(1) == plan.select(SHORT) == plan.select(2048) == FAST_SHORT
    assert plan.select(2049) == plan.select(3000) == plan.select(LONG) == FAST_LONG
    assert plan.select(at(3000)) == FAST_LONG
    assert plan.select(np.int64(3000)) == FAST_LONG


@pytest.mark.parametrize("seq_len, message", [
    (LONG + 1, "beyond this plan's longest bucket (4096 tokens)"),
    (0, "positive integer"),
    (2.5, "positive integer"),
])
def test_select_refuses_lengths_the_plan_does_not_cover(plan_file, seq_len, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        load_plan(plan_file).select(seq_len)


def test_select_refuses_another_shape_unless_forced(plan_file):
    plan = load_plan(plan_file)
    other = at(3000, heads=16, dtype="fp32")
    with pytest.raises(PlanMismatchError) as refused:
        plan.select(other)
    assert "heads 8 in the plan, 16 asked" in str(refused.value)
    assert "dtype 'bf16' in the plan, 'fp32' asked" in str(refused.value)
    assert plan.select(other, force=True) == FAST_LONG


def test_ranks_pins_the_rank_count_of_every_bucket(db):
    plan = export_plan([at(SHORT), at(LONG)], ranks=2, db=db)
    assert {b.config.ranks for b in plan.buckets} == {2}
    assert plan.buckets[0].config == FAST_SHORT and plan.launch.ranks == 2


def test_export_refuses_mixed_shapes(db):
    with pytest.raises(CPTuneError, match="one attention shape"):
        export_plan([at(SHORT), at(LONG, heads=16)], db=db)


# --------------------------------------------------------------------------- the file


def test_the_file_validates_against_the_shipped_schema_and_round_trips(db, plan_file):
    data = json.loads(plan_file.read_text())
    jsonschema.validate(data, plan_schema(), cls=jsonschema.Draft202012Validator)
    assert data["schema_version"] == 1 and data["digest"] == digest(data)
    assert data["shape"] == {"heads": 8, "kv_heads": 8, "head_dim": 64, "batch": 1, "dtype": "bf16",
                             "causal": False, "mode": "forward"}  # a plan says what it was tuned for
    loaded = load_plan(plan_file)
    exported = export_plan([at(SHORT), at(LONG)], db=db)
    assert loaded.buckets == exported.buckets and loaded.launch == exported.launch
    assert loaded.hardware == exported.hardware and loaded.source == str(plan_file)


def line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


def resigned(data: dict) -> str:
    """A copy edited by someone who also recomputed the digest."""
    data["digest"] = digest(data)
    return json.dumps(data, indent=2)


def edit_value(text: str, old: str, new: str) -> str:
    assert text.count(old) >= 1
    return text.replace(old, new, 1)


def edit_latency(text: str, new: str) -> str:
    """The first bucket's latency_ms (a combined estimate: not a round figure) set to ``new``."""
    edited, count = re.subn(r'"latency_ms": [-+.e0-9]+', f'"latency_ms": {new}', text, count=1)
    assert count == 1
    return edited


def with_alternative(data: dict, config: dict) -> dict:
    """``data`` with its first bucket ranking ``config`` first among its alternatives."""
    first = data["buckets"][0]
    ranked = {"config": config, "latency_ms": 9.0, "interval_ms": [8.0, 10.0], "source": "prior"}
    first = {**first, "alternatives": [ranked, *first["alternatives"]]}
    return {**data, "buckets": [first, *data["buckets"][1:]]}


def with_tied(data: dict, *configs: dict) -> dict:
    """``data`` with its first bucket listing ``configs`` as tied alternatives."""
    return {**data, "buckets": [{**data["buckets"][0], "tied": list(configs)}, *data["buckets"][1:]]}


# (how the copy is broken, the text on the reported line, the reason)
BROKEN = {
    "truncated": (lambda t, d: t[: t.index('"launch"')], None, "not valid JSON"),
    # JSON parsers report the token where the comma was expected: the next line
    "missing comma": (lambda t, d: edit_value(t, '"seq_len": 1024,', '"seq_len": 1024'), '"config"',
                      "Expecting ',' delimiter"),
    "unknown strategy": (lambda t, d: edit_value(t, '"strategy": "ring"', '"strategy": "rign"'),
                         '"strategy": "rign"', "'rign' is not one of"),
    "missing launch": (lambda t, d: json.dumps({k: v for k, v in d.items() if k != "launch"}, indent=2),
                       "{", "'launch' is a required property"),
    "unexpected key": (lambda t, d: edit_value(t, '"source": "measured"', '"source": "measured", "speed": 1'),
                       '"speed": 1', "Additional properties are not allowed ('speed' was unexpected)"),
    "negative latency": (lambda t, d: edit_latency(t, '-5.0'),
                         '"latency_ms": -5.0', "-5.0 is less than or equal to the minimum of 0"),
    "not a number": (lambda t, d: edit_latency(t, 'NaN'),
                     '"latency_ms": NaN', "not valid JSON: NaN (only Python reads it)"),
    "nested too deeply": (lambda t, d: "[" * 5000 + "]" * 5000, None, "nested too deeply"),
    "edited after export": (lambda t, d: edit_latency(t, '4.0'),
                            '"digest"', "does not match its digest"),
    "resigned infeasible head group": (
        lambda t, d: resigned({**d, "buckets": [{**d["buckets"][0], "config": {
            "strategy": "ring", "ranks": 3, "head_group": 3}, "label": "ulysses3xring1"}, d["buckets"][1]]}),
        '"config"', "cannot run this shape"),
    "resigned gap between buckets": (
        lambda t, d: resigned({**d, "buckets": [d["buckets"][0], {**d["buckets"][1], "min_seq_len": 2100}]}),
        '"min_seq_len": 2100', "must be 2049"),
    "resigned unknown tied strategy": (
        lambda t, d: resigned(with_tied(d, {"strategy": "rign", "ranks": 2, "head_group": 1})),
        '"rign"', "buckets[0].tied[0].strategy: 'rign' is not one of"),
    "resigned tied with itself": (
        lambda t, d: resigned(with_tied(d, d["buckets"][0]["config"])), ('"tied"', 1),  # the item's "{"
        "buckets[0].tied[0]: Ring on 2 ranks is listed already in this bucket"),
    "resigned tied beyond the launch": (
        lambda t, d: resigned(with_tied(d, {"strategy": "ring", "ranks": 8, "head_group": 1})), '"ranks": 8',
        "buckets[0].tied[0].ranks: 8 ranks, but the launch starts only 4"),
    "resigned infeasible tied": (
        lambda t, d: resigned(with_tied(d, {"strategy": "ring", "ranks": 3, "head_group": 3})), ('"tied"', 1),
        "buckets[0].tied[0]: 3-way Ulysses"),
    "resigned alternative that is the pick": (
        lambda t, d: resigned(with_alternative(d, d["buckets"][0]["config"])), ('"alternatives"', 1),
        "buckets[0].alternatives[0]: Ring on 2 ranks is listed already in this bucket"),
    "resigned infeasible alternative": (
        lambda t, d: resigned(with_alternative(d, {"strategy": "ring", "ranks": 3, "head_group": 3})),
        ('"alternatives"', 1), "buckets[0].alternatives[0]: 3-way Ulysses"),
    "resigned ranks beyond any machine": (
        lambda t, d: resigned({**d, "buckets": [{**d["buckets"][0], "config": {
            "strategy": "ring", "ranks": 10**30, "head_group": 1}}, d["buckets"][1]]}),
        f'"ranks": {10**30}', f"buckets[0].config.ranks: {10**30} is greater than the maximum of 1000000"),
    "resigned launch beyond any machine": (
        lambda t, d: resigned({**d, "launch": {**d["launch"], "ranks": 10**30}}),
        f'"ranks": {10**30}', f"launch.ranks: {10**30} is greater than the maximum of 1000000"),
    "a number too long to read": (lambda t, d: edit_value(t, '"seq_len": 1024', '"seq_len": 1' + "0" * 5000),
                                  None, "holds a number of more than 4,300 digits"),
    "resigned wrong label": (
        lambda t, d: resigned({**d, "buckets": [{**d["buckets"][0], "label": "ulysses"}, d["buckets"][1]]}),
        '"label": "ulysses"', "must be 'ring'"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_hand_broken_copy_is_refused_with_its_line_and_reason(plan_file, tmp_path, name):
    break_it, marker, reason = BROKEN[name]
    text = plan_file.read_text()
    broken = break_it(text, json.loads(text))
    copy = tmp_path / "broken.json"
    copy.write_text(broken)
    with pytest.raises(PlanError) as refused:
        load_plan(copy)
    message = str(refused.value)
    assert message.startswith(f"{copy}: ") and reason in message and "\n" not in message
    if marker is not None:
        text, lines_below = marker if isinstance(marker, tuple) else (marker, 0)
        assert f": line {line_of(broken, text) + lines_below}" in message


def tied_db(tmp_path) -> str:
    """Every config measured at SHORT in three interleaved rounds: Ring on 2 ranks and
    AllGather-KV on 4 trade places (a tie); the rest are far behind."""
    path = str(tmp_path / "tied.db")
    figures = {FAST_SHORT: (5.0, 5.2, 4.9), CPConfig("allgather_kv", 4): (5.1, 4.95, 5.15)}
    with Store(path) as store:
        store.add_calibration(this_host(), make_calibration())
        configs = [c for c in candidate_configs(4) if not feasibility(at(SHORT), c)]
        for i, config in enumerate(configs):
            for round_index, ms in enumerate(figures.get(config, (9.0 + i,) * 3)):
                store.add_measurement(this_host(), measurement(at(SHORT), config, ms),
                                      round_id=f"r{round_index}")
    return path


def test_the_schema_bounds_every_count_where_cptune_bounds_it():
    """Rank counts at most what any machine built has (``cptune.hardware.MAX_RANKS``, as a
    hardware description's), other integers at most what a database holds (``MAX_INT``): a
    count read from a plan is bounded where it is read, before anything is built from it."""
    from cptune.hardware import MAX_RANKS
    from cptune.workload import MAX_INT

    schema = plan_schema()
    launch = schema["properties"]["launch"]["properties"]
    counts = [schema["$defs"]["config"]["properties"][key] for key in ("ranks", "head_group")]
    counts += [launch[key] for key in ("ranks", "nodes", "ranks_per_node")]
    counts += list(launch["devices"]["items"]["properties"].values())[:3]
    assert {count["maximum"] for count in counts} == {MAX_RANKS}
    bucket = schema["properties"]["buckets"]["items"]["properties"]
    others = [*schema["properties"]["shape"]["properties"].values(), bucket["measurement_ids"]["items"],
              *(bucket[key] for key in ("min_seq_len", "max_seq_len", "seq_len"))]
    assert {value["maximum"] for value in others if value.get("type") == "integer"} == {MAX_INT}


def test_a_bucket_lists_the_tied_alternatives_and_round_trips(tmp_path):
    db = tied_db(tmp_path)
    plan = export_plan([at(SHORT)], ranks=None, db=db)
    (bucket,) = plan.buckets
    assert (bucket.config, bucket.tied) == (FAST_SHORT, (CPConfig("allgather_kv", 4),))
    assert plan.launch.ranks == 4  # the tied alternative can run too
    assert len(bucket.measurement_ids) == len(set(bucket.measurement_ids)) and len(bucket.measurement_ids) > 3
    assert bucket.measurement_ids[:3] == tuple(ids_of(db, SHORT, FAST_SHORT))  # the pick's three visits first
    path = plan.write(tmp_path / "tied.json")
    data = json.loads(path.read_text())
    jsonschema.validate(data, plan_schema(), cls=jsonschema.Draft202012Validator)
    assert data["buckets"][0]["tied"] == [{"strategy": "allgather_kv", "ranks": 4, "head_group": 1}]
    assert load_plan(path).buckets == plan.buckets


def test_the_pick_is_the_paired_leader_and_its_ties_are_its_own(tmp_path):
    """The lowest median need not lead: Ulysses on 2 ranks runs 0.90-1.02x of Ring on 2 in the
    three rounds they share, while Ring's three visits alone in quiet rounds pull its median
    below Ulysses'. The pick is the verdict's leader (Ulysses), and what it lists as tied is
    relative to it (Ring), never the pick itself - the plan loads back."""
    ring, ulysses = CPConfig("ring", 2), CPConfig("ulysses", 2)
    path = str(tmp_path / "paired.db")
    with Store(path) as store:
        store.add_calibration(this_host(), make_calibration())
        for i, config in enumerate(c for c in candidate_configs(4) if not feasibility(at(SHORT), c)):
            for r in range(3) if config not in (ring, ulysses) else ():
                store.add_measurement(this_host(), measurement(at(SHORT), config, 40.0 + i),
                                      round_id=f"shared{r}")
        for r, (ring_ms, ulysses_ms) in enumerate(((20.0, 18.0), (20.0, 19.4), (20.0, 20.4))):
            store.add_measurement(this_host(), measurement(at(SHORT), ring, ring_ms), round_id=f"shared{r}")
            store.add_measurement(this_host(), measurement(at(SHORT), ulysses, ulysses_ms),
                                  round_id=f"shared{r}")
        for r in range(3):
            store.add_measurement(this_host(), measurement(at(SHORT), ring, 10.0), round_id=f"alone{r}")
    pick = recommend(at(SHORT), db=path)
    assert min(pick.candidates, key=lambda c: c.latency_ms).config == ring  # the lowest median
    assert pick.verdict is not None and pick.verdict.leader.config == ulysses
    assert (pick.config, pick.tied, pick.contenders) == (ulysses, (ring,), pick.verdict.contenders)
    plan = export_plan([at(SHORT)], db=path)
    assert [b.contenders for b in plan.buckets] == [(ulysses, ring)]
    assert load_plan(plan.write(tmp_path / "paired.json")).buckets == plan.buckets


def test_a_plan_without_tied_alternatives_still_loads(plan_file, tmp_path):
    data = json.loads(plan_file.read_text())
    for bucket in data["buckets"]:
        del bucket["tied"]  # as written before buckets listed them
    old = tmp_path / "old.json"
    old.write_text(resigned(data))
    assert [b.tied for b in load_plan(old).buckets] == [(), ()]
    assert load_plan(old).select(SHORT) == FAST_SHORT


def test_a_plan_without_an_engine_or_torchrun_still_loads(plan_file, tmp_path):
    data = json.loads(plan_file.read_text())
    assert data["hardware"]["engine"] == "mpi" and data["launch"]["torchrun"][0] == "torchrun"
    del data["hardware"]["engine"], data["launch"]["torchrun"]  # as written before they were added
    old = tmp_path / "old.json"
    old.write_text(resigned(data))
    plan = load_plan(old)
    assert plan.hardware.engine is None and plan.launch.torchrun == ()
    assert plan.select(SHORT) == FAST_SHORT


def test_missing_and_non_plan_files_are_refused(tmp_path):
    with pytest.raises(PlanError, match="no such file; write one with cptune export"):
        load_plan(tmp_path / "absent.json")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PlanError, match="not UTF-8"):
        load_plan(binary)


# --------------------------------------------------------------------------- hardware


def test_a_plan_for_other_hardware_is_refused_unless_forced(plan_file):
    assert load_plan(plan_file, hardware=this_host().fingerprint).buckets
    h100 = load_description("h100-sxm-8")
    with pytest.raises(PlanMismatchError, match=re.escape(f"not {h100.describe()}")):
        load_plan(plan_file, hardware="h100-sxm-8")
    with pytest.raises(PlanMismatchError, match="not hardware 0123456789abcdef"):
        load_plan(plan_file, hardware="0123456789abcdef")
    assert load_plan(plan_file, hardware="h100-sxm-8", force=True).select(SHORT) == FAST_SHORT


def test_a_described_plan_launches_gpus_and_is_refused_on_this_host(db, tmp_path):
    plan = export_plan([at(16896, heads=24, head_dim=128)], ranks=16, hardware="h100-sxm-2x8-ib", db=db)
    (bucket,) = plan.buckets
    assert bucket.source == "prior" and bucket.measurement_ids == () and bucket.config.ranks == 16
    launch = plan.launch
    assert (launch.ranks, launch.nodes, launch.ranks_per_node) == (16, 2, 8)
    assert launch.mpiexec == ("mpiexec", "-n", "16", "-ppn", "8")
    assert "--gpus-per-task=1" in launch.srun and "--nodes=2" in launch.srun
    assert [(d.node, d.device) for d in launch.devices[7:9]] == [(0, "cuda:7"), (1, "cuda:0")]
    path = plan.write(tmp_path / "h100.json")
    with pytest.raises(PlanMismatchError, match=re.escape("name it: hardware='h100-sxm-2x8-ib'")):
        load_plan(path)
    assert load_plan(path, hardware="h100-sxm-2x8-ib").select(10_000).ranks == 16


def test_a_plan_with_figures_given_is_named_by_its_fingerprint_not_the_description(db, tmp_path):
    """Figures given at export (``--figure``) make hardware the shipped name no longer describes:
    the refusal names the fingerprint that matches, and the shipped name is refused."""
    given = {"links.node.bandwidth_gbps.all_to_all": 14}
    plan = export_plan([at(8192, heads=32, head_dim=128)], ranks=8, hardware="l20-pcie-8", db=db,
                       figures=given)
    assert plan.hardware.fingerprint == load_description("l20-pcie-8").with_given(given).fingerprint
    path = plan.write(tmp_path / "l20.json")
    named = re.escape(f"name it: hardware='{plan.hardware.fingerprint}'")
    with pytest.raises(PlanMismatchError, match=named):
        load_plan(path)
    with pytest.raises(PlanMismatchError):
        load_plan(path, hardware="l20-pcie-8")
    assert load_plan(path, hardware=plan.hardware.fingerprint).select(8192).ranks <= 8


def test_a_plan_for_a_settled_nccl_path_is_named_by_its_fingerprint(db):
    plan = export_plan([at(16384, heads=32, head_dim=32)], ranks=4, hardware="a100-pcie-4", db=db,
                       nccl_path="shm")
    assert plan.hardware.fingerprint == load_description("a100-pcie-4").with_nccl_path("shm").fingerprint
    assert "NCCL goes through host memory" in plan.hardware.description
    assert plan._described_as() == plan.hardware.fingerprint


# --------------------------------------------------------------------------- command line


@pytest.mark.slow  # the plan is loaded by a fresh interpreter: what it imports shows
def test_cli_export_then_load_in_another_process_without_the_model(cptune_here, db, tmp_path):
    out = tmp_path / "cli-plan.json"
    done = cptune_here("export", "--db", db, "--heads", "8", "--head-dim", "64", "--seq-lens",
                       f"{SHORT},{LONG}", "-o", out)
    assert done.returncode == 0, done.stderr
    assert "mpiexec -n 4 <your program>" in done.stdout and f"wrote {out}" in done.stdout
    script = (f"import sys, cptune; plan = cptune.load_plan({str(out)!r}); "
              f"print(plan.select(3000).label, plan.select(3000).ranks, plan.select(1500).label, "
              f"'sklearn' in sys.modules, 'sqlalchemy' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["ulysses", "4", "ring", "False", "False"]


def test_cli_export_says_which_configurations_are_tied(cptune_here, tmp_path):
    db = tied_db(tmp_path)
    out = tmp_path / "tied-plan.json"
    done = cptune_here("export", "--db", db, "--heads", "8", "--head-dim", "64", "--seq-lens", str(SHORT),
               "-o", str(out))
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert f"1-{SHORT}: Ring on 2 ranks is tied with AllGather-KV on 4 ranks" in said
    assert [b.tied for b in load_plan(out).buckets] == [(CPConfig("allgather_kv", 4),)]


@pytest.mark.parametrize("args, message", [
    (["--hardware", "h200-nvl-9"], "no shipped hardware description of that name"),
    (["--ranks", "9"], "ranks must be between 1 and 4"),
    (["--ranks", "4", "--strategies", "ulysses", "--heads", "3"], "no configuration can run"),
    (["-o", "/nonexistent-dir/plan.json"], "cannot write the plan to /nonexistent-dir/plan.json"),
])
def test_cli_export_bad_input_exits_2_in_one_line(cptune_here, db, tmp_path, monkeypatch, args, message):
    shape = ["--heads", "8", "--head-dim", "64", "--seq-lens", f"{SHORT},{LONG}"]
    flags = dict(zip(shape[::2], shape[1::2], strict=True))
    flags.update(dict(zip(args[::2], args[1::2], strict=True)))
    given = [part for pair in flags.items() for part in pair]
    monkeypatch.chdir(tmp_path)
    assert_refused(cptune_here("export", "--db", db, *given), message)  # one line, whatever the width


def test_a_plan_for_a_stored_fingerprint_uses_its_measurements(db, tmp_path):
    with Store(db) as store:
        store.add_calibration(OTHER_HOST, make_calibration())
    add_measurements(db, measurement(at(SHORT), CPConfig("allgather_kv", 2), 1.0), hardware=OTHER_HOST)
    plan = export_plan([at(SHORT)], ranks=2, hardware=OTHER_HOST.fingerprint[:8], db=db)
    (bucket,) = plan.buckets
    assert plan.hardware.fingerprint == OTHER_HOST.fingerprint and plan.hardware.kind == "host"
    assert (bucket.config, bucket.source, bucket.latency_ms) == (CPConfig("allgather_kv", 2), "measured", 1.0)
    path = plan.write(tmp_path / "other.json")
    with pytest.raises(PlanMismatchError, match="export a plan on this hardware"):
        load_plan(path)
    assert load_plan(path, hardware=OTHER_HOST.fingerprint).select(SHORT) == CPConfig("allgather_kv", 2)


def test_a_one_rank_plan_is_labelled_local_and_its_label_checked(db, tmp_path):
    path = export_plan([at(SHORT), at(LONG)], ranks=1, db=db).write(tmp_path / "one.json")
    data = json.loads(path.read_text())
    assert [b["label"] for b in data["buckets"]] == ["local", "local"]
    assert load_plan(path).select(SHORT).label == "local"
    copy = tmp_path / "ring-labelled.json"
    first, second = data["buckets"]
    copy.write_text(resigned({**data, "buckets": [{**first, "label": "ring"}, second]}))
    with pytest.raises(PlanError, match="must be 'local'"):
        load_plan(copy)
