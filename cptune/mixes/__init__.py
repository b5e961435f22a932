"""Length mixes: sequences of many lengths, answered as one configuration (and a bucketed plan)
for the whole mix, or as a plan per batch (groups of ranks, a configuration each, and which
sequences each runs). See docs/mixes.md."""

from cptune.mixes._batch import BatchPlan, Group, exact_batch_plan, one_group_plan, plan_batch
from cptune.mixes._costs import MixCosts, check_fits, mix_costs
from cptune.mixes._mix import LengthMix, MixError, read_mix
from cptune.mixes._policy import batch_policy, mix_policy
from cptune.mixes._static import MixRecommendation, MixTime, recommend_mix

__all__ = ["BatchPlan", "Group", "LengthMix", "MixCosts", "MixError", "MixRecommendation", "MixTime",
           "batch_policy", "check_fits", "exact_batch_plan", "mix_costs", "mix_policy", "one_group_plan",
           "plan_batch", "read_mix", "recommend_mix"]
