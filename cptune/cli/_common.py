"""What every command shares: one-line errors, plain-text printing, flag types, and the flags
that describe a workload (declared here once)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cptune.config import LAYOUTS, STRATEGIES
from cptune.engines import ENGINES, Engine, get_engine
from cptune.errors import CPTuneError
from cptune.frameworks import FRAMEWORKS, Spelling, Substitution
from cptune.hardware import NCCL_PATHS, builtin_descriptions, parse_hosts, read_hostfile
from cptune.masks import read_documents
from cptune.space import MAX_SEQ_LENS, MEASURE_COUNTS, check_seconds
from cptune.workload import MAX_INT, MAX_INT_TEXT, MODES, WIRE_DTYPES, Workload

USAGE_ERROR = 2
Number = TypeVar("Number", int, float)

DB_HELP = "database: a file path or SQLAlchemy URL (default: $CPTUNE_DB or ./cptune.db)"
SHARE_DB_HELP = ("let cptune add its tables to a database that already holds other programs' tables "
                 "(for example a PostgreSQL schema shared with other apps); theirs are left as they are. "
                 "Without it such a database is refused untouched")
MAX_RANKS_HELP = "largest rank count (default: this host's cores; its GPUs with a GPU backend)"
HARDWARE_HELP = (f"this host (default), a stored fingerprint, a shipped description "
                 f"({', '.join(builtin_descriptions())}; cptune hardware lists them) or a TOML file")


class UsageError(CPTuneError):
    """Bad input from the user: reported in one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """A flag error in one line and where to get help, instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class PipedConsole(Console):
    """A console whose reader may leave (``cptune results | head -1``): a closed pipe is a
    ``BrokenPipeError`` for ``main`` to end on quietly with exit 0, as ``--json`` and ``--csv``
    do, not rich's own exit 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


#: Errors and warnings: always stderr, whatever stdout carries.
STDERR = PipedConsole(stderr=True)
Part = str | tuple[str, str]


def say(console: Console, *parts: Part) -> None:
    """Print one message: each part plain text (never markup) or (text, style). Soft-wrapped:
    the terminal wraps it, so a path or command copies out whole."""
    console.print(Text.assemble(*parts), highlight=False, soft_wrap=True)


def warn(*parts: Part) -> None:
    say(STDERR, *parts)


def table(title: str, caption: str) -> Table:
    """A table that fits 80 columns (CI logs and narrow terminals show every figure); title
    and caption as Text: they carry names from users' files, never markup."""
    return Table(title=Text(title, style="table.title"), caption=Text(caption, style="table.caption"),
                 box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)


def show_framework_choice(
    console: Console, heading: str, substitution: Substitution, spelling: Spelling
) -> None:
    """One length's answer for a framework: what runs and at what cost, its settings as the
    framework takes them (indented, to copy), the launch line and what the user must also do."""
    kept = substitution.chosen.config == substitution.pick.config and substitution.as_cptune_runs
    say(console, (heading, "bold"), " ", (substitution.describe(), "bold green" if kept else "yellow"))
    for line in spelling.code.splitlines():
        say(console, f"    {line}")
    launches = spelling.launch.splitlines()  # one per node on several
    for node, line in enumerate(launches):
        label = "  launch:" if len(launches) == 1 else f"  launch on node {node}:"
        say(console, (label, "dim"), f" {line}")
    for need in spelling.needs:
        say(console, ("  needs:", "dim"), f" {need}")


# --------------------------------------------------------------------------- flag types


def _items(text: str, example: str) -> list[str]:
    """The comma-separated entries of a flag's ``text``, each stripped; an empty one (as in
    1024,,2048 or a trailing comma) or none at all is refused, like a value listed twice."""
    items = [part.strip() for part in text.split(",")]
    if not text.strip() or "" in items:
        raise argparse.ArgumentTypeError(f"expected comma-separated values like {example}, without empty "
                                         f"entries, got {text!r}")
    twice = next((item for i, item in enumerate(items) if item in items[:i]), None)
    if twice is not None:
        raise argparse.ArgumentTypeError(f"{twice} is listed twice in {text!r}; list each value once")
    return items


def ids(text: str) -> tuple[int, ...]:
    """Measurement ids, e.g. 12,15 (as cptune results lists them)."""
    example = "12,15 (cptune results lists them)"
    try:
        found = tuple(int(part) for part in _items(text, example))
    except ValueError:
        found = ()
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"expected measurement ids like {example}, got {text!r}")
    if max(found) > MAX_INT:
        raise argparse.ArgumentTypeError(f"no measurement has an id above {MAX_INT_TEXT}, got {max(found)}")
    return found


