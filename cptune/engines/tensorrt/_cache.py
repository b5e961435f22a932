"""Serialized TensorRT engines on disk, so a graph is built once per GPU model and version.

Building an engine takes seconds to minutes (TensorRT times kernels on the GPU); the
result depends only on the graph, the TensorRT version and the GPU it was built for, so
those three make the key. Entries are written atomically (a temporary file in the same
directory, then a rename) with the SHA-256 of the engine next to it: a reader never sees
a half-written engine, and a damaged one reads as missing and is rebuilt.

No TensorRT here: the rank side passes in the bytes and the facts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where engines are kept: ``$CPTUNE_CACHE/engines``, else the user's cache directory
    (``$XDG_CACHE_HOME`` or ``~/.cache``) under ``cptune/engines``."""
    if root := os.environ.get("CPTUNE_CACHE"):
        return Path(root) / "engines"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cptune" / "engines"


def graph_digest(graph: bytes) -> str:
    """SHA-256 of a serialized ONNX graph (serialize it deterministically)."""
    return hashlib.sha256(graph).hexdigest()


def engine_key(graph: bytes, tensorrt_version: str, gpu_name: str, compute_capability: str) -> str:
    """The cache key of the engine built from ``graph`` by TensorRT ``tensorrt_version`` for
    a GPU ``gpu_name`` of ``compute_capability`` (e.g. "9.0"): any change of the four
    gives another key."""
    facts = {"graph": graph_digest(graph), "tensorrt": tensorrt_version, "gpu": gpu_name,
             "compute_capability": compute_capability}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


class EngineCache:
    """Engines by key in ``directory`` (default ``cache_dir()``)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or cache_dir()

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.engine", self.directory / f"{key}.json"

    def load(self, key: str) -> bytes | None:
        """The engine stored under ``key``, or None when there is none or it does not match
        its recorded digest (a damaged entry is a miss, never a crash)."""
        engine_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            engine = engine_path.read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("sha256") != hashlib.sha256(engine).hexdigest():
            return None
        return engine

    def store(self, key: str, engine: bytes, build_seconds: float) -> None:
        """Keep ``engine`` under ``key``, atomically: the engine first, then the record that
        vouches for it, each renamed into place."""
        self.directory.mkdir(parents=True, exist_ok=True)
        engine_path, meta_path = self._paths(key)
        meta = {"sha256": hashlib.sha256(engine).hexdigest(), "bytes": len(engine),
                "build_seconds": round(build_seconds, 3)}
        _write_atomically(engine_path, engine)
        _write_atomically(meta_path, json.dumps(meta).encode())


def _write_atomically(path: Path, data: bytes) -> None:
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
