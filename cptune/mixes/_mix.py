"""A length mix: the sequence lengths a training run or a deployment sees, with how often.

Read from a file (one length a line, a JSON list, a JSON histogram ``{"length": count}``, or a
NumPy ``.npy`` array of integers, never unpickled), a histogram or a Python list; refused in one
line when empty, not whole numbers, or below one. Whether its longest sequence fits in memory
depends on the hardware and the ranks: ``cptune.mixes.mix_costs`` checks that.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cptune._files import FileRefused, read_regular
from cptune.errors import CPTuneError
from cptune.workload import MAX_INT

#: Larger files are refused before parsing: 10 million lengths as text are about 80 MB.
MAX_MIX_BYTES = 128 * 2**20
#: The most sequences a mix holds (a histogram's counts summed): what one array of them costs
#: (8 bytes each) stays under 100 MB.
MAX_SEQUENCES = 10_000_000
_NPY_MAGIC = b"\x93NUMPY"


class MixError(CPTuneError, ValueError):
    """A length mix that cannot be used: unreadable, empty, not whole positive lengths, or
    longer than the ranks can hold."""


@dataclass(frozen=True, eq=False)
class LengthMix:
    """Sequence lengths, each sequence once, in the order given (a histogram's ascending):
    what the static answer weighs by frequency and a batch plan assigns one by one."""

    lengths: np.ndarray

    def __post_init__(self) -> None:
        array = np.asarray(self.lengths)
        if array.ndim != 1:
            raise MixError(f"a length mix is a flat list of lengths, got an array of shape {array.shape}")
        if not array.size:
            raise MixError("the length mix is empty: give at least one sequence length")
        if array.size > MAX_SEQUENCES:
            raise MixError(f"{array.size:,} sequences, more than the {MAX_SEQUENCES:,} a mix holds: give a "
                           f"histogram of lengths or a sample of the sequences")
        if not np.issubdtype(array.dtype, np.integer):
            raise MixError(f"lengths must be whole numbers of tokens, got {array.dtype} values")
        if (low := int(array.min())) < 1:
            where = int(np.argmax(array < 1))
            raise MixError(f"length {low} (sequence {where + 1}) is not a positive number of tokens: every "
                           f"sequence holds at least one token")
        if (high := int(array.max())) > MAX_INT:
            raise MixError(f"length {high:,} is longer than the {MAX_INT:,} tokens cptune counts")
        object.__setattr__(self, "lengths", array.astype(np.int64))
        self.lengths.setflags(write=False)

    @classmethod
    def of(cls, lengths: Iterable[int]) -> LengthMix:
        """A mix of ``lengths`` (Python ints or NumPy integers; ``MixError`` for anything else)."""
        values = list(lengths)
        # checked by type, not one by one (a batch plan reads a batch's lengths every step)
        if wrong := {k for k in set(map(type, values)) if k is bool or not issubclass(k, int | np.integer)}:
            bad = next((i, v) for i, v in enumerate(values) if type(v) in wrong)
            raise MixError(f"sequence {bad[0] + 1}: {bad[1]!r} is not a whole number of tokens")
        if values and max(values) > MAX_INT:
            too_long = next(v for v in values if v > MAX_INT)
            raise MixError(f"length {too_long:,} is longer than the {MAX_INT:,} tokens cptune counts")
        return cls(np.asarray(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64))

    @classmethod
    def from_histogram(cls, counts: Mapping[int, int]) -> LengthMix:
        """A mix of ``counts[length]`` sequences of each length, ascending."""
        items = sorted(counts.items()) if all(isinstance(k, int) for k in counts) else list(counts.items())
        for length, count in items:
            if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
                raise MixError(f"length {length!r}: a count must be a whole number of sequences (0 or more), "
                               f"got {count!r}")
        if sum(int(c) for _, c in items) > MAX_SEQUENCES:
            raise MixError(f"the histogram counts more than the {MAX_SEQUENCES:,} sequences a mix holds: "
                           f"scale its counts down (only their proportions matter to the static answer)")
        lengths = cls.of([k for k, _ in items]).lengths
        return cls(np.repeat(lengths, [int(c) for _, c in items]))

    @property
    def size(self) -> int:
        return int(self.lengths.size)

    @property
    def longest(self) -> int:
        return int(self.lengths.max())

    @property
    def shortest(self) -> int:
        return int(self.lengths.min())

    def histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct lengths, ascending, and how many sequences have each."""
        values, counts = np.unique(self.lengths, return_counts=True)
        return values, counts

    def describe(self) -> str:
        """E.g. "1,000 sequences of 128-131,072 tokens (median 2,048)"."""
        median = int(np.median(self.lengths))
        plural = "s" if self.size != 1 else ""
        return (f"{self.size:,} sequence{plural} of {self.shortest:,}-{self.longest:,} "
                f"tokens (median {median:,})")


def read_mix(path: str | Path) -> LengthMix:
    """The mix in the regular file at ``path``: a NumPy ``.npy`` array of integers (read with
    ``allow_pickle=False``), a JSON list of lengths or histogram ``{"length": count}``, or one
    length a line (blank lines and ``#`` comments skipped). ``MixError`` in one line, naming the
    file and where it goes wrong, for anything else."""
    try:
        data = read_regular(path, MAX_MIX_BYTES)
    except FileRefused as exc:
        raise MixError(str(exc)) from None
    except FileNotFoundError:
        raise MixError(f"{path}: no such file; name a file of sequence lengths") from None
    except OSError as exc:
        raise MixError(f"{path}: cannot be read ({exc.strerror}); name a file of sequence lengths") from None
    try:
        return _parse(data)
    except MixError as exc:
        raise MixError(f"{path}: {exc}") from None


def _parse(data: bytes) -> LengthMix:
    if data.startswith(_NPY_MAGIC):
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as exc:
            raise MixError(f"not a NumPy array of lengths cptune reads ({exc}); save integers with "
                           f"numpy.save") from None
        return LengthMix(array)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise MixError("neither text nor a NumPy .npy array: give one length a line, a JSON list, or "
                       "numpy.save's file") from None
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            value = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise MixError(f"not valid JSON ({exc})") from None
        if isinstance(value, dict):
            return LengthMix.from_histogram({_length_key(k): v for k, v in value.items()})
        if not isinstance(value, list):
            raise MixError("JSON must be a list of lengths or a histogram {\"length\": count}")
        return LengthMix.of(value)
    lengths = []
    for number, line in enumerate(text.splitlines(), start=1):
        word = line.split("#", 1)[0].strip()
        if not word:
            continue
        if not word.isascii() or not word.lstrip("+-").isdigit():
            raise MixError(f"line {number}: {word[:40]!r} is not a whole number of tokens (one length a "
                           f"line)")
        lengths.append(int(word))
    return LengthMix.of(lengths)


def _no_constant(name: str) -> object:
    raise MixError(f"{name} is not a length")


def _length_key(key: str) -> int:
    """A histogram's key as a length (JSON keys are strings)."""
    if not key.strip().isdigit() or not key.strip().isascii():
        raise MixError(f"histogram key {key!r} is not a whole number of tokens")
    return int(key)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The ``q`` quantile of ``values`` each counted ``weights`` times (the smallest value at or
    above that share of the count)."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    at = int(np.searchsorted(cumulative, q * cumulative[-1] - 1e-9 * cumulative[-1]))
    return float(values[order][min(at, len(order) - 1)])


def geometric_grid(lengths: Sequence[int], points: int) -> list[int]:
    """``lengths`` when there are at most ``points`` distinct ones, else ``points`` lengths spaced
    evenly in ratio from the shortest to the longest (both included)."""
    distinct = sorted(set(int(x) for x in lengths))
    if len(distinct) <= points:
        return distinct
    low, high = distinct[0], distinct[-1]
    grid = {round(math.exp(math.log(low) + (math.log(high) - math.log(low)) * i / (points - 1)))
            for i in range(points)}
    return sorted(grid | {low, high})
