"""The shape of one attention layer: what cptune tunes a strategy for."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cptune.masks import Documents, Mask, check_mask, check_window

#: Workload dtypes and the numpy dtype each travels as between ranks. numpy has no
#: bfloat16, so bf16 travels as float16: same width, so the bytes on the wire are real.
WIRE_DTYPES: dict[str, np.dtype] = {
    "bf16": np.dtype(np.float16),
    "fp16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
}


#: What one run of a layer is: ``forward`` (inference: the attention's output) or ``train``
#: (the forward, then the backward from a given output gradient: gradients of Q, K and V).
MODES: tuple[str, ...] = ("forward", "train")


def check_mode(mode: object) -> str:
    """``mode`` if it is one of ``MODES``, else ``ValueError`` naming them."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return str(mode)


#: The largest integer cptune takes anywhere (a size, a count, an id): what a database's
#: integer column (64-bit, signed) and numpy's int64 hold. Every reader of user input (the
#: command line's flags, TOML files, ``Workload`` and ``CPConfig``) refuses a larger one.
MAX_INT = 2**63 - 1
#: How ``MAX_INT`` is named in messages.
MAX_INT_TEXT = f"{MAX_INT} (2^63 - 1)"


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > MAX_INT:
        raise ValueError(f"{name} must be at most {MAX_INT_TEXT}, got {value!r}")


