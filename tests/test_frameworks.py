"""cptune export / recommend / search --for: what each framework can run, how its settings are
spelled (checked against the real package where it installs here, and against its released
source elsewhere: tests/framework_sources/), which ranks its own rule groups (against
cptune.layout), and what a substitution costs."""

import inspect
import json
import re
from pathlib import Path

import pytest

from conftest import TESTS, assert_refused, torchrun_summary
from cptune.config import STRATEGIES, CPConfig
from cptune.cost import MERGE_FP32_PASSES, MERGE_KERNELS, analytic_cost, block_calls
from cptune.feasibility import enumerate_configs
from cptune.frameworks import FRAMEWORKS, FrameworkError, choose, for_framework, get_framework, pricer
from cptune.layout import rank_groups
from cptune.model import hardware_profile, price_as_run, prior_as_run, prior_time
from cptune.plans import Alternative, Bucket, Plan, load_plan
from cptune.plans.export import export_plan
from cptune.workload import AttentionShape

#: FLUX.1-dev's joint attention at 1024x1024 (24 heads x 128, 4096 image + 512 text tokens
#: = 4,608; 16,896 at 2048x2048) and a Llama-3.1-8B prefill (32 query / 8 KV heads x 128, causal).
FLUX = AttentionShape(heads=24, kv_heads=24, head_dim=128, batch=1, dtype="bf16", causal=False)
LLAMA = AttentionShape(heads=32, kv_heads=8, head_dim=128, batch=1, dtype="bf16", causal=True)
ODD = AttentionShape(heads=6, kv_heads=3, head_dim=64, batch=1, dtype="bf16", causal=False)
SHAPES = {"flux": FLUX, "llama": LLAMA, "odd": ODD}
SOURCES = TESTS / "framework_sources"


def configs(shape: AttentionShape, max_ranks: int = 8) -> list[CPConfig]:
    """Every configuration cptune can run for ``shape`` on 2..``max_ranks`` ranks."""
    return [c for c in enumerate_configs(shape.at(16896), max_ranks, STRATEGIES) if c.ranks > 1]


# --------------------------------------------------------------------------- limits


#: What each framework cannot run (from its source: docs/frameworks.md), as a rule over
#: (shape, config), written apart from cptune.frameworks.
def _no_allgather(c: CPConfig) -> bool:
    return c.strategy == "allgather_kv" and c.context_degree > 1


def _ulysses_allgather(c: CPConfig) -> bool:
    return c.strategy == "allgather_kv" and c.head_group > 1


def _kv_unsplit(s: AttentionShape, c: CPConfig) -> bool:
    return s.kv_heads % c.head_group > 0


def _te_odd_a2a(s: AttentionShape, c: CPConfig) -> bool:
    """TransformerEngine's fused backend off for a2a with odd heads or KV heads (utils.py)."""
    return c.head_group > 1 and (s.heads % 2 > 0 or s.kv_heads % 2 > 0)


CANNOT = {
    "diffusers": lambda s, c: s.causal or s.kv_heads != s.heads
    or (c.strategy == "ring" and c.context_degree > 1),
    "xdit": lambda s, c: s.causal or _no_allgather(c) or _kv_unsplit(s, c),
    "yunchang": lambda s, c: _no_allgather(c) or _kv_unsplit(s, c),
    "sglang": lambda s, c: (_no_allgather(c) and (c.head_group > 1 or s.causal))
    or (c.strategy != "allgather_kv" and _kv_unsplit(s, c)),
    "vllm-omni": lambda s, c: _no_allgather(c) or _kv_unsplit(s, c),
    "transformer-engine": lambda s, c: _ulysses_allgather(c) or _te_odd_a2a(s, c) or _kv_unsplit(s, c),
    "megatron": lambda s, c: _ulysses_allgather(c) or _te_odd_a2a(s, c) or _kv_unsplit(s, c),
}



