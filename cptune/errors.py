"""Errors cptune raises on purpose: each names the problem and what to do about it."""

from __future__ import annotations


class CPTuneError(Exception):
    """Base class: an expected failure with a message meant for the user."""


class InfeasibleConfigError(CPTuneError, ValueError):
    """A configuration cannot run this workload; raised before any process starts."""

    def __init__(self, message: str, reasons: list[str]) -> None:
        super().__init__(message)
        self.reasons = reasons


class SearchSetupError(CPTuneError, ValueError):
    """A search or calibration that cannot start as asked; nothing ran, nothing was stored."""


class EngineError(CPTuneError, RuntimeError):
    """A run failed on the ranks. ``kind`` is one of ``KINDS``; the message says which rank
    failed, how, and what to try."""

    KINDS = ("crash", "timeout", "error", "out_of_memory", "wrong_output", "launch")

    def __init__(self, kind: str, message: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown EngineError kind {kind!r}")
        super().__init__(message)
        self.kind = kind
