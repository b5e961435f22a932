"""A framework's view of cptune's configurations: which it can run, and how it spells one.

Each framework takes its context-parallel choice as settings of its own (degrees, a comm
type, flags). A ``Framework`` says, for one attention shape and one ``CPConfig``, why it
cannot run it (``refusal``) and how it spells it (``spell``: the settings as it names them,
a Python snippet or flags, the launch line and what the user must also do). Every framework
here puts a Ulysses group on consecutive ranks and the context group across them, as
cptune's ``r = g * u + j`` does (tests/test_frameworks.py holds each one's own rule against
``cptune.layout``). The facts come from each framework's source at the version named in
``pinned`` (docs/frameworks.md cites the files).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.workload import AttentionShape


class FrameworkError(CPTuneError, ValueError):
    """A framework that cptune does not know, or a plan or workload it cannot take."""


@dataclass(frozen=True)
class Spelling:
    """One configuration in a framework's own terms."""

    #: The framework's setting names and values, e.g. {"ring_degree": 2, "ulysses_degree": 4}.
    settings: Mapping[str, Any]
    #: A Python snippet or command-line flags, as the framework takes them.
    code: str
    #: How to start the ranks (the user's own program or model in angle brackets).
    launch: str
    #: What the user must also do for the settings to run as cptune measured them.
    needs: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Runs:
    """What a framework runs for one of cptune's configurations, in terms cptune's counts price:
    the configuration whose exchange and token layout it has (``config``), and whether it
    attends the gathered keys block by block, c calls merged by log-sum-exp in float32
    (``per_block_calls``, AllGather-KV's exchange only). ``what``: the framework's own
    implementation in a sentence (empty where it runs cptune's configuration as cptune does)."""

    config: CPConfig
    per_block_calls: bool = False
    what: str = ""

    @property
    def label(self) -> str:
        """Short name: the configuration's label, with its calls where it attends block by block
        (e.g. "ulysses2xallgather_kv4 in 4 calls")."""
        calls = f" in {self.config.context_degree} calls" if self.per_block_calls else ""
        return self.config.label + calls

    def same_as(self, config: CPConfig) -> bool:
        """Whether this is ``config`` as cptune runs and prices it."""
        return self.config == config and not self.per_block_calls


class Framework(ABC):
    """One framework: what it can run and how it spells a configuration."""

    #: The name ``--for`` takes.
    name: ClassVar[str]
    #: The package and version whose source the facts were read from.
    pinned: ClassVar[str]
    #: "python" (a snippet) or "flags" (command-line flags).
    form: ClassVar[str]

    @abstractmethod
    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        """Why the framework cannot run ``config`` (over more than one rank) for ``shape``."""

    @abstractmethod
    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        """``config`` (over more than one rank) in the framework's terms, for ``seq_len`` tokens
        (None: any length it takes) on nodes of ``per_node`` ranks (None: one node)."""

    def placed_refusal(self, shape: AttentionShape, config: CPConfig, seq_len: int,
                       per_node: int | None) -> str | None:
        """Why the framework cannot run ``config`` (which it can express) at ``seq_len`` on nodes
        of ``per_node`` ranks (None: one node): a length it does not take, ranks across nodes it
        does not start; None when it can."""
        return None

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        """What the framework runs for ``config`` (which it can run) at ``seq_len``: cptune's
        configuration itself unless a framework says otherwise."""
        return Runs(config)

    def refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        """Why the framework cannot run ``config`` for ``shape``; None when it can. One rank
        runs plain attention, which every framework does without context parallelism. Padded
        heads (``CPConfig.pad_heads``) are cptune's own: no framework's settings spell them yet."""
        if config.ranks == 1:
            return None
        if config.pad_heads:
            return (f"{self.name} splits whole heads over its head group, and cptune's padded heads "
                    f"are none of its settings")
        return self.context_refusal(shape, config)

    def spell(self, shape: AttentionShape, config: CPConfig, seq_len: int | None = None,
              per_node: int | None = None) -> Spelling:
        """``config`` in the framework's terms, for ``seq_len`` tokens (None: any it takes) on
        nodes of ``per_node`` ranks (None: one node); ``FrameworkError`` when it cannot run it."""
        reason = self.refusal(shape, config)
        if reason is None and seq_len is not None and config.ranks > 1:
            reason = self.placed_refusal(shape, config, seq_len, per_node)
        if reason:
            raise FrameworkError(f"{self.name} cannot run {config.describe()}: {reason}")
        if config.ranks == 1:
            return Spelling({}, "# no context parallelism: one rank runs plain attention",
                            "python <your program>")
        return self.spell_context(shape, config, seq_len, per_node)


