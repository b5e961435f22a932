"""Length mixes (cptune.mixes): read and refused in one line, costed from the cost model, the
static answer over a mix, and a plan per batch, fast and exact (against a MILP)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cptune.mixes import LengthMix, MixError, check_fits, mix_costs, read_mix
from cptune.workload import Workload

SHAPE = Workload(seq_len=1024, heads=32, kv_heads=8, head_dim=128, causal=True, mode="train").shape


@pytest.fixture(autouse=True)
def _no_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Described hardware only, answered by the prior: no database is read or made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CPTUNE_DB", raising=False)


def test_every_file_form_reads_the_same_mix(tmp_path: Path) -> None:
    lengths = [512, 2048, 512, 131072]
    (tmp_path / "lines.txt").write_text("# lengths\n512\n2048\n\n512\n131072\n")
    (tmp_path / "list.json").write_text(json.dumps(lengths))
    (tmp_path / "hist.json").write_text(json.dumps({"512": 2, "2048": 1, "131072": 1}))
    np.save(tmp_path / "array.npy", np.array(lengths, dtype=np.int32))
    for name in ("lines.txt", "list.json", "array.npy"):
        assert read_mix(tmp_path / name).lengths.tolist() == lengths, name
    assert read_mix(tmp_path / "hist.json").lengths.tolist() == sorted(lengths)
    assert LengthMix.from_histogram({512: 2, 2048: 1, 131072: 1}).histogram()[1].tolist() == [2, 1, 1]


@pytest.mark.parametrize(("content", "says"), [
    ("", "empty"), ("[]", "empty"), ("512\n0\n", "length 0 (sequence 2)"), ("512\n1.5\n", "line 2"),
    ("[512, 2.0]", "sequence 2: 2.0"), ('{"512": -1}', "count"), ("[512, true]", "sequence 2"),
    ("[NaN]", "NaN"), ('{"a": 1}', "key 'a'"), ("[99999999999999999999]", "longer than"),
])
def test_bad_text_is_refused_in_one_line(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "mix.txt"
    path.write_text(content)
    with pytest.raises(MixError, match="mix.txt") as caught:
        read_mix(path)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_arrays_that_are_not_integers_or_need_unpickling_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "floats.npy", np.array([1.0, 2.0]))
    np.save(tmp_path / "objects.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(MixError, match="whole numbers"):
        read_mix(tmp_path / "floats.npy")
    with pytest.raises(MixError, match="allow_pickle"):
        read_mix(tmp_path / "objects.npy")
    with pytest.raises(MixError, match="not a regular file"):
        read_mix(tmp_path)
    with pytest.raises(MixError, match="no such file"):
        read_mix(tmp_path / "absent.txt")


def test_a_sequence_no_configuration_holds_names_the_memory_it_needs() -> None:
    mix = LengthMix.of([1024, 1 << 20])
    check_fits(mix, SHAPE, 8, None)  # no limit: fits
    needs = r"1,048,576 tokens, needs at least .* GiB per rank .* over the 1.0 GiB"
    with pytest.raises(MixError, match=needs):
        check_fits(mix, SHAPE, 8, 2**30)
    with pytest.raises(MixError, match="needs at least"):
        mix_costs(SHAPE, LengthMix.of([1024, 1 << 25]), hardware="h100-sxm-8")


def test_costs_are_the_recommendation_at_each_length_and_between() -> None:
    from cptune.model import recommend

    mix = LengthMix.of([1000, 4000, 16000, 64000])
    costs = mix_costs(SHAPE, mix, ranks=4, hardware="h100-sxm-8")
    assert max(costs.sizes) == 4
    at = costs.times([4000])[:, 0]
    pick = recommend(SHAPE.at(4000), hardware="h100-sxm-8")
    for candidate in pick.candidates:
        if candidate.config.ranks <= 4:
            assert at[costs.configs.index(candidate.config)] == pytest.approx(candidate.latency_ms)
    between = costs.times([8000])[:, 0]
    assert np.all((between > at) & (between < costs.times([16000])[:, 0]))
    with pytest.raises(MixError, match="outside"):
        costs.times([100])
