"""The torch engine: the strategies on ``torch.distributed`` ranks with PyTorch's fused
attention kernels, gloo on the CPU, NCCL with one GPU per rank on a GPU node
(``pip install 'cptune[torch]'``). ``TorchOps`` (the ``Primitives`` its ranks run) is also
what ``cptune.torch`` deploys; it imports PyTorch, so it is loaded on first use, and the
engine's driver side imports without PyTorch (its preflight says what is missing)."""

from typing import Any

from cptune.engines.torch._engine import TorchEngine

_OPS = ("TORCH_DTYPES", "TorchOps", "kernel_name")


def __getattr__(name: str) -> Any:
    if name in _OPS:
        from cptune.engines.torch import _ops

        return getattr(_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TORCH_DTYPES", "TorchEngine", "TorchOps", "kernel_name"]
