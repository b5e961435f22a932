"""A run's facts as the store keeps them: a small JSON object of short strings.

A measurement's host facts (``Measurement.host``: the host, the engine's software, the kernel
and process group it ran with) and a calibration's (``Calibration.facts``) are kept in a JSON
column beside the row, never pickled. Whatever an engine reports, a row's facts stay bounded:
at most ``MAX_FACTS`` of them, each key and value cut to a fixed length; what a damaged or
foreign row holds there is read as the facts it can be (strings only), never trusted as is.
"""

from __future__ import annotations

#: Facts kept per row (the torch engine reports about 15), the first in the order given.
MAX_FACTS = 32
#: Characters kept of a fact's name and of its value (versions and kernel names are short).
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 256


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def bounded_facts(facts: object) -> dict[str, str]:
    """``facts`` as a row keeps them: its string-valued entries with string keys, at most
    ``MAX_FACTS``, keys and values cut to ``MAX_KEY_CHARS`` and ``MAX_VALUE_CHARS``; none
    where ``facts`` is not a mapping (a row stored before facts were kept: NULL)."""
    if not isinstance(facts, dict):
        return {}
    kept: dict[str, str] = {}
    for key, value in facts.items():
        if len(kept) == MAX_FACTS:
            break
        if isinstance(key, str) and isinstance(value, str):
            kept[_cut(key, MAX_KEY_CHARS)] = _cut(value, MAX_VALUE_CHARS)
    return kept
