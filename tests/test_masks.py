"""Masks as rules over positions (cptune.masks), the workload fields that name them, and the
fused calls a step of a masked workload takes (cptune.calls): each checked against a brute
force over every (query, key) pair."""

import itertools

import numpy as np
import pytest

from cptune import CPConfig, Workload
from cptune.calls import attention_calls
from cptune.layout import SequenceLayout, runnable_layouts
from cptune.masks import Documents, Mask

MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window": [9, 0]},
    "window both ways": {"window": [5, 3]},
    "window with sinks": {"causal": True, "window": [7, 0], "sinks": 2},
    "3 documents": {"causal": True, "documents": [20, 37, 7]},
    "17 documents": {"causal": True, "documents": [3] * 16 + [16]},
    "documents full": {"documents": [30, 34]},
    "documents, window, sinks": {"causal": True, "documents": [40, 24], "window": [6, 0], "sinks": 3},
}


def brute(workload: Workload) -> np.ndarray:
    """Whether query i sees key j, straight from the definitions."""
    n = workload.seq_len
    starts = np.cumsum([0, *workload.document_lengths])
    doc = np.searchsorted(starts, np.arange(n), side="right") - 1
    seen = np.ones((n, n), dtype=bool)
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    seen &= doc[:, None] == doc[None, :]
    if workload.causal:
        seen &= k <= q
    if workload.window:
        left, right = workload.window
        near = (k >= q - left) & (k <= q + right)
        if workload.sinks:
            near |= (k - starts[doc][None, :]) < workload.sinks
        seen &= near
    return seen


@pytest.mark.parametrize("name", MASKS)
def test_a_mask_s_rule_ranges_and_counts_agree_with_the_brute_force(name):
    workload = Workload(64, 2, 8, **MASKS[name])
    mask, truth = workload.mask, brute(workload)
    positions = np.arange(70)  # six padding positions beyond
    seen = mask.visible(positions[:, None], positions[None, :])
    assert not seen[64:].any() and not seen[:, 64:].any()
    assert (seen[:64, :64] == truth).all()
    assert (mask.row_counts(positions) == seen.sum(axis=1)).all() and mask.area == truth.sum()
    for first, last in itertools.combinations(range(64), 2):
        for a, b in mask.document_runs(first, last):
            some, every = mask.seen_ranges(a, b)
            rows = truth[a:b + 1]
            in_some = np.zeros(64, bool)
            in_every = np.zeros(64, bool)
            for lo, hi in some:
                in_some[lo:hi] = True
            for lo, hi in every:
                in_every[lo:hi] = True
            assert (in_some == rows.any(axis=0)).all() and (in_every == rows.all(axis=0)).all(), (a, b)


def covered(calls, q_pos, k_pos, mask):
    """How many calls compute each (row, key) pair as seen, and whether every call sees a pair."""
    counts = np.zeros((len(q_pos), len(k_pos)), dtype=int)
    for call in calls:
        rows, keys = q_pos[call.rows], k_pos[call.keys]
        if call.causal:
            assert (rows == keys).all(), call  # a square over the same positions
            part = keys[None, :] <= rows[:, None]
        elif call.masked:
            part = mask.visible(rows[:, None], keys[None, :])
        else:
            part = np.ones((len(rows), len(keys)), dtype=bool)
        assert part.any(), f"{call} computes no pair the mask shows"
        counts[call.rows, call.keys] += part
    return counts


@pytest.mark.parametrize("name", [n for n in MASKS if n not in ("full", "causal")])
@pytest.mark.parametrize("ranks, head_group", [(2, 1), (3, 1), (4, 1), (4, 2)])
def test_every_layout_s_calls_compute_each_seen_pair_once_and_no_hidden_one(name, ranks, head_group):
    workload = Workload(64, 4, 8, **MASKS[name])
    mask, seen = workload.mask, workload.mask.visible
    for strategy in ("ring", "allgather_kv"):
        base = CPConfig(strategy, ranks, head_group)
        for layout_name in runnable_layouts(workload, base):
            layout = SequenceLayout(workload, base.with_layout(layout_name))
            for g in range(layout.context_degree):
                q_pos = layout.block_positions(g)
                steps = ([layout.gathered_positions] if strategy == "allgather_kv" else
                         [layout.block_positions(h) for h in range(layout.context_degree)])
                for k_pos in steps:
                    counts = covered(attention_calls(q_pos, k_pos, mask), q_pos, k_pos, mask)
                    truth = seen(q_pos[:, None], k_pos[None, :])
                    assert (counts == truth).all(), (layout_name, g)


