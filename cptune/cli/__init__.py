"""The ``cptune`` command line: it parses and prints; what each command does is a library call.

``search`` (``_search``), ``results`` (``_results``), ``measure`` and ``calibrate``
(``_measure``), ``doctor`` (``_doctor``), ``fit`` and ``recommend`` (``_model``), ``hardware``
(``_hardware``), ``export``,
``export-graph`` and ``report`` (``_outputs``). Bad input (flags, space files, databases)
ends with one line on stderr naming the problem and the fix, and exit code 2; never a
traceback. So does a full disk (``ENOSPC``; the store's ``DiskFullError`` for the database).
Normal output goes to stdout (to stderr when stdout carries --json or --csv); errors and
warnings always to stderr. Text from users and messages is printed as text, never as Rich markup.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import signal
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from cptune.cli import _doctor, _hardware, _measure, _model, _outputs, _results, _search
from cptune.cli._common import CTRL_C, USAGE_ERROR, Parser, PipedConsole, UsageError, warn
from cptune.errors import CPTuneError
from cptune.version import __version__

#: What each command runs: (parsed flags, the console for normal output) -> exit code.
COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "search": _search.run,
    "results": _results.run,
    "measure": _measure.run_measure,
    "calibrate": _measure.run_calibrate,
    "doctor": _doctor.run_doctor,
    "fit": _model.run_fit,
    "recommend": _model.run_recommend,
    "hardware": _hardware.run,
    "export": _outputs.run_export,
    "report": _outputs.run_report,
    "export-graph": _outputs.run_export_graph,
}
#: What a command leaves when it is stopped part way (Ctrl-C, SIGTERM, a full disk), said in
#: the line that ends it; a command not named changes nothing.
LEFT_BEHIND = {
    "search": "every finished measurement is stored; rerun to resume",
    "calibrate": "no calibration is stored (one is kept only whole); run it again",
    "measure": "measure stores nothing; run it again",
    "doctor": "no verdict is stored; run it again",
    "export": "no plan is written (a plan is written whole or not at all); run it again",
    "report": "the report's folder may hold part of it; run it again",
    "export-graph": "the graphs' folder may hold part of them; run it again",
}
NOTHING_CHANGED = "nothing was changed"


class Terminated(SystemExit):
    """SIGTERM or SIGHUP: the way out runs as for any exit, and ``main`` says what was kept."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


#: The commands that run an engine's ranks: under torchrun with --backend torch, rank 0 runs
#: them and the other ranks serve it.
RANK_COMMANDS = ("search", "measure", "calibrate")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="cptune",
                    description="Measure context-parallel attention strategies on this machine and pick one.")
    parser.add_argument("--version", action="version", version=f"cptune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _search.add_parser(commands)
    _results.add_parser(commands)
    _measure.add_parsers(commands)
    _doctor.add_parser(commands)
    _model.add_parsers(commands)
    _hardware.add_parser(commands)
    _outputs.add_parsers(commands)
    for command_parser in commands.choices.values():  # flags it does not know are its error
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    machine_output = getattr(args, "json", False) or getattr(args, "csv", False)
    console = PipedConsole(stderr=machine_output)  # normal output; stdout unless it carries JSON/CSV
    restore_sigint = CTRL_C.install()
    restore_termination = _exit_on_termination()
    try:
        command = functools.partial(COMMANDS[args.command], args, console)
        if getattr(args, "backend", None) == "torch" and args.command in RANK_COMMANDS:
            from cptune.engines.torch import on_launched_ranks

            code = on_launched_ranks(command)  # ranks torchrun launched: rank 0 drives, the rest serve
        else:
            code = command()
        CTRL_C.raise_if_pressed()
        return code
    except CPTuneError as error:
        warn(("cptune: error:", "red"), f" {error}")
        return USAGE_ERROR
    except KeyboardInterrupt:
        warn(("interrupted", "yellow"), f": {LEFT_BEHIND.get(args.command, NOTHING_CHANGED)}")
        return 130
    except Terminated as ended:
        name = signal.Signals(ended.signum).name
        warn(("stopped", "yellow"), f" by {name}: {LEFT_BEHIND.get(args.command, NOTHING_CHANGED)}")
        return 128 + ended.signum
    except BrokenPipeError:  # before OSError, of which it is one
        # the reader left (cptune results --csv | head -1): nothing more to say, and the
        # interpreter's last flush must not fail on the closed pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        where = f" ({error.filename})" if error.filename else ""
        kept = "every finished measurement is stored; " if args.command == "search" else ""
        resumes = ": it resumes where it stopped" if args.command == "search" else ""
        warn(("cptune: error:", "red"), f" no space left on the device{where}: {kept}free space there, then "
                                        f"run the same command again{resumes}")
        return USAGE_ERROR
    finally:
        restore_termination()
        restore_sigint()


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _exit_on_termination() -> Callable[[], None]:
    """SIGTERM and SIGHUP (where their action is the default: to end the process on the spot)
    become ``Terminated`` (a ``SystemExit(128 + signal)``), so the way out runs: the engines' pools stop and
    their folders are removed (``atexit``), and a search's finished measurements are stored
    as always. Returns what puts the previous handlers back."""
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, _terminate)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]
