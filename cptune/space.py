"""Search spaces: which workloads to tune and which configurations to try, read from TOML.

A search space names one model's attention layer, the sequence lengths it runs at, and the
rank counts and strategies worth trying. It is validated completely when loaded, so a typo
or an impossible model is reported before any rank starts, as one line naming the file, the
TOML key and what to change. Built-in spaces ship in ``cptune.search_spaces``.
"""

from __future__ import annotations

import math
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from cptune._files import FileRefused, existing_kind
from cptune._shipped import shipped
from cptune._toml import TableReader, TomlFileError, got, read_toml, show, suggest
from cptune.config import STRATEGIES
from cptune.feasibility import candidate_configs, closest_to_fitting, enumerate_configs, feasibility
from cptune.hardware import MAX_RANKS
from cptune.masks import MAX_DOCUMENTS, read_documents
from cptune.workload import MODES, WIRE_DTYPES, AttentionShape, Workload

#: The built-in space ``cptune`` uses when none is named: small enough for a laptop CPU.
DEMO_SPACE = "demo"
#: The orders a search takes its trials in (``cptune.search``): "guided", the cost model's
#: best prediction first, stopping when no configuration left is likely to beat the fastest
#: (needs a calibration), or "exhaustive", every configuration (TPE within a trial budget).
ORDERS: tuple[str, ...] = ("guided", "exhaustive")

#: Allowed keys of each table, in the order the file format documents them.
TOP_KEYS = ("name", "description", "model", "sweep", "measure")
MODEL_KEYS = ("heads", "kv_heads", "head_dim", "batch", "dtype", "causal", "mode", "window", "sinks",
              "documents", "text")
#: The mask's keys of ``[model]`` (``cptune.masks``), each a field of ``AttentionShape``.
MASK_KEYS = ("window", "sinks", "documents", "text")
SWEEP_KEYS = ("seq_lens", "ranks", "strategies", "trials", "within_node_heads")
MEASURE_KEYS = ("warmup", "repeats", "timeout", "rounds", "race_rounds", "confirm_rounds")

#: A line the user can copy for each key, shown when the key is missing or mistyped.
_EXAMPLES = {
    "name": 'name = "my-model"',
    "description": 'description = "what this space measures"',
    "model": "[model] with heads = 24 and head_dim = 128",
    "sweep": "[sweep] with seq_lens = [4096, 8192]",
    "measure": "[measure] with warmup = 2 and repeats = 10",
    "model.heads": "heads = 24",
    "model.kv_heads": "kv_heads = 8",
    "model.head_dim": "head_dim = 128",
    "model.batch": "batch = 1",
    "model.dtype": 'dtype = "bf16"',
    "model.causal": "causal = false",
    "model.mode": 'mode = "train"',
    "model.window": "window = [4096, 0] (or window = 4096: the last 4096 keys)",
    "model.sinks": "sinks = 4",
    "model.documents": 'documents = [2048, 4096, 2048], documents = 2048 (each) or documents = "@docs.txt"',
    "model.text": "text = 512",
    "sweep.seq_lens": "seq_lens = [4096, 8192]",
    "sweep.ranks": 'ranks = "auto" or ranks = [2, 4, 8]',
    "sweep.strategies": 'strategies = ["ring", "ulysses"]',
    "sweep.trials": "trials = 40",
    "sweep.within_node_heads": "within_node_heads = true",
    "measure.warmup": "warmup = 2",
    "measure.repeats": "repeats = 10",
    "measure.timeout": "timeout = 600",
    "measure.rounds": "rounds = 2",
    "measure.race_rounds": "race_rounds = 10",
    "measure.confirm_rounds": "confirm_rounds = 3",
}


#: Each count of ``[measure]`` (and of the flags that set it): (least, most). Past the most a
#: visit or a search runs for hours and settles nothing more - a visit's median of 10-100
#: iterations is steady, and rounds past a few dozen only repeat the host's drift - so more is
#: a slip of the keyboard, refused before anything runs.
MEASURE_COUNTS = {"warmup": (0, 1_000), "repeats": (1, 10_000), "rounds": (1, 1_000),
                  "race_rounds": (0, 1_000), "confirm_rounds": (0, 1_000)}
#: The most sequence lengths one space (or ``--seq-lens``) sweeps: each is a search of its own.
MAX_SEQ_LENS = 256


