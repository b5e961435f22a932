"""The torch engine: the strategies on ``torch.distributed`` ranks with PyTorch's fused
attention kernels, gloo on the CPU, NCCL with one GPU per rank on a GPU node
(``pip install 'cptune[torch]'``). ``TorchOps`` (the ``Primitives`` its ranks run) is also
what ``cptune.torch`` deploys; it imports PyTorch, so it is loaded on first use, and the
engine's driver side imports without PyTorch (its preflight says what is missing)."""

import importlib.util
from collections.abc import Callable
from typing import Any

from cptune.engines.torch._engine import TorchEngine
from cptune.engines.torch._implementations import (
    IMPLEMENTATIONS,
    TIMED_FRAMEWORKS,
    Implementation,
    framework_configs,
)

_OPS = ("TORCH_DTYPES", "TorchOps", "model_output", "strategy_inputs")


def __getattr__(name: str) -> Any:
    if name in _OPS:
        from cptune.engines.torch import _ops

        return getattr(_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def on_launched_ranks(command: Callable[[], int]) -> int:
    """Run ``command`` (a command that runs torch ranks) here, or serve it: where the user
    launched several ranks with torchrun or srun, rank 0 runs it and drives the others,
    which serve it and return 0 when it is done; alone, it just runs."""
    if importlib.util.find_spec("torch") is None:
        return command()  # the engine's preflight says how to install PyTorch
    from cptune.engines.torch._launch import driving, launched_ranks
    from cptune.engines.torch._worker import serve_launched

    launch = launched_ranks()
    if launch is None:
        return command()
    if launch.rank > 0:
        serve_launched(launch)
        return 0
    with driving(launch):
        return command()


__all__ = ["IMPLEMENTATIONS", "TIMED_FRAMEWORKS", "TORCH_DTYPES", "Implementation", "TorchEngine",
           "framework_configs", "TorchOps", "model_output", "on_launched_ranks", "strategy_inputs"]
