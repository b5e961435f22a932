"""Every rank of a ``ContextParallelAttention`` group passing the same ``seq_len``, checked.

The length picks the configuration and its layout, so ranks that pass different lengths
run different exchanges: in different buckets they wait on each other forever (gloo's
30-minute default), in one bucket gloo aborts the process on mismatched sizes. One small
all-gather of the lengths, at the first call with each length, turns that into the same
``ValueError`` on every rank, naming each rank's length. A length checked once costs nothing
after (a model calls the module from every layer with the same length). Packed documents
(``cu_seqlens``) are checked beside the length: they pick the layout as the length does.
``unshard`` checks at every call (``agree``): it runs once per sequence, beside a gather of
the whole sequence, and a rank that skipped the check (its length checked before) would
meet the others' check with its data, which gloo answers by aborting the process.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


class SameLength:
    """The lengths (and packed documents) every rank of ``group`` passed, checked equal once
    per pair; the ranks are named by their place in the layout (``layout_ranks[i]``: the group
    rank of rank i)."""

    def __init__(self, group: dist.ProcessGroup, layout_ranks: list[int]) -> None:
        self.group = group
        self.layout_ranks = layout_ranks
        self.agreed: set[tuple[int, tuple[object, ...]]] = set()

    def check(self, seq_len: int, bounds: tuple[object, ...] = ()) -> None:
        """Return when every rank passed ``seq_len`` and the document boundaries ``bounds``
        (``cu_seqlens`` as given, empty for none), collective over the group at a pair's first
        call; ``ValueError`` on every rank otherwise."""
        if (seq_len, bounds) not in self.agreed:
            self.agree(seq_len, bounds)

    def agree(self, seq_len: int, bounds: tuple[object, ...] = ()) -> None:
        """Return when every rank passed ``seq_len`` and ``bounds``, ``ValueError`` on every
        rank otherwise: collective over the group at every call, so every rank meets the
        others' lengths before any data, whatever it checked before."""
        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        digest = int.from_bytes(hashlib.sha256(repr(bounds).encode()).digest()[:7], "big")
        documents = max(len(bounds) - 1, 0)
        mine = torch.tensor([seq_len, documents, digest], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in self.layout_ranks]
        dist.all_gather(gathered, mine, group=self.group)
        passed = [gathered[g].tolist() for g in self.layout_ranks]
        if len({length for length, _, _ in passed}) > 1:
            said = ", ".join(f"rank {rank} passed {length}" for rank, (length, _, _) in enumerate(passed))
            raise ValueError(f"the ranks passed different seq_len ({said}): every rank of the group must "
                             f"pass the same seq_len, the whole sequence's length (not its local shard's)")
        if len({(count, digest) for _, count, digest in passed}) > 1:
            said = ", ".join(f"rank {rank} passed {count}" for rank, (_, count, _) in enumerate(passed))
            raise ValueError(f"the ranks passed different cu_seqlens (documents: {said}): every rank of "
                             f"the group must pass the same boundaries, the whole sequence's documents")
        self.agreed.add((seq_len, bounds))