def strategies(text: str) -> tuple[str, ...]:
    names = tuple(_items(text, "ring,ulysses"))
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def _number_type(convert: Callable[[str], Number], what: str, zero: bool = False) -> Callable[[str], Number]:
    """An argparse type: ``convert`` the text, refusing what is not a number above zero (or,
    with ``zero``, at least zero), and a whole number above ``MAX_INT`` (what a database
    holds)."""

    def parse(text: str) -> Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero else 'positive'}, got {text}")
        if value > MAX_INT:
            raise argparse.ArgumentTypeError(f"must be at most {MAX_INT_TEXT}, got {text}")
        return value

    return parse


positive = _number_type(int, "a whole number")
non_negative = _number_type(int, "a whole number", zero=True)


def seconds(text: str) -> float:
    """A number of seconds cptune waits (``cptune.space.check_seconds``: finite, above 0, at
    most a year)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    try:
        return check_seconds(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_list(text: str) -> tuple[int, ...]:
    return tuple(positive(part) for part in _items(text, "1024,2048"))


def window(text: str) -> tuple[int, int]:
    """A sliding window: ``LEFT,RIGHT`` key counts either side of each query, or ``N`` alone
    for ``N,0`` (the causal window: the last N keys)."""
    parts = [part.strip() for part in text.split(",")]
    if len(parts) not in (1, 2) or "" in parts:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (e.g. 4096,0) or one number N for N,0, "
                                         f"got {text!r}")
    left, *right = (non_negative(part) for part in parts)
    return left, (right[0] if right else 0)


def documents(text: str) -> tuple[int, ...] | int:
    """Packed documents: their lengths (``2048,4096,...``, summing to the sequence's length),
    one length for all (``N``: N tokens each, the last the rest) or ``@FILE`` (one length a
    line, or a JSON list: ``cptune.masks.read_documents``)."""
    if text.startswith("@"):
        try:
            return read_documents(text[1:])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parts = [part.strip() for part in text.split(",")]
    if "" in parts:
        raise argparse.ArgumentTypeError(f"expected document lengths like 2048,4096 (or N for one length for "
                                         f"all, or @FILE), without empty entries, got {text!r}")
    lengths = tuple(positive(part) for part in parts)
    return lengths if len(lengths) > 1 else lengths[0]


def seq_lens(text: str) -> tuple[int, ...]:
    """Sequence lengths, e.g. 1024,2048: at most ``MAX_SEQ_LENS`` of them."""
    found = positive_list(text)
    if len(found) > MAX_SEQ_LENS:
        raise argparse.ArgumentTypeError(f"{len(found):,} lengths, more than the {MAX_SEQ_LENS} one command "
                                         f"sweeps (each is a search of its own); split them over runs")
    return found


def count(name: str) -> Callable[[str], int]:
    """An argparse type for the ``[measure]`` count ``name`` (``cptune.space.MEASURE_COUNTS``:
    the flag and the TOML key take the same range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        least, most = MEASURE_COUNTS[name]
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be a whole number from {least} to {most:,}, got {text}")
        return value

    return parse


# --------------------------------------------------------------------------- shared flags


def add_workload_flags(
    parser: argparse.ArgumentParser,
    *,
    lengths: bool = False,
    required: bool = False,
    defaults: dict[str, int] | None = None,
    with_strategies: bool = False,
    with_mode: bool = True,
) -> None:
    """The flags that describe one attention layer, in a group of their own: ``--seq-lens``
    (several; with ``lengths``) or ``--seq-len``, ``--heads``, ``--kv-heads``, ``--head-dim``,
    ``--batch``, ``--dtype``, ``--causal``, ``--mode``; ``required``: the length, heads and head_dim must
    be given; ``defaults`` for those (``cptune measure``'s demo shape); ``with_strategies``:
    also ``--strategies``; ``with_mode``: ``--mode`` (not where only the forward exists: the
    exported inference graphs)."""
    d = defaults or {}

    def shown(name: str, what: str) -> str:
        return f"{what} (default {d[name]})" if name in d else what

    group = parser.add_argument_group("workload (one attention layer)")
    if lengths:
        group.add_argument("--seq-lens", type=seq_lens, help="sequence lengths, e.g. 1024,2048")
    else:
        group.add_argument("--seq-len", type=positive, default=d.get("seq_len"), required=required,
                           help=shown("seq_len", "tokens per sequence"))
    group.add_argument("--heads", type=positive, default=d.get("heads"), required=required,
                       help=shown("heads", "query heads"))
    group.add_argument("--kv-heads", type=positive, default=None,
                       help="KV heads (default: as many as --heads)")
    group.add_argument("--head-dim", type=positive, default=d.get("head_dim"), required=required,
                       help=shown("head_dim", "head dimension"))
    group.add_argument("--batch", type=positive, default=1, help="sequences per batch (default 1)")
    group.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="bf16",
                       help="activation dtype (default bf16)")
    group.add_argument("--causal", action="store_true", help="causal mask (LLM prefill)")
    group.add_argument("--window", type=window, default=None, metavar="LEFT,RIGHT",
                       help="sliding window: a query sees LEFT keys before it and RIGHT after (N alone: N,0; "
                            "with --causal RIGHT is 0)")
    group.add_argument("--sinks", type=non_negative, default=0, metavar="N",
                       help="attention sinks beside --window: the first N tokens of each document seen by "
                            "every query")
    group.add_argument("--documents", type=documents, default=None, metavar="LENGTHS",
                       help="packed documents: their lengths (2048,4096,... summing to the length), N (N "
                            "tokens each, the last the rest) or @FILE (one length a line, or a JSON list)")
    group.add_argument("--text", type=non_negative, default=0, metavar="N",
                       help="joint text and image attention (MMDiT: FLUX, SD3): N text tokens before the "
                            "image tokens")
    if with_mode:
        group.add_argument("--mode", choices=MODES, default=None,
                           help="forward (inference, the default) or train: the forward and the backward")
    if with_strategies:
        group.add_argument("--strategies", type=strategies, default=None,
                           help=f"comma-separated subset of {','.join(STRATEGIES)} (default: all)")


def add_backend(parser: argparse.ArgumentParser) -> None:
    """``--backend``, one choice per registered engine (the first is the default)."""
    listed = "; ".join(f"{name}: {spec.summary}" for name, spec in ENGINES.items())
    parser.add_argument("--backend", choices=tuple(ENGINES), default=next(iter(ENGINES)),
                        help=f"engine ({listed})")


def add_hosts_flags(parser: argparse.ArgumentParser) -> None:
    """``--hosts`` and ``--hostfile``: run the ranks on these nodes (mpiexec's -hosts and -f)."""
    nodes = parser.add_mutually_exclusive_group()
    nodes.add_argument("--hosts", metavar="HOST:RANKS,...",
                       help="run the ranks on these nodes, equal ranks on each (e.g. a:2,b:2; mpiexec starts "
                            "them; docs/multi-node.md)")
    nodes.add_argument("--hostfile", metavar="FILE",
                       help="the nodes from a hostfile (MPICH Hydra's: host:ranks per line)")


def engine_of(args: argparse.Namespace) -> str | Engine:
    """The engine the flags ask for: its name (this host), or on ``--hosts``/``--hostfile``'s
    nodes the engine itself; ``ClusterError`` or ``BackendUnavailableError`` for nodes it
    cannot use."""
    if args.hosts is not None:
        return get_engine(args.backend, hosts=parse_hosts(args.hosts))
    if args.hostfile is not None:
        return get_engine(args.backend, hosts=read_hostfile(args.hostfile))
    return str(args.backend)


def add_framework_flag(parser: argparse.ArgumentParser, does: str) -> None:
    """``--for FRAMEWORK``: the command answers in terms of a framework users deploy through."""
    parser.add_argument("--for", dest="framework", metavar="FRAMEWORK",
                        help=f"{does} ({', '.join(FRAMEWORKS)}; docs/frameworks.md)")


def add_host_backend(parser: argparse.ArgumentParser) -> None:
    """``--backend`` where it only says whose view of this host ``--hardware``'s default is:
    each engine stores its measurements and calibration under its own fingerprint."""
    timed = tuple(name for name, spec in ENGINES.items() if spec.timed)
    parser.add_argument("--backend", choices=timed, default=timed[0],
                        help=f"with no --hardware: this host as this engine's ranks ran it "
                             f"(default {timed[0]})")


def figure_setting(text: str) -> tuple[str, float]:
    """One ``--figure KEY=VALUE``: a description's figure key and a number in the file's units
    (whether the key is a figure of the hardware, and the value in range, the library checks)."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE like links.node.bandwidth_gbps.all_to_all=17, got {text!r}")
    try:
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number after {key.strip()}=, got {value!r}") from None


#: Which NCCL takes which path through a CPU (``cptune.hardware.NCCL_PATHS``), and where to read it.
NCCL_PATH_RULE = ("shm (through host memory: NCCL 2.23.4 and later, or any NCCL on Intel CPUs) or p2p (peer "
                  "to peer through the CPU: NCCL 2.15-2.22 on AMD CPUs); NCCL_DEBUG=INFO prints 'via SHM' "
                  "or 'via P2P' for each channel")


def add_given_flags(parser: argparse.ArgumentParser) -> None:
    """What a user knows of a described machine: ``--figure KEY=VALUE``, repeatable, a figure
    measured there, and ``--nccl-path``, the path NCCL takes between GPUs joined only by a CPU."""
    parser.add_argument(
        "--figure", action="append", type=figure_setting, dest="figures", metavar="KEY=VALUE",
        help="with a hardware description: one of its figures as you measured it on the machine, in the "
             "file's units, its range closed (e.g. links.node.bandwidth_gbps.all_to_all=17 for 17 GB/s "
             "all-to-all busbw); repeatable; a tie names the figure that decides it")
    parser.add_argument(
        "--nccl-path", choices=NCCL_PATHS,
        help=f"with a PCIe description: how NCCL moves data between GPUs that only a CPU joins: "
             f"{NCCL_PATH_RULE} (default: both are weighed)")


def figures_of(args: argparse.Namespace) -> dict[str, float] | None:
    """The ``--figure`` settings by key, or None; a key given twice is a ``UsageError``."""
    figures: dict[str, float] = {}
    for key, value in args.figures or ():
        if key in figures:
            raise UsageError(f"--figure {key} is given twice ({figures[key]:g} and {value:g}); give it once")
        figures[key] = value
    return figures or None


def workload_of(args: argparse.Namespace, seq_len: int) -> Workload:
    """The workload the flags describe at ``seq_len`` tokens; a bad shape as a ``UsageError``."""
    try:
        return Workload(seq_len=seq_len, heads=args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads,
                        batch=args.batch, dtype=args.dtype, causal=args.causal,
                        mode=getattr(args, "mode", None) or "forward", **mask_of(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def mask_of(args: argparse.Namespace) -> dict[str, Any]:
    """The mask's parts the flags give (``--window``, ``--sinks``, ``--documents``, ``--text``),
    as ``Workload``'s keyword arguments."""
    return {"window": args.window, "sinks": args.sinks, "documents": args.documents, "text": args.text}


def mask_given(args: argparse.Namespace) -> bool:
    """Whether any of the mask's flags beyond ``--causal`` is given."""
    return bool(args.window or args.sinks or args.documents or args.text)


def add_layout_flag(parser: argparse.ArgumentParser) -> None:
    """``--layout``: how one named configuration deals the tokens out (``cptune.config.LAYOUTS``)."""
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="only this token layout (default: each the mask makes worth trying; "
                             "docs/masks.md)")


