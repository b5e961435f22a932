"""Tuned choices in the terms of the frameworks users deploy through: diffusers, xDiT,
yunchang, SGLang diffusion, vLLM-Omni, TransformerEngine and Megatron-Core.

``for_framework(plan, "diffusers")`` gives each bucket of a plan as the framework runs it: the
fastest configuration it can express (cptune's pick where it can), its settings spelled as
the framework spells them, the launch line, and what a substitution costs against the pick.
``choose`` does the same for one ranking (``cptune recommend --for``); a ``Framework``'s
``refusal`` says what it cannot run (``cptune search --for`` measures only the rest).
"""

from cptune.frameworks._choice import Pricer, Substitution, choose
from cptune.frameworks._framework import Framework, FrameworkError, Runs, Spelling
from cptune.frameworks._plan import (
    FrameworkBucket,
    FrameworkPick,
    FrameworkPlan,
    check_engine,
    for_framework,
    for_recommendation,
    pricer,
)
from cptune.frameworks._registry import FRAMEWORKS, get_framework

__all__ = [
    "FRAMEWORKS",
    "Framework",
    "FrameworkBucket",
    "FrameworkError",
    "FrameworkPick",
    "FrameworkPlan",
    "Pricer",
    "Runs",
    "Spelling",
    "Substitution",
    "check_engine",
    "choose",
    "for_framework",
    "for_recommendation",
    "pricer",
    "get_framework",
]
