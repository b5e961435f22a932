"""``ContextParallelAttention`` under masks on gloo ranks, against unsharded masked attention
(tests/test_torch_masks.py launches it with ``python -m torch.distributed.run --standalone
--nproc-per-node 2 torch_masks.py [EXAMPLE]``; EXAMPLE, a script run after it on the same
ranks: docs/torch.md's masked example).

Every case builds the module for one configuration on all ranks (every strategy and head
group, in every layout that deals its mask out), cuts the full sequence with ``shard`` (the
documents given by ``cu_seqlens``), runs the forward and, where the configuration trains, the
backward from a fixed output gradient, and puts the output and dQ, dK, dV back together with
``unshard``. The reference is attention over the whole sequence in float64 with a dense mask
built here from the definitions (documents by their boundaries, causal, window, sinks), apart
from ``cptune.masks``. Rank 0 prints one JSON line: {"world", "cases": [{"case", "config",
"errors": [out, dq, dk, dv], "control"}], "refusals": {...}}, ``control`` the output's error
against the reference of a mask perturbed by one token (what a wrong mask would cost).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from cptune.config import CPConfig
from cptune.feasibility import enumerate_configs, feasibility
from cptune.layout import runnable_layouts
from cptune.plans import Bucket, Plan, PlanHardware
from cptune.plans._plan import launch_for
from cptune.torch import ContextParallelAttention
from cptune.torch._sequence import sequence_layout
from cptune.version import __version__
from cptune.workload import AttentionShape

HEADS, HEAD_DIM, BATCH = 4, 8, 2
#: Not a multiple of 4: every layout pads.
SEQ_LEN = 42
#: name -> (causal, window, sinks, cu_seqlens, text): the masks a deployment passes.
MASKS: dict[str, tuple[bool, tuple[int, int] | None, int, list[int] | None, int]] = {
    "causal-documents": (True, None, 0, [0, 5, 23, 42], 0),
    "full-documents": (False, None, 0, [0, 17, 20, 42], 0),
    "causal-window-sinks": (True, (6, 0), 2, None, 0),
    "window": (False, (5, 3), 0, None, 0),
    "causal-window-sinks-documents": (True, (4, 0), 1, [0, 9, 30, 42], 0),
    "text": (False, None, 0, None, 10),
}


def dense_mask(seq_len: int, causal: bool, window: tuple[int, int] | None, sinks: int,
               cu_seqlens: Sequence[int] | None) -> torch.Tensor:
    """[seq, seq] boolean: query i sees key j, from the definitions in docs/masks.md."""
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    bounds = torch.tensor(list(cu_seqlens) if cu_seqlens else [0, seq_len])
    doc = torch.bucketize(torch.arange(seq_len), bounds[1:], right=True)
    start = bounds[doc]
    seen = doc[:, None] == doc[None, :]
    if causal:
        seen &= j <= i
    if window is not None:
        near = (j >= i - window[0]) & (j <= i + window[1])
        if sinks:
            near |= (j - start[None, :]) < sinks
        seen &= near
    return seen


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention in float64 on the whole sequence, [batch, seq, heads, head_dim]."""
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
    scores = (qh @ kh.transpose(-1, -2)) / HEAD_DIM**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(1, 2)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max())


def perturbed(seq_len: int, causal: bool, window: tuple[int, int] | None, sinks: int,
              cu_seqlens: list[int] | None, text: int) -> torch.Tensor:
    """The mask one token off: the first document boundary moved, the window one narrower,
    one sink fewer, or the text seeing only the text."""
    if cu_seqlens is not None and window is None:
        return dense_mask(seq_len, causal, window, sinks, [0, cu_seqlens[1] + 1, *cu_seqlens[2:]])
    if sinks:
        return dense_mask(seq_len, causal, window, sinks - 1, cu_seqlens)
    if window is not None:
        return dense_mask(seq_len, causal, (window[0] - 1, window[1]), sinks, cu_seqlens)
    seen = dense_mask(seq_len, causal, window, sinks, cu_seqlens)
    seen[:text, text:] = False
    return seen


def run_case(cp: ContextParallelAttention, name: str, seed: int, train: bool,
             seq_len: int = SEQ_LEN) -> dict[str, object]:
    causal, window, sinks, cu_seqlens, text = MASKS[name]
    return run_mask(cp, (causal, window, sinks, cu_seqlens, text), seed, train, seq_len)


def run_mask(cp: ContextParallelAttention, mask: tuple, seed: int, train: bool,
             seq_len: int) -> dict[str, object]:
    """``cp`` on a random batch under ``mask`` (as ``MASKS`` holds them), sharded, run and
    unsharded: the errors of the output (and the gradients) against the reference."""
    causal, window, sinks, cu_seqlens, text = mask
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq_len, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    k, v = torch.randn(2, BATCH, seq_len, cp.shape.kv_heads, HEAD_DIM, generator=generator,
                       dtype=torch.float64)
    dout = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    bounds = torch.tensor(cu_seqlens, dtype=torch.int32) if cu_seqlens else None  # as flash-attn gives them

    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference(*exact, dense_mask(seq_len, causal, window, sinks, cu_seqlens))
    (expected * dout).sum().backward()
    control = reference(q, k, v, perturbed(seq_len, causal, window, sinks, cu_seqlens, text))

    local = [cp.shard(t.float(), bounds).requires_grad_(train) for t in (q, k, v)]
    with torch.set_grad_enabled(train):
        out = cp(*local, seq_len, bounds)
    if train:
        out.backward(cp.shard(dout.float(), bounds))
    got = [cp.unshard(out.detach(), seq_len, bounds)]
    wanted = [expected.detach()]
    if train:
        got += [cp.unshard(t.grad, seq_len, bounds) for t in local]  # type: ignore[arg-type]
        wanted += [t.grad for t in exact]  # type: ignore[misc]
    return {"errors": [relative_error(g, w) for g, w in zip(got, wanted, strict=True)],
            "control": relative_error(got[0], control)}