def check_count(name: str, value: object) -> int:
    """``value`` as the ``MEASURE_COUNTS`` count ``name``; ``ValueError`` saying the range otherwise."""
    least, most = MEASURE_COUNTS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValueError(f"{name} must be a whole number from {least} to {most:,}, got {value!r}")
    return value


#: The longest timeout or time budget cptune waits, in seconds: a year. Longer is a slip of
#: the keyboard (and past about 292 years the system's timers cannot hold it).
MAX_SECONDS = 365 * 24 * 3600


def check_seconds(value: object) -> float:
    """``value`` as a number of seconds cptune waits: finite, above 0, at most ``MAX_SECONDS``
    (the flags, the TOML key and ``MeasureSettings`` all check with this); ``ValueError``
    saying what is expected otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and 0 < value <= MAX_SECONDS
    ):
        raise ValueError(f"expected a positive number of seconds, at most {MAX_SECONDS} (a year), "
                         f"got {value!r}")
    return float(value)


class SpaceError(TomlFileError):
    """A search space that cannot be used, raised before anything runs. The message reads
    ``"{file}: {key}: {reason}"``: the file as given, the dotted TOML key (or where in the
    file, for a syntax error) and what is wrong with what to do about it."""


@dataclass(frozen=True)
class MeasureSettings:
    """How each configuration is timed: each visit runs untimed ``warmup`` iterations, then
    ``repeats`` timed ones; ``timeout`` (seconds per visit) None means scaled to its size.
    A search visits every configuration that ran ``rounds`` times at least, in interleaved
    rounds, and those tied with the leader up to ``race_rounds`` times more; a winner and
    those close to it ``confirm_rounds`` times more in a second sitting, after the other
    sequence lengths."""

    warmup: int = 2
    repeats: int = 10
    timeout: float | None = None
    rounds: int = 2
    race_rounds: int = 10
    confirm_rounds: int = 3

    def __post_init__(self) -> None:
        # Direct construction gets the same limits the TOML loader enforces.
        for name in MEASURE_COUNTS:
            check_count(name, getattr(self, name))
        if self.timeout is not None:
            try:
                check_seconds(self.timeout)
            except ValueError as exc:
                raise ValueError(f"timeout: {exc}") from None


@dataclass(frozen=True)
class SearchSpace:
    """One model's attention layer at several sequence lengths, and the configurations to
    try on it. Built by ``load_space``, which validates every field."""

    name: str
    description: str
    #: The file it was loaded from (None when built in code).
    source: Path | None
    shape: AttentionShape
    seq_lens: tuple[int, ...]
    #: Rank counts to try; None means "auto": every count from 1 to the ranks available.
    ranks: tuple[int, ...] | None
    strategies: tuple[str, ...]
    #: Optuna trial budget per workload; None means try every configuration in the space.
    trials: int | None
    measure: MeasureSettings
    #: On a cluster, only the configurations whose head groups fit inside a node
    #: (``cptune.hardware.heads_span_nodes``); nothing is left out on one node.
    within_node_heads: bool = False

    @property
    def origin(self) -> str:
        """Where the space came from, as messages name it: its file, else its description."""
        return str(self.source) if self.source is not None else self.description

    def workloads(self) -> list[Workload]:
        """One Workload per sequence length, in the order the file lists them."""
        return [self.shape.at(s) for s in self.seq_lens]

    def rank_counts(self, available: int) -> tuple[int, ...]:
        """The rank counts to try: 1..available for "auto", else the file's list as given
        (entries above ``available`` are kept: the MPI engine may oversubscribe)."""
        if self.ranks is not None:
            return self.ranks
        if isinstance(available, bool) or not isinstance(available, int) or available < 1:
            raise ValueError(f"available ranks must be a positive integer, got {available!r}")
        return tuple(range(1, available + 1))


# --------------------------------------------------------------------------- loading


def _read_space_file(file: str) -> dict[str, Any]:
    """Parse the TOML file, turning every read or syntax failure into a SpaceError."""

    def missing() -> str:
        names = ", ".join(builtin_spaces())
        return f"no such file; check the path (built-in spaces, usable by name: {names})"

    return read_toml(file, SpaceError, missing)


def load_space(path: str | Path) -> SearchSpace:
    """Read and validate a search space from a TOML file (see search_spaces/demo.toml for
    the format). Raises SpaceError naming the file, the key and the fix for the first
    problem found: unreadable file, bad TOML, unknown key, wrong type or range, or a model
    Workload rejects."""
    file = str(path)
    doc = _read_space_file(file)
    r = TableReader(file, error=SpaceError, examples=_EXAMPLES)

    r.check_keys(doc, TOP_KEYS, "")
    name = r.string(r.value(doc, "name", "", required=True), "name", non_empty=True)
    raw_description = r.value(doc, "description", "", required=False)
    description = "" if raw_description is None else r.string(raw_description, "description", non_empty=False)

    model = r.table(doc, "model", required=True)
    assert model is not None
    r.check_keys(model, MODEL_KEYS, "model")
    heads = r.integer(r.value(model, "heads", "model", required=True), "model.heads", 1)
    head_dim = r.integer(r.value(model, "head_dim", "model", required=True), "model.head_dim", 1)
    raw = r.value(model, "kv_heads", "model", required=False)
    kv_heads = heads if raw is None else r.integer(raw, "model.kv_heads", 1)
    raw = r.value(model, "batch", "model", required=False)
    batch = 1 if raw is None else r.integer(raw, "model.batch", 1)
    raw = r.value(model, "dtype", "model", required=False)
    dtype = "bf16" if raw is None else r.string(raw, "model.dtype", non_empty=True)
    if dtype not in WIRE_DTYPES:
        raise r.fail("model.dtype", f"unknown dtype {show(dtype)}{suggest(dtype, list(WIRE_DTYPES))}; "
                     f"choose one of {', '.join(WIRE_DTYPES)}")
    raw = r.value(model, "causal", "model", required=False)
    causal = False if raw is None else r.boolean(raw, "model.causal")
    raw = r.value(model, "mode", "model", required=False)
    mode = "forward" if raw is None else r.string(raw, "model.mode", non_empty=True)
    if mode not in MODES:
        raise r.fail("model.mode", f"unknown mode {show(mode)}{suggest(mode, list(MODES))}; "
                     f"choose one of {', '.join(MODES)}")
    mask = _read_mask(r, model, Path(path))

    sweep = r.table(doc, "sweep", required=True)
    assert sweep is not None
    r.check_keys(sweep, SWEEP_KEYS, "sweep")
    seq_lens = r.array(
        r.value(sweep, "seq_lens", "sweep", required=True), "sweep.seq_lens",
        lambda v, k: r.integer(v, k, 1),
    )
    if len(seq_lens) > MAX_SEQ_LENS:
        raise r.fail("sweep.seq_lens", f"{len(seq_lens):,} lengths, more than the {MAX_SEQ_LENS} a space may "
                                       f"sweep (each is a search of its own); split it into several spaces")
    ranks = _read_ranks(r, r.value(sweep, "ranks", "sweep", required=False))
    raw = r.value(sweep, "strategies", "sweep", required=False)
    strategies = (
        STRATEGIES if raw is None else r.array(raw, "sweep.strategies", lambda v, k: _strategy(r, v, k))
    )
    raw = r.value(sweep, "trials", "sweep", required=False)
    trials = None if raw is None else r.integer(raw, "sweep.trials", 1)
    raw = r.value(sweep, "within_node_heads", "sweep", required=False)
    within_node_heads = False if raw is None else r.boolean(raw, "sweep.within_node_heads")

    measure_table = r.table(doc, "measure", required=False) or {}
    r.check_keys(measure_table, MEASURE_KEYS, "measure")
    counts = {}
    for key, (least, most) in MEASURE_COUNTS.items():
        raw = r.value(measure_table, key, "measure", required=False)
        counts[key] = getattr(MeasureSettings, key) if raw is None else r.integer(raw, f"measure.{key}",
                                                                                  least, most)
    raw = r.value(measure_table, "timeout", "measure", required=False)
    timeout = None if raw is None else _timeout(r, raw)

    shape = _shape(r, heads, kv_heads, head_dim, batch, dtype, causal, mode, mask)
    for i, seq_len in enumerate(seq_lens):
        try:
            shape.at(seq_len)
        except ValueError as exc:
            raise _model_failure(r, str(exc), f" (at sweep.seq_lens[{i}] = {seq_len})") from None
    return SearchSpace(
        name=name, description=description, source=Path(path),
        shape=shape, seq_lens=seq_lens,
        ranks=ranks, strategies=strategies, trials=trials,
        measure=MeasureSettings(timeout=timeout, **counts), within_node_heads=within_node_heads,
    )


def _read_ranks(r: TableReader, raw: object) -> tuple[int, ...] | None:
    """``"auto"`` (or absent) -> None; else a non-empty array of distinct positive ints, each at
    most ``MAX_RANKS`` (more than any machine built)."""
    if raw is None or raw == "auto":
        return None
    if isinstance(raw, str):
        raise r.fail("sweep.ranks", f'expected "auto" or an array of positive integers, {got(raw)}'
                     f"{r.example('sweep.ranks')}")
    return r.array(raw, "sweep.ranks", lambda v, k: r.integer(v, k, 1, MAX_RANKS))  # any machine's, at most


def _timeout(r: TableReader, raw: object) -> float:
    """``measure.timeout``: a number of seconds ``check_seconds`` takes."""
    seconds = r.positive_number(raw, "measure.timeout")
    try:
        return check_seconds(seconds)
    except ValueError as exc:
        raise r.fail("measure.timeout", f"out of range: {exc}{r.example('measure.timeout')}") from None


def _strategy(r: TableReader, value: object, key: str) -> str:
    name = r.string(value, key, non_empty=True)
    if name not in STRATEGIES:
        raise r.fail(key, f"unknown strategy {show(name)}{suggest(name, STRATEGIES)}; "
                     f"choose from {', '.join(STRATEGIES)}")
    return name


def _read_mask(r: TableReader, model: dict[str, Any], source: Path) -> dict[str, Any]:
    """``[model]``'s mask keys as ``AttentionShape``'s keyword arguments: ``window`` as
    [left, right] or N (for [N, 0]), ``sinks`` and ``text`` as counts, ``documents`` as their
    lengths, one length for all, or "@FILE" (read relative to the space's folder)."""
    mask: dict[str, Any] = {}
    raw = r.value(model, "window", "model", required=False)
    if isinstance(raw, list):
        if len(raw) != 2:
            raise r.fail("model.window", f"expected [left, right], two token counts, got {len(raw)} value(s)"
                                         f"{r.example('model.window')}")
        mask["window"] = tuple(r.integer(v, f"model.window[{i}]", 0) for i, v in enumerate(raw))
    elif raw is not None:
        mask["window"] = (r.integer(raw, "model.window", 0), 0)
    for key in ("sinks", "text"):
        raw = r.value(model, key, "model", required=False)
        if raw is not None:
            mask[key] = r.integer(raw, f"model.{key}", 0)
    raw = r.value(model, "documents", "model", required=False)
    if isinstance(raw, str):
        if not raw.startswith("@") or len(raw) < 2:
            raise r.fail("model.documents", f"expected a list of lengths, one length or \"@FILE\", "
                                            f"{got(raw)}{r.example('model.documents')}")
        try:
            mask["documents"] = read_documents(source.parent / raw[1:])
        except ValueError as exc:
            raise r.fail("model.documents", str(exc)) from None
    elif isinstance(raw, list):
        if not raw:
            raise r.fail("model.documents", f"an empty list packs no document; leave documents out for one "
                                            f"sequence{r.example('model.documents')}")
        if len(raw) > MAX_DOCUMENTS:
            raise r.fail("model.documents", f"{len(raw):,} documents, more than the {MAX_DOCUMENTS:,} one "
                                            f"sequence packs")
        mask["documents"] = tuple(r.integer(v, f"model.documents[{i}]", 1) for i, v in enumerate(raw))
    elif raw is not None:
        mask["documents"] = r.integer(raw, "model.documents", 1)
    return mask


def _shape(r: TableReader, heads: int, kv_heads: int, head_dim: int, batch: int, dtype: str,
           causal: bool, mode: str, mask: dict[str, Any]) -> AttentionShape:
    """The model's attention shape; a combination it rejects is reported against the key at fault."""
    try:
        return AttentionShape(heads, kv_heads, head_dim, batch, dtype, causal, mode, **mask)
    except ValueError as exc:
        raise _model_failure(r, str(exc)) from None


def _model_failure(r: TableReader, text: str, where: str = "") -> Exception:
    """``AttentionShape``'s or ``Workload``'s refusal ``text`` against the ``[model]`` key it
    names (``where``: at which length, for what depends on one)."""
    field = re.match(r"(kv_heads|heads|head_dim|batch|dtype|causal|window|sinks|documents|text)\b:?\s*", text)
    if field is None:
        return r.fail("model", text + where)
    # Drop Workload's own "field: " prefix: the key already names it.
    if text[field.end(1):].startswith(":"):
        text = text[field.end():]
    return r.fail(f"model.{field.group(1)}", text + where)


# --------------------------------------------------------------------------- runnability


def check_runnable(space: SearchSpace, available_ranks: int, file: str | None = None,
                   memory_limit: Callable[[int], int | None] | None = None) -> None:
    """Raise SpaceError if some sequence length has no feasible configuration among the
    space's rank counts and strategies, naming it and giving the reasons for the largest
    rank count tried, in one line. ``file`` names the space in the message (default: its
    source). ``memory_limit(ranks)``: the bytes each of that many ranks may hold (None: not
    checked), as ``cptune.execute.rank_memory_limit`` gives it for an engine."""
    file = file if file is not None else str(space.source or space.name)
    counts = space.rank_counts(available_ranks)
    limit = memory_limit or (lambda ranks: None)
    for i, workload in enumerate(space.workloads()):
        runnable = [c for c in enumerate_configs(workload, max(counts), space.strategies)
                    if c.ranks in counts]
        if any(not feasibility(workload, c, limit(c.ranks)) for c in runnable):
            continue
        if runnable:  # runnable but for memory
            raise SpaceError(
                file, f"sweep.seq_lens[{i}]",
                f"seq_len {workload.seq_len} does not fit in memory on ranks {', '.join(map(str, counts))}: "
                f"{closest_to_fitting(workload, runnable, limit)}",
            )
        largest = max(counts)
        reasons: list[str] = []
        for strategy in space.strategies:
            for config in candidate_configs(largest, (strategy,), largest, workload.heads):
                for reason in feasibility(workload, config):
                    line = f"{config.describe()}: {reason}"
                    if line not in reasons:
                        reasons.append(line)
        raise SpaceError(
            file, f"sweep.seq_lens[{i}]",
            f"seq_len {workload.seq_len} has no feasible configuration on ranks "
            f"{', '.join(map(str, counts))} with strategies {', '.join(space.strategies)}; "
            f"add rank counts or strategies in [sweep], or change [model]. "
            f"On {largest} rank{'s' if largest != 1 else ''}: {' | '.join(reasons)}",
        )


# --------------------------------------------------------------------------- built-ins


def builtin_spaces() -> dict[str, Traversable]:
    """The spaces shipped in ``cptune.search_spaces``, by file stem (e.g. "flux1-dev")."""
    package = shipped("cptune.search_spaces")
    found = {
        entry.name.removesuffix(".toml"): entry
        for entry in package.iterdir()
        if entry.name.endswith(".toml") and entry.is_file()
    }
    return dict(sorted(found.items()))


def find_space(space: SearchSpace | str | Path) -> SearchSpace:
    """``space`` itself, or the space a file path or built-in name (``resolve_space``) holds,
    loaded and validated (``load_space``)."""
    if isinstance(space, SearchSpace):
        return space
    return load_space(resolve_space(str(space)))


def resolve_space(name_or_path: str) -> Path:
    """The file a space argument names: an existing file path wins, then a built-in name
    (e.g. "demo", "flux1-dev"); otherwise SpaceError listing the built-in names."""
    as_path = Path(name_or_path)
    try:  # anything there but a folder is read, and a device or FIFO refused in one line
        if (mode := existing_kind(as_path)) is not None and not stat.S_ISDIR(mode):
            return as_path
    except FileRefused as refused:
        raise SpaceError(name_or_path, "(file)", refused.reason) from None
    builtins = builtin_spaces()
    if name_or_path in builtins:
        # The package is a plain directory in both editable and regular installs.
        return Path(str(builtins[name_or_path]))
    names = ", ".join(builtins)
    close = suggest(name_or_path, list(builtins))
    raise SpaceError(
        name_or_path, "(file)",
        f"no such file and no built-in space of that name{close}; give the path of a .toml "
        f"file or one of the built-in spaces: {names}",
    )
