"""--for with masks and layouts: what each framework runs for packed documents, sliding windows,
sinks and joint text, how it spells it, and what it runs instead where it cannot run cptune's
pick - each rule held against its framework's released source (the installed package, or the
lines quoted in tests/framework_sources/)."""

import inspect

import pytest
from test_frameworks import _source

from cptune.config import CPConfig
from cptune.frameworks import FRAMEWORKS, FrameworkError, choose, get_framework
from cptune.plans import Alternative
from cptune.workload import AttentionShape

#: A Llama-3.1-8B training layer packed with five documents (8,192 tokens; no document a multiple
#: of 16), a sliding-window prefill with and without sinks, FLUX.1-dev's joint attention.
DOCS = AttentionShape(heads=32, kv_heads=8, head_dim=128, batch=1, dtype="bf16", causal=True, mode="train",
                      documents=(1000, 3000, 500, 2692, 1000))
WINDOW = AttentionShape(heads=32, kv_heads=8, head_dim=128, batch=1, dtype="bf16", causal=True,
                        window=(4096, 0))
SINKS = AttentionShape(heads=32, kv_heads=8, head_dim=128, batch=1, dtype="bf16", causal=True,
                       window=(4096, 0), sinks=4)
JOINT = AttentionShape(heads=24, kv_heads=24, head_dim=128, batch=1, dtype="bf16", causal=False, text=512)
TE_FILE = "transformer_engine/pytorch/attention/dot_product_attention/"


def _ranked(*entries: tuple[CPConfig, float]) -> list[Alternative]:
    return [Alternative(config, ms, (ms * 0.99, ms * 1.01), "prior") for config, ms in entries]


def _quoted(name: str, *lines: str) -> None:
    """Each of ``lines`` (a quoted line, or its start) among the lines quoted of ``name``'s release."""
    text = _source(name)
    for line in lines:
        assert line in text, line


def _te(at: str, text: str) -> str:
    """A line of TransformerEngine's attention package, 'file.py:N' and its text, as quoted."""
    return f"{TE_FILE}{at}: {text}"


# --------------------------------------------------------------------------- TransformerEngine, Megatron


@pytest.mark.parametrize("name", ["transformer-engine", "megatron"])
def test_packed_documents_run_as_te_thd_each_document_zigzagged_and_padded_to_2cp(name):
    framework = get_framework(name)
    ring = CPConfig("ring", 4)
    runs = framework.runs(DOCS, ring, 8192)  # cptune's default (zigzag of the whole sequence) is not TE's
    assert runs.config == ring.with_layout("doc_zigzag") and "THD" in runs.what
    assert framework.runs(DOCS, ring.with_layout("doc_zigzag"), 8192).same_as(ring.with_layout("doc_zigzag"))
    # 8,190 tokens: no multiple of 2 x 4, yet THD pads each document instead of refusing the length
    odd = AttentionShape(**{**DOCS.to_dict(), "documents": (1000, 3000, 500, 2690, 1000)})
    assert framework.placed_refusal(odd, ring, 8190, None) is None
    plain = AttentionShape(**{**DOCS.to_dict(), "documents": None})
    assert "not a multiple of 8" in framework.placed_refusal(plain, ring, 8190, None)
    spelled = framework.spell(DOCS, CPConfig("allgather_kv", 8), 8192)
    thd = spelled.settings if name == "transformer-engine" else spelled.settings["packed_seq_params"]
    cu = thd["cu_seqlens"] if name == "transformer-engine" else thd["cu_seqlens_q"]
    padded = thd["cu_seqlens_padded"] if name == "transformer-engine" else thd["cu_seqlens_q_padded"]
    assert cu == [0, 1000, 4000, 4500, 7192, 8192]
    assert padded == [0, 1008, 4016, 4528, 7232, 8240]  # each document to a multiple of 2 x 8 = 16
    steps = zip(padded, padded[1:], cu, cu[1:], strict=False)
    assert all((b - a) % 16 == 0 and b - a - (d - c) < 16 for a, b, c, d in steps)
    assert any("8192 tokens become 8240 (+0.6%" in need for need in spelled.needs)
    if name == "transformer-engine":
        assert thd["qkv_format"] == "thd" and thd["attn_mask_type"] == "padding_causal"
        assert "cu_seqlens_q_padded=cu_seqlens_padded" in spelled.code and 'qkv_format="thd"' in spelled.code
        _quoted(name, _te("utils.py:1268", "    # Note: context parallelism requires seq_len % (cp_size * 2) "
                                           "== 0 for each sequence in q, k, v."),
                _te("context_parallel.py:5686", "    ), \"cu_seqlens_padded can not be None for context "
                                                "parallelism and qkv_format = 'thd'!\""),
                *(f"         {arg}: " for arg in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                                                  "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv")),
                _te("context_parallel.py:3304", '            assert padding, f"THD format requires padding'))
    else:
        assert thd["qkv_format"] == "thd"
        _quoted(name, *(f"megatron/core/packed_seq_params.py:{n}:     {field}: " for n, field in
                        ((16, "qkv_format"), (17, "cu_seqlens_q"), (19, "cu_seqlens_q_padded"))),
                "megatron/core/utils.py:2414:     divisible by ``2 * cp_size``.")


