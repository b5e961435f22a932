"""The hardware a measurement belongs to, reduced to a fingerprint.

Two measurements are comparable when they ran on the same kind of machine with the same
communication stack; the fingerprint is a hash of exactly those facts, so results from
one machine never answer questions about another.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
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
    #: A cluster: its nodes, the ranks each runs, and the link between nodes
    #: (``interconnect`` is then the link inside one node). One node: 1, None, None.
    nodes: int = 1
    ranks_per_node: int | None = None
    network: str | None = None

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of every field (computed once: recommendations ask
        often). A cluster's fields count only on a cluster, so one node's fingerprint is what
        it was before clusters were measured."""
        facts = asdict(self)
        if self.nodes == 1 and self.ranks_per_node is None and self.network is None:
            for key in _CLUSTER_FIELDS:
                del facts[key]
        canonical = json.dumps(facts, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def describe(self) -> str:
        devices = f"{self.gpu_count}x {self.gpu_model}" if self.gpu_model else f"{self.cpu_count} CPU cores"
        if self.nodes == 1:
            return f"{self.host}: {devices}, {self.interconnect}"
        return (f"{self.host}: {self.nodes} nodes x {self.ranks_per_node} ranks ({devices} each), "
                f"{self.interconnect} inside a node, {self.network} across nodes")


#: The fields only a cluster sets.
_CLUSTER_FIELDS = ("nodes", "ranks_per_node", "network")


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


# --------------------------------------------------------------------------- GPUs
#
# What the NVIDIA driver reports, read with nvidia-smi (a subprocess with an argument
# list): it needs no CUDA library in this process, so the fingerprint and the TensorRT
# preflight work before (and without) any GPU package being importable.

#: The nvidia-smi query behind ``GpuInfo``; its CSV columns, in order.
GPU_QUERY_FIELDS: tuple[str, ...] = ("index", "uuid", "name", "compute_cap", "driver_version")
_NVIDIA_SMI_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA GPU as the driver lists it."""

    index: int
    uuid: str
    name: str
    compute_capability: str  # "9.0"
    driver_version: str

    @property
    def sm(self) -> int:
        """The compute capability as one number: "9.0" -> 90."""
        major, _, minor = self.compute_capability.partition(".")
        return int(major) * 10 + int(minor or 0)


def parse_gpu_query(text: str) -> list[GpuInfo]:
    """The GPUs in the output of ``nvidia-smi --query-gpu=<GPU_QUERY_FIELDS>
    --format=csv,noheader``; lines that do not have those columns are skipped."""
    gpus = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(GPU_QUERY_FIELDS) or not cells[0].isdigit():
            continue
        index, uuid, name, capability, driver = cells
        if not re.fullmatch(r"\d+\.\d+", capability):
            continue
        gpus.append(GpuInfo(int(index), uuid, name, capability, driver))
    return gpus


def visible_gpus(gpus: Sequence[GpuInfo], cuda_visible_devices: str | None) -> list[GpuInfo]:
    """The GPUs a CUDA process sees: all of them, or those ``CUDA_VISIBLE_DEVICES`` names
    (by index or UUID prefix, in its order; the list ends at the first unknown entry, as
    in CUDA)."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = [g for g in gpus if (entry.isdigit() and g.index == int(entry))
                 or (entry.startswith("GPU-") and g.uuid.startswith(entry))]
        if not match:
            break
        chosen.append(match[0])
    return chosen


