"""Attention masks: which keys each query sees, as a rule over token positions.

A workload's mask is made of a few parts, each optional (``Workload``'s fields):

- ``causal``: a query sees the keys at or before its own position;
- ``window = (left, right)``: a query at ``i`` sees the keys at ``i - left .. i + right``
  (Mistral's, Gemma's sliding window; with ``causal``, ``right`` is 0);
- ``sinks = N``: beside a window, the first N tokens (of each document) are seen by every
  query (StreamingLLM's attention sinks; under ``causal`` only from their own position on);
- ``documents``: the sequence packs documents (varlen / THD); a query sees its own
  document's keys only, the other parts of the mask applied inside each document;
- ``text = N``: joint attention (MMDiT: FLUX, SD3): N text tokens before the image tokens,
  full attention over both. The mask is full; the text part matters to the layout (text
  replicated on every rank, or sharded with the image).

Padding keys (positions at or beyond the sequence's length) are seen by no query. The rule
is evaluated by position only, so every engine, the reference, the fused calls' plan and the
cost counts read the same mask (``Mask``), and a graph engine can hold it as constants.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cptune._files import FileRefused, read_regular

#: Position ranges [start, stop).
Ranges = tuple[tuple[int, int], ...]

#: The most documents one sequence packs: a million (a 1M-token sequence of 1-token documents).
#: More is a slip (a file of something else); a plan's schema and the store hold this many.
MAX_DOCUMENTS = 2**20
#: The largest documents file cptune reads (``read_documents``): a million lengths of up to 7
#: digits, one a line.
MAX_DOCUMENTS_BYTES = 8 * 2**20


@dataclass(frozen=True, order=True)
class Documents:
    """How a packed sequence is cut into documents: the given ``lengths`` (summing to the
    sequence's length), or one every ``every`` tokens, the last one the rest (the same rule at
    any length: what a shape searched at several lengths takes). Empty (no lengths, ``every``
    0): one sequence, no documents."""

    lengths: tuple[int, ...] = ()
    every: int = 0

    def __post_init__(self) -> None:
        if self.lengths and self.every:
            raise ValueError("documents: give their lengths or one length for all (every), not both")
        if len(self.lengths) > MAX_DOCUMENTS:
            raise ValueError(f"documents: {len(self.lengths):,} documents, more than the {MAX_DOCUMENTS:,} "
                             f"one sequence packs; give fewer (or one length for all)")
        for n in self.lengths:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"documents: every length must be a positive integer, got {n!r} "
                                 f"(a zero-length document holds no token: leave it out)")
        if isinstance(self.every, bool) or not isinstance(self.every, (int, np.integer)) or self.every < 0:
            raise ValueError(f"documents: every must be a positive number of tokens, got {self.every!r}")
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        object.__setattr__(self, "every", int(self.every))

    @classmethod
    def of(cls, value: Documents | int | Sequence[int] | None) -> Documents:
        """``value`` as documents: an int is one length for all, a sequence the lengths, None none."""
        if value is None:
            return cls()
        if isinstance(value, Documents):
            return value
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"documents: every must be a positive number of tokens, got {value!r}")
            return cls(every=int(value))
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(f"documents must be a list of lengths or one length for all, got {value!r}")
        if not value:
            raise ValueError("documents: an empty list holds no document; leave documents out for one "
                             "sequence")
        return cls(lengths=tuple(value))

    def __bool__(self) -> bool:
        return bool(self.lengths or self.every)

    def lengths_at(self, seq_len: int) -> tuple[int, ...]:
        """The documents' lengths in a sequence of ``seq_len`` tokens (one document: none cut)."""
        if self.lengths:
            if sum(self.lengths) != seq_len:
                raise ValueError(f"documents: their lengths sum to {sum(self.lengths)}, not the sequence's "
                                 f"{seq_len} tokens; give lengths that sum to it")
            return self.lengths
        if not self.every:
            return (seq_len,)
        whole, rest = divmod(seq_len, self.every)
        return (self.every,) * whole + ((rest,) if rest else ())

    def to_json(self) -> list[int] | int | None:
        """As a workload's JSON holds it: the lengths, one length for all, or None."""
        return list(self.lengths) if self.lengths else (self.every or None)

    def describe(self) -> str:
        if self.every:
            return f"documents of {self.every}"
        if len(self.lengths) <= 4:
            return f"{len(self.lengths)} document(s) ({', '.join(map(str, self.lengths))})"
        return f"{len(self.lengths)} documents ({min(self.lengths)}-{max(self.lengths)} tokens)"


