"""Counts and figures read from what a user gives (issue 54): a plan, ``--hosts`` and hostfiles,
rank flags, search spaces, hardware descriptions, database URLs. Each is bounded where it is read,
before anything is enumerated or started: one line on stderr, exit 2, every named file byte for
byte as it was - never a traceback, a hang or memory that grows."""

import hashlib
import json

from conftest import assert_refused
from cptune.plans._plan import digest

DESCRIBED = ["--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128", "--seq-lens", "16896"]


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_plan_of_more_ranks_than_any_machine_is_one_line_for_export_for(cptune_here, tmp_path):
    plan = tmp_path / "p.json"
    assert cptune_here("export", *DESCRIBED, "-o", plan).returncode == 0
    data = json.loads(plan.read_text())
    data["buckets"][0]["config"]["ranks"] = 10**30
    data["digest"] = digest(data)
    plan.write_text(json.dumps(data, indent=2))
    before = sha256(plan)
    result = cptune_here("export", "--for", "diffusers", "--plan", plan)
    assert_refused(result, str(plan), "buckets[0].config.ranks", "greater than the maximum of 1000000")
    assert sha256(plan) == before