@pytest.mark.parametrize("name", ["transformer-engine", "megatron"])
def test_te_refuses_a_window_with_p2p_and_takes_it_with_a2a_and_all_gather(name):
    framework = get_framework(name)
    _quoted("transformer-engine",
            _te("context_parallel.py:5692", '        "a2a",'),
            _te("context_parallel.py:5693", '        "all_gather",'),
            _te("context_parallel.py:5694", '    ], f"Context parallelism does not support sliding window '
                                            'attention with {cp_comm_type=}!"'),
            _te("dot_product_attention.py:862", "        window_size: Optional[Tuple[int, int]] = None,"))
    for config, takes in ((CPConfig("ring", 8), False), (CPConfig("ring", 8, 2), False),
                          (CPConfig("allgather_kv", 8), True), (CPConfig("ulysses", 8), True)):
        reason = framework.refusal(WINDOW, config)
        assert (reason is None) == takes, (config.label, reason)
        if not takes:
            assert "sliding window" in reason and "'a2a' and 'all_gather'" in reason
    gathered = framework.spell(WINDOW, CPConfig("allgather_kv", 8), 8192)
    assert gathered.settings["window_size"] == ((4096, 0) if name == "transformer-engine" else "4096,0")
    if name == "megatron":
        assert "--window-size 4096,0" in gathered.code
        _quoted(name, "arguments.py:2301:     group.add_argument('--window-size', type=tuple_type")
    else:
        assert "window_size=(4096, 0)" in gathered.code
    # all_gather deals the window out as DUAL_CHUNK_SWAP: cptune's zigzag, not a window's contiguous default
    assert framework.runs(WINDOW, CPConfig("allgather_kv", 8), 8192).config.layout == "zigzag"
    # attention sinks are tokens; TE's softmax_type is an offset
    assert "no attention sinks" in framework.refusal(SINKS, CPConfig("ulysses", 8))
    _quoted("transformer-engine", _te("context_parallel.py:5700",
                                      '        softmax_type == "vanilla" or cp_comm_type == "a2a"'))


def test_a_window_pick_te_cannot_run_is_replaced_by_the_fastest_it_can_with_the_cost():
    ranked = _ranked((CPConfig("ring", 8), 1.0), (CPConfig("allgather_kv", 8), 1.05),
                     (CPConfig("allgather_kv", 8).with_layout("zigzag"), 1.1), (CPConfig("ulysses", 8), 1.2))
    chosen = choose(FRAMEWORKS["transformer-engine"], WINDOW, 8192, ranked)
    assert chosen.chosen.config == CPConfig("allgather_kv", 8) and chosen.runs.config.layout == "zigzag"
    assert chosen.cost_pct == pytest.approx(10.0)  # priced as TE runs it: the zigzag's 1.1 ms
    assert "sliding window" in chosen.passed_over[0][1] and "+10.0%" in chosen.describe()


def test_joint_text_te_and_diffusers_shard_with_the_image():
    replicated = CPConfig("allgather_kv", 8, layout="replicated_text")
    for name in ("transformer-engine", "diffusers"):
        runs = get_framework(name).runs(JOINT, replicated, 4608)
        assert runs.config.layout is None and "shard" in runs.what, name
    diffusers = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    plan = inspect.getsource(diffusers.FluxTransformer2DModel)
    assert '"encoder_hidden_states": ContextParallelInput(split_dim=1' in plan


# --------------------------------------------------------------------------- diffusers, xDiT, yunchang


@pytest.mark.parametrize("shape", [WINDOW, SINKS, DOCS], ids=["window", "sinks", "documents"])
def test_diffusers_and_xdit_refuse_masks_beyond_full_attention_in_one_line(shape):
    full = AttentionShape(**{**shape.to_dict(), "causal": False, "mode": "forward", "kv_heads": 32})
    for name in ("diffusers", "xdit"):
        reason = get_framework(name).refusal(full, CPConfig("ulysses", 8))
        assert reason and "\n" not in reason and "no " in reason, (name, reason)
    dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
    assert "TemplatedRingAnythingAttention does not support non-None attn_mask" in inspect.getsource(dispatch)
    _quoted("xdit", "attention_processor.py:841:                 is_causal=False,")