def read_documents(path: str | Path) -> tuple[int, ...]:
    """The documents' lengths in the file at ``path``: one length a line (blank lines and
    ``#`` comments skipped) or one JSON list. A regular file of at most
    ``MAX_DOCUMENTS_BYTES``; ``ValueError`` in one line naming the file and the fix."""
    try:
        text = read_regular(path, MAX_DOCUMENTS_BYTES).decode()
    except FileRefused as refused:
        raise ValueError(f"documents file {refused}") from None
    except UnicodeDecodeError:
        raise ValueError(f"documents file {path}: not text; give one length a line or a JSON list") from None
    except OSError as exc:
        raise ValueError(f"documents file {path}: cannot read it ({exc.strerror}); check the path") from None
    if text.lstrip().startswith("["):
        try:
            found = json.loads(text)
        except ValueError:
            found = None
        if not isinstance(found, list) or not all(type(n) is int for n in found):
            raise ValueError(f"documents file {path}: not a JSON list of whole numbers; give one like "
                             f"[2048, 4096] or one length a line")
        lengths = found
    else:
        lengths = []
        for number, line in enumerate(text.splitlines(), 1):
            word = line.split("#", 1)[0].strip()
            if not word:
                continue
            if not (word.isascii() and word.isdigit()):
                raise ValueError(f"documents file {path}: line {number} holds {word[:40]!r}, not a length; "
                                 f"give one whole number of tokens a line")
            lengths.append(int(word))
    if not lengths:
        raise ValueError(f"documents file {path}: holds no length; give one whole number of tokens a line")
    try:
        return Documents(lengths=tuple(lengths)).lengths
    except ValueError as exc:
        raise ValueError(f"documents file {path}: {str(exc).removeprefix('documents: ')}") from None


def check_window(window: object) -> tuple[int, ...]:
    """``window`` as ``(left, right)`` (None or empty: no window); ``ValueError`` naming the fix."""
    if window is None or (isinstance(window, (tuple, list)) and not window):
        return ()
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in window):
        raise ValueError(f"window must be [left, right], two non-negative token counts, got {window!r}")
    return int(window[0]), int(window[1])


def check_mask(seq_len: int | None, causal: bool, window: tuple[int, ...], sinks: int, documents: Documents,
               text: int) -> None:
    """``ValueError`` naming the field and the fix where the mask's parts do not go together
    (or, given ``seq_len``, do not fit the sequence)."""
    if isinstance(sinks, bool) or not isinstance(sinks, (int, np.integer)) or sinks < 0:
        raise ValueError(f"sinks must be a non-negative number of tokens, got {sinks!r}")
    if isinstance(text, bool) or not isinstance(text, (int, np.integer)) or text < 0:
        raise ValueError(f"text must be a non-negative number of tokens, got {text!r}")
    if window and causal and window[1] != 0:
        raise ValueError(f"window: a causal query sees no key after its own, so a causal window is "
                         f"[left, 0], got [{window[0]}, {window[1]}]; drop causal or set right to 0")
    if sinks and not window:
        raise ValueError("sinks: attention sinks are the tokens every query sees beside its window; "
                         "give a window, or leave sinks out")
    if text and (causal or window or documents):
        raise ValueError("text: joint text and image attention is full over both; it takes no causal "
                         "mask, window or documents")
    if seq_len is None:
        return
    if window and max(window) >= seq_len:
        raise ValueError(f"window: [{window[0]}, {window[1]}] reaches across the whole {seq_len}-token "
                         f"sequence; use a full or causal mask, or a narrower window")
    if text >= seq_len:
        raise ValueError(f"text: {text} text tokens leave none of the {seq_len}-token sequence for the "
                         f"image; give fewer text tokens than the sequence holds")
    lengths = documents.lengths_at(seq_len)  # raises where given lengths do not sum to seq_len
    if sinks >= min(lengths):
        raise ValueError(f"sinks: {sinks} sink tokens fill a whole document ({min(lengths)} tokens); give "
                         f"fewer sinks than the shortest document holds")


