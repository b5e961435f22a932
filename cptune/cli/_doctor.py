"""``cptune doctor``: what this node's runtime does that only running it can tell
(``cptune.search.check_host``), a table of its probes and what cptune does about each."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from rich.text import Text

from cptune.cli._common import SHARE_DB_HELP, positive, say, table
from cptune.engines import ENGINES, PROBES, UNTRIED, NodeVerdict

#: Exit code of a doctor that ran and found a probe failing.
UNHEALTHY = 1


def probing_backend(text: str) -> str:
    """An argparse type: an engine with node probes (``EngineSpec.probes``)."""
    from cptune.search._space import no_probes  # the search (Optuna, SQLAlchemy) loads on use

    spec = ENGINES.get(text)
    if spec is None or not spec.probes:
        raise argparse.ArgumentTypeError(no_probes(text))
    return text


def add_parser(commands: argparse._SubParsersAction) -> None:
    probing = tuple(name for name, spec in ENGINES.items() if spec.probes)
    questions = "; ".join(f"{name}: {question}" for name, question in PROBES.items())
    doctor = commands.add_parser(
        "doctor",
        help="probe what this GPU node's runtime does that only running it can tell",
        description=(
            "Run tiny probes on this node's GPUs and say, for each, whether the runtime does it, what "
            "was seen and what cptune does about it. Exit 0: every probe passed; 1: some failed (cptune "
            "works around each as the table says); 2: the node cannot run the engine at all (one line "
            "says what is missing). With --db the verdict is kept there for searches on this host, "
            f"which otherwise probe once themselves. The probes: {questions}."
        ),
    )
    listed = ",".join(probing)
    doctor.add_argument("--backend", type=probing_backend, default=probing[0], metavar=f"{{{listed}}}",
                        help=f"an engine with node probes (default {probing[0]})")
    doctor.add_argument("--max-ranks", type=positive, help="GPUs to probe on (default: all of this node's)")
    doctor.add_argument("--db", help="keep the verdict in this database (a file path or SQLAlchemy URL), "
                                     "where searches on this host go by it instead of probing (default: "
                                     "not kept)")
    doctor.add_argument("--share-db", action="store_true", help=SHARE_DB_HELP)


def verdict_table(verdict: NodeVerdict, where: str) -> Table:
    """Each probe's answer in ``verdict`` on ``where`` (the node, in words)."""
    shown = table(f"node probes on {verdict.ranks} GPU(s) of {where}",
                  "seen on the GPUs; a probe that fails is worked around as its last column says; each "
                  "probe's question: cptune doctor --help")
    shown.add_column("probe", no_wrap=True)
    shown.add_column("result", no_wrap=True)
    shown.add_column("what was seen")
    shown.add_column("what cptune does")
    for result in verdict.results:
        if result.answer == UNTRIED:
            outcome = Text("not tried", style="dim")
        else:
            outcome = Text("ok", style="green") if result.ok else Text("FAILED", style="bold red")
        shown.add_row(result.probe, outcome, Text(result.seen), Text(result.action or "-"))
    return shown


def summary(verdict: NodeVerdict, engine: str, kept_in: str | None) -> str:
    """One line: how many probes failed, and where the verdict is kept."""
    total, failed = len(verdict.results), sum(not r.ok for r in verdict.results)
    if not total:
        line = f"no probes ran on {verdict.ranks} GPU(s): nothing to say"
    elif not failed:
        line = (f"healthy: all {total} probes passed on {verdict.ranks} GPU(s); {engine} runs every "
                f"configuration")
    else:
        names = ", ".join(r.probe for r in verdict.results if not r.ok)
        line = (f"{failed} of {total} probes failed on {verdict.ranks} GPU(s) ({names}): cptune works around "
                f"each as the table says")
    kept = (f"kept in {kept_in}, where searches on this host go by it" if kept_in is not None
            else "not kept (--db keeps it for searches)")
    return f"{line}; {kept}"


def run_doctor(args: argparse.Namespace, console: Console) -> int:
    from cptune.search import check_host
    from cptune.store import display_url

    hardware, verdict = check_host(args.db, backend=args.backend, max_ranks=args.max_ranks,
                                   share=args.share_db)
    console.print(verdict_table(verdict, hardware.describe()))
    say(console, summary(verdict, args.backend, display_url(args.db) if args.db else None))
    return 0 if verdict.healthy else UNHEALTHY
