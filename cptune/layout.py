"""Which tokens each rank holds, and which ranks talk to which.

Ranks are numbered ``r = g * u + j``: head group ``g`` (of ``c = ranks / u``) holds one
*context block* of the sequence, and its ``u`` members (j = 0..u-1) each start with a
contiguous piece of that block. Ulysses' all-to-all inside a head group gives every member
the whole block for ``heads / u`` heads; the context strategy (Ring or AllGather-KV) then
runs across the ``c`` ranks that share the same ``j``.

How the tokens are dealt out to the blocks is the configuration's layout (``CPConfig.layout``,
``cptune.config.LAYOUTS``), a tuned choice where the mask makes it matter (``layout_choices``):

- ``contiguous``: block g holds the g-th of c equal pieces (the default without a causal
  mask, and for a window: each block's queries reach only the blocks just before it);
- ``zigzag``: the sequence cut into 2c chunks, block g holding chunks g and 2c - 1 - g, so
  every block has the same share of the causal triangle (the default for a causal mask);
- ``striped``: the sequence cut into stripes (``stripe_tokens``), dealt round-robin, so every
  block has an equal share of every part of the sequence (TransformerEngine's JAX CP);
- ``doc_zigzag``: each packed document zigzagged on its own (TransformerEngine's THD layout:
  every document padded to a multiple of 2c);
- ``doc_whole``: documents kept whole, each on the block with the least attention so far,
  longest first (greedy by area): no block then sees another's keys;
- ``replicated_text``: joint attention's text tokens on every rank (xDiT's), the image
  tokens dealt out contiguously; otherwise the text is dealt out with the image.

The sequence is padded to a length every split divides: padding tokens take the positions
from ``seq_len`` on (padding keys are seen by no query, padding queries are dropped), at the
end of a block, or of a document in ``doc_zigzag``. Contiguous and zigzag blocks are worked
out by arithmetic (``block_ranges``: any length costs the same); the others hold arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import CPConfig
from cptune.workload import Workload

#: Groups of global ranks that run one collective at once.
Groups = Sequence[tuple[int, ...]]


def rank_at(group: int, member: int, head_group: int) -> int:
    """The rank of ``member`` j of head group g: ``r = g * u + j`` (the one place this
    numbering is written)."""
    return group * head_group + member


def rank_coordinates(rank: int, head_group: int) -> tuple[int, int]:
    """(head group g, member j) of ``rank``: the inverse of ``rank_at``."""
    return divmod(rank, head_group)


def head_group_members(rank: int, head_group: int) -> list[int]:
    """The ranks that exchange heads with ``rank`` (Ulysses all-to-all), in order."""
    group, _ = rank_coordinates(rank, head_group)
    return [rank_at(group, j, head_group) for j in range(head_group)]


def context_group_members(rank: int, head_group: int, ranks: int) -> list[int]:
    """The ranks that exchange K/V with ``rank`` (Ring / AllGather-KV), in order."""
    _, member = rank_coordinates(rank, head_group)
    return [rank_at(g, member, head_group) for g in range(ranks // head_group)]


@dataclass(frozen=True)
class RankGroups(Sequence[tuple[int, ...]]):
    """One configuration's head groups (``along="heads"``: the ``ranks / head_group``
    consecutive blocks of ``head_group`` ranks) or context groups (``along="context"``: the
    ``head_group`` groups of ranks ``j, j + u, j + 2u, ...``), every group once, in order.
    Held as the rule, not the members: a cluster's configuration costs the same to name
    whatever its size, and what it moves over a topology can be worked out from the rule
    (``cptune.hardware.traffic``). Members are computed when a group is read."""

    along: str
    ranks: int
    head_group: int

    def __post_init__(self) -> None:
        if self.along not in ("heads", "context"):
            raise ValueError(f"along must be 'heads' or 'context', got {self.along!r}")
        if self.ranks < 1 or self.head_group < 1 or self.ranks % self.head_group:
            raise ValueError(f"head group {self.head_group} must divide {self.ranks} ranks")

    @property
    def size(self) -> int:
        """Members per group."""
        return self.head_group if self.along == "heads" else self.ranks // self.head_group

    def __len__(self) -> int:
        return self.ranks // self.size

    def __getitem__(self, index: int) -> tuple[int, ...]:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"group {index} of {len(self)}")
        index %= len(self)
        if self.along == "heads":
            return tuple(head_group_members(rank_at(index, 0, self.head_group), self.head_group))
        return tuple(context_group_members(index, self.head_group, self.ranks))

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return (self[i] for i in range(len(self)))


def rank_groups(config: CPConfig) -> tuple[RankGroups, RankGroups]:
    """(head groups, context groups) of ``config`` as global ranks, every group once."""
    return (RankGroups("heads", config.ranks, config.head_group),
            RankGroups("context", config.ranks, config.head_group))


def kv_replication(workload: Workload, head_group: int) -> int:
    """How many copies of each KV head the Ulysses all-to-all needs: 1 when the KV heads
    split evenly over the head group, head_group / kv_heads when the group is larger than
    the KV heads (GQA/MQA: each rank then gets one replicated KV head, as DeepSpeed does).
    Of ``heads_as_run``'s workload where heads are padded."""
    if workload.kv_heads % head_group == 0:
        return 1
    return head_group // workload.kv_heads


