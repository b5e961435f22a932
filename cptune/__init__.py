"""cptune: measure the context-parallel attention strategies on your hardware and pick one.

The vocabulary (``Workload``, ``CPConfig``, ``feasibility``, ``analytic_cost``) describes
what could run; ``compute`` and ``measure`` run it for real on MPI ranks; ``recommend``
picks a configuration from measurements and the cost model; ``evaluate`` scores that model;
``export_plan`` writes the picks per sequence length as a plan a deployment ``load_plan``s.
"""

from cptune.config import STRATEGIES, CPConfig
from cptune.cost import AnalyticCost, analytic_cost
from cptune.errors import CPTuneError, EngineError, InfeasibleConfigError
from cptune.execute import compute, measure
from cptune.feasibility import enumerate_configs, feasibility
from cptune.measurement import Measurement
from cptune.workload import AttentionShape, Workload

__version__ = "0.1.0"

#: Imported on first use: they bring scikit-learn and SQLAlchemy, which the MPI ranks
#: (importing this package) never need. No name here may also be a submodule of cptune:
#: importing a submodule binds its name on the package, hiding the lazy one.
_LAZY = {
    "evaluate": "cptune.model",
    "recommend": "cptune.model",
    "Recommendation": "cptune.model",
    "Plan": "cptune.plans",
    "PlanError": "cptune.plans",
    "PlanMismatchError": "cptune.plans",
    "load_plan": "cptune.plans",
    "export_plan": "cptune.plans.export",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cptune' has no attribute {name!r}")

__all__ = [
    "STRATEGIES",
    "AnalyticCost",
    "AttentionShape",
    "CPConfig",
    "CPTuneError",
    "EngineError",
    "InfeasibleConfigError",
    "Measurement",
    "Plan",
    "PlanError",
    "PlanMismatchError",
    "Recommendation",
    "Workload",
    "analytic_cost",
    "compute",
    "enumerate_configs",
    "evaluate",
    "export_plan",
    "feasibility",
    "load_plan",
    "measure",
    "recommend",
]