# --------------------------------------------------------------------------- Ctrl-C


class CtrlC:
    """Ctrl-C, remembered. Python drops a KeyboardInterrupt raised while a finalizer runs
    (a ``__del__`` or weakref callback; SQLAlchemy's and sqlite3's connections have them),
    prints it as a traceback and goes on as if no key was pressed. Remembered, the press is
    raised again at the search's next visit and, at the latest, makes the command's return
    the interrupted exit; the dropped one is not printed."""

    def __init__(self) -> None:
        self.pressed = False

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def install(self) -> Callable[[], None]:
        """Take over SIGINT unless it is ignored (a job started in the background keeps it
        ignored); returns what puts the previous handlers back."""
        self.pressed = False
        previous_sigint, previous_unraisable = signal.getsignal(signal.SIGINT), sys.unraisablehook
        if previous_sigint is not signal.default_int_handler:
            return lambda: None

        def on_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
            if not isinstance(unraisable.exc_value, KeyboardInterrupt):
                previous_unraisable(unraisable)

        def restore() -> None:
            signal.signal(signal.SIGINT, previous_sigint)
            sys.unraisablehook = previous_unraisable

        signal.signal(signal.SIGINT, self._on_sigint)
        sys.unraisablehook = on_unraisable
        return restore

    def raise_if_pressed(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt



#: The command line's Ctrl-C (``main`` installs it; a search raises it at its next visit).
CTRL_C = CtrlC()
