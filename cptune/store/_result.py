"""One stored measurement or failure as the store hands it out (its ``status``: ``STATUSES``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cptune.config import CPConfig
from cptune.hardware import heads_span_nodes
from cptune.measurement import STATUSES, ran_with
from cptune.workload import Workload

__all__ = ["RESULT_COLUMNS", "STATUSES", "Result"]


#: The keys of ``Result.to_dict``, in order: known without a row (a CSV header).
RESULT_COLUMNS = (
    "id", "hardware", "seq_len", "heads", "head_dim", "kv_heads", "batch", "dtype", "causal", "mode",
    "window", "sinks", "documents", "text", "strategy", "ranks", "head_group", "layout", "pad_heads",
    "status",
    "median_ms", "p10_ms", "p90_ms", "compute_ms", "comm_ms",
    "forward_ms", "peak_bytes",
    "max_error", "error", "engine", "measured_at", "oversubscribed", "excluded", "round_id", "disturbed",
    "heads_span_nodes", "kernel", "facts",
)


@dataclass(frozen=True)
class Result:
    """One stored measurement or failure, flattened for listing and export."""

    id: int
    hardware: str
    workload: Workload
    config: CPConfig
    status: str
    median_ms: float | None
    p10_ms: float | None
    p90_ms: float | None
    compute_ms: float | None
    comm_ms: float | None
    peak_bytes: int | None
    max_error: float | None
    error: str | None
    engine: str
    #: ISO 8601 in UTC, with its offset, whatever the database keeps.
    measured_at: str
    oversubscribed: bool = False
    excluded: bool = False
    round_id: str | None = None
    #: Why the contention guard judged the run disturbed; None when it ran clean.
    disturbed: str | None = None
    #: Ranks per node of the cluster it ran on (None: one node).
    ranks_per_node: int | None = None
    #: A training run's forward alone (ms); None for a forward run.
    forward_ms: float | None = None
    #: What it ran with (``Measurement.host``, as the store keeps it): none for a failure and
    #: for rows stored before these were kept.
    facts: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def kernel(self) -> str | None:
        """The attention kernel(s) it ran (on a GPU, those the torch engine's probe chose);
        None where not recorded."""
        return self.facts.get("kernel") or None

    @property
    def ran_with(self) -> str:
        """Its kernel, process group and GPU software in one line (``cptune.measurement.ran_with``)."""
        return ran_with(self.facts)

    @property
    def heads_span_nodes(self) -> bool:
        """Whether its head groups spanned nodes (``cptune.hardware.heads_span_nodes``): its
        all-to-all then crossed the network."""
        return heads_span_nodes(self.config, self.ranks_per_node)

    @property
    def clean(self) -> bool:
        """A successful run that counts: not disturbed, not set aside by the user."""
        return self.status == "ok" and self.median_ms is not None and not self.disturbed and not self.excluded

    def to_dict(self) -> dict[str, object]:
        """Every one of ``RESULT_COLUMNS``, in order: the mask's parts, the layout and padded
        heads as well where they are defaults (None, 0 or False), so every row has the same keys."""
        mask: dict[str, object] = {"window": None, "sinks": 0, "documents": None, "text": 0}
        workload = self.workload.to_dict()
        return {
            "id": self.id, "hardware": self.hardware, **workload, **(mask | workload),
            **self.config.to_dict(), "layout": self.config.layout, "pad_heads": self.config.pad_heads,
            "status": self.status, "median_ms": self.median_ms, "p10_ms": self.p10_ms, "p90_ms": self.p90_ms,
            "compute_ms": self.compute_ms, "comm_ms": self.comm_ms, "forward_ms": self.forward_ms,
            "peak_bytes": self.peak_bytes,
            "max_error": self.max_error, "error": self.error, "engine": self.engine,
            "measured_at": self.measured_at, "oversubscribed": self.oversubscribed, "excluded": self.excluded,
            "round_id": self.round_id, "disturbed": self.disturbed, "heads_span_nodes": self.heads_span_nodes,
            "kernel": self.kernel, "facts": dict(self.facts),
        }


