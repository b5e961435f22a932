"""What the frameworks do with a workload's mask and its tokens' layout: the layout each runs
for a configuration (``as_layout``), the packed documents' boundaries as TransformerEngine's
THD format takes them (``thd``), and the one-line refusals shared by several frameworks.
The facts are each framework's own, quoted in tests/framework_sources/ and docs/frameworks.md.
"""

from __future__ import annotations

from itertools import accumulate

from cptune.config import CPConfig
from cptune.frameworks._framework import Runs
from cptune.layout import normal
from cptune.workload import AttentionShape


def packs_documents(shape: AttentionShape, seq_len: int) -> bool:
    """Whether ``shape`` at ``seq_len`` packs more than one document."""
    return len(shape.at(seq_len).document_lengths) > 1


def as_layout(shape: AttentionShape, config: CPConfig, seq_len: int, layout: str | None,
              what: str) -> Runs:
    """What a framework runs when it deals ``config``'s tokens out by ``layout`` (None: the
    workload's default): ``config`` itself where that is its layout, else the same exchange in
    ``layout``, with ``what`` saying why."""
    workload = shape.at(seq_len)
    ran = normal(workload, config.with_layout(layout))
    return Runs(config) if ran == normal(workload, config) else Runs(ran, False, what)


def padded(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def thd(shape: AttentionShape, config: CPConfig, seq_len: int) -> tuple[list[int], list[int], str]:
    """(cu_seqlens, cu_seqlens_padded, what the padding costs) of ``shape``'s packed documents
    at ``seq_len`` as TransformerEngine's THD format takes them: it cuts every document into 2 x
    cp chunks, so each is padded to a multiple of 2 x cp (cp: every rank of the context group,
    its a2a part included). The padding sits between the documents (``cu_seqlens`` without it,
    ``cu_seqlens_padded`` with it), so no query attends it: it is held and moved, as cptune's
    per-document zigzag holds and moves its own padding (to a multiple of 2 x its context degree),
    and what TransformerEngine pads beyond that is stated, not priced."""
    lengths = shape.at(seq_len).document_lengths
    multiple = 2 * config.ranks
    grown = [padded(n, multiple) for n in lengths]
    cu = [0, *accumulate(lengths)]
    cu_padded = [0, *accumulate(grown)]
    extra = cu_padded[-1] - seq_len
    c = config.context_degree
    priced = ("padding between the documents, attended by no query: held and moved" +
              (f" as cptune's per-document zigzag pads each to a multiple of 2 x {c}; beyond that not priced"
               if c > 1 else "; not priced (cptune's Ulysses moves the documents unpadded)"))
    cost = (f"each document padded to a multiple of 2 x {config.ranks} = {multiple} tokens "
            f"(cu_seqlens_padded): {seq_len} tokens become {cu_padded[-1]} (+{100 * extra / seq_len:.1f}%; "
            f"{priced})")
    return cu, cu_padded, cost


def mask_words(shape: AttentionShape) -> str:
    """The mask's parts beyond full and causal, in words: "a sliding window", "packed documents"."""
    parts = ["a sliding window"] if shape.window else []
    parts += ["attention sinks"] if shape.sinks else []
    parts += ["packed documents"] if shape.documents else []
    return " and ".join(parts)


def unread_mask(framework: str, shape: AttentionShape) -> str | None:
    """Why ``framework``, whose mask settings cptune has not read from its source, is not
    exported for ``shape``'s mask beyond full and causal; None for a plain one."""
    if not mask_words(shape):
        return None
    return (f"cptune has not read how {framework} runs {mask_words(shape)} under context parallelism: "
            f"export for transformer-engine or megatron, which take them")