def every_case(world: int) -> list[dict[str, object]]:
    cases: list[dict[str, object]] = []
    for name, (causal, window, sinks, cu_seqlens, text) in MASKS.items():
        for kv_heads in (HEADS, 2, 1):
            shape = AttentionShape(HEADS, kv_heads, HEAD_DIM, BATCH, "fp32", causal, window=window or (),
                                   sinks=sinks, text=text)
            bounds = cu_seqlens or [0, SEQ_LEN]
            lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            workload = AttentionShape(HEADS, kv_heads, HEAD_DIM, BATCH, "fp32", causal, window=window or (),
                                      sinks=sinks, documents=lengths if cu_seqlens else None,
                                      text=text).at(SEQ_LEN)
            configs = {CPConfig(c.strategy, c.ranks, c.head_group) for c in enumerate_configs(workload, world)
                       if c.ranks == world}
            for config in sorted(configs, key=lambda c: c.label):
                for layout in runnable_layouts(workload, config):
                    laid = config.with_layout(layout)
                    if feasibility(workload, laid):
                        continue
                    train = not feasibility(workload.in_mode("train"), laid)
                    cp = ContextParallelAttention(laid, shape)
                    case = {"case": f"{name} {kv_heads}kv", "config": laid.label, "train": train}
                    cases.append(case | run_case(cp, name, len(cases), train))
    return cases


def plan_cases(world: int) -> list[dict[str, object]]:
    """A plan whose buckets name layouts (whole documents up to 30 tokens, striped beyond) for
    a causal window with sinks, run with documents at a length in each bucket and with one
    document (whole documents then deal out as the default layout)."""
    shape = AttentionShape(HEADS, 2, HEAD_DIM, BATCH, "fp32", True, window=(6, 0), sinks=2)
    buckets = [(30, CPConfig("ring", world, layout="doc_whole")),
               (64, CPConfig("allgather_kv", world, layout="striped"))]
    made, start = [], 1
    for stop, config in buckets:
        made.append(Bucket(start, stop, stop, config, 1.0, (0.9, 1.1), "model", ()))
        start = stop + 1
    hardware = PlanHardware(fingerprint="0123456789abcdef", description="a test host", kind="host", name=None)
    plan = Plan(hardware, shape, tuple(made), launch_for(world, world, False), __version__,
                "2026-01-01T00:00:00+00:00")
    cp = ContextParallelAttention(plan)
    cases = []
    for seq_len, cu_seqlens in ((30, [0, 10, 30]), (42, [0, 5, 23, 42]), (30, None)):
        mask = (True, (6, 0), 2, cu_seqlens, 0)
        layout = sequence_layout(cp.workload(seq_len, cu_seqlens), cp.config_for(seq_len)).layout
        cases.append({"case": f"plan {seq_len} {len(cu_seqlens or [0, 1]) - 1} documents", "layout": layout,
                      "config": cp.config_for(seq_len).label} | run_mask(cp, mask, seq_len, True, seq_len))
    return cases


def refusals() -> dict[str, str]:
    """What the module refuses, with the fix (every rank raises the same)."""
    shape = AttentionShape(HEADS, HEADS, HEAD_DIM, BATCH, "fp32", True)
    cp = ContextParallelAttention(CPConfig("ring", 2), shape)
    x = torch.zeros(BATCH, SEQ_LEN, HEADS, HEAD_DIM)
    mine = [0, 10 + dist.get_rank(), SEQ_LEN]  # each rank its own boundaries
    calls = {
        "short_cu_seqlens": lambda: cp.shard(x, [0, 10, 40]),
        "backward_cu_seqlens": lambda: cp.shard(x, [0, 10, 10, 42]),
        "not_from_zero": lambda: cp.shard(x, [1, 42]),
        "float_cu_seqlens": lambda: cp.shard(x, torch.tensor([0.0, 42.0])),
        "wide_window": lambda: ContextParallelAttention(CPConfig("ring", 2), shape, window=(50, 0)).shard(x),
        "flash_window": lambda: ContextParallelAttention(CPConfig("ring", 2), shape, window=(8, -1)),
        "causal_right": lambda: ContextParallelAttention(CPConfig("ring", 2), shape, window=(8, 2)),
        "text_layout": lambda: ContextParallelAttention(CPConfig("ring", 2, layout="replicated_text"), shape),
        "different_cu_seqlens": lambda: cp(*(cp.shard(x, mine),) * 3, SEQ_LEN, mine),
        "different_cu_seqlens_unshard": lambda: cp.unshard(cp.shard(x, mine), SEQ_LEN, mine),
    }
    said = {}
    for name, call in calls.items():
        try:
            with torch.no_grad():
                call()
            said[name] = "not refused"
        except ValueError as refused:
            said[name] = f"{type(refused).__name__}: {refused}"
    return said


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    summary = {"world": world, "cases": every_case(world), "plan": plan_cases(world), "refusals": refusals()}
    if dist.get_rank() == 0:
        print(json.dumps(summary), flush=True)
    if len(sys.argv) > 1:  # a script of its own next (docs/torch.md's example), on the same ranks
        # in the world made above: a second default group on torchrun's store would meet the first
        # one's keys there (the group count starts again after a destroy) and may wait forever
        made = dist.init_process_group
        dist.init_process_group = lambda *args, **kw: None if dist.is_initialized() else made(*args, **kw)
        example = Path(sys.argv[1])
        exec(compile(example.read_text(), str(example), "exec"), {"__name__": "__main__"})
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
