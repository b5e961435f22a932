"""The model side: what a configuration will cost on hardware, and which one to run.

Data flows in one direction: calibrations and measurements from the store feed the physical
prior (``_prior``: analytic terms x a hardware profile's rates), the cost model corrects it
where measurements exist (``_cost_model``), cross-validation scores both and decides whether
the correction is trusted (``_evaluation``), and ``recommend`` ranks every feasible
configuration from the best evidence (``_recommend``). Imported on first use by ``cptune``:
it brings scikit-learn and SQLAlchemy, which the MPI ranks never need.
"""

from cptune.model._cost_model import MIN_SAMPLES, Case, CostModel, TrainingSet, features, training_set
from cptune.model._evaluation import (
    GROUPINGS,
    CorrectionVerdict,
    Evaluation,
    GroupScore,
    compare,
    correction_verdict,
    cross_validate_groups,
    evaluate,
    fit_advised,
    fixed_rule,
    held_out_predictions,
    load_training,
    score_group,
)
from cptune.model._prior import (
    CalibratedProfile,
    DescribedProfile,
    FigureSwing,
    PriorTime,
    Profile,
    Tie,
    computed_flops,
    decide,
    figure_swings,
    groups_of,
    prior_range,
    prior_time,
)
from cptune.model._recommend import (
    SOURCES,
    Candidate,
    Recommendation,
    correction_verdict_of,
    hardware_profile,
    predict_for,
    predicted,
    recommend,
)

__all__ = [
    "GROUPINGS",
    "MIN_SAMPLES",
    "SOURCES",
    "CalibratedProfile",
    "Candidate",
    "Case",
    "CorrectionVerdict",
    "CostModel",
    "DescribedProfile",
    "Evaluation",
    "FigureSwing",
    "GroupScore",
    "PriorTime",
    "Profile",
    "Recommendation",
    "Tie",
    "TrainingSet",
    "compare",
    "computed_flops",
    "correction_verdict",
    "correction_verdict_of",
    "cross_validate_groups",
    "decide",
    "evaluate",
    "features",
    "fixed_rule",
    "figure_swings",
    "fit_advised",
    "groups_of",
    "hardware_profile",
    "held_out_predictions",
    "load_training",
    "predict_for",
    "predicted",
    "prior_range",
    "prior_time",
    "recommend",
    "score_group",
    "training_set",
]
