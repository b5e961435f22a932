"""Length mixes: sequences of many lengths, answered as one configuration (and a bucketed plan)
for the whole mix, or as a plan per batch (groups of ranks, a configuration each, and which
sequences each runs). See docs/mixes.md."""

from cptune.mixes._costs import MixCosts, check_fits, mix_costs
from cptune.mixes._mix import LengthMix, MixError, read_mix

__all__ = ["LengthMix", "MixCosts", "MixError", "check_fits", "mix_costs", "read_mix"]
