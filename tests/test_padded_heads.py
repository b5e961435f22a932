"""Issue 56, item 2's last clause: heads a head group does not divide run padded (zero heads
appended before Ulysses' exchange, computed and moved as real ones, dropped after it), a
configuration of their own (``CPConfig.pad_heads``) that feasibility, the enumeration, the
cost counts, the store, the search's space and the engines all read."""

from __future__ import annotations

import dataclasses

import pytest

import cptune
from cptune import CPConfig, Workload, analytic_cost
from cptune.engines import ENGINES, NodeVerdict, UnpaddedEngineError, check_runs, get_engine
from cptune.feasibility import enumerate_configs, feasibility, head_groups_that_fit
from cptune.layout import heads_as_run, padded_heads
from cptune.model._prior import computed_flops
from cptune.reference import (
    make_inputs,
    make_output_gradient,
    reference_attention,
    reference_gradients,
    relative_error,
)

SIX = Workload(37, 6, 8, dtype="fp32", causal=True)
PADDED = CPConfig("ulysses", 4, pad_heads=True)


def test_a_padded_configuration_round_trips_through_its_label_dict_and_hash():
    assert PADDED.label == "ulysses+padded" and PADDED.describe() == "Ulysses on 4 ranks, heads padded"
    assert CPConfig("ring", 4, 2, "contiguous", True).label == "ulysses2xring2+contiguous+padded"
    assert PADDED.to_dict() == {"strategy": "ulysses", "ranks": 4, "head_group": 4, "pad_heads": True}
    assert "pad_heads" not in CPConfig("ulysses", 4).to_dict()  # reads as before padded heads existed
    assert CPConfig(**PADDED.to_dict()) == PADDED and CPConfig("ulysses", 4) != PADDED
    assert len({PADDED, CPConfig("ulysses", 4)}) == 2
    assert PADDED.with_layout("zigzag").pad_heads and not PADDED.with_padded_heads(False).pad_heads
    with pytest.raises(ValueError, match="pad_heads must be True or False"):
        CPConfig("ulysses", 4, pad_heads=1)  # type: ignore[arg-type]


def test_heads_the_head_group_does_not_divide_run_only_padded_and_each_refusal_is_one_line():
    (unpadded,) = feasibility(SIX, CPConfig("ulysses", 4))
    assert unpadded.startswith("Ulysses limit: 6 heads") and "pad them to 8" in unpadded
    assert "33% more attention work" in unpadded
    assert feasibility(SIX, PADDED) == []
    (nothing,) = feasibility(SIX, CPConfig("ulysses", 3, pad_heads=True))
    assert "pads nothing" in nothing and "drop pad_heads" in nothing
    assert "larger than the 6 heads" in feasibility(SIX, CPConfig("ulysses", 8, pad_heads=True))[0]
    # GQA: 24 heads in groups of 3 per KV head padded to 32 are not whole groups
    gqa = Workload(64, 24, 8, kv_heads=8)
    (shifted,) = feasibility(gqa, CPConfig("ulysses", 16, pad_heads=True))
    assert "not whole groups of 3 query heads per KV head" in shifted
    # ... but 6 heads in groups of 2 padded to 8 are: 4 KV heads, one per rank
    assert padded_heads(dataclasses.replace(SIX, kv_heads=3), PADDED) == (8, 4)
    assert feasibility(dataclasses.replace(SIX, kv_heads=3), PADDED) == []
    assert padded_heads(dataclasses.replace(SIX, kv_heads=1), PADDED) == (8, 1)  # MQA keeps its KV head
    assert padded_heads(SIX, PADDED) == (8, 8)  # MHA pads K/V the same
    # unpadded where padding cannot help either: both reasons in the one line
    (neither,) = feasibility(gqa, CPConfig("ulysses", 16))
    assert neither.startswith("Ulysses limit: 24 heads cannot be split")
    assert "nor padded (pad_heads: 24 heads padded to 32 are not whole groups" in neither
    refused = (CPConfig("ulysses", 4), *(CPConfig("ulysses", u, pad_heads=True) for u in (3, 8)))
    assert all(len(feasibility(SIX, c)) == 1 for c in refused)


