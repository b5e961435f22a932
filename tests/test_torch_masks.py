"""``cptune.torch.ContextParallelAttention`` under masks: packed documents by ``cu_seqlens``,
a sliding window with sinks, joint text. On 2 gloo ranks (tests/torch_masks.py under
torchrun) every strategy and head group in every layout that deals the mask out gives the
unsharded layer's masked output and dQ, dK, dV; on one rank the refusals and the layout's
helpers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the cptune[torch] extra; CI installs it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from conftest import torchrun_lines  # noqa: E402
from cptune.config import CPConfig  # noqa: E402
from cptune.layout import SequenceLayout  # noqa: E402
from cptune.torch import ContextParallelAttention, shard_sequence, unshard_sequence  # noqa: E402
from cptune.workload import AttentionShape, Workload  # noqa: E402

TESTS = Path(__file__).parent
#: fp32 relative error allowed against the float64 reference (tests/test_torch_deploy.py's).
TOLERANCE = 1e-4


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped", "doc_zigzag", "doc_whole"])
def test_shard_and_unshard_follow_the_layout_with_documents(layout):
    workload = Workload(45, 4, 8, 2, batch=2, dtype="fp32", causal=True, documents=[3, 30, 12])
    config = CPConfig("ring", 4, 2, layout=layout)
    x = torch.randn(2, 45, 3)
    shards = [shard_sequence(x, workload, config, r) for r in range(4)]
    layout_of = SequenceLayout(workload, config)
    for rank, shard in enumerate(shards):
        positions = torch.from_numpy(layout_of.rank_positions(rank))
        real = positions < 45
        assert torch.equal(shard[:, real], x[:, positions[real]]) and not shard[:, ~real].any()
    assert torch.equal(unshard_sequence(shards, workload, config), x)


def test_replicated_text_is_held_by_every_rank_and_unsharded_once():
    workload = Workload(30, 4, 8, batch=1, dtype="fp32", text=7)
    config = CPConfig("allgather_kv", 3, layout="replicated_text")
    x = torch.randn(1, 30, 2)
    shards = [shard_sequence(x, workload, config, r) for r in range(3)]
    assert [s.shape[1] for s in shards] == [7 + 8] * 3  # the text, then a third of 23 image tokens padded
    assert all(torch.equal(s[:, :7], x[:, :7]) for s in shards)
    assert torch.equal(unshard_sequence(shards, workload, config), x)


def test_a_one_document_batch_under_a_documents_layout_runs_the_default_layout(one_rank):
    shape = AttentionShape(4, 4, 8, 1, "fp32", True)
    cp = ContextParallelAttention(CPConfig("ring", 1, layout=None), shape)
    assert cp.workload(20, [0, 20]).document_lengths == (20,)
    workload = shape.at(20)
    whole = SequenceLayout(workload, CPConfig("ring", 2))
    per_document = CPConfig("ring", 2, layout="doc_zigzag")
    assert [whole.rank_positions(r).tolist() for r in range(2)] == [
        shard_sequence(torch.arange(20)[None], workload, per_document, r)[0].tolist() for r in range(2)]


def test_masked_calls_on_one_rank_equal_masked_attention(one_rank):
    shape = AttentionShape(4, 2, 8, 2, "fp32", True)
    cp = ContextParallelAttention(CPConfig("ring", 1), shape, window=(5, 0), sinks=2)
    q, k, v = (torch.randn(2, 30, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    bounds = torch.tensor([0, 11, 30], dtype=torch.int32)
    with torch.no_grad():
        out = cp(q.float(), k.float(), v.float(), 30, bounds)
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    doc = (torch.arange(30) >= 11).long()
    start = torch.tensor([0, 11])[doc]
    seen = (doc[:, None] == doc[None, :]) & (j <= i) & ((j >= i - 5) | (j - start[None, :] < 2))
    kk, vv = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
    scores = (q.transpose(1, 2) @ kk.transpose(-1, -2) / 8**0.5).masked_fill(~seen, float("-inf"))
    expected = (scores.softmax(-1) @ vv).transpose(1, 2)
    assert float((out.double() - expected).abs().max()) < TOLERANCE


def test_the_mask_is_refused_in_one_line_with_the_fix(one_rank):
    from test_torch_deploy import make_plan

    from cptune.plans import PlanMismatchError

    shape = AttentionShape(4, 4, 8, 1, "fp32", True)
    cp = ContextParallelAttention(CPConfig("ring", 1), shape)
    x = torch.zeros(1, 20, 4, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 19, but the sequence holds 20 tokens"):
        cp(x, x, x, 20, [0, 19])
    with pytest.raises(ValueError, match="cu_seqlens must increase: document 1 runs from 5 to 5"):
        cp.shard(x, [0, 5, 5, 20])
    with pytest.raises(ValueError, match="window: \\[30, 0\\] reaches across the whole 20-token sequence"):
        ContextParallelAttention(CPConfig("ring", 1), shape, window=(30, 0)).shard(x)
    with pytest.raises(ValueError, match="sinks: 4 sink tokens fill a whole document"):
        ContextParallelAttention(CPConfig("ring", 1), shape, window=(3, 0), sinks=4).shard(x, [0, 4, 20])
    with pytest.raises(ValueError, match="text: joint text and image attention is full over both"):
        ContextParallelAttention(CPConfig("ring", 1), shape, text=4)
    with pytest.raises(ValueError, match="flash-attn's -1, no limit"):
        ContextParallelAttention(CPConfig("ring", 1), shape, window=(4, -1))
    plan = make_plan(shape, [(64, CPConfig("ring", 1))], 1)
    with pytest.raises(PlanMismatchError, match="export a plan for this mask"):
        ContextParallelAttention(plan, window=(8, 0))


@pytest.mark.slow
def test_on_gloo_ranks_every_strategy_and_layout_gives_the_unsharded_masked_layer(tmp_path):
    """And docs/torch.md's masked example, run after it on the same ranks, prints what the
    docs say."""
    example = tmp_path / "masked.py"
    example.write_text(doc_example("torch.md", "### Masks"))
    printed = torchrun_lines(2, TESTS / "torch_masks.py", str(example), timeout=300)
    summary = json.loads(next(line for line in printed if line.startswith("{")))
    assert summary["world"] == 2
    cases = summary["cases"]
    for case in cases:
        assert max(case["errors"]) < TOLERANCE, case
        assert case["control"] > 100 * TOLERANCE, case  # a mask one token off would show
    labels = {(c["case"].split()[0], c["config"]) for c in cases}
    for strategy in ("allgather_kv", "ring"):
        for layout in ("contiguous", "zigzag", "striped", "doc_zigzag", "doc_whole"):
            assert ("causal-documents", f"{strategy}+{layout}") in labels
        assert ("text", f"{strategy}+replicated_text") in labels
    assert ("causal-window-sinks", "ulysses+contiguous") in labels
    trained = {c["case"].split()[0] for c in cases if c["train"] and len(c["errors"]) == 4}
    assert trained == {"causal-documents", "full-documents", "causal-window-sinks", "window",
                       "causal-window-sinks-documents", "text"}
    assert not any(c["train"] for c in cases if c["config"].endswith("replicated_text"))
    plan = summary["plan"]
    assert [(c["config"], c["layout"]) for c in plan] == [
        ("ring+doc_whole", "doc_whole"), ("allgather_kv+striped", "striped"),
        ("ring+doc_whole", "contiguous")]  # one document: a window's default layout
    for case in plan:
        assert max(case["errors"]) < TOLERANCE and case["control"] > 100 * TOLERANCE, case
    refusals = summary["refusals"]
    assert refusals["short_cu_seqlens"].startswith("ValueError: cu_seqlens ends at 40, but the sequence "
                                                   "holds 42")
    assert "flash-attn's -1" in refusals["flash_window"]
    assert "layout replicated_text" in refusals["text_layout"]
    for call in ("different_cu_seqlens", "different_cu_seqlens_unshard"):
        expected = "ValueError: the ranks passed different cu_seqlens (documents: rank 0 passed 2, rank 1"
        assert refusals[call].startswith(expected), refusals[call]
    assert all(said != "not refused" for said in refusals.values()), refusals

    said = re.findall(r"rank (\d): 600 of 1200 tokens here; output off by (\S+), dq by (\d\S+\d)",
                      "\n".join(printed))  # the ranks' lines may come interleaved
    assert sorted(rank for rank, _, _ in said) == ["0", "1"], printed
    assert all(float(output) < 1e-5 and float(dq) < 1e-4 for _, output, dq in said), said


def doc_example(doc: str, after: str) -> str:
    """The first python block of ``docs/<doc>`` after the line ``after``."""
    text = (TESTS.parent / "docs" / doc).read_text()
    return text[text.index(after):].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_masked_call_in_masks_md_runs_and_prints_what_it_says(capsys):
    exec(compile(doc_example("masks.md", "## The masked call"), "masks.md", "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": off by")[0] for line in lines] == [
        "Ring on 2 ranks, per-document zigzag",
        "2-way Ulysses x 2-way AllGather-KV on 4 ranks, whole documents"]
    assert all(float(line.split("off by ")[1]) < 2e-5 for line in lines), lines