class Mask:
    """A workload's mask as a rule over token positions (see the module docstring): which keys
    each query sees, and the position ranges a run of queries sees, some or all of them."""

    def __init__(self, seq_len: int, causal: bool = False, window: tuple[int, ...] = (), sinks: int = 0,
                 documents: Sequence[int] = ()) -> None:
        self.seq_len = seq_len
        self.causal = causal
        self.window = window
        self.sinks = sinks
        lengths = tuple(documents) or (seq_len,)
        #: Each document's first position, and the sequence's length after the last.
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    @functools.cached_property
    def key(self) -> tuple[object, ...]:
        """What the rule depends on: two masks with the same key are the same rule."""
        return (self.seq_len, self.causal, self.window, self.sinks, tuple(self.starts.tolist()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mask) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def plain(self) -> bool:
        """Whether the rule is full or causal attention over one sequence (no window, no documents)."""
        return not self.window and len(self.starts) <= 2

    @property
    def full(self) -> bool:
        """Whether every query sees every key (no causal mask, window or documents)."""
        return not (self.causal or self.window or len(self.starts) > 2)

    @property
    def documents(self) -> int:
        return len(self.starts) - 1

    def visible(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
        """Whether each query at ``q_pos`` sees each key at ``k_pos``: the arrays broadcast
        (``q_pos[:, None]`` against ``k_pos[None, :]`` for a matrix)."""
        q, k = np.asarray(q_pos), np.asarray(k_pos)
        seen = (k < self.seq_len) & (q < self.seq_len)
        if len(self.starts) > 2:
            seen &= self._document(q) == self._document(k)
        if self.causal:
            seen &= k <= q
        if self.window:
            left, right = self.window
            near = (k >= q - left) & (k <= q + right)
            if self.sinks:
                near |= (k - self.starts[self._document(k)]) < self.sinks
            seen &= near
        return seen

    def _document(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, positions, side="right") - 1

    def document_runs(self, first: int, last: int) -> list[tuple[int, int]]:
        """The run of consecutive positions ``first..last`` cut where documents begin, as
        (first, last) pieces each inside one document; padding positions (at the sequence's
        length or beyond) left out."""
        last = min(last, self.seq_len - 1)
        if first > last:
            return []
        inside = self.starts[(self.starts > first) & (self.starts <= last)]
        edges = [first, *inside.tolist(), last + 1]
        return [(a, b - 1) for a, b in zip(edges[:-1], edges[1:], strict=True)]

    def seen_ranges(self, first: int, last: int) -> tuple[Ranges, Ranges]:
        """(some, every): the key position ranges some query of the run ``first..last`` sees,
        and those every one of them sees, ascending and disjoint. The run lies inside one
        document (``document_runs``)."""
        doc = int(np.searchsorted(self.starts, first, side="right")) - 1
        start, stop = int(self.starts[doc]), int(self.starts[doc + 1])
        some_lo, some_hi, all_lo, all_hi = start, stop, start, stop
        if self.causal:
            some_hi, all_hi = min(some_hi, last + 1), min(all_hi, first + 1)
        if self.window:
            left, right = self.window
            some_lo, all_lo = max(some_lo, first - left), max(all_lo, last - left)
            some_hi, all_hi = min(some_hi, last + right + 1), min(all_hi, first + right + 1)
        some = [(some_lo, some_hi)] if some_lo < some_hi else []
        every = [(all_lo, all_hi)] if all_lo < all_hi else []
        if self.window and self.sinks:
            sink_stop = min(start + self.sinks, stop)
            if self.causal:  # a sink is seen from its own position on
                some.append((start, min(sink_stop, last + 1)))
                every.append((start, min(sink_stop, first + 1)))
            else:
                some.append((start, sink_stop))
                every.append((start, sink_stop))
        return _union(some), _union(every)

    def row_counts(self, q_pos: np.ndarray) -> np.ndarray:
        """How many keys each query at ``q_pos`` sees (0 for padding queries): the unmasked
        area row by row, in closed form (any length costs the same per query)."""
        q = np.asarray(q_pos, dtype=np.int64)
        real = q < self.seq_len
        qr = np.where(real, q, 0)
        doc = self._document(qr)
        start, stop = self.starts[doc], self.starts[doc + 1]
        lo, hi = start.copy(), stop.copy()
        if self.causal:
            hi = np.minimum(hi, qr + 1)
        if self.window:
            left, right = self.window
            lo, hi = np.maximum(lo, qr - left), np.minimum(hi, qr + right + 1)
        counts = np.maximum(hi - lo, 0)
        if self.window and self.sinks:
            sink_stop = np.minimum(start + self.sinks, stop)
            if self.causal:
                sink_stop = np.minimum(sink_stop, qr + 1)
            counts += np.maximum(np.minimum(sink_stop, lo) - start, 0)  # sinks before the window's start
        return np.where(real, counts, 0)

    @functools.cached_property
    def area(self) -> int:
        """(query, key) pairs the whole sequence's queries see, per head."""
        return int(self.row_counts(np.arange(self.seq_len)).sum())


def _union(ranges: list[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, empty ones dropped, overlapping or adjacent ones joined."""
    joined: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[0] < r[1]):
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], stop))
        else:
            joined.append((start, stop))
    return tuple(joined)
