"""The physical prior: a configuration's latency from its analytic terms and the hardware's rates.

``analytic_cost`` counts what a configuration does (FLOPs, bytes per collective, bytes through
device memory, kernels, steps); a ``Profile`` says how fast a hardware does each. A calibrated
host measured its rates (``cptune calibrate``); a described one has them from a topology file
(datasheets and published benchmarks). Both answer the same questions, so the prior has one
shape for both. It carries predictions where no measurement reaches: longer sequences, more
ranks, hardware that is only calibrated or only described.

    compute     = FLOPs the busiest rank's kernel executes (masked pairs it computes
                  included: ``computed_flops``) / attention rate per rank (at the work per
                  kernel call and head_dim: small blocks and small head_dims run slower;
                  the Ring's calls together count as one call where the profile charges
                  what each of its steps repeats, ``charges_ring_steps``, each call beyond
                  the first adding its fixed cost, ``ring_call_s``)
                  + attention calls x the fixed cost of one call however little its work
                  (one per step, or the fused calls ``cptune.calls`` plans where the profile's
                  engine cuts them by position, ``position_calls``)
                  (a described GPU's ``attention_call_us``, from a microbenchmark of the
                  kernel; a calibrated host's rate at the work per call already holds it)
    memory      = bytes of the memory-bound steps (permutes, GQA replication, the merges,
                  the Ring's query re-reads) / device-memory bandwidth; on a calibrated
                  host, the Ring's merges and query preparations at their measured cost per
                  element (the others are not calibrated and count 0). Where the profile's
                  engine runs the fused calls ``cptune.calls`` plans (``position_calls``), the
                  merges are the passes that engine makes (``analytic_cost``): each call's
                  partial merged into a float32 accumulator (the Ring's steps, causal
                  AllGather-KV's diagonals), the copies into it and the cast back
    overhead    = kernels launched outside the Ring's steps x the fixed cost of one launch
    all-to-all  = 3 calls (Q, K/V, O) x latency + bytes sent x time per byte  (head groups)
    all-gather  = latency + bytes sent x time per byte                          (context groups)
                  (time per byte: the slowest tier the traffic crosses, by its share of it)
    Ring        = c blocks; while a block's K/V streams in, compute on the block in hand runs
                  slower (overlap_slowdown, for as long as the transfer runs) and the step
                  waits for the slower of the two; the host launches a step's kernels while
                  the device runs them, so a step's launches cost only what the device hides not:
                  (c - 1) * max(block + slowdown * min(block, transfer) + merge + requery,
                                the step's launches, transfer) + last block
                  (p2p. An engine without point-to-point broadcasts every block, its own
                  included: c steps, the one beyond c - 1 hides behind nothing; the profile
                  says which: a calibration's engine spec, ``Profile.stream``). Under a mask
                  the p2p stream stops where the layout's reach does (a window's halo: one
                  step): r steps of r + 1 blocks, r = the stream's steps (``analytic_cost``)
    waits       = where ranks share cores (a calibrated host's ranks outnumbering its cores), the
                  blocking exchanges that follow a stretch of compute (Ulysses' last,
                  AllGather-KV's gather, each Ring step) x what one costs beyond its own time
                  with that many ranks busy (``Profile.exchange_wait_s``): it completes only
                  once its members run together, and the ranks computing beside them hold the
                  cores for their slices
    latency     = compute + memory + overhead + all-to-all + all-gather + the Ring's exposed time
                  + waits

A training step is that of its forward, then its backward's (``_backward_time``):
    compute     = BACKWARD_FLOPS_RATIO x the forward's FLOPs / (its rate x the hardware's
                  ``backward_speed``) + attention calls x the fixed cost of one call
    memory      = the backward's own memory-bound steps (``analytic_cost``'s
                  ``backward_memory_bytes``: Ulysses' permutes back, the float32 fold of
                  replicated KV heads, the gradients' float32 accumulations and casts back)
    overhead    = its kernels outside the Ring's steps x the fixed cost of one launch
                  (``backward_kernels``, and per call FlashAttention's two kernels around its
                  backward and the engine's three accumulations)
    exchanges   = those ``analytic_cost`` adds, which wait: Ulysses' 3 more all-to-alls,
                  AllGather-KV's gather again and reduce-scatter (a calibrated host reads it at
                  its all-gather's rates: the same bytes to the same peers); and the Ring's,
                  which overlap: (c - 1) * max(busy, step) + max(work, launches) + home, busy =
                  max(work + slowdown * min(block, step), launches), work = block + its
                  accumulations, launches = the step's kernels x the fixed cost of one launch,
                  a step bringing the next K/V block and passing a gradient on, home the last
                  gradient's way back
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from cptune._position_work import BlockWork, blocks_work, busiest, counted_by_position
from cptune.calls import busiest_calls
from cptune.config import CPConfig
from cptune.cost import (
    BACKWARD_CALL_KERNELS,
    BACKWARD_FLOPS_RATIO,
    COLLECTIVES,
    GRAD_ACCUMULATE_KERNELS,
    analytic_cost,
    attention_flops,
)
from cptune.hardware import TIERS, tier_of
from cptune.kernels import check_kernel, computed_pairs
from cptune.layout import SequenceLayout, heads_as_run, kv_replication, rank_groups
from cptune.model._profiles import Profile
from cptune.workload import Workload


@dataclass(frozen=True)
class PriorTime:
    """The prior's latency of one configuration, in seconds, split by what it is spent on."""

    compute_s: float
    all_to_all_s: float
    all_gather_s: float
    ring_exposed_s: float
    #: Memory-bound steps: permutes, GQA replication, the Ring's merges.
    memory_s: float = 0.0
    #: Fixed cost of the kernels launched.
    overhead_s: float = 0.0
    #: What blocking exchanges after compute cost beyond their own time where ranks share
    #: cores and others compute beside them (``Profile.exchange_wait_s``).
    wait_s: float = 0.0

    @functools.cached_property  # read three times per configuration weighed; a sum of arrays of variants
    def total_s(self) -> float:
        return (self.compute_s + self.all_to_all_s + self.all_gather_s + self.ring_exposed_s
                + self.memory_s + self.overhead_s + self.wait_s)

    @property
    def outside_compute(self) -> float:
        """The share of the total spent outside attention compute (communication, memory-bound
        steps, launches): where the prior's mechanisms are least sure (``STRUCTURAL_ERROR``)."""
        return (self.total_s - self.compute_s) / self.total_s

    @property
    def comm_s(self) -> float:
        """Communication not hidden behind compute, with the exchanges' waits on shared cores."""
        return self.all_to_all_s + self.all_gather_s + self.ring_exposed_s + self.wait_s

    def __add__(self, other: PriorTime) -> PriorTime:
        """Both one after the other (a training step: the forward, then the backward)."""
        return PriorTime(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


#: Longest padded sequence whose numpy-kernel work ``computed_flops`` counts block by block
#: (well under a second of counting); longer ones waste under rows_per_block / length.
EXACT_KERNEL_WORK_TOKENS = 2**20


@functools.lru_cache(maxsize=65536)  # pure; the prior asks for the same pairs often
def computed_flops(workload: Workload, config: CPConfig, kernel: str) -> int:
    """Attention FLOPs the busiest rank's ``kernel`` executes (4 * head_dim per computed
    (query, key) pair and head). A fused kernel: ``analytic_cost``'s useful FLOPs. The numpy
    kernel also computes the masked pairs inside each query row block that straddles the
    causal diagonal (``computed_pairs``): up to half a block's rows per query, so a short
    causal sequence costs up to 1.5x its useful work. Each rank attends its context block to
    every block: in one call over the keys in position order (AllGather-KV, Ulysses, one rank)
    or one call per block (Ring).
    Counted exactly up to ``EXACT_KERNEL_WORK_TOKENS``; beyond, the masked share is below
    0.1% and the useful FLOPs stand for it. A workload with a mask beyond full or causal, or a
    layout beyond the default, is counted from its plan (``cptune._position_work``): the
    fused calls' pairs (a call masked by position computes its whole rectangle), or the numpy
    kernel's row blocks' segments, of the block with the most."""
    check_kernel(kernel)
    workload = heads_as_run(workload, config)  # padded heads computed as real ones
    if counted_by_position(workload, config):  # a mask or a layout beyond the default: its plan's
        per_head = 4 * workload.batch * workload.head_dim * (workload.heads // config.head_group)
        work, numpy = _busiest_block(workload, config, kernel)
        return per_head * (work.numpy_pairs if numpy else work.fused_pairs)
    if kernel == "fused" or not workload.causal:
        return attention_flops(workload, config)
    layout = SequenceLayout(workload, config)
    if layout.padded_len > EXACT_KERNEL_WORK_TOKENS:
        return attention_flops(workload, config)

    def runs(group: int) -> list[tuple[int, int]]:
        return [(start, stop - start) for start, stop in layout.block_ranges(group)]

    blocks = range(config.context_degree)
    calls = ([runs(j) for j in blocks] if config.strategy == "ring"
             else [sorted(run for j in blocks for run in runs(j))])  # gathered in position order
    pairs = max(
        sum(computed_pairs(runs(g), keys, workload.causal, workload.seq_len) for keys in calls)
        for g in blocks
    )
    return 4 * workload.batch * workload.head_dim * (workload.heads // config.head_group) * pairs


def _busiest_block(workload: Workload, config: CPConfig, kernel: str) -> tuple[BlockWork, bool]:
    """The block of a workload counted by position whose work ``computed_flops`` counts (the
    most pairs ``kernel`` computes), and whether they are the numpy kernel's own (up to
    ``EXACT_KERNEL_WORK_TOKENS``; beyond, the fused calls' stand for them)."""
    numpy = kernel == "numpy" and SequenceLayout(workload, config).padded_len <= EXACT_KERNEL_WORK_TOKENS
    return busiest(blocks_work(workload, config, numpy), kernel if numpy else "fused"), numpy


@functools.lru_cache(maxsize=65536)  # pure, an int: the prior asks once per configuration weighed
def key_elements(workload: Workload, config: CPConfig, kernel: str) -> int:
    """K and V elements the kernel calls of ``computed_flops``'s busiest rank read, summed over
    its calls: a kernel that prepares each call's keys before any score (the numpy kernel makes
    K and V float32 and takes each key's norm) pays per key read, seen or not. The Ring reads
    its own block, then each block as far round as some query reaches that its queries see
    (``cptune._position_work``); AllGather-KV every key gathered (its own block alone where no
    block sees another's); Ulysses and one rank the whole sequence. Under packed documents a
    query sees only its document, so these passes weigh far more per FLOP than on the
    calibrated shapes (each query seeing nearly all of four times its rows in keys)."""
    workload = heads_as_run(workload, config)
    u, c = config.head_group, config.context_degree
    kv_heads = workload.kv_heads * kv_replication(workload, u) // u if u > 1 else workload.kv_heads
    if counted_by_position(workload, config):
        keys = _busiest_block(workload, config, kernel)[0].keys_read
    else:
        layout = SequenceLayout(workload, config)
        ring = config.strategy == "ring" and c > 1
        keys = busiest_calls(layout) * (layout.padded_len // c) if ring else layout.padded_len
    return 2 * workload.batch * kv_heads * workload.head_dim * keys


@functools.lru_cache(maxsize=65536)  # pure, an int: a training step's forward and backward both ask
def _calls(workload: Workload, config: CPConfig) -> int:
    """The fused calls the busiest rank makes (``cptune.calls``): in closed form for a plain
    workload (``busiest_calls``), from its plan for one counted by position (many short
    documents: many small calls, each paying the kernel's fixed cost)."""
    if counted_by_position(workload, config):
        return busiest(blocks_work(workload, config)).fused_calls
    return busiest_calls(SequenceLayout(workload, config))


def prior_time(workload: Workload, config: CPConfig, profile: Profile) -> PriorTime:
    """The physical prior of ``config`` on ``workload`` on ``profile``'s hardware and engine
    (see the module docstring). A description's figures may be numpy arrays of variants
    (``HardwareDescription.spread``, how its ranges are evaluated at once), so every step is
    elementwise: ``np.maximum``/``np.minimum``, never ``max``/``min``. A training step is its
    forward followed by its backward (``_backward_time``). Padded heads are priced as the real
    heads they are run as (``cptune.layout.heads_as_run``)."""
    workload = heads_as_run(workload, config)
    if workload.training:
        forward = _forward_time(workload.in_mode("forward"), config, profile)
        return forward + _backward_time(workload, config, profile)
    return _forward_time(workload, config, profile)


def _forward_time(workload: Workload, config: CPConfig, profile: Profile) -> PriorTime:
    cost = analytic_cost(workload, config, profile.stream, profile.position_calls)
    n, u, c = config.ranks, config.head_group, config.context_degree
    one_per_step = cost.kernels["attention"]
    calls = _calls(workload, config) if profile.position_calls else one_per_step
    flops = computed_flops(workload, config, profile.attention_kernel)
    work_per_call = flops if profile.charges_ring_steps else flops / calls
    compute = flops / profile.attention_rate(workload, n, work_per_call) + calls * profile.attention_call_s
    # the keys its calls read, prepared before any score (beyond those the rate holds)
    keys = key_elements(workload, config, profile.attention_kernel)
    compute += profile.key_preparation_s(workload, n, keys, flops, work_per_call)
    if calls > 1:  # the lookup is the prior's hot path; one call adds nothing
        compute += (calls - 1) * profile.ring_call_s(workload, n)
    memory = {step: profile.memory_time(step, nbytes, workload, n) if nbytes else 0.0
              for step, nbytes in cost.memory_bytes.items()}
    launch = profile.launch_s
    kernels = sum(cost.kernels.values()) + calls - one_per_step
    heads, context = rank_groups(config)

    all_to_all = 0.0
    if u > 1:
        all_to_all = profile.collective_time("all_to_all", n, heads, cost.bytes_sent["all_to_all"],
                                             cost.comm_steps["all_to_all"])
    all_gather = 0.0
    if cost.comm_steps["all_gather"]:
        all_gather = profile.collective_time("all_gather", n, context, cost.bytes_sent["all_gather"], 1)
    ring_exposed = 0.0
    # the Ring's stream, as the profile's engine expresses it (send/recv, or a broadcast per step)
    stream = profile.stream
    if steps := cost.comm_steps[stream]:
        transfer = profile.collective_time(stream, n, context, cost.bytes_sent[stream] / steps, 1)
        # steps hidden behind the attention on the block in hand: c - 1, or as far round as
        # the mask reaches (``SequenceLayout.reach``: a window's halo, one step)
        overlapped = steps if stream == "p2p" else c - 1
        block = compute / (overlapped + 1)
        ring_kernels = calls + cost.kernels["merge"] + cost.kernels["stream"]
        step_launches = (ring_kernels - 1) / overlapped
        # the host launches a step's kernels while the device runs them: the larger of the two
        per_step = (memory["merge"] + memory["requery"]) / overlapped
        busy = np.maximum(block + profile.overlap_slowdown * np.minimum(block, transfer) + per_step,
                          step_launches * launch)
        # a step beyond those (a broadcast of the rank's own block) has nothing to hide behind
        ring = ((steps - overlapped) * transfer + overlapped * np.maximum(busy, transfer)
                + np.maximum(block, launch))
        ring_exposed = ring - compute - memory["merge"] - memory["requery"]
        kernels -= ring_kernels
    return PriorTime(compute, all_to_all, all_gather, ring_exposed, memory_s=sum(memory.values()),
                     overhead_s=launch * kernels, wait_s=_waits(config, steps, profile))


def _waits(config: CPConfig, ring_steps: int, profile: Profile) -> float:
    """Seconds the busiest rank's blocking exchanges that follow a stretch of compute cost
    beyond their own time (``Profile.exchange_wait_s``): Ulysses' last exchange (the output's,
    after the attention; its first follows the previous sequence's last exchange or the shared
    start, with no compute between), AllGather-KV's gather (after the previous sequence's
    compute) where no Ulysses exchange comes before it, and each of the Ring's ``ring_steps``
    steps (after its block). None on one rank: nothing to exchange."""
    if config.ranks == 1:
        return 0.0
    ulysses = 1 if config.head_group > 1 else 0
    gather = 1 if config.strategy == "allgather_kv" and config.context_degree > 1 and not ulysses else 0
    return (ulysses + gather + ring_steps) * profile.exchange_wait_s(config.ranks, config.ranks)


def _backward_time(workload: Workload, config: CPConfig, profile: Profile) -> PriorTime:
    """The backward of a training ``workload`` (see the module docstring): the exchanges
    ``analytic_cost`` adds to its forward's, the attention backward at the forward's rate
    times the hardware's ``backward_speed``, and its own memory-bound steps and launches."""
    forward = workload.in_mode("forward")
    train = analytic_cost(workload, config, profile.stream, profile.position_calls)
    alone = analytic_cost(forward, config, profile.stream, profile.position_calls)
    sent = {kind: train.bytes_sent[kind] - alone.bytes_sent[kind] for kind in COLLECTIVES}
    steps = {kind: train.comm_steps[kind] - alone.comm_steps[kind] for kind in COLLECTIVES}
    n = config.ranks
    calls = _calls(forward, config) if profile.position_calls else alone.kernels["attention"]
    forward_flops = computed_flops(forward, config, profile.attention_kernel)
    # each call at the rate of its own work: no step of the backward's Ring is charged apart
    # (a calibrated host's merges and query re-reads are the forward's), so what each of its
    # calls repeats is in the rate of a call that size
    per_call = forward_flops / calls
    rate = profile.attention_rate(forward, n, per_call) * profile.backward_speed(forward, per_call)
    compute = BACKWARD_FLOPS_RATIO * forward_flops / rate + calls * profile.attention_call_s
    # the memory-bound steps and kernels beside the calls (0 on a calibrated host: in its rates)
    memory = sum(profile.memory_time(step, nbytes, workload, n) if nbytes else 0.0
                 for step, nbytes in train.backward_memory_bytes.items())
    ring_memory = (profile.memory_time("grad", train.backward_ring_bytes, workload, n)
                   if train.backward_ring_bytes else 0.0)
    call_kernels = calls * (BACKWARD_CALL_KERNELS + GRAD_ACCUMULATE_KERNELS)
    kernels = sum(train.backward_kernels.values()) + call_kernels
    launch = profile.launch_s
    heads, context = rank_groups(config)
    all_to_all = 0.0
    if steps["all_to_all"]:
        all_to_all = profile.collective_time("all_to_all", n, heads, sent["all_to_all"], steps["all_to_all"])
    all_gather = 0.0
    for kind in ("all_gather", "reduce_scatter"):
        if steps[kind]:
            all_gather += profile.collective_time(kind, n, context, sent[kind], steps[kind])
    ring_exposed, ring_steps = 0.0, 0
    if steps["p2p"]:
        reach = alone.comm_steps["p2p"]  # c - 1, or as far round as the mask reaches
        kv_block = alone.bytes_sent["p2p"] / reach
        grad_block = (sent["p2p"] - reach * kv_block) / (reach + 1)
        # each of c - 1 steps brings the next K/V block and passes the gradient of the one in
        # hand on, behind the backward of the block in hand and its accumulations; the host
        # launches a step's kernels while the device runs them, so a step takes the longer of
        # the two; the last gradient goes home after
        step = profile.collective_time("p2p", n, context, kv_block + grad_block, 2)
        home = profile.collective_time("p2p", n, context, grad_block, 1)
        block = compute / (reach + 1)
        step_launches = (train.backward_ring_kernels + call_kernels + calls) / (reach + 1) * launch
        work = block + ring_memory / (reach + 1)
        busy = np.maximum(work + profile.overlap_slowdown * np.minimum(block, step), step_launches)
        ring = reach * np.maximum(busy, step) + np.maximum(work, step_launches) + home
        ring_exposed = ring - compute - ring_memory
        kernels -= train.backward_ring_kernels + call_kernels
        ring_steps = reach
    elif steps["broadcast"]:
        raise ValueError("the backward's Ring is modelled on point-to-point streams only: no engine without "
                         "them trains")
    return PriorTime(compute, all_to_all, all_gather, ring_exposed, memory_s=memory,
                     overhead_s=launch * kernels, wait_s=_waits(config, ring_steps, profile))


def tier_split(workload: Workload, config: CPConfig, profile: Profile) -> dict[str, float]:
    """The prior's seconds of ``config`` by where they go: "compute" (attention, memory-bound
    steps, launches) and each link tier its exchanges cross (``cptune.hardware.TIERS``):
    Ulysses' all-to-all over its head groups' tier, the context exchange over theirs."""
    time = prior_time(workload, config, profile)
    heads, context = rank_groups(config)
    split = dict.fromkeys(("compute", *TIERS), 0.0)
    split["compute"] = float(time.compute_s + time.memory_s + time.overhead_s)
    split[tier_of(heads, profile.ranks_per_node)] += float(time.all_to_all_s)
    split[tier_of(context, profile.ranks_per_node)] += float(time.all_gather_s + time.ring_exposed_s)
    # the exchanges' waits on shared cores: where its exchanges run, its context's or its heads'
    exchanging = context if config.context_degree > 1 else heads
    split[tier_of(exchanging, profile.ranks_per_node)] += float(time.wait_s)
    return split
