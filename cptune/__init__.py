"""cptune: measure the context-parallel attention strategies on your hardware and pick one.

The vocabulary (``Workload``, ``CPConfig``, ``feasibility``, ``analytic_cost``) describes
what could run; ``compute``, ``measure`` and ``measure_all`` run it for real on real ranks
(``compute_gradients`` a training step: a ``Workload`` of ``mode="train"`` measures both);
``search_space`` searches a whole space and stores every result, as ``cptune search`` does
(``calibrate_host`` calibrates this machine, as ``cptune calibrate`` does; ``check_host``
probes a GPU node's runtime, as ``cptune doctor`` does); ``recommend``
picks a configuration from measurements and the cost model; ``evaluate`` scores that model;
``export_plan`` writes the picks per sequence length as a plan a deployment ``load_plan``s;
for sequences of many lengths, ``recommend_mix`` answers a whole ``LengthMix`` (``read_mix``)
and ``plan_batch`` splits the ranks into CP groups for one batch (``exact_batch_plan`` proves it
on small ones; ``mix_costs`` is what both read); ``measure_batch`` runs a batch plan's groups
side by side on real ranks (``measure_mix`` solves it first).
"""

from typing import TYPE_CHECKING

from cptune.config import STRATEGIES, CPConfig
from cptune.cost import AnalyticCost, analytic_cost
from cptune.engines import Trained
from cptune.errors import CPTuneError, EngineError, InfeasibleConfigError
from cptune.execute import (
    BatchMeasurement,
    compute,
    compute_gradients,
    measure,
    measure_all,
    measure_batch,
    measure_mix,
)
from cptune.feasibility import enumerate_configs, feasibility
from cptune.measurement import Measurement
from cptune.version import __version__ as __version__
from cptune.workload import AttentionShape, Workload

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
    "LengthMix": "cptune.mixes",
    "read_mix": "cptune.mixes",
    "mix_costs": "cptune.mixes",
    "recommend_mix": "cptune.mixes",
    "plan_batch": "cptune.mixes",
    "exact_batch_plan": "cptune.mixes",
    "search_space": "cptune.search",
    "calibrate_host": "cptune.search",
    "check_host": "cptune.search",
}


if TYPE_CHECKING:  # a type checker reads the lazy names' own types, not __getattr__'s object
    from cptune.mixes import LengthMix, exact_batch_plan, mix_costs, plan_batch, read_mix, recommend_mix
    from cptune.model import Recommendation, evaluate, recommend
    from cptune.plans import Plan, PlanError, PlanMismatchError, load_plan
    from cptune.plans.export import export_plan
    from cptune.search import calibrate_host, check_host, search_space


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cptune' has no attribute {name!r}")

__all__ = [
    "STRATEGIES",
    "AnalyticCost",
    "AttentionShape",
    "BatchMeasurement",
    "CPConfig",
    "CPTuneError",
    "EngineError",
    "InfeasibleConfigError",
    "LengthMix",
    "Measurement",
    "Plan",
    "PlanError",
    "PlanMismatchError",
    "Recommendation",
    "Trained",
    "Workload",
    "analytic_cost",
    "calibrate_host",
    "check_host",
    "compute",
    "compute_gradients",
    "enumerate_configs",
    "evaluate",
    "exact_batch_plan",
    "export_plan",
    "feasibility",
    "load_plan",
    "measure",
    "measure_all",
    "measure_batch",
    "measure_mix",
    "mix_costs",
    "plan_batch",
    "read_mix",
    "recommend",
    "recommend_mix",
    "search_space",
]
