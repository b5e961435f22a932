"""``cptune.torch.BatchRunner``: a batch plan's groups run side by side on 4 gloo ranks
(tests/torch_batch.py under torchrun), every sequence's output and gradients those of
unsharded attention (and not a mask one token off); the process groups made once; a rank's
perturbed plan refused by all."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")  # the cptune[torch] extra; CI installs it

from conftest import torchrun_summary  # noqa: E402

TESTS = Path(__file__).parent
#: fp32 relative error allowed against the float64 reference (tests/test_torch_masks.py's).
TOLERANCE = 1e-4


@pytest.mark.slow
def test_a_batch_plan_on_four_gloo_ranks_gives_every_sequence_the_unsharded_layer():
    summary = torchrun_summary(4, TESTS / "torch_batch.py", timeout=240)
    assert summary["world"] == 4
    steps = summary["steps"]
    for step in steps:
        assert sorted(map(int, step["errors"])) == [0, 1, 2, 3, 4]  # every sequence ran, once
        for sequence, errors in step["errors"].items():
            assert len(errors) == 5 and max(errors[:4]) < TOLERANCE, (sequence, errors)
            assert errors[4] > 100 * TOLERANCE  # a mask one token off would show
    made = [step["groups_made"] for step in steps]
    assert made[0] < made[1] <= made[2] == made[3]  # the first plan again makes no group
    assert steps[2]["idle"] == [False, False, False, True] and not any(steps[0]["idle"])
    for said in summary["perturbed"]:  # every rank, not only the one that differs
        assert said.startswith("the ranks passed 2 different batch plans (one by rank(s) 0, one by rank(s) "
                               "1 2 3)"), said