def heads_refusal(shape: AttentionShape, head_group: int, what: str) -> str | None:
    """Why a framework that exchanges K and V heads as it exchanges queries' (no KV head
    replication) cannot split ``shape`` over ``head_group`` ranks; None when it can."""
    if shape.kv_heads % head_group:
        return (f"{what} splits K and V heads as it splits query heads: {shape.kv_heads} KV heads "
                f"over a head group of {head_group} does not divide")
    return None


def flags(settings: Mapping[str, Any], spell_name: Mapping[str, str]) -> str:
    """``--name value`` for each setting, named as ``spell_name`` says."""
    parts = []
    for key, value in settings.items():
        shown = " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        parts.append(f"{spell_name[key]} {shown}")
    return " ".join(parts)


def torch_ring(shape: AttentionShape, config: CPConfig, caller: str, layout: str | None = None) -> Runs:
    """What torch's ``_templated_ring_attention`` runs with load balance off and its default
    rotater, the all-gather (``_cp_options``: ``enable_load_balance=False`` as ``caller`` sets
    it, ``rotate_method=ALL_GATHER``; ``_AllGatherRotater``): one all-gather of the ring group's
    K/V, then one attention call per block merged by log-sum-exp (``_SDPAMerger``, float32);
    under a causal mask contiguous blocks, rank r computing r + 1 of them (``_is_causal_behavior``
    skips the later ones). ``layout``: the tokens' layout the caller deals out otherwise (None:
    contiguous blocks)."""
    c = config.context_degree
    layout = "contiguous" if shape.causal else layout
    balance = (f"; causal without load balance: contiguous blocks, rank r computing r + 1 of {c}"
               if shape.causal else "")
    return Runs(CPConfig("allgather_kv", config.ranks, config.head_group, layout), True,
                f"{caller} runs torch's _templated_ring_attention with load balance off and its all-gather "
                f"rotater: one all-gather of the ring's K/V, then {c} calls merged by log-sum-exp{balance}")


def nodes_of(ranks: int, per_node: int | None) -> tuple[int, int]:
    """(nodes, ranks on each) of ``ranks`` ranks packed ``per_node`` to a node (None: one node)."""
    here = min(ranks, per_node or ranks)
    return -(-ranks // here), here


def torchrun(ranks: int, per_node: int | None, program: str) -> str:
    """torchrun's launch of ``ranks`` ranks ``per_node`` to a node: one line on one node, else one
    line per node with its node rank, meeting at the first node's c10d rendezvous (torch/
    distributed/run.py: --nnodes, --nproc-per-node, --node-rank, --rdzv-backend, --rdzv-endpoint,
    --rdzv-id; set MASTER_ADDR to the first node)."""
    nodes, here = nodes_of(ranks, per_node)
    if nodes == 1:
        return f"torchrun --nproc-per-node={ranks} {program}"
    return "\n".join(f"torchrun --nnodes={nodes} --nproc-per-node={here} --node-rank={k} --rdzv-backend=c10d "
                     f"--rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=cptune {program}" for k in range(nodes))


#: The lines of a snippet that pin each rank to its own GPU (torchrun sets LOCAL_RANK).
SET_DEVICE = ("import os", 'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))')
