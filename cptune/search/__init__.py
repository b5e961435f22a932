"""The search: which configuration is fastest on this machine, measured, and how sure that is.

``search_space`` runs a whole space as ``cptune search`` does (``calibrate_host`` calibrates
this machine as ``cptune calibrate`` does, and ``check_host`` probes it as ``cptune doctor``
does); ``WorkloadSearch`` searches one workload in
phases: Optuna trials (``_trials``; exhaustive, TPE, or the cost model's ``GuidedSampler``
order), interleaved rounds, a final race and a second sitting (``_workload``), each run
reported as a ``Visit`` and what the verdict leaves out named as a ``LeftOut``
(``_visits``), every stored run also shown in a study for the dashboard (``_view``).
"""

from cptune.search._frameworks import FrameworkTimingError, Timed, time_framework
from cptune.search._guided import STOP_PROBABILITY, EarlyStop, GuidedSampler, any_wins, win_probability
from cptune.search._ledger import RETRIED_FAILURES
from cptune.search._space import (
    SearchProgress,
    SearchSetupError,
    SpaceSearch,
    calibrate_host,
    check_host,
    search_space,
)
from cptune.search._trials import study_name, suggest, tree_of
from cptune.search._visits import PHASES, LeftOut, Visit, measure_command
from cptune.search._workload import NEAR_MISS_RATIO, WorkloadSearch, is_near_miss

__all__ = [
    "NEAR_MISS_RATIO",
    "PHASES",
    "STOP_PROBABILITY",
    "RETRIED_FAILURES",
    "EarlyStop",
    "FrameworkTimingError",
    "GuidedSampler",
    "LeftOut",
    "SearchProgress",
    "SearchSetupError",
    "SpaceSearch",
    "Timed",
    "Visit",
    "WorkloadSearch",
    "any_wins",
    "calibrate_host",
    "check_host",
    "is_near_miss",
    "measure_command",
    "search_space",
    "study_name",
    "suggest",
    "time_framework",
    "tree_of",
    "win_probability",
]