def test_the_enumeration_offers_fluxs_24_heads_a_head_group_of_16_padded_to_32():
    flux = Workload(4096, 24, 128, dtype="bf16")
    assert 16 in head_groups_that_fit(flux, 16) and 24 not in head_groups_that_fit(flux, 16)
    configs = enumerate_configs(flux, 32)
    assert CPConfig("ring", 32, 16, pad_heads=True) in configs
    assert CPConfig("ulysses", 16, pad_heads=True) in configs
    assert CPConfig("ulysses", 8) in configs  # a dividing head group is never padded
    assert all(c.pad_heads == bool(24 % c.head_group) for c in configs)
    assert all(not feasibility(flux, c) for c in configs)


def test_padded_heads_are_counted_as_the_work_and_traffic_of_real_heads():
    """The padded configuration counts exactly what the same configuration counts on a workload
    of the padded head count, which is (padded heads / heads) x what its real heads would cost:
    per-head counts are linear, so 8 heads on 4 cost twice 4 heads on 4, and 6 real heads'
    share of that is 6/8."""
    for mode in ("forward", "train"):
        six, eight, four = (Workload(4096, h, 64, mode=mode, causal=True) for h in (6, 8, 4))
        padded = analytic_cost(six, PADDED)
        plain, quarter = (analytic_cost(w, CPConfig("ulysses", 4)) for w in (eight, four))
        assert padded.flops == plain.flops == 2 * quarter.flops
        assert padded.flops == pytest.approx(8 / 6 * (6 / 4 * quarter.flops))  # padded / real heads
        assert padded.bytes_sent == plain.bytes_sent
        sent = quarter.bytes_sent["all_to_all"]
        assert padded.bytes_sent["all_to_all"] == pytest.approx(8 / 6 * (6 / 4 * sent))
        assert padded.peak_bytes == plain.peak_bytes
        assert computed_flops(six, PADDED, "fused") == computed_flops(eight, CPConfig("ulysses", 4), "fused")
    assert heads_as_run(SIX, CPConfig("ulysses", 2)) is SIX  # unpadded: the workload itself


def test_the_store_reads_padded_heads_back_from_the_workloads_heads_without_a_column(tmp_path):
    from cptune.hardware import Hardware
    from cptune.store import Store

    hardware = Hardware(host="h1", cpu_model="test cpu", cpu_count=2, gpu_model=None, gpu_count=0,
                        interconnect="shared memory (one host)", mpi_library="MPICH 5")
    with Store(str(tmp_path / "results.db")) as store:
        store.add_failure(hardware, SIX, PADDED, "timeout", "rank 1 hung", "mpi")
        store.add_failure(hardware, SIX, CPConfig("ulysses", 2), "crash", "rank 0 died", "mpi")
        (padded, plain) = store.results()
        assert padded.config == PADDED and plain.config == CPConfig("ulysses", 2)
        assert padded.to_dict()["pad_heads"] is True and plain.to_dict()["pad_heads"] is False


def test_the_search_space_holds_padded_heads_as_a_conditional_parameter_of_one_value():
    import optuna

    from cptune.search._trials import config_of, distributions, params_of, suggest, tree_of

    configs = enumerate_configs(SIX, 4)
    tree = tree_of(configs)
    assert params_of(PADDED, tree)["pad_heads|ulysses|4|4"] is True
    assert "pad_heads|ulysses|2|2" not in params_of(CPConfig("ulysses", 2), tree)
    assert config_of(params_of(PADDED, tree)) == PADDED
    assert set(distributions(tree, PADDED)) >= {"pad_heads|ulysses|4|4"}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = {suggest(study.ask(), tree) for _ in range(60)}
    assert PADDED in seen and seen <= set(configs)


