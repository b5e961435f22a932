"""The model side: what a configuration will cost on hardware, and which one to run.

Data flows in one direction: calibrations and measurements from the store feed the physical
prior (``_prior``: analytic terms x a hardware profile's rates), the cost model corrects it
where measurements exist (``_cost_model``), cross-validation scores both and decides whether
the correction is trusted (``_evaluation``), and ``recommend`` ranks every feasible
configuration from the best evidence (``_recommend``). Imported on first use by ``cptune``:
it brings scikit-learn and SQLAlchemy, which the ranks never need.
"""

from cptune.model._as_run import PricedAsRun, price_as_run, prior_as_run
from cptune.model._cost_model import Case, CostModel, TrainingSet, training_set
from cptune.model._evaluation import (
    CorrectionDecision,
    GroupScore,
    compare,
    evaluate,
    fit_advised,
    held_out_predictions,
    load_training,
)
from cptune.model._prior import computed_flops, prior_time, tier_split
from cptune.model._profiles import CalibratedProfile, DescribedProfile, Profile
from cptune.model._recommend import (
    Candidate,
    MeasuredHost,
    Recommendation,
    TierDecision,
    correction_decision_of,
    hardware_profile,
    predict_for,
    predicted,
    recommend,
)
from cptune.model._ties import STRUCTURAL_ERROR, STRUCTURAL_ERROR_TRAIN, STRUCTURE, Tie, prior_ties

__all__ = [
    "CalibratedProfile",
    "Candidate",
    "Case",
    "CorrectionDecision",
    "CostModel",
    "DescribedProfile",
    "GroupScore",
    "MeasuredHost",
    "PricedAsRun",
    "Profile",
    "Recommendation",
    "Tie",
    "TierDecision",
    "TrainingSet",
    "compare",
    "computed_flops",
    "correction_decision_of",
    "evaluate",
    "fit_advised",
    "hardware_profile",
    "held_out_predictions",
    "load_training",
    "predict_for",
    "predicted",
    "price_as_run",
    "prior_ties",
    "STRUCTURAL_ERROR",
    "STRUCTURAL_ERROR_TRAIN",
    "STRUCTURE",
    "prior_as_run",
    "prior_time",
    "recommend",
    "tier_split",
    "training_set",
]
