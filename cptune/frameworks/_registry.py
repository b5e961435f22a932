"""Every framework cptune exports for, by the name ``--for`` takes."""

from __future__ import annotations

from cptune.frameworks._diffusers import Diffusers
from cptune.frameworks._framework import Framework, FrameworkError
from cptune.frameworks._megatron import Megatron
from cptune.frameworks._sglang import SGLang
from cptune.frameworks._transformer_engine import TransformerEngine
from cptune.frameworks._vllm_omni import VLLMOmni
from cptune.frameworks._xdit import XDiT
from cptune.frameworks._yunchang import Yunchang

FRAMEWORKS: dict[str, Framework] = {
    f.name: f
    for f in (Diffusers(), XDiT(), Yunchang(), SGLang(), VLLMOmni(), TransformerEngine(), Megatron())
}


def get_framework(name: str) -> Framework:
    """The framework ``name`` names; ``FrameworkError`` naming the known ones otherwise."""
    try:
        return FRAMEWORKS[name]
    except KeyError:
        raise FrameworkError(f"unknown framework {name!r}: cptune exports for "
                             f"{', '.join(FRAMEWORKS)}") from None
