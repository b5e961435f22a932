"""The attention kernels engines run, and the work each executes: what the cost model counts
as compute.

``"fused"`` (TensorRT's, FlashAttention's, PyTorch's scaled_dot_product_attention) skips
masked tiles; the masked work inside its diagonal tiles is neglected, so its work is the
useful FLOPs. ``"numpy"`` (the mpi engine's, ``cptune.engines.mpi``) reads keys in equal
chunks of at most ``KEY_CHUNK`` and queries in row blocks of ``rows_per_block`` rows, and
computes each block's keys up to its last query: under a causal mask the masked pairs
near the diagonal cost too (``computed_pairs``). The block sizes are defined here once:
the kernel runs with them and the cost model counts with them.
"""

from __future__ import annotations

import numpy as np

#: Attention kernels, by the work they execute (see the module docstring).
ATTENTION_KERNELS: tuple[str, ...] = ("numpy", "fused")

#: Most keys per chunk of the numpy kernel: K and V of one chunk (2 x 2048 x head_dim 128
#: float32 = 2 MiB) stay in cache.
KEY_CHUNK = 2048

#: Consecutive token positions in index order: (first position, count).
Run = tuple[int, int]


def key_chunk(keys: int) -> int:
    """Keys per chunk for a call over ``keys`` keys: as few chunks as ``KEY_CHUNK`` allows,
    all of one size. A short last chunk (1024 of 3072 keys) ran at a lower rate than the
    shapes calibration times, all of whose chunks are full: 3072 keys in two chunks of 1536
    took 0.95 of the time of 2048 + 1024 (16 heads x d64 fp32, one process, interleaved)."""
    if keys <= 0:
        return KEY_CHUNK
    chunks = -(-keys // KEY_CHUNK)
    return -(-keys // chunks)


def chunk_slices(keys: int) -> list[slice]:
    """The key index ranges the numpy kernel reads in turn for a call over ``keys`` keys
    (one, empty, where there are none: the call still returns its partial)."""
    size = key_chunk(keys)
    return [slice(start, start + size) for start in range(0, max(keys, 1), size)]


def rows_per_block(keys: int) -> int:
    """Query rows per block: about 2 MiB of float32 scores, between 256 and 1024 rows (fewer
    rows make the two GEMMs inefficient; more spill the scores out of cache)."""
    return min(1024, max(256, 2**19 // max(keys, 1)))


def _joined(runs: list[Run]) -> list[Run]:
    """``runs`` with neighbours whose positions continue one another made one run."""
    joined: list[Run] = []
    for first, count in runs:
        if count <= 0:
            continue
        if joined and joined[-1][0] + joined[-1][1] == first:
            joined[-1] = (joined[-1][0], joined[-1][1] + count)
        else:
            joined.append((first, count))
    return joined


def even_pieces(ranges: list[tuple[int, int, bool]]) -> list[list[tuple[int, int, bool]]]:
    """Index ``ranges`` (start, stop, a flag kept with each part) in consecutive pieces of
    ``key_chunk`` keys of their total, as the numpy kernel reads them: one piece where they
    hold at most ``KEY_CHUNK``, none where they hold no key."""
    total = sum(stop - start for start, stop, _ in ranges)
    size = room = key_chunk(total)
    if size >= total:
        return [ranges] if total else []
    pieces: list[list[tuple[int, int, bool]]] = [[]]
    for start, stop, flag in ranges:
        while start < stop:
            if not room:
                pieces.append([])
                room = size
            taken = min(stop - start, room)
            pieces[-1].append((start, start + taken, flag))
            start, room = start + taken, room - taken
    return pieces


def computed_pairs(q_runs: list[Run], k_runs: list[Run], causal: bool, seq_len: int) -> int:
    """(query, key) pairs per head the numpy kernel computes for queries and keys at these
    runs of positions, counted by run, not by position: the same plan (key chunks, query
    row blocks, each block's segments up to its last query), so pairs masked inside a block
    that straddles the diagonal count and skipped segments do not. Padding keys (positions
    >= ``seq_len``) are never computed; padding queries are."""
    queries = _joined(q_runs)
    total = 0
    for piece in even_pieces([(first, first + count, False) for first, count in _joined(k_runs)]):
        chunk = [(start, stop - start) for start, stop, _ in piece]
        rows = rows_per_block(sum(count for _, count in chunk))
        keys = [(first, min(count, seq_len - first)) for first, count in _joined(chunk)]
        firsts = np.array([first for first, real in keys if real > 0], dtype=np.int64)
        reals = np.array([real for _, real in keys if real > 0], dtype=np.int64)
        for first_q, count_q in queries:
            block_rows = np.minimum(rows, count_q - np.arange(0, count_q, rows, dtype=np.int64))
            if not causal:
                total += int(block_rows.sum() * reals.sum())
                continue
            last_q = first_q + np.arange(0, count_q, rows, dtype=np.int64) + block_rows - 1
            seen = np.clip(last_q[:, None] - firsts[None, :] + 1, 0, reals[None, :])
            total += int(block_rows @ seen.sum(axis=1))
    return total


def check_kernel(kernel: str) -> None:
    """Raise ``ValueError`` unless ``kernel`` is one of ``ATTENTION_KERNELS``."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