def parse_cuda_version(text: str) -> str | None:
    """The CUDA version the driver supports, from ``nvidia-smi`` or ``nvidia-smi -q``."""
    found = re.search(r"CUDA Version\s*:\s*([\d.]+)", text)
    return found.group(1) if found else None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_topology(text: str, indices: Sequence[int]) -> str:
    """The links between the GPUs of driver index ``indices`` from ``nvidia-smi topo -m``'s
    matrix, in the driver's terms: "NVLink (NV18)" when every pair is linked by NVLink,
    "PCIe (PIX, SYS)" when none is, "NVLink (NV4) and PCIe (SYS)" when some are; "single
    GPU" for one. ``ValueError`` when the matrix lacks a pair."""
    if len(indices) <= 1:
        return "single GPU"
    rows: dict[str, list[str]] = {}
    header: list[str] = []
    for line in _ANSI.sub("", text).splitlines():
        cells = line.split()
        if not cells:
            continue
        if not header and cells[0].startswith("GPU"):
            header = [c for c in cells if re.fullmatch(r"GPU\d+", c)]
        elif header and re.fullmatch(r"GPU\d+", cells[0]):
            rows[cells[0]] = cells[1 : 1 + len(header)]
    wanted = [f"GPU{i}" for i in indices]
    links: set[str] = set()
    for i, a in enumerate(wanted):
        for j in range(i + 1, len(wanted)):
            if a not in rows or wanted[j] not in header:
                raise ValueError(f"nvidia-smi topo -m lists no link between {a} and {wanted[j]}")
            links.add(rows[a][header.index(wanted[j])])
    nvlink = sorted(link for link in links if link.startswith("NV"))
    other = sorted(links - set(nvlink))
    parts = [f"NVLink ({', '.join(nvlink)})"] if nvlink else []
    if other:
        parts.append(f"PCIe ({', '.join(other)})")
    return " and ".join(parts)


def _nvidia_smi(*arguments: str) -> str:
    """The output of nvidia-smi with ``arguments``; ``OSError`` when it is missing or fails."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        raise FileNotFoundError("nvidia-smi is not on PATH: no NVIDIA driver here")
    try:
        done = subprocess.run([executable, *arguments], capture_output=True, text=True,
                              timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise OSError(f"nvidia-smi did not answer within {_NVIDIA_SMI_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        reason = (done.stdout + done.stderr).strip().splitlines()
        raise OSError(f"nvidia-smi failed: {reason[0] if reason else f'exit code {done.returncode}'}")
    return done.stdout


def list_gpus() -> list[GpuInfo]:
    """The CUDA GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied); ``OSError``
    naming the reason when the driver cannot be asked."""
    text = _nvidia_smi(f"--query-gpu={','.join(GPU_QUERY_FIELDS)}", "--format=csv,noheader")
    listed, selection = parse_gpu_query(text), os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = visible_gpus(listed, selection)
    if listed and not visible:
        raise OSError(
            f"CUDA_VISIBLE_DEVICES={selection!r} selects none of the {len(listed)} GPUs the driver lists"
        )
    return visible


def _first_version(*packages: str) -> str | None:
    for package in packages:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return None


def tensorrt_version() -> str | None:
    """TensorRT's version from package metadata (the metapackage or a CUDA-specific one)."""
    return _first_version("tensorrt", "tensorrt-cu13", "tensorrt-cu12")


def nccl_version() -> str | None:
    """The NCCL wheel's version from package metadata (the libnccl nccl4py loads by default)."""
    return _first_version("nvidia-nccl-cu13", "nvidia-nccl-cu12")


def gpu_hardware(gpus: Sequence[GpuInfo], topology: str, cuda_version: str | None) -> Hardware:
    """The fingerprint of a GPU node as the TensorRT engine uses it: the GPUs' model (of
    the first: one process per GPU assumes one model), compute capability, driver and CUDA
    version (in ``gpu_model``: the store has no separate columns for them), their count
    and link (``topology``: ``nvidia-smi topo -m``'s text), NCCL and TensorRT versions."""
    facts = describe_host()
    first = gpus[0]
    cuda = f", CUDA {cuda_version}" if cuda_version else ""
    return Hardware(
        host=facts["hostname"],
        cpu_model=facts["cpu"],
        cpu_count=available_cores(),
        gpu_model=f"{first.name} (sm_{first.sm}, driver {first.driver_version}{cuda})",
        gpu_count=len(gpus),
        interconnect=parse_topology(topology, [g.index for g in gpus]),
        mpi_library=mpi_library(),
        nccl_version=nccl_version(),
        tensorrt_version=tensorrt_version(),
    )


def this_gpu_node(gpus: Sequence[GpuInfo]) -> Hardware:
    """This node's GPUs ``gpus`` (from ``list_gpus``) as a ``Hardware`` fingerprint; asks
    nvidia-smi for the CUDA version and the GPUs' links."""
    topology = _nvidia_smi("topo", "-m") if len(gpus) > 1 else ""
    return gpu_hardware(gpus, topology, parse_cuda_version(_nvidia_smi("-q")))