def _check_layer(heads: int, head_dim: int, kv_heads: int, batch: int, dtype: str, causal: object) -> None:
    """``ValueError`` naming the field for a bad layer shape (everything but the length and mask)."""
    for name, value in dict(heads=heads, head_dim=head_dim, kv_heads=kv_heads, batch=batch).items():
        check_positive_int(name, value)
    if heads % kv_heads:
        raise ValueError(
            f"kv_heads: {heads} query heads cannot share {kv_heads} KV heads "
            f"evenly (heads must be a multiple of kv_heads)"
        )
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WIRE_DTYPES)}, got {dtype!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be True or False, got {causal!r}")


@dataclass(frozen=True, init=False)
class Workload:
    """One attention layer: ``batch`` sequences of ``seq_len`` tokens, ``heads`` query
    heads of ``head_dim`` and ``kv_heads`` key/value heads (None: as many as query heads;
    fewer means GQA, one means MQA), run in ``mode`` (``MODES``: a training layer is a
    workload of its own), under a mask (``cptune.masks``): ``causal``, a sliding ``window``
    (left, right) with ``sinks``, packed ``documents`` (their lengths, or one length for all),
    or ``text`` tokens of joint text and image attention. Validated on construction: a bad
    value raises ``ValueError`` naming the field and the fix."""

    seq_len: int
    heads: int
    head_dim: int
    kv_heads: int
    batch: int
    dtype: str
    causal: bool
    mode: str
    window: tuple[int, ...]
    sinks: int
    documents: Documents
    text: int

    def __init__(
        self,
        seq_len: int,
        heads: int,
        head_dim: int,
        kv_heads: int | None = None,
        batch: int = 1,
        dtype: str = "bf16",
        causal: bool = False,
        mode: str = "forward",
        window: Sequence[int] | None = None,
        sinks: int = 0,
        documents: Documents | int | Sequence[int] | None = None,
        text: int = 0,
    ) -> None:
        kv_heads = heads if kv_heads is None else kv_heads
        check_positive_int("seq_len", seq_len)
        _check_layer(heads, head_dim, kv_heads, batch, dtype, causal)
        checked_window, checked_documents = check_window(window), Documents.of(documents)
        check_mask(int(seq_len), bool(causal), checked_window, sinks, checked_documents, text)
        sizes = dict(seq_len=seq_len, heads=heads, head_dim=head_dim, kv_heads=kv_heads, batch=batch)
        for name, value in sizes.items():
            object.__setattr__(self, name, int(value))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "causal", bool(causal))
        object.__setattr__(self, "mode", check_mode(mode))
        object.__setattr__(self, "window", checked_window)
        object.__setattr__(self, "sinks", int(sinks))
        object.__setattr__(self, "documents", checked_documents)
        object.__setattr__(self, "text", int(text))
        # hashed once: every cache of the prior is keyed by the workload
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self.__dict__["_hash"]  # type: ignore[no-any-return]

    @property
    def mask(self) -> Mask:
        """The mask as a rule over token positions (``cptune.masks.Mask``)."""
        return _mask(self.seq_len, self.causal, self.window, self.sinks, self.documents)

    @property
    def document_lengths(self) -> tuple[int, ...]:
        """The packed documents' lengths (one document, the whole sequence, when none are packed)."""
        return self.documents.lengths_at(self.seq_len)

    @property
    def masked(self) -> bool:
        """Whether the mask holds more than full or causal attention (a window, documents, text)."""
        return bool(self.window or self.documents or self.text)

    @property
    def training(self) -> bool:
        """Whether a run is the forward and the backward (``mode`` "train")."""
        return self.mode == "train"

    def in_mode(self, mode: str) -> Workload:
        """This layer run in ``mode`` (itself where it runs so already; the prior asks for a
        training layer's forward once per configuration it weighs, so each is made once)."""
        return self if mode == self.mode else _in_mode(self, mode)

    @property
    def wire_dtype(self) -> np.dtype:
        """The numpy dtype Q, K, V and O travel in between ranks."""
        return WIRE_DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.heads // self.kv_heads

    @property
    def shape(self) -> AttentionShape:
        """This layer without its sequence length."""
        return AttentionShape(self.heads, self.kv_heads, self.head_dim, self.batch, self.dtype, self.causal,
                              self.mode, self.window, self.sinks, self.documents, self.text)

    def describe(self) -> str:
        return f"seq {self.seq_len} x {self.shape.describe()}"

    def flags(self, length_flag: str = "--seq-len") -> list[str]:
        """This workload as the command line's workload flags (``length_flag`` names the
        length: ``cptune measure`` takes ``--seq-len``, ``cptune search`` ``--seq-lens``), the
        defaults left out but the dtype: what a printed command a user runs is made of."""
        words = [length_flag, str(self.seq_len), "--heads", str(self.heads)]
        words += ["--kv-heads", str(self.kv_heads)] if self.kv_heads != self.heads else []
        words += ["--head-dim", str(self.head_dim)]
        words += ["--batch", str(self.batch)] if self.batch != 1 else []
        return [*words, "--dtype", self.dtype, *(["--causal"] if self.causal else []),
                *(["--mode", self.mode] if self.training else []), *self.shape.mask_flags()]

    def to_dict(self) -> dict[str, object]:
        """Plain JSON, the mask's parts only where set (so a plain workload reads as before
        masks existed); ``Workload(**to_dict())`` is the same workload."""
        shape = self.shape.to_dict()
        return {"seq_len": self.seq_len, "heads": self.heads, "head_dim": self.head_dim, **shape}


