"""Every rank of a ``ContextParallelAttention`` group passing the same ``seq_len``, checked.

The length picks the configuration and its layout, so ranks that pass different lengths
run different exchanges: in different buckets they wait on each other forever (gloo's
30-minute default), in one bucket gloo aborts the process on mismatched sizes. One small
all-gather of the lengths, at the first call with each length, turns that into the same
``ValueError`` on every rank, naming each rank's length. A length checked once costs nothing
after (a model calls the module from every layer with the same length). ``unshard`` checks at
every call (``agree``): it runs once per sequence, beside a gather of the whole sequence, and
a rank that skipped the check (its length checked before) would meet the others' check with
its data, which gloo answers by aborting the process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SameLength:
    """The lengths every rank of ``group`` passed, checked equal once per length; the ranks
    are named by their place in the layout (``layout_ranks[i]``: the group rank of rank i)."""

    def __init__(self, group: dist.ProcessGroup, layout_ranks: list[int]) -> None:
        self.group = group
        self.layout_ranks = layout_ranks
        self.agreed: set[int] = set()

    def check(self, seq_len: int) -> None:
        """Return when every rank passed ``seq_len`` (collective over the group at a length's
        first call); ``ValueError`` on every rank otherwise."""
        if seq_len not in self.agreed:
            self.agree(seq_len)

    def agree(self, seq_len: int) -> None:
        """Return when every rank passed ``seq_len``, ``ValueError`` on every rank otherwise:
        collective over the group at every call, so every rank meets the others' lengths
        before any data, whatever it checked before."""
        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        mine = torch.tensor([seq_len], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in self.layout_ranks]
        dist.all_gather(gathered, mine, group=self.group)
        lengths = [int(gathered[g].item()) for g in self.layout_ranks]
        if len(set(lengths)) > 1:
            passed = ", ".join(f"rank {rank} passed {length}" for rank, length in enumerate(lengths))
            raise ValueError(f"the ranks passed different seq_len ({passed}): every rank of the group must "
                             f"pass the same seq_len, the whole sequence's length (not its local shard's)")
        self.agreed.add(seq_len)
