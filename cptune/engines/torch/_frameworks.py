"""Frameworks' own context-parallel attention, run by the torch engine's ranks in place of a
strategy (``IMPLEMENTATIONS``), so that what a framework runs is timed, not only priced.

Each takes this rank's contiguous shard of q, k, v ([batch, seq / ranks, heads, head_dim],
rank r holding the r-th piece, as the frameworks' callers shard it: the configuration's
"contiguous" layout) and the configuration's Ulysses (head) and ring (context) groups, as
the framework makes them (consecutive ranks exchange heads, strided ranks form the ring), and
returns this rank's output shard [batch, heads, seq / ranks, head_dim]:

- ``yunchang``: yunchang's ``LongContextAttention`` (``ring_impl_type="basic"``: a
  point-to-point ring without load balance, after Ulysses' all-to-all), its PyTorch flash
  kernel (``AttnType.TORCH_FLASH``); with no Ulysses group (head
  group 1) its ring function ``ring_flash_attn_func`` alone, which is what the layer runs
  after an all-to-all of one rank.
- ``torch_ring``: torch's ``_templated_ring_attention`` as xDiT's and SGLang's ``ring_attn``
  call it: ``_cp_options.enable_load_balance = False``, the default all-gather rotater,
  ``aten._scaled_dot_product_flash_attention``, sequence dim 2; ring configurations only
  (head group 1: the Ulysses around it is the framework's, not torch's).

Both call ``aten._scaled_dot_product_flash_attention``, which has no CPU kernel; on CPU ranks
its CPU twin ``_scaled_dot_product_flash_attention_for_cpu`` runs in its place (``_flash``),
so what is timed there is the framework's exchange and merging around torch's CPU kernel.

Imported by the ranks only (it imports PyTorch, and yunchang where asked); the names, what
each can run and which framework runs which are ``_implementations``' (no PyTorch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

#: One implementation's call: (q, k, v [batch, seq, heads, head_dim], head group, context
#: group, causal) -> output [batch, heads, seq, head_dim].
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "dist.ProcessGroup | None",
                      "dist.ProcessGroup | None", bool], torch.Tensor]


def _flash(q: torch.Tensor) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The flash-attention op the frameworks call (``aten._scaled_dot_product_flash_attention``),
    on a CPU its CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``, same arguments
    and the same output and log-sum-exp first): the exchange and merges stay the framework's."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return torch.ops.aten._scaled_dot_product_flash_attention


def _yunchang(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dist.ProcessGroup | None,
              context: dist.ProcessGroup | None, causal: bool) -> torch.Tensor:
    from yunchang import LongContextAttention
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType, attention
    from yunchang.ring import ring_flash_attn_func

    if q.device.type == "cpu":  # the op yunchang calls has no CPU kernel: torch's CPU flash one
        attention._scaled_dot_product_flash_attention = _flash(q)
    if heads is None:  # no all-to-all: the layer's ring function on the ring group
        out = ring_flash_attn_func(q, k, v, causal=causal, group=context, attn_type=AttnType.TORCH_FLASH)
    else:
        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = heads, context
        layer = LongContextAttention(ring_impl_type="basic", attn_type=AttnType.TORCH_FLASH)
        out = layer(q, k, v, causal=causal)
    return out.transpose(1, 2)


def _torch_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dist.ProcessGroup | None,
                context: dist.ProcessGroup | None, causal: bool) -> torch.Tensor:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    cp._cp_options.enable_load_balance = False  # as xDiT's and SGLang's ring_attn set it
    cp._cp_options.rotate_method = cp._RotateMethod.ALL_GATHER  # torch's default
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out, *_ = cp._templated_ring_attention(context, 2, _flash(q), q, k, v, is_causal=causal)
    return out


CALLS: dict[str, Attention] = {"yunchang": _yunchang, "torch_ring": _torch_ring}
