"""``cptune search``: a whole space searched on this machine (``cptune.search.search_space``),
drawn live: a progress bar per sequence length and each length's fastest configuration so far."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from cptune.calibration import RESUMING, RETIMED
from cptune.cli._common import (
    CTRL_C,
    DB_HELP,
    MAX_RANKS_HELP,
    SHARE_DB_HELP,
    UsageError,
    add_backend,
    add_framework_flag,
    add_hosts_flags,
    add_workload_flags,
    count,
    engine_of,
    mask_given,
    non_negative,
    positive,
    positive_list,
    say,
    seconds,
    table,
    warn,
    workload_of,
)
from cptune.config import STRATEGIES
from cptune.engines import get_engine
from cptune.execute import space_rank_counts
from cptune.measurement import Measurement, format_ms
from cptune.space import DEMO_SPACE, ORDERS, MeasureSettings, SearchSpace, find_space

if TYPE_CHECKING:
    from rich.status import Status

    from cptune.config import CPConfig
    from cptune.engines import NodeVerdict
    from cptune.estimate import Verdict
    from cptune.hardware import Hardware
    from cptune.search import SpaceSearch, Visit, WorkloadSearch
    from cptune.workload import Workload

OVERSUBSCRIBE_HELP = ("allow more ranks than this host's cores: such runs time ranks waiting for a core, so "
                      "they are stored marked oversubscribed and left out of the model and the picks")
#: How the progress bar names each phase of a search (``cptune.search.PHASES``).
_PHASE_WORDS = {"explore": "exploring", "round": "rounds", "race": "final race", "confirm": "second sitting"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    search = commands.add_parser(
        "search",
        help="search the CP configurations of a model on this hardware and store every result",
        description=(
            "For each sequence length of a search space, run Optuna trials over strategy, rank "
            "count and head group: every configuration is run on real ranks, checked against a "
            "float64 reference, timed, and stored. Then interleaved rounds visit each one again in "
            "a fresh random order, and a final race re-runs those tied with the fastest until it is "
            "separated or the budget is spent; the answer is a winner with its margin or a tie. "
            "What is stored counts: a rerun runs only what is missing. SPACE is a TOML file or a "
            f"built-in space name (default: {DEMO_SPACE}); or describe one model with the workload flags."
        ),
    )
    search.add_argument("space", nargs="?", help=f"search space file or built-in name (default {DEMO_SPACE})")
    search.add_argument("--db", help=DB_HELP)
    search.add_argument("--share-db", action="store_true", help=SHARE_DB_HELP)
    search.add_argument("--trials", type=positive,
                        help="trial budget per sequence length (default: the space's)")
    search.add_argument("--timeout", type=seconds,
                        help="time budget per sequence length (trials, rounds and race), in seconds")
    search.add_argument("--max-ranks", type=positive, help=MAX_RANKS_HELP)
    search.add_argument("--ranks", type=positive_list,
                        help="rank counts to try, e.g. 1,2 (with workload flags)")
    add_backend(search)
    add_hosts_flags(search)
    search.add_argument("--within-node-heads", action="store_true",
                        help="on --hosts' nodes, measure only the configurations whose head groups (Ulysses) "
                             "fit inside a node (a space's within_node_heads = true)")
    search.add_argument("--remeasure", action="store_true",
                        help="visit every configuration afresh (exploration, rounds, race) even if stored; "
                             "the verdict combines the new visits with the stored ones")
    search.add_argument("--rounds", type=count("rounds"),
                        help="clean visits every configuration that ran gets, in interleaved rounds "
                             "(default: the space's [measure] rounds, else 2); each visit times [measure] "
                             "repeats iterations")
    search.add_argument("--race-rounds", type=count("race_rounds"),
                        help="further visits the configurations tied with the fastest may get in the final "
                             "race (default: the space's [measure] race_rounds, else 10; 0: no race)")
    search.add_argument("--confirm-rounds", type=count("confirm_rounds"),
                        help="rounds a winner and the configurations close to it get again in a second "
                             "sitting, after the other sequence lengths, so the verdict covers two states "
                             "of the host (default: the space's [measure] confirm_rounds, else 3; 0: none)")
    search.add_argument("--no-calibrate", action="store_true",
                        help="skip the calibration a first search on new hardware runs (the cost "
                             "model needs one; cptune calibrate adds it later)")
    search.add_argument("--oversubscribe", action="store_true", help=OVERSUBSCRIBE_HELP)
    search.add_argument("--order", choices=ORDERS, default="exhaustive",
                        help="guided: the cost model orders the trials, best predicted first, and the search "
                             "stops when no configuration left is likely to beat the fastest measured one "
                             "(needs a calibration); exhaustive: every configuration (TPE within a --trials "
                             "budget below the space's size). Default: exhaustive")
    search.add_argument("--seed", type=non_negative,
                        help="seed of the rounds' random order, to repeat a search's order (default: fresh)")
    add_workload_flags(search, lengths=True, with_strategies=True)
    add_framework_flag(search, "measure only the configurations FRAMEWORK can run (with --backend torch)")
    search.add_argument("--time-framework", action="store_true",
                        help="with --for, --backend torch, workload flags and --ranks: time FRAMEWORK's "
                             "own attention (yunchang's layer; torch's templated ring for xdit and sglang) "
                             "in one interleaved round beside cptune's configurations on those ranks, each "
                             "checked against the reference; its rows are stored named and excluded from "
                             "the model")


def _space_from_flags(args: argparse.Namespace) -> SearchSpace:
    missing = [flag for flag, value in (("--heads", args.heads), ("--head-dim", args.head_dim),
                                        ("--seq-lens", args.seq_lens)) if value is None]
    if missing:
        raise UsageError(f"a workload given by flags needs {', '.join(missing)} "
                         f"(or name a search space file instead)")
    for seq_len in args.seq_lens:
        workload_of(args, seq_len)  # refuses a bad shape in the user's terms
    return SearchSpace(
        name="flags", description="command-line flags", source=None,
        shape=workload_of(args, args.seq_lens[0]).shape, seq_lens=tuple(dict.fromkeys(args.seq_lens)),
        ranks=args.ranks, strategies=args.strategies or STRATEGIES, trials=None, measure=MeasureSettings(),
    )


def space_of(args: argparse.Namespace) -> SearchSpace | str:
    """The space the command line names: the workload flags' (``--ranks`` among them), or a
    file or built-in name (default: the demo), run in ``--mode`` where given;
    ``--within-node-heads`` restricts either."""
    flags_given = any(getattr(args, name, None) is not None for name in (
        "heads", "head_dim", "seq_lens", "kv_heads", "strategies", "ranks")) or args.causal
    flags_given = flags_given or mask_given(args)
    if args.space and flags_given:
        raise UsageError("give either a search space or workload flags (--heads, --seq-lens, ...), not both")
    space = _space_from_flags(args) if flags_given else args.space or DEMO_SPACE
    if args.mode is not None and not flags_given:  # a named space in another mode
        found = find_space(space)
        space = dataclasses.replace(found, shape=dataclasses.replace(found.shape, mode=args.mode))
    if not getattr(args, "within_node_heads", False):
        return space
    return dataclasses.replace(find_space(space), within_node_heads=True)


def best_table(run: SpaceSearch, finished: set[int]) -> Table:
    """Each sequence length's fastest configuration so far, with its interval and standing
    (``finished``: the lengths whose search is over)."""
    shown = table(f"{run.space.name}: fastest configuration so far",
                  "ms per iteration of the slowest rank, combined over its clean visits, 95% interval; "
                  "tied: within the noise of this hardware")
    for column in ("seq_len", "config", "ranks", "ms", "95% interval", "visits", "verdict"):
        shown.add_column(column, justify="left" if column in ("config", "verdict") else "right", no_wrap=True)
    for seq_len in run.space.seq_lens:
        search = run.searches.get(seq_len)
        verdict = search.verdict if search is not None else None
        if verdict is None:
            standing = "node refuses all" if seq_len in run.skipped else "-"
            shown.add_row(str(seq_len), "-", "-", "-", "-", "-", standing)
            continue
        lead, done = verdict.leader, seq_len in finished
        if verdict.tied:
            standing = f"tied with {len(verdict.tied)}"
        elif not verdict.comparisons:
            standing = "only one" if done else "only one so far"
        else:
            standing = "winner" if done else "leads"
        shown.add_row(str(seq_len), lead.config.label, str(lead.config.ranks), format_ms(lead.median_ms),
                      f"{format_ms(lead.low_ms)}-{format_ms(lead.high_ms)}", str(lead.rounds), standing)
    return shown


def verdict_line(seq_len: int, verdict: Verdict | None, second: bool, unconfirmed: bool) -> str | None:
    """What one sitting of a workload's search found, in words, and whether its winner is
    still ``unconfirmed`` (``WorkloadSearch.unconfirmed``); None when nothing ran clean."""
    if verdict is None:
        return None
    line = f"seq {seq_len}" + (" after a second sitting" if second else "") + f": {verdict.describe()}"
    if unconfirmed:
        line += ("; not confirmed yet (the time budget or the runs ran out, or the leader changed): a "
                 "rerun of this search adds a sitting" if second
                 else "; a second sitting after the other lengths confirms it")
    if verdict.leader.visits[-1].oversubscribed:
        line += "; it ran more ranks than cores (--oversubscribe), so the model and the picks leave it out"
    return line


class LiveSearch:
    """A ``cptune.search.SearchProgress`` drawn on the terminal: a bar per sitting, the table
    of each length's fastest configuration, and a line per verdict."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console)
        self.live: Live | None = None
        self.run: SpaceSearch | None = None
        self.finished: set[int] = set()
        self._task = TaskID(0)
        self._seen = 0  # visits of the current sitting (reused ones too), for its bar
        self._status: Status | None = None
        #: The configurations the node refused of the workload being set up, by reason.
        self._refused: dict[str, list[CPConfig]] = {}
        self._refused_of = 0  # that workload's length

    def _redraw(self) -> None:
        if self.live is not None and self.run is not None:
            self.live.update(Group(self.progress, best_table(self.run, self.finished)))

    def started(self, run: SpaceSearch) -> None:
        self.run = run
        say(self.console, "searching ", (run.space.name, "bold"),
            f" ({run.space.origin}) on {run.hardware.describe()} ", (run.hardware.fingerprint, "dim"),
            f" in {run.rounds} round(s), up to {run.race_rounds} more in the final race, "
            f"{run.confirm_rounds} in a second sitting for each winner; results in {run.url}, "
            f"{run.order} order")

    def host_busy(self, notice: str) -> None:
        warn((notice, "yellow"))

    def calibrating(self, hardware: Hardware, ranks: int, url: str, first_run: bool) -> None:
        if first_run:
            say(self.console, f"this hardware has no calibration yet: calibrating 1..{ranks} ranks first "
                              f"(the cost model's prior needs it; --no-calibrate skips)")
        else:
            say(self.console, f"calibrating {hardware.describe()} ", (hardware.fingerprint, "dim"),
                f" on 1..{ranks} ranks; results in {url}")
        self._status = self.console.status("calibrating")
        self._status.start()

    def calibration_step(self, step: str) -> None:
        if self._status is not None:
            self._status.update(f"calibrating: {step}")
        if RETIMED in step:  # a step timed again (or kept): said beyond the spinner, on stderr, unwrapped
            warn((step, "yellow"))
        elif step.startswith(RESUMING):
            say(self.console, step)

    def calibrated(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def checking_node(self, hardware: Hardware, ranks: int) -> None:
        self.calibrated()
        engine = self.run.engine if self.run is not None else "the engine"
        say(self.console, f"this node has not been probed for {engine} yet: probing it on {ranks} GPU(s) "
                          f"first (once per host; cptune doctor --backend {engine} shows what probes find)")
        self._status = self.console.status("probing this node")
        self._status.start()

    def node_checked(self, verdict: NodeVerdict, stored: bool) -> None:
        self.calibrated()
        if verdict.healthy:
            if not stored and verdict.results:
                say(self.console, f"this node passed all {len(verdict.results)} probes (kept for later "
                                  f"searches)")
            return
        engine = self.run.engine if self.run is not None else "the engine"
        failed = ", ".join(r.probe for r in verdict.results if not r.ok)
        when = "the stored verdict" if stored else "probed now"
        say(self.console, ("this node failed probes:", "yellow"),
            f" {failed} ({when}); cptune leaves out or works around what they affect "
            f"(cptune doctor --backend {engine} shows how)")

    def refused(self, workload: Workload, config: CPConfig, reason: str) -> None:
        self.calibrated()
        if workload.seq_len != self._refused_of:
            self._say_refused()
        self._refused_of = workload.seq_len
        self._refused.setdefault(reason, []).append(config)

    def _say_refused(self) -> None:
        """A line per reason the node gave to refuse configurations of the workload being set
        up, naming those the reason does not name itself."""
        for reason, configs in self._refused.items():
            names = ", ".join(c.describe() for c in configs if c.describe() not in reason)
            say(self.console, f"seq {self._refused_of}: left out{' ' + names if names else ''}: {reason}")
        self._refused.clear()

    def skipped(self, workload: Workload) -> None:
        line = f"seq {workload.seq_len}: not searched, this node refuses every configuration"
        if len(self._refused) == 1:  # one reason for all: said once, naming none
            line += f": {self._refused.popitem()[0]}"
        self._say_refused()
        say(self.console, line)

    def sitting_started(self, search: WorkloadSearch, second: bool) -> None:
        self.calibrated()
        self._say_refused()
        if self.live is None:
            self.live = Live(Group(self.progress), console=self.console, refresh_per_second=4)
            self.live.start()
        name = f"seq {search.workload.seq_len}" + (" (second sitting)" if second else "")
        self._task = self.progress.add_task(name, total=None)
        self._seen = 0
        self._redraw()

    def visited(self, search: WorkloadSearch, visit: Visit, second: bool) -> None:
        CTRL_C.raise_if_pressed()
        self._seen += 1
        phase = _PHASE_WORDS[visit.phase]
        self.progress.update(self._task, description=f"seq {search.workload.seq_len} {phase}",
                             completed=self._seen, total=self._seen + visit.left)
        self._redraw()

    def sitting_done(self, search: WorkloadSearch, second: bool, visits: list[Visit],
                     unconfirmed: bool) -> None:
        seq_len = search.workload.seq_len
        name = f"seq {seq_len}" + (" (second sitting)" if second else "")
        self.progress.update(self._task, description=name, total=self._seen, completed=self._seen)
        if not second and search.unguided is not None:
            say(self.console, f"seq {seq_len}: not guided, every configuration instead: {search.unguided}")
        if not second and search.early_stop is not None:
            say(self.console, f"seq {seq_len}: {search.early_stop.describe()}")
        if line := verdict_line(seq_len, search.verdict, second, unconfirmed):
            say(self.console, line)
        if here := sum(v.disturbed is not None for v in visits):
            say(self.console, f"seq {seq_len}: {here} visit(s) disturbed by other load: stored marked, "
                              f"not counted, visited again")
        if search.stayed_busy is not None and not second:
            say(self.console, f"seq {seq_len}: stopped waiting for quiet: {search.stayed_busy}; its "
                              f"disturbed visits are stored marked and count as runs, so a configuration "
                              f"whose runs are used up is measured again only by a rerun with --remeasure, "
                              f"when the host is quiet")
        if second or not unconfirmed:
            self.finished.add(seq_len)
            for left in search.left_out:  # once the length's search is over, never silently
                say(self.console, (f"seq {seq_len}: ", "yellow"), left.describe())
        self._redraw()

    def close(self) -> None:
        self.calibrated()
        self._say_refused()
        if self.live is not None:
            self._redraw()
            self.live.stop()
            self.live = None
            if not self.console.is_terminal:
                self.console.line()  # Rich ends the last frame with a newline only on a terminal


def run_framework_timing(args: argparse.Namespace, console: Console) -> int:
    """``--time-framework``: ``time_framework`` for each length and rank count the flags give."""
    from cptune.search import time_framework
    from cptune.store import display_url

    if not args.framework or not args.ranks:
        raise UsageError("--time-framework needs --for FRAMEWORK and --ranks N (the ranks to time it on)")
    space = space_of(args)
    if not isinstance(space, SearchSpace):
        raise UsageError("--time-framework takes a workload given by flags (--heads, --head-dim, "
                         "--seq-lens), not a space file")
    shown = table(f"{args.framework}'s implementation beside cptune's configurations, one interleaved round",
                  "median ms per iteration of the slowest rank; implementation: the framework's own "
                  "attention in the configuration's place (stored excluded); -: cptune's strategy")
    for column in ("seq_len", "config", "implementation", "median ms", "error", "row"):
        shown.add_column(column, justify="left" if column in ("config", "implementation") else "right")
    for seq_len in space.seq_lens:
        workload = workload_of(args, seq_len)
        for ranks in args.ranks:
            timed = time_framework(args.framework, workload, ranks, args.db, backend=args.backend,
                                   seed=args.seed, share=args.share_db)
            for t in sorted(timed, key=lambda t: getattr(t.result, "median_ms", float("inf"))):
                m = t.result
                median, error = ((f"{m.median_ms:.2f}{'*' if m.disturbed else ''}", f"{m.max_error:.0e}")
                                 if isinstance(m, Measurement) else (f"[red]failed: {m.kind}[/]", ""))
                shown.add_row(str(seq_len), t.config.label, t.implementation or "-", median, error,
                              str(t.row_id or ""))
    console.print(shown)
    where_db = f" --db {display_url(args.db)}" if args.db else ""
    say(console, f"* = disturbed by other load; see the stored rows, the implementation named, with: "
                 f"cptune results{where_db}")
    return 0


def run(args: argparse.Namespace, console: Console) -> int:
    if args.time_framework:
        return run_framework_timing(args, console)
    space, backend = find_space(space_of(args)), engine_of(args)
    # bad flags and rank counts are refused before the search's imports (optuna, the model: seconds)
    space_rank_counts(space, get_engine(backend), args.max_ranks, args.oversubscribe)
    from cptune.search import search_space
    from cptune.store import display_url

    shown = LiveSearch(console)
    try:
        done = search_space(
            space, args.db, backend=backend, max_ranks=args.max_ranks, trials=args.trials,
            timeout=args.timeout, rounds=args.rounds, race_rounds=args.race_rounds,
            confirm_rounds=args.confirm_rounds, order=args.order, remeasure=args.remeasure,
            oversubscribe=args.oversubscribe, calibrate_first=not args.no_calibrate, seed=args.seed,
            share=args.share_db, framework=args.framework,
            progress=shown,  # type: ignore[arg-type]  # a SearchProgress by shape
        )
    finally:
        shown.close()
    where_db = f" --db {display_url(args.db)}" if args.db else ""
    say(console, f"{len(done.measured)} configuration(s) measured now in {done.visits} visit(s) "
                 f"({done.failed} failed, stored with their reason; {done.disturbed} disturbed by other "
                 f"load, stored marked and visited again); see them with: cptune results{where_db}")
    if done.refused_count:
        lengths = ", ".join(map(str, done.skipped))
        skipped = f"; seq {lengths} not searched at all" if done.skipped else ""
        say(console, f"{done.refused_count} configuration(s) left out, refused by this node (the reasons are "
                     f"above; cptune doctor --backend {done.engine} shows its probes){skipped}")
    say(console, f"each workload's runs are also an Optuna study there: optuna-dashboard {done.url}")
    return 0
