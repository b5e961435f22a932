"""Reading cptune's TOML files: parse, then validate key by key with messages that say
``"{file}: {key}: {reason}"``.

Shared by the loaders of search spaces (``cptune.space``) and of hardware descriptions
(``cptune.hardware``): each passes its own error class and its own example line per key.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import json
import re
import tomllib
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

from cptune._files import FileRefused, read_regular
from cptune.errors import CPTuneError
from cptune.workload import MAX_INT, MAX_INT_TEXT

#: The largest TOML file read: spaces and descriptions are a few KB; a bigger file is not one.
MAX_TOML_BYTES = 1 << 20

#: Builds the error a loader raises from (file, dotted key, reason).
ErrorFactory = Callable[[str, str, str], Exception]

#: TOML type names by Python type, most specific first (bool is an int, datetime a date).
_TOML_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"), (list, "an array"),
    (dict, "a table"), (_dt.datetime, "a date-time"), (_dt.date, "a date"), (_dt.time, "a time"),
)


def _toml_type(value: object) -> str:
    """The TOML name of a parsed value's type, for messages the file's author reads."""
    return next((name for kind, name in _TOML_TYPES if isinstance(value, kind)), type(value).__name__)


def show(value: object) -> str:
    """``value`` as it would be written in TOML (shortened), so the user recognises it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, dict):
        text = "{" + ", ".join(value) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(show(v) for v in value) + "]"
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def got(value: object) -> str:
    return f"got {_toml_type(value)} ({show(value)})"


def suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


#: Format characters that reorder or hide text on a terminal (bidirectional overrides and
#: isolates, marks, zero-width characters): a name holding one can print as another name.
_FORMAT_CONTROLS = frozenset("\u061c\u200b\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                             "\u2060\u2066\u2067\u2068\u2069\ufeff")


def _hidden_character(text: str) -> str | None:
    """The first control or text-reordering character in ``text`` (tabs and line breaks aside),
    as U+XXXX; None when it prints as it reads."""
    for char in text:
        if (unicodedata.category(char) == "Cc" and char not in "\t\n") or char in _FORMAT_CONTROLS:
            return f"U+{ord(char):04X}"
    return None


class TomlFileError(CPTuneError, ValueError):
    """A TOML input file that cannot be used; the message reads ``"{file}: {key}: {reason}"``."""

    def __init__(self, file: str, key: str, reason: str) -> None:
        super().__init__(f"{file}: {key}: {reason}")
        self.file = file
        self.key = key
        self.reason = reason


class TableReader:
    """Reads typed values out of a parsed TOML document, raising ``error(file, key, reason)``
    for the first value that does not fit. ``examples`` maps dotted keys (and table names)
    to a line the user can copy; it is appended to the reason where one exists."""

    def __init__(self, file: str, error: ErrorFactory, examples: Mapping[str, str]) -> None:
        self.file = file
        self.error = error
        self.examples = examples

    def fail(self, key: str, reason: str) -> Exception:
        return self.error(self.file, key, reason)

    def example(self, key: str) -> str:
        base = re.sub(r"\[\d+\]$", "", key)
        return f"; e.g. {self.examples[base]}" if base in self.examples else ""

    def check_keys(self, table: dict[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
        for key in table:
            if key not in allowed:
                where = f"{prefix}.{key}" if prefix else key
                section = f"in [{prefix}]" if prefix else "at the top level"
                raise self.fail(
                    where,
                    f"unknown key{suggest(key, allowed)}; allowed {section}: "
                    f"{', '.join(allowed)}",
                )

    def table(self, doc: dict[str, Any], key: str, required: bool, prefix: str = "") -> dict[str, Any] | None:
        where = f"{prefix}.{key}" if prefix else key
        if key not in doc:
            if required:
                add = self.examples.get(where, f"a [{where}] section")
                raise self.fail(where, f"missing required table; add {add}")
            return None
        value = doc[key]
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a table ([{where}] section), {got(value)}")
        return value

    def value(self, table: dict[str, Any], name: str, prefix: str, required: bool) -> Any:
        key = f"{prefix}.{name}" if prefix else name
        if name not in table:
            if required:
                raise self.fail(key, f"missing required key{self.example(key)}")
            return None
        return table[name]

    def integer(self, value: object, key: str, minimum: int, maximum: int = MAX_INT) -> int:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected {wanted}, {got(value)}{self.example(key)}")
        if value < minimum:
            raise self.fail(key, f"out of range: expected {wanted}, got {value}{self.example(key)}")
        if value > maximum:
            most = MAX_INT_TEXT if maximum == MAX_INT else f"{maximum:,}"
            raise self.fail(key, f"out of range: expected {wanted} of at most {most}, got {value:,}"
                                 f"{self.example(key)}")
        return value

    def positive_number(self, value: object, key: str, unit: str = "seconds") -> float:
        """A finite number > 0, integer or float; ``unit`` names what it counts."""
        wanted = f"a positive number of {unit}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"expected {wanted}, {got(value)}{self.example(key)}")
        if not value > 0 or value == float("inf"):
            raise self.fail(key, f"out of range: expected {wanted}, got {show(value)}{self.example(key)}")
        return float(value)

    def string(self, value: object, key: str, non_empty: bool) -> str:
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, {got(value)}{self.example(key)}")
        if non_empty and not value.strip():
            raise self.fail(key, f"must not be empty{self.example(key)}")
        if hidden := _hidden_character(value):
            raise self.fail(key, f"holds the invisible character {hidden}, which a terminal would print "
                                 f"as something else; remove it{self.example(key)}")
        return value

    def boolean(self, value: object, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"expected a boolean (true or false), {got(value)}{self.example(key)}")
        return value

    def array(self, value: object, key: str, item: Callable[[object, str], Any]) -> tuple[Any, ...]:
        """A non-empty array without duplicates, each item read by ``item(value, key[i])``."""
        if not isinstance(value, list):
            raise self.fail(key, f"expected an array, {got(value)}{self.example(key)}")
        if not value:
            raise self.fail(key, f"must not be empty: list at least one value{self.example(key)}")
        seen: dict[object, int] = {}
        items = []
        for i, raw in enumerate(value):
            entry = item(raw, f"{key}[{i}]")
            if entry in seen:
                raise self.fail(
                    f"{key}[{i}]",
                    f"duplicate value {show(entry)} (already {key}[{seen[entry]}]); list each value once",
                )
            seen[entry] = i
            items.append(entry)
        return tuple(items)


def read_toml(file: str, error: ErrorFactory, missing: Callable[[], str]) -> dict[str, Any]:
    """Parse the TOML file, turning every read or syntax failure into ``error``. ``missing()``
    is the reason given when the file does not exist (called only then)."""
    try:
        data = read_regular(file, MAX_TOML_BYTES)
    except FileNotFoundError:
        raise error(file, "(file)", missing()) from None
    except FileRefused as refused:
        raise error(file, "(file)", refused.reason) from None
    except OSError as exc:
        raise error(file, "(file)", f"cannot read it: {exc.strerror or exc}; check the path") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (some editors write one) is no TOML
    except UnicodeDecodeError as exc:
        raise error(file, "(file)", f"not UTF-8 text ({exc.reason} at byte {exc.start}); "
                    "save the file as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        where = re.search(r"\s*\(at (line \d+, column \d+|end of document)\)\s*$", message)
        location = where.group(1) if where else "(toml)"
        problem = message[: where.start()] if where else message
        raise error(
            file, location,
            f"invalid TOML: {problem}; fix the syntax there (strings need quotes, arrays brackets)",
        ) from None
