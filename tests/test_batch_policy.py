"""A plan carrying the per-batch policy (issue 58, item 5): exported, loaded and solved without
a database, the same batch plan as the solver on the costs it came from; a broken policy refused
in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cptune.mixes import LengthMix, mix_costs, mix_policy, plan_batch
from cptune.plans import PlanError, load_plan
from cptune.plans._plan import digest
from cptune.plans.export import export_plan
from cptune.workload import Workload

SHAPE = Workload(seq_len=1024, heads=32, kv_heads=8, head_dim=128, causal=True, mode="train").shape
HARDWARE = "h100-sxm-8"
#: The lengths the policy is read over, and a stated batch within them.
MIX = [700, 900, 1024, 2048, 3000, 8192, 16384]
BATCH = [16384, 900, 3000, 2048, 700, 8192, 1024, 1024, 5000]


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = export_plan([SHAPE.at(1024), SHAPE.at(16384)], hardware=HARDWARE,
                       batch_policy=mix_policy(SHAPE, MIX, hardware=HARDWARE))
    return plan.write(tmp_path_factory.mktemp("policy") / "plan.json")


def test_a_loaded_policy_plans_a_batch_as_the_solver_does_from_its_costs(policy_file: Path) -> None:
    plan = load_plan(policy_file, hardware=HARDWARE)
    assert plan.batch_policy is not None and plan.batch_policy.ranks == 8
    costs = mix_costs(SHAPE, LengthMix.of(MIX), 8, hardware=HARDWARE)
    for ranks in (8, 5):
        assert plan_batch(plan, BATCH, ranks) == plan_batch(costs, BATCH, ranks)
    assert plan_batch(plan, BATCH).ranks == 8


def test_a_plan_without_a_policy_says_how_to_export_one(tmp_path: Path) -> None:
    plan = load_plan(export_plan([SHAPE.at(1024)], hardware=HARDWARE).write(tmp_path / "p.json"),
                     hardware=HARDWARE)
    assert plan.batch_policy is None
    with pytest.raises(PlanError, match="--batch-lengths"):
        plan_batch(plan, BATCH)


def _drop(field: str) -> Any:
    return lambda policy: policy.pop(field)


def _set_curve(field: str, value: object) -> Any:
    return lambda policy: policy["curves"][0].__setitem__(field, value)


@pytest.mark.parametrize(("edit", "says"), [
    (_drop("grid"), "batch_policy: 'grid' is a required property"),
    (lambda policy: policy["curves"][0]["ms"].__setitem__(0, -1.5), "batch_policy.curves[0].ms[0]"),
    (lambda policy: policy.__setitem__("ranks", "8"), "batch_policy.ranks: '8' is not of type 'integer'"),
    (_set_curve("shared_max", -3), "batch_policy.curves[0].shared_max"),
    (lambda policy: policy["curves"][0]["ms"].pop(), "one time (or null) per grid length"),
    (lambda policy: policy["grid"].reverse(), "must ascend strictly"),
    (lambda policy: policy.__setitem__("ranks", 64), "the launch starts only 8"),
    (lambda policy: policy["curves"].append(policy["curves"][0]), "is listed already"),
])
def test_a_broken_policy_is_refused_in_one_line_naming_the_field(policy_file: Path, tmp_path: Path,
                                                                 edit: Any, says: str) -> None:
    data = json.loads(policy_file.read_text())
    edit(data["batch_policy"])
    data["digest"] = digest(data)  # re-signed: the check itself must refuse it
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data, indent=1))
    with pytest.raises(PlanError) as refused:
        load_plan(broken, hardware=HARDWARE)
    message = str(refused.value)
    assert "\n" not in message and says in message, message


FLAGS = ["export", "--hardware", HARDWARE, "--seq-lens", "1024,8192", "--heads", "32", "--kv-heads", "8",
         "--head-dim", "128", "--mode", "train"]


def test_cli_export_writes_a_policy_a_deployment_solves_with(cptune_here: Any, tmp_path: Path) -> None:
    (tmp_path / "mix.txt").write_text("\n".join(map(str, MIX)) + "\n")
    done = cptune_here(*FLAGS, "--batch-lengths", tmp_path / "mix.txt", "-o", tmp_path / "plan.json")
    assert done.returncode == 0, done.stderr
    assert "batch policy:" in done.stdout
    plan = load_plan(tmp_path / "plan.json", hardware=HARDWARE)
    assert plan_batch(plan, BATCH).makespan_ms > 0


@pytest.mark.parametrize(("words", "says"), [
    (["--batch-lengths", "{bad}"], "line 2"),
    (["--batch-lengths", "{missing}"], "no such file"),
    (["--batch-lengths", "{mix}", "--for", "megatron"], "leave out --for and --plan"),
    (["--batch-lengths", "{mix}", "--nodes", "2"], "leave out --nodes or --batch-lengths"),
])
def test_cli_bad_batch_lengths_are_refused_in_one_line_writing_nothing(cptune_here: Any, tmp_path: Path,
                                                                       words: list[str], says: str) -> None:
    from conftest import assert_refused

    (tmp_path / "mix.txt").write_text("512\n")
    (tmp_path / "bad.txt").write_text("512\nmany\n")
    files = {"mix": tmp_path / "mix.txt", "bad": tmp_path / "bad.txt", "missing": tmp_path / "none.txt"}
    out = tmp_path / "plan.json"
    assert_refused(cptune_here(*FLAGS, *(w.format(**files) for w in words), "-o", out), says)
    assert not out.exists()
