"""A tuned plan: the configuration to run per sequence-length bucket, and how to launch it.

The file is JSON described by the shipped ``plan.schema.json``, so a C++ deployment reads it
without Python. ``load_plan`` refuses, with the line and the reason, a file that is not
JSON, breaks the schema, contradicts itself (buckets that overlap, a config the shape
cannot run) or no longer matches its digest (edited after export). A plan tuned for other
hardware, or asked about another attention shape, is refused unless the caller forces it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from cptune._files import FileRefused, check_regular_or_absent, existing_kind, read_regular
from cptune.config import CPConfig
from cptune.engines import get_engine
from cptune.errors import CPTuneError
from cptune.feasibility import feasibility
from cptune.hardware import HardwareDescriptionError, load_description
from cptune.workload import AttentionShape, Workload, check_positive_int

SCHEMA_VERSION = 1
#: Larger files are refused before parsing: a plan is a few KiB.
MAX_PLAN_BYTES = 4 * 2**20
#: A measured host's fingerprint, or a description's.
FINGERPRINT = re.compile(r"[0-9a-f]{16}|described:[0-9a-f]{12}")


class PlanError(CPTuneError, ValueError):
    """A plan file that cannot be used: unreadable, malformed, inconsistent or tampered."""


class PlanMismatchError(PlanError):
    """A valid plan asked to serve hardware or an attention shape it was not tuned for."""


@dataclass(frozen=True)
class PlanHardware:
    """The hardware a plan was tuned on: a measured host or a topology description."""

    fingerprint: str
    description: str
    #: "host" (calibrated and measured) or "described" (a topology description).
    kind: str
    #: The description's name, e.g. "h100-sxm-8"; None for a host.
    name: str | None
    #: The engine whose ranks measured a host (its fingerprint is that engine's view of the
    #: host, ``Engine.hardware``); None for a description.
    engine: str | None = None


@dataclass(frozen=True)
class Alternative:
    """A configuration the evidence ranked below a bucket's pick, with its latency (ms), its
    interval and where they come from ("measured", "model" or "prior")."""

    config: CPConfig
    latency_ms: float
    interval_ms: tuple[float, float]
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "latency_ms": self.latency_ms,
                "interval_ms": list(self.interval_ms), "source": self.source}


@dataclass(frozen=True)
class Bucket:
    """Sequence lengths ``min_seq_len..max_seq_len`` run ``config``, chosen at ``seq_len``."""

    min_seq_len: int
    max_seq_len: int
    seq_len: int
    config: CPConfig
    latency_ms: float
    interval_ms: tuple[float, float]
    #: "measured", "model" or "prior": the evidence behind the choice.
    source: str
    #: The stored measurements behind it, the pick's first; empty when predicted.
    measurement_ids: tuple[int, ...]
    #: Configurations tied with ``config`` (``Recommendation.tied``), fastest first: a deployment
    #: may run any of them at no cost the evidence can see.
    tied: tuple[CPConfig, ...] = ()
    #: Every other configuration ranked at ``seq_len``, fastest first (empty in plans written
    #: before they were kept): what a framework that cannot run ``config`` takes instead.
    alternatives: tuple[Alternative, ...] = ()
    #: On hardware of several nodes, which part of the prior's time decides the pick
    #: (``cptune.model.TierDecision``), in words; None on one node.
    decided_by: str | None = None

    def __post_init__(self) -> None:
        if self.config in self.tied or len(set(self.tied)) < len(self.tied):
            raise ValueError(f"a bucket lists each configuration tied with its pick once, never the pick "
                             f"itself: {self.config.label} tied with {[c.label for c in self.tied]}")

    @property
    def contenders(self) -> tuple[CPConfig, ...]:
        """The pick and the configurations tied with it, the pick first
        (``Recommendation.contenders``)."""
        return (self.config, *self.tied)

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_seq_len": self.min_seq_len, "max_seq_len": self.max_seq_len, "seq_len": self.seq_len,
            "config": self.config.to_dict(), "label": self.config.label, "latency_ms": self.latency_ms,
            "interval_ms": list(self.interval_ms), "source": self.source,
            "measurement_ids": list(self.measurement_ids), "tied": [c.to_dict() for c in self.tied],
            "alternatives": [a.to_dict() for a in self.alternatives],
        } | ({} if self.decided_by is None else {"decided_by": self.decided_by})


@dataclass(frozen=True)
class Device:
    """Where one rank runs: its node, its rank within the node, and its device."""

    rank: int
    node: int
    local_rank: int
    #: "cpu" (CPU ranks) or "cuda:<local rank>".
    device: str


@dataclass(frozen=True)
class Launch:
    """How to start the ranks: argument vectors to which the deployment appends its program."""

    ranks: int
    nodes: int
    ranks_per_node: int
    mpiexec: tuple[str, ...]
    srun: tuple[str, ...]
    devices: tuple[Device, ...]
    #: PyTorch's launcher (a multi-node run adds its rendezvous flags); empty in plans
    #: written before it was added.
    torchrun: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
            "mpiexec": list(self.mpiexec), "srun": list(self.srun), "torchrun": list(self.torchrun),
            "devices": [vars(d).copy() for d in self.devices],
        }


def launch_for(ranks: int, ranks_per_node: int, gpus: bool) -> Launch:
    """The launch of ``ranks`` ranks packed ``ranks_per_node`` to a node (MPICH's mpiexec,
    Slurm's srun, PyTorch's torchrun), one GPU per rank when ``gpus``."""
    per_node = min(ranks, ranks_per_node)
    nodes = -(-ranks // per_node)
    mpiexec = ["mpiexec", "-n", str(ranks)] + (["-ppn", str(per_node)] if nodes > 1 else [])
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={ranks}", f"--ntasks-per-node={per_node}"]
    torchrun = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
    if nodes > 1:  # every node's torchrun meets at the first node's agent (set MASTER_ADDR to it)
        torchrun += ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:29500", "--rdzv-id=cptune"]
    if gpus:
        srun.append("--gpus-per-task=1")
    devices = tuple(
        Device(rank, rank // per_node, rank % per_node, f"cuda:{rank % per_node}" if gpus else "cpu")
        for rank in range(ranks)
    )
    return Launch(ranks, nodes, per_node, tuple(mpiexec), tuple(srun), devices, tuple(torchrun))


@dataclass(frozen=True)
class PolicyCurve:
    """One configuration of a batch policy: its time (ms per sequence, the slowest rank's) at
    each of the policy's grid lengths beside a batch's other groups, all the policy's ranks busy
    (None where the cost model gave none), and the longest sequence it holds within a rank's
    memory alone on its ranks and with all ranks busy."""

    config: CPConfig
    ms: tuple[float | None, ...]
    alone_max: int
    shared_max: int

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "ms": list(self.ms), "alone_max": self.alone_max,
                "shared_max": self.shared_max}


@dataclass(frozen=True)
class BatchPolicy:
    """What the per-batch solver needs to plan any batch on up to ``ranks`` ranks without a
    database: each configuration's cost curve over ``grid`` lengths and its memory limits
    (``cptune.mixes.MixCosts``, its undominated configurations only: the solver needs no others).
    ``cptune.mixes.plan_batch(plan, lengths)`` solves a batch from it."""

    ranks: int
    grid: tuple[int, ...]
    curves: tuple[PolicyCurve, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "grid": list(self.grid), "curves": [c.to_dict() for c in self.curves]}


@dataclass(frozen=True)
class Plan:
    """The configuration per sequence-length bucket for one attention ``shape`` on one
    ``hardware``. ``select`` answers a length; ``to_json`` writes the file ``load_plan`` reads."""

    hardware: PlanHardware
    shape: AttentionShape
    buckets: tuple[Bucket, ...]
    launch: Launch
    cptune_version: str
    created_at: str
    #: The file it was loaded from (None when built in memory).
    source: str | None = None
    #: The per-batch policy, when exported with one (``cptune export --batch-lengths``).
    batch_policy: BatchPolicy | None = None

    @property
    def max_seq_len(self) -> int:
        return self.buckets[-1].max_seq_len

    def bucket(self, seq_len: int) -> Bucket:
        """The bucket holding ``seq_len``; PlanError beyond the longest tuned length."""
        try:
            check_positive_int("seq_len", seq_len)  # numpy integers too: deployments compute lengths
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        seq_len = int(seq_len)
        if seq_len > self.max_seq_len:
            raise PlanError(
                f"seq_len {seq_len} is beyond this plan's longest bucket ({self.max_seq_len} tokens): "
                f"export a plan whose --seq-lens reach {seq_len}"
            )
        starts = [b.min_seq_len for b in self.buckets]
        return self.buckets[bisect.bisect_right(starts, seq_len) - 1]

    def select(self, request: int | Workload, force: bool = False) -> CPConfig:
        """The configuration for a sequence length, or for a ``Workload`` whose shape must be
        the plan's (``PlanMismatchError`` otherwise, unless ``force``)."""
        if isinstance(request, Workload):
            planned, asked = self.shape.to_dict(), request.shape.to_dict()
            differences = [
                f"{field} {planned.get(field, 'none')!r} in the plan, {asked.get(field, 'none')!r} asked"
                for field in dict.fromkeys([*planned, *asked]) if planned.get(field) != asked.get(field)
            ]
            if differences and not force:
                raise PlanMismatchError(
                    f"this plan was tuned for another attention shape ({'; '.join(differences)}): "
                    f"export a plan for this shape with cptune export, or pass force=True"
                )
            return self.bucket(request.seq_len).config
        return self.bucket(request).config

    def check_hardware(self, hardware: str | None = None, force: bool = False) -> None:
        """Refuse (``PlanMismatchError``) unless the plan was tuned for ``hardware``: None for
        this host, a fingerprint, or a hardware description's name or file."""
        if force:
            return
        if hardware is None:  # as the engine that measured the plan's host sees this one
            host = get_engine(self.hardware.engine or "mpi").hardware()
            here, what = host.fingerprint, f"this host ({host.describe()}, {host.fingerprint})"
        elif hardware == self.hardware.fingerprint:
            return
        elif FINGERPRINT.fullmatch(hardware):
            here, what = hardware, f"hardware {hardware}"
        else:
            try:
                description = load_description(hardware)
            except HardwareDescriptionError as exc:
                raise PlanError(f"hardware {hardware!r} is neither a fingerprint nor a description: "
                                f"{exc}") from None
            here, what = description.fingerprint, f"{description.describe()} ({description.fingerprint})"
        if here != self.hardware.fingerprint:
            if self.hardware.kind == "described":
                fix = (f"if this machine is that hardware, name it: hardware={self._described_as()!r}; "
                       f"else export a plan for it")
            else:
                fix = "export a plan on this hardware (cptune search, then cptune export)"
            raise PlanMismatchError(
                f"{self.source or 'this plan'} was tuned for {self.hardware.description} "
                f"({self.hardware.fingerprint}), not {what}: {fix}, or pass force=True"
            )

    def _described_as(self) -> str:
        """How to name a described plan's hardware: its description's name where that still
        loads to the plan's fingerprint, else the fingerprint (figures or NCCL's path given at
        export, or a description changed since)."""
        name = self.hardware.name
        try:
            if name is not None and load_description(name).fingerprint == self.hardware.fingerprint:
                return name
        except HardwareDescriptionError:
            pass
        return self.hardware.fingerprint

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON data, without its digest."""
        return {
            "schema_version": SCHEMA_VERSION,
            "cptune_version": self.cptune_version,
            "created_at": self.created_at,
            "hardware": vars(self.hardware).copy(),
            "shape": self.shape.to_dict(),
            "buckets": [b.to_dict() for b in self.buckets],
            "launch": self.launch.to_dict(),
        } | ({} if self.batch_policy is None else {"batch_policy": self.batch_policy.to_dict()})

    def to_json(self) -> str:
        """The file's text: the plan and its digest, indented for people to read."""
        data = self.to_dict()
        data["digest"] = digest(data)
        return _readable(data) + "\n"

    def write(self, path: str | Path, force: bool = False) -> Path:
        """Write the plan to ``path`` whole or not at all (a temporary file beside it, then a
        rename). An existing file there is replaced only if it is a plan (``check_replaceable``)
        or with ``force``; ``PlanError`` for that and for what the filesystem refuses."""
        target = Path(path)
        check_replaceable(target, force)
        text = self.to_json().encode("utf-8")
        partial: Path | None = None
        try:
            # a new file of its own beside the target (never one that was there: O_EXCL)
            fd, name = tempfile.mkstemp(prefix=f".{target.name[:64]}.", suffix=".partial",
                                        dir=target.parent)
            partial = Path(name)
            with os.fdopen(fd, "wb") as file:
                file.write(text)
                os.fchmod(file.fileno(), _new_file_mode())  # as open() would have made it, not 0600
            partial.replace(target)
        except OSError as exc:
            left = ""
            if partial is not None:  # only what this call created is removed; a failure to remove it is said
                try:
                    partial.unlink(missing_ok=True)
                except OSError as cleanup:
                    left = f"; {partial} is left over ({cleanup.strerror or cleanup}): delete it"
            raise PlanError(f"cannot write the plan to {target}: {exc.strerror or exc}{left}; write it "
                            f"elsewhere (cptune export -o PATH)") from None
        return target


def _new_file_mode() -> int:
    """The mode a new file gets from ``open``: 0o666 less this process's umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def check_replaceable(path: str | Path, force: bool = False) -> None:
    """``PlanError`` unless ``path`` holds nothing or a plan cptune export wrote, checked by its
    content: a JSON object with a plan's ``schema_version`` and a ``digest`` that matches it. A
    plan of any version, hardware or content is replaced (exporting again is how a plan is
    updated); one edited since (its digest no longer matches) only with ``force``. Anything
    else - a database, a search space, a hardware description, the host lock, another
    program's file, a directory, a device, FIFO or socket - is never replaced, ``force`` or
    not: what a user names as the output may be one of the command's own inputs."""
    target = Path(path)
    elsewhere = "write the plan elsewhere (cptune export -o PATH)"
    try:
        mode = existing_kind(target)
        if mode is not None and stat.S_ISDIR(mode):
            raise PlanError(f"cannot write the plan to {target}: it is a directory; name a file "
                            f"(cptune export -o {target / 'plan.json'})")
        check_regular_or_absent(target, elsewhere)
    except FileRefused as refused:
        raise PlanError(f"cannot write the plan to {refused}") from None
    except OSError as exc:
        raise PlanError(f"cannot write the plan to {target}: {exc.strerror or exc}; {elsewhere}") from None
    if mode is None:
        return
    kind = _plan_kind(target)
    if kind == "plan" or (kind == "edited" and force):
        return
    if kind == "edited":
        raise PlanError(f"{target} is a plan edited since cptune export wrote it (its digest no longer "
                        f"matches), so it is left as it is: {elsewhere}, or replace it with cptune export "
                        f"--force (force=True)")
    forced = ", --force or not" if force else ""
    raise PlanError(f"{target} exists and is not a plan written by cptune export, so it is left as it is"
                    f"{forced} (cptune replaces only its own plans): {elsewhere}, or move that file away "
                    f"first")


def _plan_kind(path: Path) -> str | None:
    """What the file at ``path`` is, by its content: "plan" (a plan cptune export wrote, whatever
    its version: a small regular file holding a JSON object with a plan's ``schema_version``
    and a ``digest`` that matches it), "edited" (such an object whose digest no longer
    matches) or None (not a plan)."""
    try:
        data = json.loads(read_regular(path, MAX_PLAN_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not (isinstance(data, dict) and "schema_version" in data and "digest" in data):
        return None
    try:
        return "plan" if data["digest"] == digest(data) else "edited"
    except RecursionError:  # nested deeper than it can be written back: not cptune's
        return None


def _readable(value: Any, indent: str = "") -> str:
    """JSON indented by two spaces, with each list or object of plain values on one line
    when it fits: a file a person reads top to bottom."""
    flat = json.dumps(value)
    containers = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if containers is None or (len(flat) + len(indent) <= 100
                              and not any(isinstance(v, dict | list) for v in containers)):
        return flat
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_readable(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    return "[\n" + ",\n".join(inner + _readable(v, inner) for v in value) + f"\n{indent}]"


def digest(data: Mapping[str, Any]) -> str:
    """SHA-256 of ``data`` without its "digest" key, serialised canonically."""
    content = {key: value for key, value in data.items() if key != "digest"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


# --------------------------------------------------------------------------- loading


def plan_schema() -> dict[str, Any]:
    """The shipped JSON Schema of a plan file."""
    text = (resources.files("cptune.plans") / "plan.schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def load_plan(path: str | Path, hardware: str | None = None, force: bool = False) -> Plan:
    """Read and validate the plan at ``path``.

    Refuses (``PlanError``, with the line and the reason) a file that is not JSON, breaks
    ``plan.schema.json``, contradicts itself or no longer matches its digest; and
    (``PlanMismatchError``) a plan tuned for other hardware than ``hardware`` - None for this
    host, a fingerprint, or a description name or file - unless ``force``."""
    name = str(path)
    text = _read(Path(path))
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
        locate = _Locator(name, text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{name}: line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg}") from None
    except _NotJSON as exc:
        line = text.count("\n", 0, constant.start()) + 1 if (constant := _CONSTANT.search(text)) else 1
        raise PlanError(f"{name}: line {line}: not valid JSON: {exc} (only Python reads it)") from None
    except RecursionError:
        raise PlanError(f"{name}: nested too deeply to be a plan written by cptune export") from None
    except ValueError:  # an integer of more digits than Python converts
        raise PlanError(f"{name}: holds a number of more than {sys.get_int_max_str_digits():,} digits, so it "
                        f"is not a plan written by cptune export") from None
    _check_schema(data, locate)
    if data["digest"] != digest(data):
        raise locate.error(("digest",), "the content does not match its digest: the file was changed "
                                        "after export; export the plan again (cptune export)")
    plan = _plan_from(data, name, locate)
    plan.check_hardware(hardware, force)
    return plan


class _NotJSON(ValueError):
    """NaN or Infinity: Python's json reads them, JSON (and a C++ reader) does not."""


#: Where such a constant stands as a value.
_CONSTANT = re.compile(r"[:\[,]\s*(-?Infinity|NaN)\b")


def _refuse_constant(name: str) -> Any:
    raise _NotJSON(name)


def _read(path: Path) -> str:
    try:
        return read_regular(path, MAX_PLAN_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise PlanError(f"{path}: no such file; write one with cptune export -o {path}") from None
    except FileRefused as refused:
        raise PlanError(str(refused)) from None
    except UnicodeDecodeError:
        raise PlanError(f"{path}: not UTF-8 text, so not a plan written by cptune export") from None
    except OSError as exc:
        raise PlanError(f"{path}: cannot read it: {exc.strerror}") from None


def _check_schema(data: Any, locate: _Locator) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    validator = Draft202012Validator(plan_schema(), format_checker=Draft202012Validator.FORMAT_CHECKER)
    error = best_match(validator.iter_errors(data))
    if error is not None:
        path = tuple(error.absolute_path)
        if error.validator == "additionalProperties":  # point at the first unexpected key
            path += (min(set(error.instance) - set(error.schema.get("properties", {}))),)
        raise locate.error(path, error.message)


def _plan_from(data: dict[str, Any], name: str, locate: _Locator) -> Plan:
    """Build the plan from schema-valid data, refusing what the schema cannot express."""
    try:
        shape = AttentionShape(**data["shape"])
    except ValueError as exc:
        raise locate.error(("shape",), str(exc)) from None
    buckets: list[Bucket] = []
    for i, entry in enumerate(data["buckets"]):
        at = ("buckets", i)
        start = 1 if i == 0 else buckets[-1].max_seq_len + 1
        if entry["min_seq_len"] != start:
            raise locate.error(at + ("min_seq_len",), f"must be {start}: buckets start at 1 and each "
                                                       f"starts one past the previous max_seq_len")
        if not entry["min_seq_len"] <= entry["seq_len"] <= entry["max_seq_len"]:
            raise locate.error(at + ("seq_len",), "must lie within min_seq_len..max_seq_len")
        config = _runnable(entry["config"], at + ("config",), shape.at(entry["seq_len"]), data, locate)
        if entry["label"] != config.label:
            raise locate.error(at + ("label",), f"must be {config.label!r}, the label of its config")
        tied: list[CPConfig] = []
        for j, alternative in enumerate(entry.get("tied", [])):
            other = _runnable(alternative, at + ("tied", j), shape.at(entry["seq_len"]), data, locate)
            if other == config or other in tied:
                raise locate.error(at + ("tied", j), f"{other.describe()} is listed already in this bucket: "
                                                     f"each tied configuration once, never the bucket's own")
            tied.append(other)
        alternatives: list[Alternative] = []
        for j, ranked in enumerate(entry.get("alternatives", [])):
            other = CPConfig(**ranked["config"])
            if reasons := feasibility(shape.at(entry["seq_len"]), other):
                raise locate.error(at + ("alternatives", j), f"{other.describe()} cannot run this shape: "
                                                              f"{reasons[0]}")
            if other == config or any(a.config == other for a in alternatives):
                raise locate.error(at + ("alternatives", j), f"{other.describe()} is listed already in "
                                                              f"this bucket: each alternative once, never "
                                                              f"its pick")
            fast, slow = ranked["interval_ms"]
            alternatives.append(Alternative(other, ranked["latency_ms"], (fast, slow), ranked["source"]))
        low, high = entry["interval_ms"]
        buckets.append(Bucket(
            entry["min_seq_len"], entry["max_seq_len"], entry["seq_len"], config, entry["latency_ms"],
            (low, high), entry["source"], tuple(entry["measurement_ids"]), tuple(tied), tuple(alternatives),
            entry.get("decided_by"),
        ))
    policy = None if "batch_policy" not in data else _policy_from(data["batch_policy"], shape, data, locate)
    launch = data["launch"]
    devices = tuple(Device(**d) for d in launch["devices"])
    if [d.rank for d in devices] != list(range(launch["ranks"])):
        raise locate.error(("launch", "devices"), f"must list ranks 0..{launch['ranks'] - 1} in order")
    return Plan(
        hardware=PlanHardware(**data["hardware"]),
        shape=shape,
        buckets=tuple(buckets),
        launch=Launch(launch["ranks"], launch["nodes"], launch["ranks_per_node"], tuple(launch["mpiexec"]),
                      tuple(launch["srun"]), devices, tuple(launch.get("torchrun", ()))),
        cptune_version=data["cptune_version"],
        created_at=data["created_at"],
        source=name,
        batch_policy=policy,
    )


def _policy_from(entry: dict[str, Any], shape: AttentionShape, data: dict[str, Any], locate: _Locator
                 ) -> BatchPolicy:
    """The batch policy of schema-valid ``entry``, refusing what the schema cannot express."""
    at: tuple[str | int, ...] = ("batch_policy",)
    grid = entry["grid"]
    if any(b <= a for a, b in zip(grid, grid[1:], strict=False)):
        raise locate.error(at + ("grid",), "must ascend strictly: the lengths the curves were read at")
    if entry["ranks"] > data["launch"]["ranks"]:
        raise locate.error(at + ("ranks",), f"{entry['ranks']} ranks, but the launch starts only "
                                            f"{data['launch']['ranks']}")
    curves: list[PolicyCurve] = []
    for i, curve in enumerate(entry["curves"]):
        here = at + ("curves", i)
        if len(curve["ms"]) != len(grid):
            raise locate.error(here + ("ms",), f"{len(curve['ms'])} times, but the grid has {len(grid)} "
                                               f"lengths: one time (or null) per grid length")
        config = CPConfig(**curve["config"])
        if reasons := feasibility(shape.at(max(grid[-1], config.ranks)), config):
            raise locate.error(here + ("config",), f"{config.describe()} cannot run this shape: {reasons[0]}")
        if config.ranks > entry["ranks"]:
            raise locate.error(here + ("config", "ranks"), f"{config.ranks} ranks, more than the policy's "
                                                            f"{entry['ranks']}")
        if any(c.config == config for c in curves):
            raise locate.error(here + ("config",), f"{config.describe()} is listed already: each "
                                                    f"configuration once")
        curves.append(PolicyCurve(config, tuple(curve["ms"]), curve["alone_max"], curve["shared_max"]))
    return BatchPolicy(entry["ranks"], tuple(grid), tuple(curves))


def _runnable(
    fields: dict[str, Any], at: tuple[str | int, ...], workload: Workload, data: dict[str, Any],
    locate: _Locator,
) -> CPConfig:
    """The configuration ``fields`` (at ``at`` in the file), refused unless it runs ``workload``
    within the plan's launch."""
    config = CPConfig(**fields)
    reasons = feasibility(workload, config)
    if reasons:
        raise locate.error(at, f"{config.describe()} cannot run this shape: {reasons[0]}")
    if config.ranks > data["launch"]["ranks"]:
        raise locate.error(at + ("ranks",), f"{config.ranks} ranks, but the launch starts "
                                            f"only {data['launch']['ranks']}")
    return config


_SPACE = re.compile(r"[ \t\n\r]*")
_SCALAR = re.compile(r'"(?:[^"\\]|\\.)*"|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null')


class _Locator:
    """The line each value of a JSON text starts on, by its path (keys and indices), for
    errors a person can find in the file."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text
        self.newlines = [i for i, c in enumerate(text) if c == "\n"]
        self.lines: dict[tuple[str | int, ...], int] = {}
        self._value(0, ())

    def error(self, path: Sequence[str | int], reason: str) -> PlanError:
        path = tuple(path)
        while path and path not in self.lines:
            path = path[:-1]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "(top)"
        return PlanError(f"{self.name}: line {self.lines.get(path, 1)}: {where}: {reason}")

    def _skip(self, i: int) -> int:
        match = _SPACE.match(self.text, i)
        assert match is not None  # the pattern matches the empty string
        return match.end()

    def _value(self, i: int, path: tuple[str | int, ...]) -> int:
        """Record the line of the value at ``i`` (and of everything inside it); return its end."""
        i = self._skip(i)
        self.lines[path] = bisect.bisect_left(self.newlines, i) + 1
        opening = self.text[i]
        if opening not in "{[":
            match = _SCALAR.match(self.text, i)
            assert match is not None  # the text parsed as JSON before it is located
            return match.end()
        closing, i, index = ("}" if opening == "{" else "]"), self._skip(i + 1), 0
        while self.text[i] != closing:
            if opening == "{":
                key = _SCALAR.match(self.text, i)
                assert key is not None
                i = self._skip(key.end()) + 1  # past the colon
                i = self._value(i, path + (json.loads(key.group()),))
            else:
                i = self._value(i, path + (index,))
                index += 1
            i = self._skip(i)
            if self.text[i] == ",":
                i = self._skip(i + 1)
        return i + 1
