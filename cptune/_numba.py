"""Numba compilation with a cache that never fails an import: the one place cptune compiles
loops (the per-batch solver's, ``cptune.mixes``; the numpy kernel's softmax pass,
``cptune.engines.mpi``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import njit


def compiled(function: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``function`` compiled on first call (``njit`` with ``options``), its machine code cached
    beside its file or in the user's cache directory, whichever is writable; where neither is,
    compiled in each process. Used bare (``@compiled``) or with options (``@compiled(fastmath=...)``)."""
    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        try:
            return njit(cache=True, **options)(function)
        except RuntimeError:  # Numba found no writable cache directory
            return njit(**options)(function)
    return wrap if function is None else wrap(function)