@dataclass(frozen=True, order=True)
class AttentionShape:
    """One attention layer without its sequence length: what a plan is tuned for and a
    report draws, over several lengths. Validated as ``Workload`` validates it (what depends
    on the length, such as documents given by their lengths, when ``at`` a length)."""

    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype: str
    causal: bool
    mode: str = "forward"
    window: tuple[int, ...] = ()
    sinks: int = 0
    documents: Documents = Documents()
    text: int = 0

    def __post_init__(self) -> None:  # raises ValueError naming the bad field
        _check_layer(self.heads, self.head_dim, self.kv_heads, self.batch, self.dtype, self.causal)
        check_mode(self.mode)
        object.__setattr__(self, "window", check_window(self.window))
        object.__setattr__(self, "documents", Documents.of(self.documents))
        check_mask(None, self.causal, self.window, self.sinks, self.documents, self.text)

    def at(self, seq_len: int) -> Workload:
        """This layer at ``seq_len`` tokens."""
        return Workload(seq_len=seq_len, heads=self.heads, head_dim=self.head_dim, kv_heads=self.kv_heads,
                        batch=self.batch, dtype=self.dtype, causal=self.causal, mode=self.mode,
                        window=self.window, sinks=self.sinks, documents=self.documents, text=self.text)

    def describe_mask(self) -> str:
        """The mask in words, "" for full attention: "causal", "causal, window 4096+4 sinks,
        documents of 2048", "joint, 512 text tokens"."""
        parts = ["causal"] if self.causal else []
        if self.window:
            left, right = self.window
            reach = f"{left}" if right == 0 else f"[{left}, {right}]"
            parts.append(f"window {reach}" + (f"+{self.sinks} sinks" if self.sinks else ""))
        if self.documents:
            parts.append(self.documents.describe())
        if self.text:
            parts.append(f"joint, {self.text} text tokens")
        return ", ".join(parts)

    def mask_label(self) -> str:
        """The mask in a table's few words: "full", "causal", "causal, docs 8x2048",
        "causal, window 1024,0 +4 sinks", "text 512"."""
        parts = ["causal"] if self.causal else []
        if self.window:
            sinks = f" +{self.sinks} sinks" if self.sinks else ""
            parts.append(f"window {self.window[0]},{self.window[1]}{sinks}")
        lengths = self.documents.lengths
        if self.documents.every:
            parts.append(f"docs of {self.documents.every}")
        elif lengths:
            same = len(set(lengths)) == 1
            parts.append(f"docs {len(lengths)}x{lengths[0]}" if same else
                         f"docs {len(lengths)} ({min(lengths)}-{max(lengths)})")
        if self.text:
            parts.append(f"text {self.text}")
        return ", ".join(parts) or "full"

    def describe(self) -> str:
        """E.g. "16/4kv heads x d128, batch 1, bf16 causal", "..., bf16 causal, train"."""
        kv = "" if self.kv_heads == self.heads else f"/{self.kv_heads}kv"
        mask = f" {self.describe_mask()}" if self.describe_mask() else ""
        train = ", train" if self.mode == "train" else ""
        return f"{self.heads}{kv} heads x d{self.head_dim}, batch {self.batch}, {self.dtype}{mask}{train}"

    def mask_flags(self) -> list[str]:
        """The command line's flags for the mask's parts beyond ``--causal`` (none for a plain layer)."""
        words = ["--window", f"{self.window[0]},{self.window[1]}"] if self.window else []
        words += ["--sinks", str(self.sinks)] if self.sinks else []
        if self.documents:
            words += ["--documents", str(self.documents.every) if self.documents.every
                      else ",".join(map(str, self.documents.lengths))]
        return words + (["--text", str(self.text)] if self.text else [])

    def to_dict(self) -> dict[str, object]:
        """Plain JSON, the mask's parts only where set."""
        mask: dict[str, object] = {}
        if self.window:
            mask["window"] = list(self.window)
        if self.sinks:
            mask["sinks"] = self.sinks
        if self.documents:
            mask["documents"] = self.documents.to_json()
        if self.text:
            mask["text"] = self.text
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "batch": self.batch, "dtype": self.dtype, "causal": self.causal, "mode": self.mode, **mask}


@functools.lru_cache(maxsize=256)
def _mask(seq_len: int, causal: bool, window: tuple[int, ...], sinks: int, documents: Documents) -> Mask:
    return Mask(seq_len, causal, window, sinks, documents.lengths_at(seq_len))


@functools.lru_cache(maxsize=256)  # pure: a validated copy, what the prior asks for per configuration
def _in_mode(workload: Workload, mode: str) -> Workload:
    return dataclasses.replace(workload, mode=mode)