def test_xdit_replicates_text_front_where_its_pipeline_cannot_shard_it():
    _quoted("xdit", 'transformer_flux.py:280:                 joint_strategy="front",',
            "pipeline_flux.py:419:             if prompt_embeds.shape[-2] % get_sequence_parallel_world_size",
            "pipeline_flux.py:422:                 get_runtime_state().split_text_embed_in_sp = False",
            'usp.py:414:             if (joint_strategy == "front" and step == 0)')
    xdit = get_framework("xdit")
    ring = CPConfig("ring", 8)
    sharded = xdit.runs(JOINT, ring, 4608)  # 512 text tokens over 8 ranks: FLUX's pipeline shards them
    assert sharded.config == CPConfig("allgather_kv", 8) and sharded.per_block_calls
    assert any("sharded with the image" in n for n in xdit.spell(JOINT, ring, 4608).needs)
    odd = AttentionShape(**{**JOINT.to_dict(), "text": 510})  # 510 over 8 does not divide: "front"
    front = xdit.runs(odd, ring, 4606)
    assert front.config == CPConfig("allgather_kv", 8, layout="replicated_text") and front.per_block_calls
    assert any("joint_strategy='front'" in n for n in xdit.spell(odd, ring, 4606).needs)
    picked = xdit.runs(JOINT, ring.with_layout("replicated_text"), 4608)  # cptune's pick replicates: front
    assert picked.config.layout == "replicated_text"
    gathered = xdit.runs(odd, CPConfig("ring", 8, 2), 4606)
    assert gathered.config.layout == "replicated_text"


def test_yunchang_ring_variants_deal_out_cptunes_causal_layouts():
    ring = pytest.importorskip("yunchang.hybrid.utils")
    assert {"basic", "zigzag", "strip"} <= set(ring.RING_IMPL_DICT)
    stripe = inspect.getsource(pytest.importorskip("yunchang.ring.stripe_flash_attn"))
    assert "stripe flash attn only supports causal attention" in stripe
    extract = inspect.getsource(pytest.importorskip("yunchang.comm.extract_local").stripe_extract_local)
    assert "value.reshape(batch_size, seqlen // rd, rd, -1)" in extract  # token t on ring rank t % rd
    yunchang = get_framework("yunchang")
    causal = AttentionShape(heads=32, kv_heads=8, head_dim=128, batch=1, dtype="bf16", causal=True)
    layouts = ((None, "zigzag"), ("zigzag", "zigzag"), ("contiguous", "basic"), ("striped", "strip"))
    for layout, impl in layouts:
        config = CPConfig("ring", 4, layout=layout)
        spelled = yunchang.spell(causal, config, 8192)
        assert spelled.settings["ring_impl_type"] == impl, layout
        assert yunchang.runs(causal, config, 8192).same_as(config)
    striped = yunchang.spell(causal, CPConfig("ring", 4, layout="striped"), 8192)
    assert any("stripe_extract_local" in n for n in striped.needs)
    flux = AttentionShape(heads=24, kv_heads=24, head_dim=128, batch=1, dtype="bf16", causal=False)
    assert yunchang.spell(flux, CPConfig("ring", 4), 8192).settings["ring_impl_type"] == "basic"


def test_yunchang_takes_a_window_on_ulysses_alone_and_no_documents():
    attention = pytest.importorskip("yunchang.hybrid.attn_layer")
    parameters = inspect.signature(attention.LongContextAttention.forward).parameters
    assert "window_size" in parameters and not any("cu_seqlens" in p for p in parameters)
    basic = inspect.getsource(pytest.importorskip("yunchang.ring.ring_flash_attn").ring_flash_attn_forward)
    assert "window_size=window_size," in basic  # every step gets the caller's window, unshifted
    yunchang = get_framework("yunchang")
    assert yunchang.refusal(WINDOW, CPConfig("ulysses", 8)) is None
    assert "Ulysses alone" in yunchang.refusal(WINDOW, CPConfig("ring", 8, 2))
    assert "cu_seqlens" in yunchang.refusal(DOCS, CPConfig("ulysses", 8))
    assert yunchang.runs(JOINT, CPConfig("ring", 8, layout="replicated_text"), 4608).config.layout is None


def test_a_mask_no_ranked_configuration_of_a_framework_runs_is_refused_in_one_line():
    ranked = _ranked((CPConfig("ring", 8), 1.0), (CPConfig("ring", 8, 2), 1.1))
    with pytest.raises(FrameworkError, match=r"yunchang runs none of the 2 .*Ulysses alone") as raised:
        choose(FRAMEWORKS["yunchang"], WINDOW, 8192, ranked)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name", ["sglang", "vllm-omni"])
def test_frameworks_whose_mask_settings_were_not_read_refuse_a_mask_rather_than_export_it_plain(name):
    full = AttentionShape(heads=32, kv_heads=32, head_dim=128, batch=1, dtype="bf16", causal=False,
                          window=(1024, 1024))
    reason = get_framework(name).refusal(full, CPConfig("ulysses", 8))
    assert reason and "has not read" in reason and "a sliding window" in reason
    assert get_framework(name).refusal(JOINT, CPConfig("ulysses", 8)) is None  # joint text: full attention


def test_te_thd_padding_sits_between_the_documents_where_no_query_attends_it():
    _quoted("transformer-engine", "Cumulative sum of sequence lengths (without offset) in a batch for",
            "Cumulative sum of sequence lengths (with offset) in a batch for",
            "If ``True``, there are padding tokens between individual sequences in a packed batch.")
    need = get_framework("transformer-engine").spell(DOCS, CPConfig("ulysses", 8), 8192).needs[0]
    assert "attended by no query" in need and "not priced" in need
