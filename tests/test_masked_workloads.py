"""Masks everywhere a workload goes: the command line's flags, the search's space over layouts
(Optuna's and the guided order), the cost model's features and plans. No ranks start here."""

import argparse
import json

import optuna
import pytest

from conftest import assert_refused, candidate, measurement, replay, stand_in_measuring
from cptune import CPConfig, Workload, enumerate_configs
from cptune.cli._common import documents, window
from cptune.config import LAYOUTS
from cptune.hardware import this_host
from cptune.layout import layout_choices
from cptune.masks import MAX_DOCUMENTS, read_documents
from cptune.search import WorkloadSearch, suggest, tree_of
from cptune.search._trials import config_of, distributions, params_of, view_trial
from cptune.store import Store

#: A causal layer packed with three documents: the layouts a search sweeps on 2 ranks are several.
PACKED = Workload(seq_len=96, heads=4, head_dim=16, dtype="fp32", causal=True, documents=(16, 32, 48))


# --------------------------------------------------------------------------- flags


def test_window_and_documents_flags_parse_as_masks_md_says(tmp_path):
    assert window("1024") == (1024, 0) and window("8, 2") == (8, 2)
    assert documents("2048") == 2048 and documents("2048,2048,1024") == (2048, 2048, 1024)  # repeats allowed
    listed = tmp_path / "docs.txt"
    listed.write_text("# packed\n16\n\n32  # a comment\n48\n")
    assert documents(f"@{listed}") == (16, 32, 48)
    (tmp_path / "docs.json").write_text("[16, 80]")
    assert read_documents(tmp_path / "docs.json") == (16, 80)
    for bad in ("1,2,3", "", "a", "-1", "4,"):
        with pytest.raises(argparse.ArgumentTypeError):
            window(bad)
    for bad in ("1,,2", "0", "x", f"@{tmp_path}", f"@{tmp_path / 'absent'}"):
        with pytest.raises(argparse.ArgumentTypeError):
            documents(bad)


def test_a_documents_file_is_bounded(tmp_path):
    many = tmp_path / "many.txt"
    many.write_text("1\n" * (MAX_DOCUMENTS + 1))
    with pytest.raises(ValueError, match="more than the 1,048,576"):
        read_documents(many)
    for text, said in (("[1, 2.5]", "JSON list of whole numbers"), ("", "holds no length"),
                       ("4\n0\n", "positive integer")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ValueError, match=said):
            read_documents(bad)


