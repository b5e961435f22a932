"""Tuned plans: which configuration a deployment runs for each sequence-length bucket.

``load_plan`` reads and validates a plan file (JSON, described by the shipped
``plan.schema.json``) with nothing heavier than json and jsonschema, so a deployment's
import stays light; ``cptune.plans.export.export_plan`` builds one from recommendations.
"""

from cptune.plans._plan import (
    SCHEMA_VERSION,
    Alternative,
    BatchPolicy,
    Bucket,
    Device,
    Launch,
    Plan,
    PlanError,
    PlanHardware,
    PlanMismatchError,
    PolicyCurve,
    check_replaceable,
    load_plan,
    plan_schema,
)

__all__ = [
    "SCHEMA_VERSION",
    "Alternative",
    "BatchPolicy",
    "Bucket",
    "Device",
    "Launch",
    "Plan",
    "PlanError",
    "PlanHardware",
    "PlanMismatchError",
    "PolicyCurve",
    "check_replaceable",
    "load_plan",
    "plan_schema",
]
