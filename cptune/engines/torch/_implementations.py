"""The frameworks' own attention the torch engine can run in a configuration's place
(``_frameworks`` holds the calls): their names, what each can run, and which framework runs
which (``TIMED_FRAMEWORKS``, names as ``cptune.frameworks`` spells them). Imports no PyTorch,
so that the driver refuses what cannot run before any rank starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata

from cptune.config import CPConfig
from cptune.layout import default_layout
from cptune.workload import Workload


@dataclass(frozen=True)
class Implementation:
    """A framework's attention as the ranks call it, and the package whose version it names."""

    name: str
    package: str
    what: str

    def label(self, device: str) -> str:
        """What a stored row says it ran: the name, the package's version, the function (and
        on a CPU the kernel standing in for the one it calls, ``_flash``)."""
        try:
            version = metadata.version(self.package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        kernel = "; flash_for_cpu kernel" if device == "cpu" else ""
        return f"{self.name} ({self.package} {version}: {self.what}{kernel})"


IMPLEMENTATIONS: dict[str, Implementation] = {
    "yunchang": Implementation("yunchang", "yunchang", "LongContextAttention basic ring, torch_flash"),
    "torch_ring": Implementation("torch_ring", "torch",
                                 "_templated_ring_attention, all-gather rotater, load balance off"),
}


def refusal(name: str, workload: Workload, config: CPConfig) -> str | None:
    """Why implementation ``name`` cannot run ``config`` for ``workload``, None when it can."""
    if name not in IMPLEMENTATIONS:
        return f"unknown implementation {name!r}: use one of {', '.join(IMPLEMENTATIONS)}"
    if importlib.util.find_spec(IMPLEMENTATIONS[name].package) is None:
        package = IMPLEMENTATIONS[name].package
        return f"{name} needs {package}, which is not installed: pip install 'cptune[frameworks]'"
    if config.strategy != "ring" or config.context_degree == 1:
        return f"{name} runs a ring over two or more ranks, not {config.describe()}"
    if name == "torch_ring" and config.head_group != 1:
        return "torch_ring times the ring alone (head group 1); the Ulysses around it is the framework's"
    if config.pad_heads:
        return f"{name} splits whole heads over its head group; it does not pad them"
    if workload.kv_heads != workload.heads:
        return f"{name} is timed with as many K/V heads as query heads"
    if workload.training:
        return f"{name} is timed for the forward"
    if workload.window or workload.sinks or len(workload.document_lengths) > 1 or workload.text:
        return f"{name} is timed for a full or causal mask"
    if (config.layout or default_layout(workload, config.context_degree)) != "contiguous":
        return f"{name} takes contiguous shards: give the configuration the contiguous layout"
    return None


#: The implementation each framework's context-parallel attention is, where it runs on CPU
#: ranks: yunchang's own layer; xDiT's and SGLang's ``ring_attn`` call torch's templated ring
#: with load balance off (``cptune.frameworks``' xDiT and SGLang quote the lines).
TIMED_FRAMEWORKS: dict[str, str] = {"yunchang": "yunchang", "xdit": "torch_ring", "sglang": "torch_ring"}


def framework_configs(name: str, workload: Workload, ranks: int) -> list[CPConfig]:
    """The configurations implementation ``name`` runs on ``ranks`` ranks for ``workload``,
    in cptune's terms (contiguous Ring; yunchang also u-way Ulysses around it)."""
    laid = [CPConfig("ring", ranks, u, "contiguous") for u in range(1, ranks) if ranks % u == 0]
    return [c for c in laid if workload.heads % c.head_group == 0 and refusal(name, workload, c) is None]