def test_engines_that_do_not_pad_heads_refuse_in_one_line():
    with pytest.raises(UnpaddedEngineError, match="the tensorrt engine's graphs do not pad heads"):
        check_runs(ENGINES["tensorrt"], SIX, PADDED)
    check_runs(ENGINES["mpi"], SIX, PADDED)  # mpi, torch and onnx pad them
    assert "pads heads" in (NodeVerdict(4, ()).refuses(SIX, PADDED) or "")


def _errors(workload: Workload, config: CPConfig, engine: str, ran_as: Workload | None = None) -> float:
    """The largest error over the output (and dQ, dK, dV in training) against the float64
    reference of ``workload``, over the engine's tolerance; ``ran_as``: the workload the engine runs."""
    run = ran_as or workload
    q, k, v = make_inputs(workload, seed=7)
    if workload.training:
        dout = make_output_gradient(workload, seed=7)
        got = cptune.compute_gradients(run, config, q, k, v, dout, backend=engine)
        expected = (reference_attention(workload, q, k, v), *reference_gradients(workload, q, k, v, dout))
    else:
        got = (cptune.compute(run, config, q, k, v, backend=engine),)
        expected = (reference_attention(workload, q, k, v),)
    tolerance = get_engine(engine).tolerance[workload.dtype]
    return max(relative_error(g, e) for g, e in zip(got, expected, strict=True)) / tolerance


#: 6 heads on a head group of 4 (pure Ulysses) and 3 heads on 2 (a hybrid: 2-way Ulysses x
#: 2-way Ring or AllGather-KV), MHA and MQA, forward and training.
HYBRIDS = (CPConfig("ring", 4, 2, pad_heads=True), CPConfig("allgather_kv", 4, 2, pad_heads=True))
CASES = [(heads, kv, mode, config) for heads, config in ((6, PADDED), *((3, c) for c in HYBRIDS))
         for kv in (heads, 1) for mode in ("forward", "train")]


@pytest.mark.parametrize("engine", ["mpi", "torch"])
def test_padded_heads_match_the_reference_and_a_perturbed_mask_is_caught(engine):
    if engine == "torch":
        pytest.importorskip("torch")
    for heads, kv, mode, config in CASES:
        workload = Workload(37, heads, 8, kv_heads=kv, dtype="fp32", mode=mode, causal=True)
        assert not feasibility(workload, config)
        assert _errors(workload, config, engine) <= 1, (heads, kv, mode, config.label)
    causal = Workload(37, 6, 8, kv_heads=1, dtype="fp32", mode="train", causal=True)
    assert _errors(causal, PADDED, engine, ran_as=dataclasses.replace(causal, causal=False)) > 10


def test_the_onnx_graphs_pad_heads():
    pytest.importorskip("onnx")
    for kv in (6, 1, 3):
        assert _errors(dataclasses.replace(SIX, kv_heads=kv), PADDED, "onnx") <= 1


def test_a_padded_family_is_a_line_of_its_own_in_its_strategys_colour_lightened():
    pytest.importorskip("matplotlib")
    from cptune.report._data import family
    from cptune.report._figures import strategy_color, strategy_family

    assert family(CPConfig("ring", 8, 4, pad_heads=True)) == "ulysses4xring+padded"
    assert strategy_family("ulysses4xring2+padded") == "ulysses4xring+padded"
    names = ("ulysses", "ulysses+padded", "ulysses4xring", "ulysses4xring+padded")
    colours = {strategy_color(name) for name in names}
    assert len(colours) == 4 and strategy_color("ulysses+padded") != "#9e9e9e"  # none unknown grey


def test_no_frameworks_settings_spell_padded_heads_yet():
    from cptune.frameworks import FRAMEWORKS

    for framework in FRAMEWORKS.values():
        assert "padded heads" in (framework.refusal(SIX.shape, PADDED) or ""), framework.name
