"""cptune: measure the context-parallel attention strategies on your hardware and pick one.

The vocabulary (``Workload``, ``CPConfig``, ``feasibility``, ``analytic_cost``) describes
what could run; ``compute`` and ``measure`` run it for real on MPI ranks.
"""

from cptune.config import STRATEGIES, CPConfig
from cptune.cost import AnalyticCost, analytic_cost
from cptune.errors import CPTuneError, EngineError, InfeasibleConfigError
from cptune.execute import compute, measure
from cptune.feasibility import enumerate_configs, feasibility
from cptune.measurement import Measurement
from cptune.workload import Workload

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "AnalyticCost",
    "CPConfig",
    "CPTuneError",
    "EngineError",
    "InfeasibleConfigError",
    "Measurement",
    "Workload",
    "analytic_cost",
    "compute",
    "enumerate_configs",
    "feasibility",
    "measure",
]