@pytest.mark.parametrize("args, fragments", [
    (["measure", "--seq-len", "64", "--window", "100"],
     ["window: [100, 0] reaches across the whole 64-token"]),
    (["measure", "--seq-len", "64", "--documents", "16,16"], ["documents: their lengths sum to 32"]),
    (["measure", "--seq-len", "64", "--sinks", "4"], ["sinks:", "give a window"]),
    (["measure", "--seq-len", "64", "--text", "8", "--causal"], ["text:", "full over both"]),
    (["measure", "--seq-len", "64", "--text", "64"], ["text: 64 text tokens leave none"]),
    (["recommend", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--window", "8,2", "--causal"],
     ["right to 0"]),
    (["search", "--seq-lens", "64,128", "--heads", "4", "--head-dim", "16", "--documents", "32,32"],
     ["sum to 64, not the sequence's 128"]),
    (["export", "--seq-lens", "64", "--heads", "4", "--head-dim", "16", "--documents", "16,16"],
     ["documents:"]),
])
def test_a_bad_mask_is_one_line_and_exit_2_before_anything_runs(cptune_here, args, fragments):
    assert_refused(cptune_here(*args), *fragments)


@pytest.mark.parametrize("args, fragment", [
    (["measure", "--window", "1,2,3"], "argument --window: expected LEFT,RIGHT"),
    (["measure", "--documents", "1,,2"], "argument --documents: expected document lengths"),
    (["measure", "--sinks", "-1"], "argument --sinks: must be 0 or more"),
    (["measure", "--layout", "diagonal"], "argument --layout: invalid choice"),
])
def test_a_bad_mask_flag_is_argparses_one_line(cptune_here, args, fragment):
    assert_refused(cptune_here(*args), fragment, prefix=f"cptune {args[0]}: error: ")


def test_a_left_out_configuration_is_measured_alone_in_its_layout(cptune_here):
    from cptune.cli import build_parser
    from cptune.search import measure_command

    command = measure_command(PACKED, CPConfig("ring", 2, layout="doc_whole"))
    assert "--documents 16,32,48" in command and command.endswith("--layout doc_whole")
    args = build_parser().parse_args(command.split()[1:])
    assert (args.layout, args.documents, args.strategies, args.ranks) == ("doc_whole", (16, 32, 48),
                                                                           ("ring",), (2,))


def test_measure_refuses_a_layout_the_mask_cannot_use_before_anything_runs(cptune_here):
    result = cptune_here("measure", "--seq-len", "64", "--ranks", "2", "--strategies", "ring",
                         "--layout", "doc_whole")
    assert_refused(result, "layout doc_whole", "packs none (--documents)")
    graph = cptune_here("export-graph", "--seq-len", "64", "--heads", "4", "--head-dim", "16",
                        "--strategy", "ring", "--ranks", "2", "--layout", "doc_whole", "-o", "unwritten")
    assert_refused(graph, "whole documents cannot run", "layouts that fit: contiguous, zigzag, striped")


def test_the_flags_of_a_masked_workload_read_back_as_it(cptune_here):
    """``Workload.flags`` (what a printed command is made of) and the parser agree."""
    from cptune.cli import build_parser
    from cptune.cli._common import workload_of

    for workload in (PACKED, Workload(64, 4, 16, causal=True, window=(8, 0), sinks=2),
                     Workload(64, 4, 16, text=8), Workload(64, 4, 16, documents=16)):
        args = build_parser().parse_args(["measure", *workload.flags()])
        assert workload_of(args, args.seq_len) == workload


# --------------------------------------------------------------------------- the search's space


def test_layouts_are_a_conditional_parameter_only_where_the_mask_offers_several():
    configs = enumerate_configs(PACKED, 2)
    ring = CPConfig("ring", 2)
    assert len(layout_choices(PACKED, ring)) > 1
    assert {c.layout for c in configs if c.with_layout(None) == ring} == set(layout_choices(PACKED, ring))
    tree = tree_of(configs)
    assert tree["ring"][2][1][0] == "default" and len(tree["ring"][2][1]) == len(layout_choices(PACKED, ring))
    assert tree["ring"][1] == {1: ["default"]}  # one rank: no layout to choose
    for config in configs:
        params = params_of(config, tree)
        assert config_of(params) == config
        assert set(params) == set(distributions(tree, config))
        assert any(key.startswith("layout|") for key in params) == (len(tree[config.strategy][config.ranks]
                                                                        [config.head_group]) > 1)
    # Optuna's exhaustive sampler over the conditional space reaches every configuration once
    seen = []

    def objective(trial):
        seen.append(suggest(trial, tree))
        return 1.0

    with pytest.warns(optuna.exceptions.ExperimentalWarning):
        sampler = optuna.samplers.BruteForceSampler(seed=0)
    optuna.create_study(sampler=sampler).optimize(objective, n_trials=len(configs))
    assert sorted(seen, key=str) == sorted(configs, key=str)


def test_the_guided_order_reaches_each_layout_by_its_prediction():
    configs = enumerate_configs(PACKED, 2)
    doc_whole = CPConfig("ring", 2, layout="doc_whole")
    truth = {c: 10.0 + i for i, c in enumerate(configs)} | {doc_whole: 1.0}
    predictions = {c: candidate(c, 10.0 + i, 9.0 + i, 11.0 + i) for i, c in enumerate(configs)}
    predictions[doc_whole] = candidate(doc_whole, 1.0, 0.9, 1.1)
    order, _, _ = replay(truth, predictions)
    assert order[0] == doc_whole  # the layout predicted fastest is tried first
    assert set(order) <= set(configs)


def test_a_search_of_a_packed_workload_stores_each_layout_and_resumes(tmp_path, monkeypatch):
    """Every layout the mask offers is visited and stored under it, the stored study's
    trials carry it, and a rerun finds them all measured."""
    def fake(workload, config, **_):
        return measurement(workload, config, 5.0 if config.layout == "doc_whole" else 10.0 + config.ranks)

    stand_in_measuring(monkeypatch, fake)
    configs = enumerate_configs(PACKED, 2)
    with Store(str(tmp_path / "s.db")) as store:
        storage = optuna.storages.InMemoryStorage()
        visits = WorkloadSearch(PACKED, configs, store, this_host(), warmup=0, repeats=1, rounds=1,
                                race_rounds=0, study_storage=storage).run()
        assert {v.config for v in visits} == set(configs)
        stored = store.results(workload=PACKED)
        assert {r.config for r in stored} == set(configs)
        assert all(r.workload == PACKED for r in stored)
        unpacked = Workload(seq_len=96, heads=4, head_dim=16, dtype="fp32", causal=True)
        assert store.results(workload=unpacked) == []  # the same layer unpacked: another workload
        assert WorkloadSearch(PACKED, configs, store, this_host(), warmup=0, repeats=1, rounds=1,
                              race_rounds=0).run() == []
        for row in stored:
            assert view_trial(row).params == row.config.to_dict()  # the layout where it is not the default
        offered = set(layout_choices(PACKED, CPConfig("ring", 2)))
        assert {view_trial(row).params.get("layout") for row in stored} == offered


@pytest.mark.slow
def test_a_packed_workload_searched_on_real_ranks_stores_each_layouts_clean_run(tmp_path):
    """Two configurations that differ only in their layout, on two mpi ranks: each checked
    against the reference with the mask and stored under its own layout."""
    configs = [CPConfig("ring", 2), CPConfig("ring", 2, layout="doc_whole")]
    with Store(str(tmp_path / "real.db")) as store:
        visits = WorkloadSearch(PACKED, configs, store, this_host(), warmup=0, repeats=1, rounds=1,
                                race_rounds=0).run()
        assert {v.config for v in visits} == set(configs) and all(v.status == "ok" for v in visits)
        assert {r.config for r in store.results(workload=PACKED) if r.clean} == set(configs)


# --------------------------------------------------------------------------- the model's features


def test_masked_rows_are_workloads_of_their_own_and_their_features_are_finite():
    import numpy as np

    from conftest import make_calibration
    from cptune.model import CalibratedProfile, Case
    from cptune.model._cost_model import features

    plain = Workload(seq_len=96, heads=4, head_dim=16, dtype="fp32", causal=True)
    assert plain != PACKED and plain.shape != PACKED.shape and hash(plain) != hash(PACKED)
    profile = CalibratedProfile(this_host(), make_calibration(2))
    cases = [Case(plain, CPConfig("ring", 2), profile), Case(PACKED, CPConfig("ring", 2), profile),
             Case(PACKED, CPConfig("ring", 2, layout="doc_whole"), profile)]
    rows = features(cases, [case.prior() for case in cases])
    assert np.isfinite(rows).all()
    assert not np.array_equal(rows[0], rows[1])  # the mask tells a packed row from a plain one
    assert not np.array_equal(rows[1], rows[2])  # ... and the layout one layout from another
    assert len({case.shape for case in cases}) == 3


def test_a_results_listing_shows_the_mask_and_the_layout(cptune_here, tmp_path):
    db = tmp_path / "r.db"
    with Store(str(db)) as store:
        store.add_measurement(this_host(), measurement(PACKED, CPConfig("ring", 2, layout="doc_whole"), 2.0))
        windowed = Workload(seq_len=96, heads=4, head_dim=16, causal=True, window=(8, 0), sinks=2)
        store.add_measurement(this_host(), measurement(windowed, CPConfig("ring", 2), 3.0))
    listed = cptune_here("results", "--db", db)
    assert listed.returncode == 0, listed.stderr
    words = listed.stdout.split()
    assert "ring+doc_whole" in words and "docs" in words and "(16-48)" in words  # the mask under the config
    assert "window" in words and "+2" in words and "sinks" in words
    rows = json.loads(cptune_here("results", "--db", db, "--json").stdout)
    assert (rows[0]["documents"], rows[0]["layout"]) == ([16, 32, 48], "doc_whole")
    assert (rows[1]["window"], rows[1]["sinks"], rows[1]["layout"]) == ([8, 0], 2, None)
    table = cptune_here("results", "--db", db, "--csv").stdout.splitlines()
    assert '"[16, 32, 48]"' in table[1] and "doc_whole" in table[1]


# --------------------------------------------------------------------------- plans


def test_a_plan_carries_the_mask_and_each_buckets_layout_and_loads_back(tmp_path):
    import jsonschema

    from conftest import make_calibration
    from cptune.plans import PlanMismatchError, load_plan, plan_schema
    from cptune.plans.export import export_plan

    db = str(tmp_path / "p.db")
    fastest = CPConfig("ring", 2, layout="doc_whole")
    with Store(db) as store:
        store.add_calibration(this_host(), make_calibration(2))
        for i, config in enumerate(enumerate_configs(PACKED, 2)):
            ms = 1.0 if config == fastest else 5.0 + i
            store.add_measurement(this_host(), measurement(PACKED, config, ms))
    plan = export_plan([PACKED], db=db)
    assert plan.shape == PACKED.shape and plan.buckets[0].config == fastest
    path = plan.write(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    jsonschema.validate(data, plan_schema(), cls=jsonschema.Draft202012Validator)
    assert data["shape"]["documents"] == [16, 32, 48]
    assert data["buckets"][0]["config"]["layout"] == "doc_whole"
    assert data["buckets"][0]["label"] == "ring+doc_whole"
    loaded = load_plan(path)
    assert loaded.shape == PACKED.shape and loaded.select(PACKED) == fastest
    with pytest.raises(PlanMismatchError, match="documents"):
        loaded.select(Workload(seq_len=96, heads=4, head_dim=16, dtype="fp32", causal=True))


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["shape"].update(window=[4, 1, 2]), "window"),
    (lambda d: d["shape"].update(sinks=-1), "sinks"),
    (lambda d: d["shape"].update(documents=[]), "documents"),
    (lambda d: d["buckets"][0]["config"].update(layout="diagonal"), "layout"),
])
def test_the_plan_schema_bounds_the_mask_and_the_layout(edit, fragment):
    import jsonschema

    from cptune.plans import plan_schema

    schema = plan_schema()
    shape = schema["properties"]["shape"]["properties"]
    assert set(shape) >= {"window", "sinks", "documents", "text"}
    assert shape["documents"]["oneOf"][0]["maxItems"] == MAX_DOCUMENTS
    assert schema["$defs"]["config"]["properties"]["layout"]["enum"] == list(LAYOUTS)
    data = {"shape": {"heads": 4, "kv_heads": 4, "head_dim": 16, "batch": 1, "dtype": "bf16",
                      "causal": False},
            "buckets": [{"config": {"strategy": "ring", "ranks": 2, "head_group": 1}}]}
    edit(data)
    part = {"type": "object", "properties": {
        "shape": schema["properties"]["shape"],
        "buckets": {"type": "array", "items": {"type": "object",
                                               "properties": {"config": schema["$defs"]["config"]}}}},
        "$defs": schema["$defs"]}
    with pytest.raises(jsonschema.ValidationError) as refused:
        jsonschema.validate(data, part, cls=jsonschema.Draft202012Validator)
    assert fragment in str(list(refused.value.absolute_path)) + refused.value.message


def test_a_report_draws_each_mask_and_layout_apart():
    from cptune.report._data import family, slug

    shapes = [Workload(96, 4, 16, causal=True).shape, PACKED.shape,
              Workload(96, 4, 16, causal=True, documents=(48, 32, 16)).shape,
              Workload(96, 4, 16, causal=True, window=(8, 0), sinks=2).shape,
              Workload(96, 4, 16, text=8).shape,
              Workload(96, 4, 16, causal=True, mode="train").shape]
    names = [slug(shape) for shape in shapes]
    assert names[0] == "4x16-bf16-causal" and len(set(names)) == len(names)
    assert all(name.replace("-", "").replace("x", "").isalnum() for name in names)  # a file name's part
    assert family(CPConfig("ring", 2, layout="doc_whole")) == "ring+doc_whole" != family(CPConfig("ring", 2))
