"""The shape of one attention layer: what cptune tunes a strategy for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

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


@dataclass(frozen=True, init=False)
class Workload:
    """One attention layer: ``batch`` sequences of ``seq_len`` tokens, ``heads`` query
    heads of ``head_dim`` and ``kv_heads`` key/value heads (None: as many as query heads;
    fewer means GQA, one means MQA), run in ``mode`` (``MODES``: a training layer is a
    workload of its own). Validated on construction: a bad value raises ``ValueError``
    naming the field."""

    seq_len: int
    heads: int
    head_dim: int
    kv_heads: int
    batch: int
    dtype: str
    causal: bool
    mode: str

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
    ) -> None:
        kv_heads = heads if kv_heads is None else kv_heads
        sizes = dict(seq_len=seq_len, heads=heads, head_dim=head_dim, kv_heads=kv_heads, batch=batch)
        for name, value in sizes.items():
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
        for name, value in sizes.items():
            object.__setattr__(self, name, int(value))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "causal", bool(causal))
        object.__setattr__(self, "mode", check_mode(mode))

    @property
    def training(self) -> bool:
        """Whether a run is the forward and the backward (``mode`` "train")."""
        return self.mode == "train"

    def in_mode(self, mode: str) -> Workload:
        """This layer run in ``mode``."""
        return dataclasses.replace(self, mode=mode)

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
                              self.mode)

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
                *(["--mode", self.mode] if self.training else [])]

    def to_dict(self) -> dict[str, object]:
        return {
            "seq_len": self.seq_len,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "kv_heads": self.kv_heads,
            "batch": self.batch,
            "dtype": self.dtype,
            "causal": self.causal,
            "mode": self.mode,
        }


@dataclass(frozen=True, order=True)
class AttentionShape:
    """One attention layer without its sequence length: what a plan is tuned for and a
    report draws, over several lengths. Validated as ``Workload`` validates it."""

    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype: str
    causal: bool
    mode: str = "forward"

    def __post_init__(self) -> None:
        self.at(1)  # raises ValueError naming the bad field

    def at(self, seq_len: int) -> Workload:
        """This layer at ``seq_len`` tokens."""
        return Workload(seq_len=seq_len, heads=self.heads, head_dim=self.head_dim, kv_heads=self.kv_heads,
                        batch=self.batch, dtype=self.dtype, causal=self.causal, mode=self.mode)

    def describe(self) -> str:
        """E.g. "16/4kv heads x d128, batch 1, bf16 causal", "..., bf16 causal, train"."""
        kv = "" if self.kv_heads == self.heads else f"/{self.kv_heads}kv"
        mask = " causal" if self.causal else ""
        train = ", train" if self.mode == "train" else ""
        return f"{self.heads}{kv} heads x d{self.head_dim}, batch {self.batch}, {self.dtype}{mask}{train}"

    def to_dict(self) -> dict[str, object]:
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "batch": self.batch, "dtype": self.dtype, "causal": self.causal, "mode": self.mode}
