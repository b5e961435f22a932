"""Where a benchmark result came from: the code it ran on and the command, for its header."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """This checkout's short commit, '+ uncommitted changes' when its tree differs;
    'unknown (not a git checkout)' outside git (write it in by hand then)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes" if dirty else "")


#: The paths a command line names that belong to the machine it ran on, and their placeholders.
_PLACEHOLDERS = {"--out": "<file>", "--db": "<db>"}


def command(script: str, argv: Sequence[str]) -> str:
    """The command line as run, the --out file and a scratch --db named by placeholders."""
    words = list(argv)
    for i, word in enumerate(words):
        flag = word.partition("=")[0]
        if flag not in _PLACEHOLDERS:
            continue
        if "=" in word:
            words[i] = f"{flag}={_PLACEHOLDERS[flag]}"
        elif i + 1 < len(words):
            words[i + 1] = _PLACEHOLDERS[flag]
    return " ".join(["python", f"benchmarks/{script}", *words])
