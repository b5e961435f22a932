"""What a GPU node's TensorRT can do, as its probes found it (``cptune doctor``), and what
cptune does about each answer.

The probes (``_probes``, on the ranks) answer questions only a GPU can: do collectives
work on all ranks, and on a subgroup named in ``groups``; is a grouped broadcast's ``root``
read as a global or a group-local rank; does attention build in fp32 and bf16; do the
``DistCollective`` layers stay layers of their own in a built engine, or are they fused
into a Myelin region. A ``NodeVerdict`` keeps the answers (JSON, stored with the host by
the search) and turns them into decisions: hybrids refused where subgroups or roots go
wrong, a dtype refused where its attention does not build, multi-GPU configurations
refused where collectives do not run. (A collective fused away is also caught per engine
as it is built, and rebuilt behind a Cast boundary: the probe says ahead whether that
will happen.)
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


#: The answer of a probe the node's GPUs are too few to ask (it passes: nothing that runs on
#: them needs it).
UNTRIED = "untried"
#: What cptune does when a probe fails (per answer where the answers differ).
ACTIONS: dict[str, str] = {
    "collectives": "every multi-GPU configuration is refused: its collectives would not run as written",
    "subgroups": "hybrids (Ulysses in head groups, Ring or AllGather-KV across them) are refused; "
                 "pure strategies run, each on a communicator of its own group",
    "broadcast_root": "hybrids are refused (their Ring's broadcasts name global roots); pure strategies "
                      "write group-local roots on their group's communicator and run",
    "attention_fp32": "fp32 workloads are refused on this node",
    "attention_bf16": "bf16 workloads are refused on this node",
    "standalone:boundary": "every engine is built with a float32 Cast on each side of each collective "
                           "(16-bit workloads move twice the bytes)",
    "standalone": "every multi-GPU configuration is refused: TensorRT fuses its collectives away",
}


@dataclass(frozen=True)
class ProbeResult:
    """One probe's answer: whether the node does it as cptune writes it, what was seen (one
    line), a short machine-readable ``answer`` (e.g. "global" or "local" for a root; "" where
    the probe was not tried) and what cptune does about it."""

    probe: str
    ok: bool
    seen: str
    answer: str = ""
    action: str = ""

    @classmethod
    def judged(cls, probe: str, ok: bool, seen: str, answer: str = "") -> ProbeResult:
        """The result with the action cptune takes when it failed."""
        action = "" if ok else ACTIONS.get(f"{probe}:{answer}", ACTIONS[probe])
        return cls(probe, ok, seen, answer, action)


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

    def refuses(self, workload: Workload, config: CPConfig) -> str | None:
        """Why this node cannot run ``config`` on ``workload`` (one line), or None."""
        if config.pad_heads:
            return (f"{config.describe()} pads heads, which cptune's TensorRT graphs do not yet; use a head "
                    f"group that divides the heads")
        standalone = self.result("standalone")
        if config.ranks > 1 and (self._fails("collectives") or (
                standalone is not None and not standalone.ok and standalone.answer != "boundary")):
            probe = "collectives" if self._fails("collectives") else "standalone"
            return (f"{config.describe()} needs collectives, which this node's TensorRT does not run as "
                    f"written (cptune doctor: {probe}); only one-GPU configurations run here")
        if config.head_group > 1 and config.context_degree > 1:
            for probe in ("subgroups", "broadcast_root"):
                if self._fails(probe):
                    return (f"{config.describe()} is a hybrid, whose collectives name subgroups, and this "
                            f"node's TensorRT got them wrong (cptune doctor: {probe}); pure strategies "
                            f"still run")
        probe = f"attention_{workload.dtype}"
        if self._fails(probe):
            return (f"attention in {workload.dtype} does not build or compute right on this node's TensorRT "
                    f"(cptune doctor: {probe}); use another --dtype")
        return None

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, data: dict) -> NodeVerdict:
        return cls(int(data["ranks"]), tuple(ProbeResult(**r) for r in data["results"]))
