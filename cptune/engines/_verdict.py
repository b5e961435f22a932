"""What a GPU node's TensorRT can do, as its probes found it (``cptune doctor``), and what
cptune does about each answer.

The probes (``_probes``, on the ranks) answer questions only a GPU can: do collectives
work on all ranks, and on a subgroup named in ``groups``; is a grouped broadcast's ``root``
read as a global or a group-local rank; does attention build in fp32 and bf16; do the
``DistCollective`` layers stay layers of their own in a built engine, or are they fused
into a Myelin region. A ``NodeVerdict`` keeps the answers (JSON, stored with the host by
the search) and turns them into decisions: hybrids refused where subgroups fail, the
Cast boundary around collectives where they are fused away, a dtype refused where its
attention does not build.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cptune.config import CPConfig
from cptune.workload import Workload

#: Each probe, in the order they run, with the question it answers.
PROBES: dict[str, str] = {
    "collectives": "all_to_all, all_gather and broadcast on every rank, values checked",
    "subgroups": "the same in two subgroups named in `groups` on one communicator",
    "broadcast_root": "a grouped broadcast's root: a global or a group-local rank",
    "attention_fp32": "fused attention builds and is right in fp32",
    "attention_bf16": "fused attention builds and is right in bf16",
    "standalone": "DistCollective layers stay their own layers in a built engine",
}


@dataclass(frozen=True)
class ProbeResult:
    """One probe's answer: whether the node does it, what was seen (one line), and what
    cptune does about it."""

    probe: str
    ok: bool
    seen: str
    action: str = ""


@dataclass(frozen=True)
class NodeVerdict:
    """Every probe's answer on ``ranks`` GPUs of one node."""

    ranks: int
    results: tuple[ProbeResult, ...] = field(default_factory=tuple)

    def result(self, probe: str) -> ProbeResult | None:
        return next((r for r in self.results if r.probe == probe), None)

    def _fails(self, probe: str) -> bool:
        found = self.result(probe)
        return found is not None and not found.ok

    @property
    def healthy(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def cast_boundary(self) -> bool:
        """Collectives need a dtype-changing Cast on each side to stay layers of their own."""
        return self._fails("standalone")

    def refuses(self, workload: Workload, config: CPConfig) -> str | None:
        """Why this node cannot run ``config`` on ``workload`` (one line), or None."""
        hybrid = config.head_group > 1 and config.context_degree > 1
        if hybrid and self._fails("subgroups"):
            return (f"{config.describe()} is a hybrid, which needs collectives in subgroups, and this node's "
                    f"TensorRT got them wrong (cptune doctor: subgroups); pure strategies still run")
        probe = "attention_fp32" if workload.dtype == "fp32" else "attention_bf16"
        if workload.dtype in ("fp32", "bf16") and self._fails(probe):
            return (f"attention in {workload.dtype} does not build on this node's TensorRT "
                    f"(cptune doctor: {probe}); use another --dtype")
        return None

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, data: dict) -> NodeVerdict:
        return cls(int(data["ranks"]), tuple(ProbeResult(**r) for r in data["results"]))
