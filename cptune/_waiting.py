"""One line on stderr that says what cptune is waiting for (the host lock, a quiet host).

On a terminal the line is rewritten in place as it changes; anywhere else (a pipe, a log, a
Rich display that took stderr over, a test capturing it) a line at first and then one every
``REPEAT_S`` seconds, each whole and unwrapped, so a log shows a wait without filling up.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

#: Seconds between the lines of a wait written anywhere but straight to a terminal.
REPEAT_S = 30.0


class WaitLine:
    """The line of one wait: ``show`` it as it changes, ``end`` it when the wait is over."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``stream``: where to write (default: ``sys.stderr`` as it is at each write)."""
        self._stream = stream
        self._clock = clock
        self._last: float | None = None  # when a line was last written (not in place)
        self._in_place = False  # a line is on the terminal, not yet ended

    def _target(self) -> tuple[TextIO, bool]:
        """The stream, and whether it is the terminal itself (rewritable in place)."""
        stream = self._stream or sys.stderr
        try:
            terminal = stream.isatty() and stream is sys.__stderr__
        except (AttributeError, ValueError):
            terminal = False
        return stream, terminal

    def show(self, text: str) -> None:
        """The wait's line is now ``text``."""
        stream, terminal = self._target()
        if terminal:
            width = max(20, shutil.get_terminal_size().columns - 1)
            shown = text if len(text) <= width else text[: width - 3] + "..."
            stream.write(f"\r{shown}\x1b[K")
            self._in_place = True
        elif self._last is None or self._clock() - self._last >= REPEAT_S:
            stream.write(text + "\n")
            self._last = self._clock()
        else:
            return
        stream.flush()

    def end(self) -> None:
        """The wait is over: a line left in place on the terminal is ended."""
        if self._in_place:
            stream, _ = self._target()
            stream.write("\n")
            stream.flush()
            self._in_place = False
        self._last = None