def padded_heads(workload: Workload, config: CPConfig) -> tuple[int, int]:
    """(query heads, KV heads) as ``config`` runs them: ``workload``'s own, or with padded
    heads (``CPConfig.pad_heads``) the query heads rounded up to a multiple of the head group
    u, zero heads appended. MHA pads its K/V heads the same; MQA keeps its one KV head (every
    query head reads it); GQA appends zero KV heads so the appended query heads form whole
    groups of heads / kv_heads (``head_padding_refusal`` where they cannot)."""
    if not config.pad_heads:
        return workload.heads, workload.kv_heads
    heads = -(-workload.heads // config.head_group) * config.head_group
    if workload.kv_heads == 1:
        return heads, 1
    group = workload.heads // workload.kv_heads
    return heads, -(-heads // group)


def heads_as_run(workload: Workload, config: CPConfig) -> Workload:
    """``workload`` with the heads ``config`` computes and moves (``padded_heads``): what every
    count of work, traffic and memory prices, padded heads as real ones."""
    if not config.pad_heads:
        return workload
    heads, kv_heads = padded_heads(workload, config)
    return dataclasses.replace(workload, heads=heads, kv_heads=kv_heads)


def head_refusal(workload: Workload, config: CPConfig) -> tuple[str, str] | None:
    """Why ``config``'s heads (padded or not) cannot be split over its head group as Ulysses
    needs: (kind, one line a user acts on), kind "heads" (the query heads) or "kv_heads" (the
    K/V heads, the line naming them); None when they can."""
    u, heads, kv = config.head_group, workload.heads, workload.kv_heads
    if not config.pad_heads:
        if heads % u == 0:
            return None
        limit = (f"Ulysses limit: {heads} heads cannot be split over a head group of {u} (heads % "
                 f"head_group must be 0)")
        if (unpaddable := head_refusal(workload, config.with_padded_heads())) is not None:
            return "heads", f"{limit}, nor padded ({unpaddable[1].removeprefix('Ulysses limit: ')})"
        padded = -(-heads // u) * u
        return "heads", (f"{limit}; pad them to {padded} (pad_heads=True: {padded - heads} zero heads "
                         f"computed and moved, {100 * (padded - heads) / heads:.0f}% more attention work)")
    if heads % u == 0:
        return "heads", (f"Ulysses limit: pad_heads pads nothing, as {heads} heads already split over a "
                         f"head group of {u}; drop pad_heads")
    if u > heads:
        return "heads", (f"Ulysses limit: a head group of {u} is larger than the {heads} heads, so padded "
                         f"heads would leave ranks with no real head; use a head group of at most {heads}")
    padded, padded_kv = padded_heads(workload, config)
    if 1 < kv < heads and padded % (heads // kv):
        return "kv_heads", (
            f"pad_heads: {heads} heads padded to {padded} are not whole groups of {heads // kv} query heads "
            f"per KV head ({kv} KV heads), so padded heads would shift which KV head the real ones read; "
            f"use a head group that divides {heads} heads")
    if padded_kv % u and u % padded_kv:
        return "kv_heads", (
            f"pad_heads: {padded_kv} KV heads (padded from {kv}) and a head group of {u} do not divide each "
            f"other, as Ulysses needs; use a head group that divides {heads} heads")
    return None


def position_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges [start, stop) over which positions increase by exactly one."""
    breaks = (np.flatnonzero(np.diff(positions) != 1) + 1).tolist()
    edges = [0, *breaks, len(positions)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _dealt(workload: Workload, config: CPConfig, layout: str) -> list[np.ndarray]:
    """Every context block's positions under ``layout`` (one of those not worked out by
    arithmetic), all of one length whose part beyond the replicated tokens the head group
    divides; padding takes the positions from ``seq_len`` on, in the order it is dealt."""
    c, u, seq_len = config.context_degree, config.head_group, workload.seq_len
    if layout == "striped":
        stripe = stripe_tokens(seq_len, c)
        padded = -(-seq_len // (c * math.lcm(stripe, u))) * c * math.lcm(stripe, u)
        stripes = np.arange(padded).reshape(-1, stripe)
        return [stripes[g::c].reshape(-1) for g in range(c)]
    if layout == "replicated_text":
        text, image = workload.text, seq_len - workload.text
        share = -(-image // config.ranks) * config.ranks // c
        return [np.concatenate([np.arange(text), text + np.arange(g * share, (g + 1) * share)])
                for g in range(c)]
    padding = iter(range(seq_len, 2**62))
    starts = np.concatenate([[0], np.cumsum(workload.document_lengths)])
    documents = list(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True))
    pieces: list[list[np.ndarray]] = [[] for _ in range(c)]
    if layout == "doc_zigzag":
        for start, stop in documents:
            chunk = -(-(stop - start) // (2 * c))
            slots = np.array([start + i if start + i < stop else next(padding) for i in range(2 * c * chunk)])
            for g in range(c):
                mirror = 2 * c - 1 - g
                pieces[g] += [slots[g * chunk:(g + 1) * chunk], slots[mirror * chunk:(mirror + 1) * chunk]]
    else:  # doc_whole: longest first, each onto the block with the least attention so far
        mask, load = workload.mask, [0] * c
        for start, stop in sorted(documents, key=lambda d: (d[0] - d[1], d[0])):
            g = min(range(c), key=lambda b: (load[b], sum(len(p) for p in pieces[b]), b))
            load[g] += int(mask.row_counts(np.arange(start, stop)).sum())
            pieces[g].append(np.arange(start, stop))
        pieces = [sorted(p, key=lambda run: int(run[0])) for p in pieces]
    blocks = [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in pieces]
    length = -(-max(len(block) for block in blocks) // u) * u
    return [np.concatenate([block, [next(padding) for _ in range(length - len(block))]]).astype(np.int64)
            for block in blocks]


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def default_layout(workload: Workload, context_degree: int) -> str:
    """The layout a configuration without one takes: zigzag for a causal mask without a
    window split over more than one context block, else contiguous."""
    return "zigzag" if workload.causal and not workload.window and context_degree > 1 else "contiguous"


def runnable_layouts(workload: Workload, config: CPConfig) -> tuple[str, ...]:
    """Every layout that can deal ``workload``'s tokens out over ``config``'s context blocks
    (the default among them): with one block only the default (its ranks hold the whole
    sequence after Ulysses' exchange); joint text replicated or dealt out with the image;
    documents per-document zigzag or kept whole; any mask contiguous, zigzag or striped."""
    default = default_layout(workload, config.context_degree)
    if config.context_degree == 1:
        return (default,)
    if workload.text:
        return ("contiguous", "replicated_text")
    docs = ("doc_zigzag", "doc_whole") if len(workload.document_lengths) > 1 else ()
    return ("contiguous", "zigzag", "striped", *docs)


def layout_choices(workload: Workload, config: CPConfig) -> tuple[str | None, ...]:
    """The layouts a search sweeps for ``config`` on ``workload``, None (the default) first:
    those that deal the tokens out differently where the mask makes it matter. Full
    attention, a plain causal mask or a window: the default alone (every query sees every
    key, zigzag balances a causal triangle, and contiguous blocks keep a window's queries
    near their keys); joint text: the text replicated; packed documents: striped and whole
    documents, and under a causal mask contiguous and per-document zigzag besides. Other
    runnable layouts (``runnable_layouts``: a contiguous causal ring, as some frameworks run
    it) can be named; they are not swept."""
    if config.context_degree == 1:
        return (None,)
    if workload.text:
        return (None, "replicated_text")
    if len(workload.document_lengths) < 2:
        return (None,)
    if workload.window:
        return (None, "doc_whole")
    if workload.causal:
        return (None, "contiguous", "striped", "doc_zigzag", "doc_whole")
    return (None, "striped", "doc_whole")


def layout_refusal(workload: Workload, config: CPConfig) -> str | None:
    """Why ``config``'s layout cannot deal out ``workload``'s tokens, in words a user acts on;
    None when it can (``runnable_layouts``)."""
    layout = config.layout
    if layout is None or layout in runnable_layouts(workload, config):
        return None
    offered = runnable_layouts(workload, config)
    if config.context_degree == 1:
        why = "its ranks split no sequence between context blocks (one block: every rank holds it all)"
    elif layout == "replicated_text":
        why = "replicated_text replicates joint attention's text tokens, and this workload has none (--text)"
    elif layout in ("doc_zigzag", "doc_whole"):
        why = f"{layout} deals out packed documents, and this workload packs none (--documents)"
    else:
        why = f"joint text and image tokens are dealt out with the text replicated or not, not {layout}"
    return f"layout {layout}: {why}; layouts that fit: {', '.join(offered)}"


def normal(workload: Workload, config: CPConfig) -> CPConfig:
    """``config`` with a layout that is ``workload``'s default named as none: the one spelling
    of each configuration the store, the search and the model hold."""
    if config.layout is not None and config.layout == default_layout(workload, config.context_degree):
        return config.with_layout(None)
    return config


def stripe_tokens(seq_len: int, context_degree: int) -> int:
    """Tokens per stripe of the striped layout: 256 (a fused call's worth of rows), fewer
    where the sequence holds under four stripes per block."""
    return max(1, min(256, seq_len // (4 * context_degree)))


class SequenceLayout:
    """Token positions per rank and the two communication groups of each rank."""

    def __init__(self, workload: Workload, config: CPConfig) -> None:
        self.workload = workload
        self.config = config
        self.ranks = config.ranks
        self.head_group = config.head_group
        self.context_degree = c = config.context_degree
        self.layout = config.layout or default_layout(workload, c)
        self.zigzag = self.layout == "zigzag" and c > 1
        #: Tokens every rank holds besides its share (joint attention's text, replicated), at
        #: the start of every rank's and every block's positions; exchanges leave them out.
        self.replicated = workload.text if self.layout == "replicated_text" and c > 1 else 0
        self._arrays: list[np.ndarray] | None = None
        if self.layout == "contiguous" or self.zigzag or c == 1:
            granularity = math.lcm(self.ranks, 2 * c) if self.zigzag else self.ranks
            self.padded_len = -(-workload.seq_len // granularity) * granularity
        else:
            self._arrays = _dealt(workload, config, self.layout)
            self.padded_len = self.replicated + sum(len(block) - self.replicated for block in self._arrays)

    def block_ranges(self, group: int) -> list[tuple[int, int]]:
        """The position ranges [start, stop) context block ``group`` holds, in order: one,
        or two zigzag chunks; for the other layouts the runs of their positions (padding in
        a run of its own). Arithmetic only for contiguous and zigzag blocks, so the analytic
        cost of any length is free."""
        if self._arrays is not None:
            block = self._arrays[group]
            return [(int(block[a]), int(block[a]) + b - a) for a, b in position_runs(block)]
        c, n = self.context_degree, self.padded_len
        if not self.zigzag:
            size = n // c
            return [(group * size, (group + 1) * size)]
        chunk = n // (2 * c)
        return [(group * chunk, (group + 1) * chunk), ((2 * c - 1 - group) * chunk, (2 * c - group) * chunk)]

    @functools.cached_property
    def _blocks(self) -> list[np.ndarray]:
        """Token positions of every context block (what running a configuration needs),
        read-only: a plan of attention calls made for them holds while they live."""
        if self._arrays is not None:
            return [_read_only(block) for block in self._arrays]
        return [_read_only(np.concatenate([np.arange(start, stop) for start, stop in self.block_ranges(g)]))
                for g in range(self.context_degree)]

    def block_positions(self, group: int) -> np.ndarray:
        """Token positions of context block ``group`` (what each of its ranks holds after
        the Ulysses all-to-all), in the order the ranks hold them."""
        return self._blocks[group]

    def shared_positions(self, group: int) -> np.ndarray:
        """Positions of the part of block ``group`` its exchanges move (``shared``): all of
        it, or all but the replicated tokens, or a Ring's halo."""
        return self._blocks[group][self.shared]

    @functools.cached_property
    def shared(self) -> slice:
        """The index range of every block its exchanges move: past the replicated tokens
        every rank holds already; for a Ring that reaches one block back only the tail the
        next block's queries see (a halo), where that is less than the whole block."""
        if self.reach == 1 and self.config.strategy == "ring":
            return slice(self.replicated + self._halo_start, None)
        return slice(self.replicated, None)

    @functools.cached_property
    def gather_order(self) -> tuple[tuple[int, int, int], ...]:
        """(member, start, stop): the index ranges of each context block's shared part
        (``shared``) that, joined in this order, hold every position in increasing order (the
        zigzag halves of each block apart): the order an all-gather across head groups puts
        the keys in."""
        parts = self._shared_parts
        pieces = sorted((int(part[start]), member, start, stop) for member, part in enumerate(parts)
                        for start, stop in position_runs(part))
        return tuple((member, start, stop) for _, member, start, stop in pieces)

    @functools.cached_property
    def _shared_parts(self) -> list[np.ndarray]:
        return [block[self.replicated:] for block in self._blocks]

    @functools.cached_property
    def gathered_positions(self) -> np.ndarray:
        """Positions of the keys an all-gather in ``gather_order`` holds, after the
        replicated tokens: 0 .. padded_len - 1 (read-only)."""
        pieces = [self._shared_parts[member][start:stop] for member, start, stop in self.gather_order]
        return _read_only(np.concatenate([self._blocks[0][: self.replicated], *pieces]))

    # ----------------------------------------------------------------- what the mask lets a block see

    def sees(self, group: int, other: int) -> bool:
        """Whether some real query of block ``group`` sees some key of block ``other``'s
        shared part (its own block: any of its keys)."""
        return other in self._seen_blocks[group]

    @functools.cached_property
    def _seen_blocks(self) -> list[frozenset[int]]:
        """Per block, the blocks some real query of it sees a key of (itself included)."""
        if self.workload.mask.full:
            everything = frozenset(range(self.context_degree))
            return [everything] * self.context_degree
        owners = self._owners
        seen = []
        for group in range(self.context_degree):
            found = {group}
            for some in self._seen_ranges(group):
                for lo, hi in some:
                    found |= owners(lo, hi)
            seen.append(frozenset(found))
        return seen

    def _seen_ranges(self, group: int) -> list[tuple[tuple[int, int], ...]]:
        """The key position ranges some query of each run of block ``group`` sees."""
        mask = self.workload.mask
        return [mask.seen_ranges(a, b)[0] for start, stop in self._query_runs(group)
                for a, b in mask.document_runs(start, stop - 1)]

    def _query_runs(self, group: int) -> list[tuple[int, int]]:
        """Position ranges [start, stop) of block ``group``'s real queries."""
        seq_len = self.workload.seq_len
        return [(a, min(b, seq_len)) for a, b in self.block_ranges(group) if a < seq_len]

    @functools.cached_property
    def _owners(self) -> Callable[[int, int], set[int]]:
        """The blocks whose shared part holds some position of [lo, hi), by bisection over
        every block's runs of positions."""
        runs = sorted((a, b, g) for g in range(self.context_degree) for a, b in self.block_ranges(g)
                      if a < self.workload.seq_len)
        starts = np.array([a for a, _, _ in runs], dtype=np.int64)
        replicated = self.replicated

        def owners(lo: int, hi: int) -> set[int]:
            first = max(0, int(np.searchsorted(starts, lo, side="right")) - 1)
            last = int(np.searchsorted(starts, hi, side="left"))
            return {g for a, b, g in runs[first:last] if a < hi and b > lo and b > replicated}

        return owners

    @functools.cached_property
    def reach(self) -> int:
        """How many blocks back along the context group (in the Ring's order: block g gets
        block g - s at step s) some block's queries see keys: c - 1 where every block sees
        every other (full and causal attention), fewer for a window over contiguous blocks,
        0 where no block sees another's keys (documents kept whole on their blocks)."""
        c = self.context_degree
        if c == 1:
            return 0
        if self.workload.mask.full and not self.replicated:
            return c - 1
        return max(((g - h) % c for g in range(c) for h in self._seen_blocks[g] if h != g), default=0)

    @functools.cached_property
    def _halo_start(self) -> int:
        """Where, within every block's shared part, the keys the next block's queries see
        begin (the lowest such index over every block): a Ring that reaches one block back
        sends the part from there on."""
        c, start = self.context_degree, None
        for group in range(c):
            part = self._shared_parts[(group - 1) % c]
            seen = np.zeros(len(part), dtype=bool)
            for some in self._seen_ranges(group):
                for lo, hi in some:
                    seen |= (part >= lo) & (part < hi)
            if seen.any():
                first = int(np.argmax(seen))
                start = first if start is None else min(start, first)
        return start or 0

    def rank_positions(self, rank: int) -> np.ndarray:
        """Token positions rank ``rank`` holds before any exchange (a copy of its own): the
        replicated tokens, then its piece of its block's others."""
        group, member = rank_coordinates(rank, self.head_group)
        block, kept = self._blocks[group], self.replicated
        piece = (len(block) - kept) // self.head_group
        own = block[kept + member * piece : kept + (member + 1) * piece]
        return np.concatenate([block[:kept], own]) if kept else own.copy()

    def head_group_of(self, rank: int) -> int:
        return rank_coordinates(rank, self.head_group)[0]

    def head_group_ranks(self, rank: int) -> list[int]:
        """The ranks that exchange heads with ``rank`` (Ulysses all-to-all), in order."""
        return head_group_members(rank, self.head_group)

    def context_group_ranks(self, rank: int) -> list[int]:
        """The ranks that exchange K/V with ``rank`` (Ring / AllGather-KV), in order."""
        return context_group_members(rank, self.head_group, self.ranks)

    def real_query_positions(self, group: int) -> np.ndarray:
        """Positions of block ``group`` that are real tokens (not padding)."""
        block = self._blocks[group]
        return block[block < self.workload.seq_len]
