"""The tables cptune keeps (SQLAlchemy ORM); Alembic's migrations in ``cptune.db`` build them."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from cptune.config import CPConfig
from cptune.hardware import Hardware
from cptune.workload import Workload

#: Alembic's version table of cptune's schema (not ``alembic_version``: Optuna's tables and
#: a user's own Alembic may live in the same database).
VERSION_TABLE = "cptune_alembic_version"


class Base(DeclarativeBase):
    pass


class HardwareRow(Base):
    __tablename__ = "hardware"

    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(32), unique=True)
    host: Mapped[str] = mapped_column(String(255))
    cpu_model: Mapped[str] = mapped_column(String(255))
    cpu_count: Mapped[int] = mapped_column(Integer)
    gpu_model: Mapped[str | None] = mapped_column(String(255))
    gpu_count: Mapped[int] = mapped_column(Integer)
    interconnect: Mapped[str] = mapped_column(String(255))
    mpi_library: Mapped[str | None] = mapped_column(String(255))
    nccl_version: Mapped[str | None] = mapped_column(String(64))
    tensorrt_version: Mapped[str | None] = mapped_column(String(64))
    nodes: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    ranks_per_node: Mapped[int | None] = mapped_column(Integer)
    network: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    def to_hardware(self) -> Hardware:
        return Hardware(
            host=self.host, cpu_model=self.cpu_model, cpu_count=self.cpu_count, gpu_model=self.gpu_model,
            gpu_count=self.gpu_count, interconnect=self.interconnect, mpi_library=self.mpi_library,
            nccl_version=self.nccl_version, tensorrt_version=self.tensorrt_version,
            nodes=self.nodes, ranks_per_node=self.ranks_per_node, network=self.network,
        )


#: ``Workload.to_dict``'s keys of the mask beyond ``causal``, each a column of ``WorkloadRow``'s
#: (the window as two).
MASK_FIELDS = ("window", "sinks", "documents", "text")


def mask_key(workload: Workload) -> str:
    """What tells ``workload``'s mask apart from another's in the workloads' unique shape: ""
    for full or causal attention (every row stored before masks were kept), else a digest of
    the mask's parts as JSON (a list of documents may be longer than an index holds)."""
    parts = {key: value for key, value in workload.to_dict().items() if key in MASK_FIELDS}
    if not parts:
        return ""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class WorkloadRow(Base):
    __tablename__ = "workloads"
    __table_args__ = (
        UniqueConstraint("seq_len", "heads", "kv_heads", "head_dim", "batch", "dtype", "causal", "mode",
                         "mask_key", name="uq_workload_shape"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    seq_len: Mapped[int] = mapped_column(Integer)
    heads: Mapped[int] = mapped_column(Integer)
    kv_heads: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    batch: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(8))
    causal: Mapped[bool] = mapped_column(Boolean)
    #: ``forward`` or ``train`` (``cptune.workload.MODES``).
    mode: Mapped[str] = mapped_column(String(8), default="forward")
    #: The sliding window's keys before and after each query; None: no window.
    window_left: Mapped[int | None] = mapped_column(Integer)
    window_right: Mapped[int | None] = mapped_column(Integer)
    sinks: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: ``Documents.to_json``: the packed documents' lengths, one length for all, or None.
    documents: Mapped[list[int] | int | None] = mapped_column(JSON)
    text: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: ``mask_key``: "" for full or causal attention.
    mask_key: Mapped[str] = mapped_column(String(64), default="", server_default="")

    @staticmethod
    def key_of(workload: Workload) -> dict[str, object]:
        """``workload`` as the row's columns: its unique shape, then the mask's parts."""
        d = workload.to_dict()
        window = workload.window or (None, None)
        return {"seq_len": workload.seq_len, "heads": workload.heads, "kv_heads": workload.kv_heads,
                "head_dim": workload.head_dim, "batch": workload.batch, "dtype": workload.dtype,
                "causal": workload.causal, "mode": workload.mode, "mask_key": mask_key(workload),
                "window_left": window[0], "window_right": window[1], "sinks": workload.sinks,
                "documents": d.get("documents"), "text": workload.text}

    def to_workload(self) -> Workload:
        window = () if self.window_left is None else (self.window_left, self.window_right or 0)
        return Workload(
            seq_len=self.seq_len, heads=self.heads, head_dim=self.head_dim, kv_heads=self.kv_heads,
            batch=self.batch, dtype=self.dtype, causal=self.causal, mode=self.mode, window=window,
            sinks=self.sinks or 0, documents=self.documents, text=self.text or 0,
        )


class MeasurementRow(Base):
    __tablename__ = "measurements"
    __table_args__ = (
        # "what has this hardware measured for this workload" (resume, cost-model training)
        Index("ix_measurements_hardware_workload", "hardware_id", "workload_id", "status"),
        # "how does this configuration do across workloads" (the model's features)
        Index("ix_measurements_config", "strategy", "ranks", "head_group"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"))
    strategy: Mapped[str] = mapped_column(String(32))
    ranks: Mapped[int] = mapped_column(Integer)
    head_group: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    median_ms: Mapped[float | None] = mapped_column(Float)
    p10_ms: Mapped[float | None] = mapped_column(Float)
    p90_ms: Mapped[float | None] = mapped_column(Float)
    compute_ms: Mapped[float | None] = mapped_column(Float)
    comm_ms: Mapped[float | None] = mapped_column(Float)
    #: A training run's forward alone (median ms, slowest rank); None for a forward run.
    forward_ms: Mapped[float | None] = mapped_column(Float)
    peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_error: Mapped[float | None] = mapped_column(Float)
    samples_ms: Mapped[list[float] | None] = mapped_column(JSON)
    warmup: Mapped[int | None] = mapped_column(Integer)
    repeats: Mapped[int | None] = mapped_column(Integer)
    engine: Mapped[str] = mapped_column(String(32))
    cptune_version: Mapped[str] = mapped_column(String(32))
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    #: Ran more ranks than the host has cores (``--oversubscribe``): its timings measure
    #: the sharing, so the model and the picks leave it out unless asked.
    oversubscribed: Mapped[bool] = mapped_column(Boolean, default=False)
    #: Set aside by the user (``cptune results --exclude``): kept, but used for nothing.
    excluded: Mapped[bool] = mapped_column(Boolean, default=False)
    #: The interleaved round this run belongs to (``cptune.estimate``); None: a round of its own.
    round_id: Mapped[str | None] = mapped_column(String(64))
    #: Why the contention guard judged this run disturbed by other load; None: it ran clean.
    disturbed: Mapped[str | None] = mapped_column(Text)
    #: What it ran with (``Measurement.host``, bounded: ``_facts``): the kernel, the process
    #: group, the engine's software; None for a failure and for rows stored before revision 0010.
    facts: Mapped[dict | None] = mapped_column(JSON)
    #: The configuration's token layout (``cptune.config.LAYOUTS``); None: the workload's
    #: default (every row stored before revision 0011).
    layout: Mapped[str | None] = mapped_column(String(32))

    hardware: Mapped[HardwareRow] = relationship()
    workload: Mapped[WorkloadRow] = relationship()

    @property
    def config(self) -> CPConfig:
        return stored_config(self, self.workload.heads)


def stored_config(row: MeasurementRow, heads: int) -> CPConfig:
    """The configuration ``row`` ran, on a workload of ``heads`` heads. Padded heads
    (``CPConfig.pad_heads``) have no column: a head group that does not divide the heads runs
    only padded, and one that divides them never is, so the workload's heads say which (and
    every row stored before padded heads existed has a head group that divides them)."""
    padded = heads % row.head_group != 0
    return CPConfig(row.strategy, row.ranks, row.head_group, row.layout, pad_heads=padded)


def config_columns(config: CPConfig) -> dict[str, object]:
    """``config`` as ``MeasurementRow``'s columns: ``to_dict`` less ``pad_heads`` (``stored_config``)."""
    return {key: value for key, value in config.to_dict().items() if key != "pad_heads"}


class CalibrationRow(Base):
    __tablename__ = "calibrations"
    __table_args__ = (Index("ix_calibrations_hardware", "hardware_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    engine: Mapped[str] = mapped_column(String(32))
    #: ``Calibration.to_dict()``: plain JSON, read back with ``Calibration.from_dict``.
    data: Mapped[dict] = mapped_column(JSON)
    cptune_version: Mapped[str] = mapped_column(String(32))
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    #: What its timings ran with (``Calibration.facts``, bounded: ``_facts``), the kernel its
    #: attention was timed with among them; None for calibrations stored before revision 0010.
    facts: Mapped[dict | None] = mapped_column(JSON)


class CalibrationPieceRow(Base):
    """One step of a calibration that has not finished, timed clean (``CalibrationPieces``):
    kept so that a calibration a busy host stopped is gone on from, not started over; the
    calibration's own row replaces a hardware's and engine's pieces once it is stored."""

    __tablename__ = "calibration_pieces"
    __table_args__ = (UniqueConstraint("hardware_id", "engine", "key", name="uq_calibration_piece"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    engine: Mapped[str] = mapped_column(String(32))
    #: ``calibrate``'s key: what the step times and how (a digest), its round, its name.
    key: Mapped[str] = mapped_column(String(255))
    #: The step's seconds, one per shape or message size.
    seconds: Mapped[list[float]] = mapped_column(JSON)
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class NodeCheckRow(Base):
    """What a node's probes found (``cptune doctor``, or a search's first run there): one
    verdict per hardware and engine, the latest replacing the one before."""

    __tablename__ = "node_checks"
    __table_args__ = (UniqueConstraint("hardware_id", "engine", name="uq_node_check_hardware_engine"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    engine: Mapped[str] = mapped_column(String(32))
    #: ``NodeVerdict.to_dict()``: plain JSON, read back with ``NodeVerdict.from_dict``.
    verdict: Mapped[dict] = mapped_column(JSON)
    cptune_version: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
