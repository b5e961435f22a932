"""The hardware a measurement belongs to, reduced to a fingerprint.

Two measurements are comparable when they ran on the same kind of machine with the same
communication stack; the fingerprint is a hash of exactly those facts, so results from
one machine never answer questions about another.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata

from cptune.measurement import available_cores, describe_host


@dataclass(frozen=True)
class Hardware:
    """What decides how fast a configuration runs: processors, their link, the libraries."""

    host: str
    cpu_model: str
    cpu_count: int
    gpu_model: str | None
    gpu_count: int
    interconnect: str
    mpi_library: str | None
    nccl_version: str | None = None
    tensorrt_version: str | None = None

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of every field (computed once: recommendations ask often)."""
        canonical = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def describe(self) -> str:
        devices = f"{self.gpu_count}x {self.gpu_model}" if self.gpu_model else f"{self.cpu_count} CPU cores"
        return f"{self.host}: {devices}, {self.interconnect}"


def mpi_library() -> str | None:
    """The MPI library mpi4py loads here, from package metadata (no MPI start-up needed),
    so every caller derives the same fingerprint."""
    for package in ("mpich", "openmpi", "impi-rt"):
        try:
            return f"{package} {metadata.version(package)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def this_host() -> Hardware:
    """This machine as the MPI engine uses it: its CPU cores, linked by shared memory."""
    facts = describe_host()
    return Hardware(
        host=facts["hostname"],
        cpu_model=facts["cpu"],
        cpu_count=available_cores(),
        gpu_model=None,
        gpu_count=0,
        interconnect="shared memory (one host)",
        mpi_library=mpi_library(),
    )