@pytest.mark.parametrize("name", FRAMEWORKS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_a_configuration_a_framework_cannot_run_is_never_spelled(name, shape):
    framework = get_framework(name)
    for config in configs(shape):
        reason = framework.refusal(shape, config)
        # padded heads are cptune's own: no framework's settings spell them yet
        cannot = config.pad_heads or CANNOT[name](shape, config)
        assert (reason is not None) == cannot, (config.label, reason)
        if reason:
            with pytest.raises(FrameworkError, match=re.escape(reason)):
                framework.spell(shape, config)
        else:
            assert framework.spell(shape, config).settings
    assert framework.refusal(shape, CPConfig("ring", 1)) is None  # one rank: plain attention anywhere


def test_the_limits_the_issue_names():
    flux, llama = FLUX, LLAMA
    assert "AllGather-KV, not Ring" in FRAMEWORKS["diffusers"].refusal(flux, CPConfig("ring", 8))
    assert FRAMEWORKS["diffusers"].refusal(flux, CPConfig("allgather_kv", 8)) is None  # its ring_degree
    assert "causal" in FRAMEWORKS["diffusers"].refusal(llama, CPConfig("ulysses", 8))
    assert "causal" in FRAMEWORKS["sglang"].refusal(llama, CPConfig("allgather_kv", 8))
    assert "does not compose" in FRAMEWORKS["sglang"].refusal(flux, CPConfig("allgather_kv", 8, 2))
    assert FRAMEWORKS["sglang"].spell(flux, CPConfig("allgather_kv", 8)).settings["kv_gather_degree"] == 8
    assert "no AllGather-KV" in FRAMEWORKS["vllm-omni"].refusal(flux, CPConfig("allgather_kv", 8))
    assert "no Ulysses x AllGather-KV" in FRAMEWORKS["megatron"].refusal(llama,
                                                                         CPConfig("allgather_kv", 8, 2))


# --------------------------------------------------------------------------- rank order


def _consecutive_ulysses(u: int, c: int, world: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """yunchang's set_seq_parallel_pg with use_ulysses_low=True (yunchang/globals.py), which
    xDiT calls as it is, and SGLang's and vLLM-Omni's own copies (over their SP group's ranks):
    Ulysses ``range(i*u, (i+1)*u)``, ring ``range(i, sp, u)``."""
    return [world[i * u:(i + 1) * u] for i in range(c)], [world[i::u] for i in range(u)]


def _diffusers_mesh(u: int, c: int, world: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """diffusers' mesh: init_device_mesh(mesh_shape=(ring, ulysses)), row-major."""
    grid = [world[i * u:(i + 1) * u] for i in range(c)]
    return grid, [list(column) for column in zip(*grid, strict=True)]


def _te_cp_global_ranks(u: int, c: int, world: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """TransformerEngine's a2a+p2p: ``cp_global_ranks[p2p_rank * a2a_size + a2a_rank]``
    (context_parallel.py)."""
    return ([[world[p * u + a] for a in range(u)] for p in range(c)],
            [[world[p * u + a] for p in range(c)] for a in range(u)])


def _megatron_hierarchy(u: int, c: int, world: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Megatron's create_hierarchical_groups with sizes [u, c]: level k is
    ``rearrange(ranks, "(l s u) -> (l u) s", u=prod(sizes[:k]), s=sizes[k], l=prod(sizes[k+1:]))``."""
    def level(inner: int, size: int, outer: int) -> list[list[int]]:
        return [[world[(ol * size + s) * inner + ui] for s in range(size)]
                for ol in range(outer) for ui in range(inner)]
    return level(1, u, c), level(u, c, 1)


RULES = {"diffusers": _diffusers_mesh, "xdit": _consecutive_ulysses, "yunchang": _consecutive_ulysses,
         "sglang": _consecutive_ulysses, "vllm-omni": _consecutive_ulysses,
         "transformer-engine": _te_cp_global_ranks, "megatron": _megatron_hierarchy}


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_each_framework_groups_the_ranks_cptune_measured(name):
    """Each framework's own rule, with the degrees its export names, puts on the same ranks
    the head groups and context groups cptune's layout measured (world = the ranks 0..n-1)."""
    checked = 0
    for shape in (FLUX, LLAMA):
        for config in configs(shape):
            if get_framework(name).refusal(shape, config):
                continue
            world = list(range(config.ranks))
            ulysses, context = RULES[name](config.head_group, config.context_degree, world)
            heads, across = rank_groups(config)
            assert sorted(map(tuple, ulysses)) == sorted(heads)
            assert sorted(map(tuple, context)) == sorted(across)
            checked += 1
    assert checked >= 10


# --------------------------------------------------------------------------- names against the source


def _source(name: str) -> str:
    return (SOURCES / f"{name}.txt").read_text(encoding="utf-8")


def _flags(line: str) -> list[str]:
    return re.findall(r"--[a-z_-]+", line)


@pytest.mark.parametrize("name, defines", [
    ("xdit", lambda flag, text: f'"{flag}",' in text),
    ("sglang", lambda flag, text: f'"{flag}",' in text),
    ("vllm-omni", lambda flag, text: f'"{flag}",' in text),
    # Megatron's --context-parallel-size and --hierarchical-...: "--" + field.replace("_", "-")
    # of ModelParallelConfig's fields (argument_utils.py); --cp-comm-type: its own add_argument
    ("megatron", lambda flag, text: f"'{flag}'" in text or f"    {flag[2:].replace('-', '_')}: " in text),
])
def test_every_flag_a_framework_export_spells_is_defined_in_its_released_source(name, defines):
    text = _source(name)
    shapes = [FLUX] if name in ("xdit", "sglang", "vllm-omni") else [FLUX, LLAMA]
    spelled = set()
    for shape in shapes:
        for config in configs(shape):
            if get_framework(name).refusal(shape, config) is None:
                spelled |= set(_flags(get_framework(name).spell(shape, config).code))
    assert spelled and all(defines(flag, text) for flag in spelled), spelled
    if name == "sglang":  # the backend its ring needs is one it names
        assert '"fa"' in text.split("RING_CAPABLE_ATTENTION_BACKENDS")[1].splitlines()[0]


@pytest.mark.parametrize("name", ["transformer-engine", "megatron"])
def test_every_comm_type_spelled_is_one_transformer_engine_takes(name):
    te = _source("transformer-engine")
    taken = set(re.findall(r'``"([a-z_+0-9]+)"``', te.split("cp_comm_type : str")[1]))
    assert taken == {"p2p", "all_gather", "a2a", "a2a+p2p"}
    for word in ("num_attention_heads", "kv_channels", "num_gqa_groups", "attn_mask_type", "cp_global_ranks",
                 "cp_stream"):
        assert f"{word}:" in te
    spelled = {FRAMEWORKS[name].spell(LLAMA, c).settings["cp_comm_type"]
               for c in configs(LLAMA) if FRAMEWORKS[name].refusal(LLAMA, c) is None}
    assert spelled == taken


# --------------------------------------------------------------------------- choice and cost


def _ranked(*entries: tuple[CPConfig, float]) -> list[Alternative]:
    return [Alternative(config, ms, (ms * 0.9, ms * 1.1), "prior") for config, ms in entries]


def test_a_substitution_states_its_cost_and_whether_it_is_inside_the_tie():
    ranked = _ranked((CPConfig("allgather_kv", 8), 1.0), (CPConfig("ulysses", 8), 1.05),
                     (CPConfig("ring", 8), 1.5))
    kept = choose(FRAMEWORKS["transformer-engine"], FLUX, 4608, ranked)
    assert kept.chosen.config == CPConfig("allgather_kv", 8) and kept.cost_pct == 0 and kept.within_tie
    assert kept.describe().endswith("cptune's pick")
    tied = choose(FRAMEWORKS["xdit"], FLUX, 4608, ranked, tied=[CPConfig("ulysses", 8)])
    assert tied.chosen.config == CPConfig("ulysses", 8) and tied.within_tie
    assert tied.cost_pct == pytest.approx(5.0)
    assert "+5.0%" in tied.describe() and "within the tie" in tied.describe()
    assert tied.passed_over[0][0] == CPConfig("allgather_kv", 8)
    apart = choose(FRAMEWORKS["xdit"], FLUX, 4608, ranked)
    assert not apart.within_tie and "outside the tie" in apart.describe()


def test_a_length_a_framework_can_express_nothing_of_names_the_frameworks_that_can():
    ranked = _ranked((CPConfig("ulysses", 8), 1.0), (CPConfig("ring", 8), 1.2))
    with pytest.raises(FrameworkError, match=r"diffusers runs none of the 2 configuration\(s\).*causal.*"
                                             r"yunchang.*transformer-engine.*megatron run cptune's pick"):
        choose(FRAMEWORKS["diffusers"], LLAMA, 131072, ranked)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_exports_for_flux_and_llama_on_h100_take_the_fastest_configuration_each_framework_runs(name):
    framework = get_framework(name)
    for shape, lengths in ((FLUX, (4608, 16896)), (LLAMA, (32768, 131072))):
        plan = export_plan([shape.at(n) for n in lengths], hardware="h100-sxm-8")
        framed = for_framework(plan, name)
        if all(framework.refusal(shape, c) for c in configs(shape)):  # one rank, plain attention
            assert all(b.substitution.chosen.config.ranks == 1 and b.substitution.cost_pct > 100
                       for b in framed.buckets)
            on_eight = export_plan([shape.at(n) for n in lengths], ranks=8, hardware="h100-sxm-8")
            with pytest.raises(FrameworkError, match="runs none of"):
                for_framework(on_eight, name)
        profile = hardware_profile("h100-sxm-8")
        for entry, bucket in zip(framed.buckets, plan.buckets, strict=True):
            chosen = entry.substitution.chosen
            assert framework.refusal(shape, chosen.config) is None
            ranked = [Alternative(bucket.config, bucket.latency_ms, bucket.interval_ms, bucket.source),
                      *bucket.alternatives]
            for option in ranked:  # nothing it runs is faster, as it runs it
                if framework.refusal(shape, option.config) is None:
                    assert _as_run(framework, shape, bucket, option, profile)[0] >= chosen.latency_ms - 1e-9
            assert entry.substitution.cost_pct >= 0
            if entry.substitution.as_cptune_runs:
                assert entry.substitution.within_tie == (chosen.config in (bucket.config, *bucket.tied))
            else:
                assert entry.substitution.within_tie == _as_run(framework, shape, bucket, chosen, profile)[1]
        assert json.loads(json.dumps(framed.to_dict()))["framework"] == name


def _as_run(framework, shape, bucket, option, profile) -> tuple[float, bool]:
    """``option``'s latency as ``framework`` runs it, and whether that is tied with the pick:
    the plan's own where the framework runs it as cptune does, else the prior of what runs."""
    runs = framework.runs(shape, option.config, bucket.seq_len)
    if runs.same_as(option.config):
        return option.latency_ms, option.config in (bucket.config, *bucket.tied)
    priced = price_as_run(shape.at(bucket.seq_len), runs.config, profile, runs.per_block_calls, bucket.config)
    return priced.latency_ms, priced.tied_with_pick


def test_a_plan_file_keeps_its_ranking_so_a_framework_reads_the_same_choice_from_it(tmp_path):
    plan = export_plan([FLUX.at(4608), FLUX.at(16896)], hardware="h100-sxm-8")
    assert all(b.alternatives for b in plan.buckets)
    path = plan.write(tmp_path / "plan.json")
    loaded = load_plan(path, hardware="h100-sxm-8")
    assert loaded.buckets == plan.buckets
    for name in FRAMEWORKS:
        assert for_framework(loaded, name).to_dict() == for_framework(plan, name).to_dict()
    older = Plan(plan.hardware, plan.shape,
                 tuple(Bucket(b.min_seq_len, b.max_seq_len, b.seq_len, b.config, b.latency_ms, b.interval_ms,
                              b.source, b.measurement_ids, b.tied) for b in plan.buckets),
                 plan.launch, plan.cptune_version, plan.created_at)
    kept = for_framework(older, "transformer-engine").buckets[0].substitution.chosen
    assert kept.config == plan.buckets[0].config


def test_a_plan_measured_by_an_engine_a_framework_does_not_run_is_refused():
    plan = export_plan([FLUX.at(4608)], hardware="h100-sxm-8")
    host = Plan(type(plan.hardware)("0123456789abcdef", "a host", "host", None, "mpi"), plan.shape,
                plan.buckets, plan.launch, plan.cptune_version, plan.created_at)
    with pytest.raises(FrameworkError, match="mpi engine.*--backend torch"):
        for_framework(host, "yunchang")


# --------------------------------------------------------------------------- what each framework runs


#: Wan2.1-14B's self-attention (40 heads x 128; 32,760 tokens at 480p, 75,600 at 720p) and a
#: causal GQA prefill (64 query / 8 KV heads x 128).
WAN = AttentionShape(heads=40, kv_heads=40, head_dim=128, batch=1, dtype="bf16", causal=False)
GQA = AttentionShape(heads=64, kv_heads=8, head_dim=128, batch=1, dtype="bf16", causal=True)


def test_xdit_and_sglang_rings_are_torchs_templated_ring_without_load_balance():
    xdit, sglang = _source("xdit"), _source("sglang")
    for line in ("from xfuser.model_executor.layers.usp import USP", "import _templated_ring_attention",
                 "_cp_options.enable_load_balance = False", "out = ring_attn("):
        assert line in xdit, line
    for line in ("_cp_options.enable_load_balance = False", "_templated_ring_attention(", "out = ring_attn(",
                 "and not self.causal", "shard.num_pad == 0"):
        assert line in sglang, line
    ring = CPConfig("ring", 8, 2)
    for name in ("xdit", "sglang"):
        runs = FRAMEWORKS[name].runs(WAN, ring, 32760)
        assert runs.per_block_calls and runs.config == CPConfig("allgather_kv", 8, 2), name
        assert "all-gather" in runs.what and "4 calls" in runs.what
    assert FRAMEWORKS["sglang"].runs(WAN, ring, 32761).same_as(ring)  # its padded shard: a p2p ring
    assert FRAMEWORKS["yunchang"].runs(WAN, ring, 32760).same_as(ring)  # yunchang's own ring is one


def test_torchs_default_rotater_gathers_all_k_v_once():
    attention = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention")
    assert type(attention._cp_options)().rotate_method.name == "ALL_GATHER"
    assert "We only need to perform allgather once." in inspect.getsource(attention._AllGatherRotater)
    assert "return _CausalBehavior.SKIP" in inspect.getsource(attention._is_causal_behavior)


def test_wan_on_l40s_exports_for_xdit_and_sglang_the_fastest_of_what_they_run():
    plan = export_plan([WAN.at(32760), WAN.at(75600)], hardware="l40s-pcie-8")
    profile = hardware_profile("l40s-pcie-8")
    for name in ("xdit", "sglang"):
        for entry, bucket in zip(for_framework(plan, name).buckets, plan.buckets, strict=True):
            assert bucket.config == CPConfig("ring", 8, 2)  # cptune's own point-to-point ring
            as_run = price_as_run(WAN.at(bucket.seq_len), CPConfig("allgather_kv", 8, 2), profile, True,
                                  bucket.config).latency_ms
            chosen = entry.substitution.chosen
            assert chosen.config == CPConfig("ulysses", 8) and chosen.latency_ms < as_run
            assert entry.substitution.passed_over[0][0] == bucket.config
            assert f"{as_run:.4g} ms as run" in entry.substitution.describe()


def test_a_causal_ring_without_load_balance_is_priced_with_its_last_rank_doing_all_blocks():
    assert "if not causal or step <= comm.rank:" in _source("vllm-omni")
    w = GQA.at(262144)
    zigzag, contiguous = CPConfig("ring", 2), CPConfig("ring", 2, layout="contiguous")
    assert analytic_cost(w, contiguous).flops == pytest.approx(1.5 * analytic_cost(w, zigzag).flops, rel=1e-4)
    assert FRAMEWORKS["vllm-omni"].runs(GQA, zigzag, w.seq_len).config == contiguous
    assert FRAMEWORKS["sglang"].runs(GQA, zigzag, w.seq_len).config == CPConfig("allgather_kv", 2,
                                                                                layout="contiguous")
    profile = hardware_profile("h100-sxm-2x8-ib")
    ranked = _ranked((zigzag, prior_time(w, zigzag, profile).total_s * 1e3),
                     (CPConfig("ring", 1), prior_time(w, CPConfig("ring", 1), profile).total_s * 1e3))
    for name in ("vllm-omni", "sglang"):
        runs = FRAMEWORKS[name].runs(GQA, zigzag, w.seq_len)
        got = choose(FRAMEWORKS[name], GQA, w.seq_len, ranked, (), pricer(w, zigzag, profile))
        assert got.chosen.config == zigzag and not got.as_cptune_runs and "r + 1" in got.runs.what
        expected = price_as_run(w, runs.config, profile, runs.per_block_calls, zigzag)
        assert got.chosen.latency_ms == pytest.approx(expected.latency_ms) and got.cost_pct > 20
        assert got.within_tie == expected.tied_with_pick and "cptune's pick" not in got.describe()
    assert choose(FRAMEWORKS["yunchang"], GQA, w.seq_len, ranked).describe().endswith("cptune's pick")


def test_an_all_gather_ring_runs_c_calls_and_c_minus_1_float32_merges():
    w, gathered = WAN.at(32760), CPConfig("allgather_kv", 8, 2)
    one = analytic_cost(w, gathered, position_calls=True)
    assert one.kernels["attention"] == 1 and one.memory_bytes["merge"] == 0
    rows = 32760 // 4 * 20  # a block's queries, on each of 40 / 2 heads
    assert block_calls(w, gathered) == (4, 3 * rows * 128 * (MERGE_FP32_PASSES * 4 + 2), 3 * MERGE_KERNELS)
    profile = hardware_profile("l40s-pcie-8")
    once, blocked = prior_time(w, gathered, profile), prior_as_run(w, gathered, profile, True)
    assert blocked.all_gather_s == once.all_gather_s and blocked.all_to_all_s == once.all_to_all_s
    extra = 3 * profile.attention_call_s + profile.launch_s * (3 + 3 * MERGE_KERNELS)
    assert blocked.compute_s + blocked.overhead_s == pytest.approx(once.compute_s + once.overhead_s + extra)
    assert blocked.memory_s == pytest.approx(once.memory_s + block_calls(w, gathered).merge_bytes
                                             / profile.description.figure("device.memory_gbps"))
    assert FRAMEWORKS["diffusers"].runs(WAN, CPConfig("allgather_kv", 8), 32760).per_block_calls
    assert not FRAMEWORKS["transformer-engine"].runs(WAN, CPConfig("allgather_kv", 8), 32760).per_block_calls
    with pytest.raises(FrameworkError, match="not priced as run"):  # no profile: passed over, never mispriced
        choose(FRAMEWORKS["diffusers"], WAN, 32760, _ranked((CPConfig("allgather_kv", 8), 1.0)))


def test_diffusers_ring_degree_gathers_once_and_merges_each_block_in_float32():
    dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
    source = inspect.getsource(dispatch.TemplatedRingAttention.forward)
    assert source.count("all_gather_tensor(") == 1 and "for i in range(world_size):" in source
    assert "out = out.to(torch.float32)" in source and "torch.nn.functional.sigmoid(lse - prev_lse)" in source


# --------------------------------------------------------------------------- launch lines and lengths


def _sixteen(name: str) -> CPConfig:
    """A 16-rank configuration framework ``name`` runs for LLAMA (FLUX for those without causal)."""
    shape = FLUX if name in ("diffusers", "xdit") else LLAMA
    return next(c for c in configs(shape, 16) if c.ranks == 16 and FRAMEWORKS[name].refusal(shape, c) is None)


@pytest.mark.parametrize("name", [n for n in FRAMEWORKS if n not in ("sglang", "vllm-omni")])
def test_a_launch_across_two_nodes_is_one_torchrun_line_per_node_its_parser_takes(name):
    run = pytest.importorskip("torch.distributed.run")
    shape = FLUX if name in ("diffusers", "xdit") else LLAMA
    config = _sixteen(name)
    lines = FRAMEWORKS[name].spell(shape, config, 131072, per_node=8).launch.splitlines()
    assert len(lines) == 2
    for node, line in enumerate(lines):
        words = line.split()
        assert words[0] == "torchrun"
        args = run.get_args_parser().parse_args(words[1:])  # torch's own parser
        assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", node)
        assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "$MASTER_ADDR:29500"
    one_node = FRAMEWORKS[name].spell(shape, config, 131072).launch
    assert one_node.startswith("torchrun --nproc-per-node=16 ")


def test_sglang_across_nodes_names_each_node_and_counts_gpus_over_all_of_them():
    text = _source("sglang")
    lines = FRAMEWORKS["sglang"].spell(LLAMA, _sixteen("sglang"), 131072, per_node=8).launch.splitlines()
    assert len(lines) == 2
    for node, line in enumerate(lines):
        assert f"--nnodes 2 --node-rank {node} --dist-init-addr $MASTER_ADDR:5000" in line
        spelled = _flags(line.split("<model>")[1])  # what follows the model: the flags cptune spells
        assert "--num-gpus 16 " in line and all(f'"{flag}",' in text for flag in spelled), spelled
    assert "--num-gpus is" in text and "the total GPU count across all nodes" in text


def test_vllm_omni_refuses_ranks_across_nodes_in_one_line():
    assert "init_distributed_environment(world_size=world_size, rank=rank)" in _source("vllm-omni")
    reason = FRAMEWORKS["vllm-omni"].placed_refusal(FLUX, CPConfig("ring", 16, 8), 16896, 8)
    assert reason is not None and "no multi-node launch" in reason
    assert FRAMEWORKS["vllm-omni"].placed_refusal(FLUX, CPConfig("ring", 8, 4), 16896, 8) is None
    ranked = _ranked((CPConfig("ring", 16, 8), 1.0), (CPConfig("ulysses", 8), 1.4))
    chosen = choose(FRAMEWORKS["vllm-omni"], FLUX, 16896, ranked, per_node=8).chosen
    assert chosen.config == CPConfig("ulysses", 8)


@pytest.mark.parametrize("name", ["diffusers", "yunchang", "transformer-engine"])
def test_snippets_pin_each_rank_to_its_own_gpu(name):
    code = FRAMEWORKS[name].spell(FLUX, CPConfig("ulysses", 8)).code.splitlines()
    pinned = code.index('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))')
    assert "import os" in code[:pinned] and pinned < code.index('dist.init_process_group("nccl")')


def test_transformer_engine_names_its_qkv_format_and_refuses_a2a_with_odd_heads():
    te = _source("transformer-engine")
    assert 'qkv_format: str = "sbhd",' in te and 'num_heads % 2 != 0 or num_gqa_groups % 2 != 0' in te
    spelled = FRAMEWORKS["transformer-engine"].spell(LLAMA, CPConfig("ulysses", 8))
    assert 'qkv_format="bshd"' in spelled.code and spelled.settings["qkv_format"] == "bshd"
    odd = AttentionShape(heads=15, kv_heads=15, head_dim=128, batch=1, dtype="bf16", causal=True)
    for name in ("transformer-engine", "megatron"):
        assert "odd head count" in FRAMEWORKS[name].refusal(odd, CPConfig("ulysses", 5))
        assert FRAMEWORKS[name].refusal(odd, CPConfig("ring", 5)) is None  # p2p: no a2a


def test_a_tuned_length_a_framework_cannot_cut_is_refused_or_exported_its_way_round():
    for name in ("transformer-engine", "megatron"):
        reason = FRAMEWORKS[name].placed_refusal(LLAMA, CPConfig("ring", 8), 32760, None)
        assert reason is not None and "not a multiple of 16" in reason and "32768" in reason
        assert FRAMEWORKS[name].placed_refusal(LLAMA, CPConfig("ring", 4), 32760, None) is None
        with pytest.raises(FrameworkError, match="not a multiple of 16"):
            FRAMEWORKS[name].spell(LLAMA, CPConfig("ring", 8), 32760)
    diffusers = FRAMEWORKS["diffusers"]
    assert diffusers.spell(FLUX, CPConfig("ulysses", 6), 119000).settings["ulysses_anything"] is True
    assert diffusers.spell(FLUX, CPConfig("allgather_kv", 6), 119000).settings["ring_anything"] is True
    assert "ulysses_anything" not in diffusers.spell(FLUX, CPConfig("ulysses", 8), 119000).settings
    assert "equal pieces" in diffusers.placed_refusal(FLUX, CPConfig("allgather_kv", 6, 2), 119000, None)
    parallel = pytest.importorskip("diffusers.models._modeling_parallel")  # diffusers' own class takes it
    for config in (CPConfig("ulysses", 6), CPConfig("allgather_kv", 6)):
        parallel.ContextParallelConfig(**diffusers.spell(FLUX, config, 119000).settings)


# --------------------------------------------------------------------------- the command line


H100_FLUX = ["--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128"]


def test_export_for_prints_settings_or_json_and_writes_no_plan_unless_asked(cptune_here, tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = cptune_here("export", *H100_FLUX, "--seq-lens", "4608,16896", "--for", "xdit")
    assert shown.returncode == 0, shown.stderr
    assert "xdit (xfuser 0.7.0)" in shown.stdout and "--ulysses_degree" in shown.stdout
    assert "torchrun --nproc-per-node=8" in shown.stdout and not (tmp_path / "plan.json").exists()
    data = json.loads(cptune_here("export", *H100_FLUX, "--seq-lens", "4608,16896", "--for", "diffusers",
                                  "--json", "-o", "p.json").stdout)
    assert [b["settings"]["ulysses_degree"] * b["settings"]["ring_degree"] for b in data["buckets"]] == [8, 8]
    assert (tmp_path / "p.json").exists()
    again = cptune_here("export", "--plan", "p.json", "--for", "megatron", "--json")
    assert json.loads(again.stdout)["buckets"][0]["settings"]["context_parallel_size"] == 8


@pytest.mark.parametrize("args, fragments", [
    (["export", *H100_FLUX, "--seq-lens", "4608", "--for", "deepspeed"], ["unknown framework 'deepspeed'",
                                                                          "diffusers, xdit"]),
    (["export", *H100_FLUX, "--seq-lens", "4608", "--json"], ["--json goes with --for"]),
    (["export", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--for", "yunchang"],
     ["mpi engine", "--backend torch"]),
    (["export", "--hardware", "h100-sxm-8", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
      "--causal",
      "--seq-lens", "131072", "--ranks", "8", "--for", "diffusers"], ["diffusers runs none", "yunchang"]),
    (["recommend", *H100_FLUX, "--seq-len", "4608", "--for", "nope"], ["unknown framework 'nope'"]),
    (["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--for", "xdit", "--no-calibrate"],
     ["mpi engine", "--backend torch"]),
])
def test_bad_framework_input_is_one_line_and_exit_2(cptune_here, tmp_path, monkeypatch, args, fragments):
    monkeypatch.chdir(tmp_path)
    assert_refused(cptune_here(*args), *fragments)
    assert list(tmp_path.iterdir()) == []


def test_a_plan_for_other_hardware_is_refused_with_the_way_to_use_it(cptune_here, tmp_path):
    plan = export_plan([FLUX.at(4608)], hardware="h100-sxm-8").write(tmp_path / "plan.json")
    before = plan.read_bytes()
    assert_refused(cptune_here("export", "--plan", plan, "--hardware", "l20-pcie-8", "--for", "xdit"),
                   "was tuned for", "h100-sxm-8", "export a plan for it")
    assert plan.read_bytes() == before and list(tmp_path.iterdir()) == [plan]


def test_recommend_for_a_framework_adds_its_choice(cptune_here):
    shown = cptune_here("recommend", *H100_FLUX, "--seq-len", "4608", "--for", "vllm-omni")
    assert shown.returncode == 0, shown.stderr
    assert "for vllm-omni (vllm-omni 0.20.0):" in shown.stdout and "vllm serve <model> --omni" in shown.stdout
    data = json.loads(cptune_here("recommend", *H100_FLUX, "--seq-len", "4608", "--for", "vllm-omni",
                                  "--json").stdout)
    assert data["for"]["framework"] == "vllm-omni" and data["for"]["config"]["strategy"] != "allgather_kv"


# --------------------------------------------------------------------------- the real packages


@pytest.mark.slow
def test_the_exported_settings_build_real_groups_on_gloo_ranks_where_cptune_measured_them(tmp_path):
    """diffusers' ContextParallelConfig and yunchang's set_seq_parallel_pg, fed the settings
    the export emits for every configuration each runs on 4 ranks, form their groups on 4
    gloo ranks with their own code: the same ranks as cptune's layout."""
    for package in ("torch", "diffusers", "yunchang"):  # the torch and frameworks extras
        pytest.importorskip(package)
    emitted: dict[str, list[dict]] = {}
    expected: dict[str, list[list[list[tuple[int, ...]]]]] = {}
    for name in ("diffusers", "yunchang"):
        runnable = [c for c in configs(FLUX, 4) if c.ranks == 4 and FRAMEWORKS[name].refusal(FLUX, c) is None]
        emitted[name] = [dict(FRAMEWORKS[name].spell(FLUX, c).settings) for c in runnable]
        expected[name] = [[sorted(group) for group in rank_groups(c)] for c in runnable]
    assert len(emitted["diffusers"]) == 3 and len(emitted["yunchang"]) == 3
    for settings in emitted["yunchang"]:
        del settings["ring_impl_type"]  # LongContextAttention's, not the groups'
    spec = tmp_path / "settings.json"
    spec.write_text(json.dumps(emitted))
    formed = torchrun_summary(4, TESTS / "framework_ranks.py", str(spec))
    for name in emitted:
        got = [[[tuple(g) for g in groups] for groups in config] for config in formed[name]]
        assert got == expected[name]


def _package_takes(name: str, settings: dict, ranks: int) -> None:
    """Raise unless the real package takes ``settings`` as the export spells them."""
    if name == "diffusers":
        from diffusers.models._modeling_parallel import ContextParallelConfig  # diffusers' own class

        ContextParallelConfig(**settings)
    else:
        import inspect

        from yunchang import LongContextAttention, set_seq_parallel_pg
        from yunchang.hybrid.utils import RING_IMPL_DICT

        groups = {k: v for k, v in settings.items() if k != "ring_impl_type"}
        inspect.signature(set_seq_parallel_pg).bind(**groups, rank=0, world_size=ranks)
        inspect.signature(LongContextAttention).bind(ring_impl_type=settings["ring_impl_type"])
        assert settings["ring_impl_type"] in RING_IMPL_DICT


@pytest.mark.parametrize("name", ["diffusers", "yunchang"])
def test_the_real_packages_take_the_settings_exported_for_flux_and_llama_on_h100(name):
    pytest.importorskip(name)
    taken = 0
    for shape, lengths in ((FLUX, (4608, 16896)), (LLAMA, (32768, 131072))):
        framed = for_framework(export_plan([shape.at(n) for n in lengths], hardware="h100-sxm-8"), name)
        for entry in framed.buckets:
            if entry.substitution.chosen.config.ranks > 1:
                _package_takes(name, dict(entry.spelling.settings), entry.substitution.chosen.config.ranks)
                taken += 1
    assert taken >= 2


def test_diffusers_takes_every_configuration_the_export_spells_for_it():
    parallel = pytest.importorskip("diffusers.models._modeling_parallel")  # what diffusers exports
    for config in configs(FLUX):
        if FRAMEWORKS["diffusers"].refusal(FLUX, config) is None:
            settings = FRAMEWORKS["diffusers"].spell(FLUX, config).settings
            built = parallel.ContextParallelConfig(**settings)
            assert built.mesh_shape == (config.context_degree, config.head_group)
            assert built.mesh_dim_names == ("ring", "ulysses")


def _doc_rows(hardware: str) -> list[str]:
    """docs/frameworks.md's table of FLUX.1-dev's export for every framework on ``hardware``."""
    plan = export_plan([FLUX.at(4608), FLUX.at(16896)], hardware=hardware)
    rows = []
    for name, framework in FRAMEWORKS.items():
        for entry in for_framework(plan, name).buckets:
            s, b = entry.substitution, entry.bucket
            shown = entry.spelling.code if framework.form == "flags" else ", ".join(
                f"{k}={v!r}" for k, v in entry.spelling.settings.items() if k != "cp_group")
            cost = "cptune's pick" if s.chosen.config == s.pick.config and s.as_cptune_runs else (
                f"{s.cost_pct:+.1f}% vs {s.pick.config.label} "
                f"({'within' if s.within_tie else 'outside'} the tie)")
            runs = "" if s.as_cptune_runs else f" (runs {s.runs.label})"
            rows.append(f"| {name} | {b.min_seq_len}-{b.max_seq_len} | {s.chosen.config.label} on "
                        f"{s.chosen.config.ranks}{runs} | `{shown}` | {cost} |")
    return rows


@pytest.mark.parametrize("hardware", ["h100-sxm-8", "l20-pcie-8"])
def test_the_docs_show_flux_exports_for_every_framework_as_the_code_gives_them(hardware):
    docs = (Path(__file__).parents[1] / "docs" / "frameworks.md").read_text(encoding="utf-8")
    table = docs.split(f"\n{hardware}:\n")[1].strip().split("\n\n")[0].splitlines()[2:]
    assert table == _doc_rows(hardware)
    for name in FRAMEWORKS:
        assert f"\n## {name}\n" in docs
