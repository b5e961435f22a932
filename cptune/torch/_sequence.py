"""A full sequence cut into the shards a configuration's layout names, and put back together.

The layout (``cptune.layout.SequenceLayout``: the configuration's ``CPConfig.layout``, or the
workload's default) says which token positions each rank holds: the sequence padded to a
length every split divides, in the zigzag order for a causal workload split over more than
one context block, per document, striped, documents kept whole or joint attention's text
replicated where the configuration names that layout. These helpers apply it to tensors
whose second axis is the sequence ([batch, seq, ...]), with no process group involved.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from cptune.config import CPConfig
from cptune.layout import SequenceLayout
from cptune.workload import Workload

#: Layouts that deal out packed documents: a sequence of one document runs the default layout.
_DOCUMENT_LAYOUTS = ("doc_zigzag", "doc_whole")


def call_config(workload: Workload, config: CPConfig) -> CPConfig:
    """The configuration that runs ``workload``: ``config``, but where its layout deals out
    packed documents and this sequence holds one (a batch of one long document under a plan
    tuned for packed ones), the default layout (per-document zigzag of one document is zigzag)."""
    if config.layout in _DOCUMENT_LAYOUTS and len(workload.document_lengths) < 2:
        return config.with_layout(None)
    return config


@functools.lru_cache(maxsize=256)
def sequence_layout(workload: Workload, config: CPConfig) -> SequenceLayout:
    """The layout ``config`` runs ``workload`` in (``call_config``), built once per pair (a
    deployment asks for the same few lengths and packings over and over)."""
    return SequenceLayout(workload, call_config(workload, config))


def shard_length(workload: Workload, config: CPConfig, rank: int) -> int:
    """Tokens ``rank`` holds under ``config`` (padding, and joint text every rank holds,
    included); 0 for a rank beyond ``config.ranks``, which takes no part."""
    if rank >= config.ranks:
        return 0
    return len(sequence_layout(workload, config).rank_positions(rank))


def _check_sequence(x: torch.Tensor, seq_len: int, what: str) -> None:
    if x.dim() < 2 or x.shape[1] != seq_len:
        raise ValueError(f"{what} must be [batch, {seq_len}, ...] (the sequence on axis 1), "
                         f"got {list(x.shape)}")


def shard_sequence(x: torch.Tensor, workload: Workload, config: CPConfig, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` ([batch, workload.seq_len, ...]): the
    tokens ``SequenceLayout.rank_positions(rank)`` names, in that order, with zero rows where
    it names padding. A rank beyond ``config.ranks`` takes no part and gets an empty shard."""
    _check_sequence(x, workload.seq_len, "x")
    if rank < 0:
        raise ValueError(f"rank must be 0 or more, got {rank}")
    if rank >= config.ranks:
        return x[:, :0]
    positions = torch.from_numpy(sequence_layout(workload, config).rank_positions(rank)).to(x.device)
    real = positions < workload.seq_len
    shard = x.new_zeros((x.shape[0], len(positions), *x.shape[2:]))
    shard[:, real] = x.index_select(1, positions[real])
    return shard


def unshard_sequence(shards: Sequence[torch.Tensor], workload: Workload, config: CPConfig) -> torch.Tensor:
    """The full sequence [batch, workload.seq_len, ...] from every rank's shard (``shards[r]``
    is rank r's, for the ``config.ranks`` ranks that take part), padding dropped: the inverse
    of ``shard_sequence`` (tokens several ranks hold, replicated text, taken from the first)."""
    if len(shards) != config.ranks:
        raise ValueError(f"{config.describe()} needs {config.ranks} shards, one per rank in rank "
                         f"order; got {len(shards)}")
    layout = sequence_layout(workload, config)
    for rank, shard in enumerate(shards):
        piece = shard_length(workload, config, rank)
        if shard.dim() < 2 or shard.shape[1] != piece:
            raise ValueError(f"rank {rank}'s shard must be [batch, {piece}, ...] ({config.describe()} "
                             f"over {workload.seq_len} tokens), got {list(shard.shape)}")
    joined = torch.cat(list(shards), dim=1)
    positions = np.concatenate([layout.rank_positions(r) for r in range(config.ranks)])
    _, first = np.unique(positions, return_index=True)  # each position once, where it first comes
    first = first[positions[first] < workload.seq_len]
    index = torch.from_numpy(first).to(joined.device)
    full = joined.new_empty((joined.shape[0], workload.seq_len, *joined.shape[2:]))
    full[:, torch.from_numpy(positions[first]).to(joined.device)] = joined.index_select(1, index)
    return full