def test_a_window_s_tiles_keep_the_calls_masked_by_position_a_small_share_of_the_work():
    workload = Workload(16384, 8, 64, causal=True, window=[1024, 0])
    q = np.arange(16384)
    calls = attention_calls(q, q, workload.mask)
    kinds = ((False, False), (True, False), (False, True))
    area = {kind: sum((c.rows.stop - c.rows.start) * (c.keys.stop - c.keys.start) for c in calls
                      if (c.causal, c.masked) == kind) for kind in kinds}
    computed = area[(False, False)] + area[(True, False)] / 2 + area[(False, True)]
    assert workload.mask.area <= computed <= 1.15 * workload.mask.area


def test_documents_given_by_length_or_one_for_all_and_refused_in_one_line():
    assert Workload(100, 4, 8, documents=40).document_lengths == (40, 40, 20)
    assert Workload(100, 4, 8, documents=[60, 40]).document_lengths == (60, 40)
    assert Workload(100, 4, 8).document_lengths == (100,)
    assert Documents.of(2048).to_json() == 2048 and Documents.of([1, 2]).to_json() == [1, 2]
    refusals = {
        "sum to 90, not the sequence's 100": dict(documents=[60, 30]),
        "zero-length document": dict(documents=[100, 0]),
        "reaches across the whole 100-token": dict(causal=True, window=[100, 0]),
        "a causal window is [left, 0]": dict(causal=True, window=[8, 8]),
        "give a window, or leave sinks out": dict(sinks=4),
        "text: 100 text tokens leave none": dict(text=100),
        "joint text and image attention is full": dict(text=10, causal=True),
        "sink tokens fill a whole document": dict(causal=True, window=[8, 0], sinks=20, documents=[20, 80]),
        "window must be [left, right]": dict(window=[8]),
    }
    for words, fields in refusals.items():
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            Workload(100, 4, 8, **fields)


def test_a_masked_workload_round_trips_through_json_and_flags_and_a_plain_one_reads_as_before():
    masked = Workload(96, 4, 8, causal=True, window=[16, 0], sinks=2, documents=[32, 64], mode="train")
    assert Workload(**masked.to_dict()) == masked
    assert masked.flags()[-6:] == ["--window", "16,0", "--sinks", "2", "--documents", "32,64"]
    assert masked.describe() == ("seq 96 x 4 heads x d8, batch 1, bf16 causal, window 16+2 sinks, "
                                 "2 document(s) (32, 64), train")
    plain = Workload(96, 4, 8, causal=True)
    assert set(plain.to_dict()) == {"seq_len", "heads", "kv_heads", "head_dim", "batch", "dtype", "causal",
                                    "mode"}
    assert masked.shape.at(96) == masked and plain.shape.at(96) == plain
    assert Mask(96, True) == plain.mask and hash(Mask(96, True)) == hash(plain.mask)


def test_graph_engines_refuse_windows_and_documents_in_one_line(tmp_path):
    """The onnx and TensorRT engines' graphs hold full and causal masks; a window or packed
    documents is refused before anything runs, naming the engines that run it."""
    from cptune import compute
    from cptune.engines import UnmaskedEngineError
    from cptune.engines.onnx import export_graphs
    from cptune.reference import make_inputs

    for fields in ({"causal": True, "window": [8, 0]}, {"causal": True, "documents": [32, 32]}):
        workload = Workload(64, 2, 8, **fields)
        with pytest.raises(UnmaskedEngineError, match="use a backend that runs it \\('mpi', 'torch'\\)"):
            compute(workload, CPConfig("ring", 2), *make_inputs(workload), backend="onnx")
        with pytest.raises(UnmaskedEngineError, match="tensorrt engine's graphs hold full and causal masks"):
            export_graphs(workload, CPConfig("ring", 2), tmp_path / "graphs")
    assert not (tmp_path / "graphs").exists()
