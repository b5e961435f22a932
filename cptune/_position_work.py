"""The work of a configuration counted by token position: what each context block's kernel
calls compute, step by step, under a mask and a layout.

A plain workload in its default layout (full attention, or a causal mask over zigzag blocks)
is counted in closed form by ``cptune.cost``: any length costs the same. Every other one -
a window, sinks, packed documents, joint text, or a layout the search sweeps beside the
default - is counted here from the code the engines run, so the counts and the runs cannot
disagree about the mask's geometry:

- the steps: those ``cptune.strategies`` take (``kv_steps``): the Ring's own block, then the
  shared part (``SequenceLayout.shared``: all of a block, or a halo) of each block as far back
  as some block's queries reach (``SequenceLayout.reach``); AllGather-KV's gathered keys in
  position order (``gathered_positions``; its own block alone where no block sees another's);
  Ulysses' and one rank's own block;
- a step with no seen key makes no kernel call (``cptune.calls.any_seen``);
- the calls a step takes and their sizes (``cptune.calls.attention_calls``: many short
  documents mean many small calls), the pairs a fused kernel computes in each (a causal
  call its triangle, a call masked by position all of its rectangle), and the pairs the
  numpy kernel computes (``cptune.calls.kernel_blocks`` over a call's keys; plain masks
  ``cptune.kernels.computed_pairs`` on the key chunks it reads);
- the useful pairs: each seen (query, key) pair once (``Mask.row_counts`` over the block's
  real queries; ``tests/test_masks.py`` checks the calls compute each seen pair once).

All figures are per head; every rank of a head group does its block's work for heads / u heads.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cptune.calls import Call, any_seen, attention_calls, kernel_blocks
from cptune.config import CPConfig
from cptune.kernels import computed_pairs
from cptune.layout import SequenceLayout, position_runs
from cptune.workload import Workload

#: The source of AllGather-KV's one step: the gathered keys of every block.
GATHERED = -1


class StepWork(NamedTuple):
    """One kernel call's worth of a block's attention (one ``Primitives.attention``): the keys
    it reads and what it computes, per head."""

    #: The block whose keys the step reads (``GATHERED``: every block's, gathered).
    source: int
    #: Keys the step reads.
    keys: int
    #: Pairs each fused call computes: a causal call its triangle, others their rectangle.
    calls: tuple[int, ...]
    #: Pairs the numpy kernel computes (its row blocks' key segments, masked ones whole).
    numpy_pairs: int


class BlockWork(NamedTuple):
    """What one context block's ranks compute: its steps with a kernel call, and the pairs
    its real queries see (each once, whichever step computes it)."""

    steps: tuple[StepWork, ...]
    useful_pairs: int

    @property
    def fused_pairs(self) -> int:
        return sum(sum(step.calls) for step in self.steps)

    @property
    def numpy_pairs(self) -> int:
        return sum(step.numpy_pairs for step in self.steps)

    @property
    def fused_calls(self) -> int:
        return sum(len(step.calls) for step in self.steps)

    @property
    def keys_read(self) -> int:
        """Keys the block's kernel calls read, summed over its steps with a call."""
        return sum(step.keys for step in self.steps)


def counted_by_position(workload: Workload, config: CPConfig) -> bool:
    """Whether ``config``'s work on ``workload`` is counted here rather than in closed form:
    a mask beyond full or causal, or a layout other than the default."""
    return workload.masked or (config.layout is not None and config.context_degree > 1)


def kv_steps(layout: SequenceLayout, group: int) -> list[tuple[int, np.ndarray]]:
    """(source, key positions) of each step block ``group``'s strategy attends, in its order
    (``cptune.strategies``), with or without a seen key."""
    q_pos = layout.block_positions(group)
    c, strategy = layout.context_degree, layout.config.strategy
    if c == 1 or strategy == "ulysses" or (strategy == "allgather_kv" and layout.reach == 0):
        return [(group, q_pos)]
    if strategy == "allgather_kv":
        return [(GATHERED, layout.gathered_positions)]
    steps = [(group, q_pos)]
    for step in range(1, layout.reach + 1):
        source = (group - step) % c
        steps.append((source, layout.shared_positions(source)))
    return steps


def _fused_pairs(call: Call) -> int:
    rows, keys = call.rows.stop - call.rows.start, call.keys.stop - call.keys.start
    return rows * (rows + 1) // 2 if call.causal else rows * keys


def _numpy_pairs(q_pos: np.ndarray, k_pos: np.ndarray, workload: Workload) -> int:
    """Pairs the numpy kernel computes attending ``q_pos`` to ``k_pos``: its plan over all the
    keys (``kernel_blocks``; a plain mask's, chunk by chunk, in closed form: ``computed_pairs``)."""
    mask = workload.mask
    if mask.plain:
        def runs(positions: np.ndarray) -> list[tuple[int, int]]:
            return [(int(positions[a]), b - a) for a, b in position_runs(positions)]
        return computed_pairs(runs(q_pos), runs(k_pos), mask.causal, mask.seq_len)
    return sum((stop - start) * sum(hi - lo for lo, hi, _ in segments)
               for start, stop, segments in kernel_blocks(q_pos, k_pos, mask))


def block_work(layout: SequenceLayout, group: int, numpy: bool = False) -> BlockWork:
    """``BlockWork`` of block ``group`` (the numpy kernel's pairs counted where ``numpy``;
    else 0: counting its plan takes a pass over every row block)."""
    workload, mask = layout.workload, layout.workload.mask
    q_pos = layout.block_positions(group)
    steps = []
    for source, k_pos in kv_steps(layout, group):
        if not any_seen(q_pos, k_pos, mask):
            continue  # no kernel call: the engine skips it
        calls = tuple(_fused_pairs(call) for call in attention_calls(q_pos, k_pos, mask))
        computed = _numpy_pairs(q_pos, k_pos, workload) if numpy else 0
        steps.append(StepWork(source, len(k_pos), calls, computed))
    useful = int(mask.row_counts(layout.real_query_positions(group)).sum())
    return BlockWork(tuple(steps), useful)


@functools.lru_cache(maxsize=4096)  # pure: the prior asks for each configuration's often
def blocks_work(workload: Workload, config: CPConfig, numpy: bool = False) -> tuple[BlockWork, ...]:
    """``block_work`` of every context block of ``config`` on ``workload``."""
    layout = SequenceLayout(workload, config)
    return tuple(block_work(layout, g, numpy) for g in range(layout.context_degree))


def busiest(work: tuple[BlockWork, ...], kernel: str = "fused") -> BlockWork:
    """The block the step waits for: the most pairs ``kernel`` computes, then the most calls."""
    if kernel == "numpy":
        return max(work, key=lambda b: (b.numpy_pairs, len(b.steps)))
    return max(work, key=lambda b: (b.fused_pairs, b.fused_calls))
