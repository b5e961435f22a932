"""The edges a first real user hits (issue 33, items 5, 6 and 9 in part): integers past what a
database holds, a sequence longer than this host's memory, a read-only or full filesystem under
``export -o``, and values the flags used to take without a word. Each one: exit 2, one line on
stderr, no traceback, the database byte for byte as it was and nothing half written."""

import dataclasses
import errno
import hashlib
import json
import math
import os
import pathlib
import tempfile

import pytest

from conftest import assert_refused, make_calibration, measurement
from cptune.config import CPConfig
from cptune.cost import analytic_cost
from cptune.feasibility import candidate_configs, feasibility
from cptune.hardware import this_host
from cptune.measurement import host_memory_bytes
from cptune.space import MeasureSettings
from cptune.store import Store
from cptune.workload import MAX_INT, Workload

SMALL = Workload(seq_len=64, heads=4, head_dim=16)
SHAPE = ["--heads", "4", "--head-dim", "16"]
TOO_BIG = str(MAX_INT + 1)  # 2^63: one past what SQLite's and numpy's integers hold


@pytest.fixture
def db(tmp_path):
    """This host calibrated on 2 ranks, and two made-up measurements of SMALL."""
    path = tmp_path / "c.db"
    with Store(str(path)) as store:
        store.add_calibration(this_host(), make_calibration(2))
        for ranks, ms in ((1, 3.0), (2, 2.0)):
            store.add_measurement(this_host(), measurement(SMALL, CPConfig("ring", ranks), ms))
    return path


def run(cptune_here, args, db):
    """``cptune *args`` with ``--db db`` where the command takes one (measure stores nothing)."""
    return cptune_here(*args, *([] if args[0] == "measure" else ["--db", db]))


def files(folder):
    """Every file under ``folder`` with the SHA-256 of its bytes: what a refusal must leave as it was."""
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- integers of 2^63 or more


@pytest.mark.parametrize("args, prefix, fragment", [
    (["results", "--seq-len", TOO_BIG], "cptune results: error: ",
     "--seq-len: must be at most 9223372036854775807"),
    (["results", "--exclude", TOO_BIG], "cptune results: error: ", "no measurement has an id above"),
    (["search", *SHAPE, "--seq-lens", TOO_BIG, "--ranks", "1"], "cptune search: error: ",
     "--seq-lens: must be at most"),
    (["search", *SHAPE, "--seq-lens", "64", "--ranks", "1", "--trials", TOO_BIG], "cptune search: error: ",
     "--trials: must be at most"),
    (["measure", *SHAPE, "--seq-len", "64", "--max-ranks", "1", "--repeats", TOO_BIG],
     "cptune measure: error: ", "--repeats: must be a whole number from 1 to 10,000"),
    (["recommend", "--hardware", "h100-sxm-8", "--heads", TOO_BIG, "--head-dim", "64", "--seq-len", "64"],
     "cptune recommend: error: ", "--heads: must be at most"),
])
def test_an_integer_past_what_a_database_holds_is_refused_as_a_flag(cptune_here, db, tmp_path, args, prefix,
                                                                     fragment):
    before = files(tmp_path)
    assert_refused(run(cptune_here, args, db), fragment, prefix=prefix)
    assert files(tmp_path) == before


def test_an_integer_past_what_a_database_holds_is_refused_in_a_space_file(cptune_here, db, tmp_path):
    space = tmp_path / "space.toml"
    space.write_text(f'name = "x"\n[model]\nheads = 4\nhead_dim = 16\n[sweep]\nseq_lens = [64, {TOO_BIG}]\n'
                     f'ranks = [1]\n')
    before = files(tmp_path)
    assert_refused(cptune_here("search", space, "--db", db),
                   f"{space}: sweep.seq_lens[1]: out of range", "at most 9223372036854775807")
    assert files(tmp_path) == before


@pytest.mark.parametrize("make, limit", [
    (lambda: Workload(seq_len=MAX_INT + 1, heads=4, head_dim=16), "9223372036854775807"),
    (lambda: CPConfig("ring", MAX_INT + 1), "9223372036854775807"),
    (lambda: MeasureSettings(repeats=MAX_INT + 1), "from 1 to 10,000"),  # the flag's and the key's range
])
def test_library_callers_get_the_same_limit(make, limit):
    with pytest.raises(ValueError, match=limit):
        make()


@pytest.mark.timeout(60)
def test_a_huge_head_count_is_answered_at_once(cptune_here, tmp_path, monkeypatch):
    # below the limit, but odd: the head groups that fit were listed by trying every divisor up to 2^62
    monkeypatch.chdir(tmp_path)
    result = cptune_here("recommend", "--hardware", "h100-sxm-8", "--heads", 2**62 + 1, "--head-dim", "64",
                         "--seq-len", "64")
    assert_refused(result, "no configuration can run")


# --------------------------------------------------------------------------- longer than this host's memory


def too_long_for_this_host(max_ranks: int) -> Workload:
    """SMALL at a length where every configuration on 1..max_ranks ranks needs more than this
    host's memory, and its queries alone as float32 (numpy's first array of a run) four times
    it: were it not refused, the first allocation would fail, not fill the host."""
    workload = SMALL
    while (min(analytic_cost(workload, c).peak_bytes * c.ranks for c in candidate_configs(max_ranks)
               if not feasibility(workload, c)) <= host_memory_bytes()
           or workload.seq_len * workload.heads * workload.head_dim * 4 <= 4 * host_memory_bytes()):
        workload = dataclasses.replace(workload, seq_len=workload.seq_len * 2)
    return workload


def test_measure_refuses_a_sequence_longer_than_this_hosts_memory(cptune_here):
    workload = too_long_for_this_host(2)
    result = cptune_here("measure", *SHAPE, "--seq-len", workload.seq_len, "--max-ranks", "2")
    assert_refused(result, f"no configuration can run seq {workload.seq_len}", "in this host's memory",
                   "over the limit of")


def test_search_refuses_a_sequence_longer_than_this_hosts_memory_before_touching_the_database(
        cptune_here, db, tmp_path):
    workload = too_long_for_this_host(2)
    before = files(tmp_path)
    result = cptune_here("search", *SHAPE, "--seq-lens", f"64,{workload.seq_len}", "--ranks", "1,2",
                         "--db", db)
    assert_refused(result, f"sweep.seq_lens[1]: seq_len {workload.seq_len} does not fit in memory on "
                           f"ranks 1, 2", "over the limit of")
    assert files(tmp_path) == before


# --------------------------------------------------------------------------- export -o


def failing_filesystem(monkeypatch, folder: pathlib.Path, error: int, when: str):
    """Make writing a plan under ``folder`` fail with ``error`` as a filesystem would: ``when``
    "open" (a read-only filesystem refuses to create anything) or "write" (a full disk: the
    temporary file opens, its bytes do not fit)."""
    real_mkstemp, real_fdopen = tempfile.mkstemp, os.fdopen

    def refused(path):
        return OSError(error, os.strerror(error), str(path))

    def mkstemp(*args, dir=None, **kwargs):
        if pathlib.Path(dir) == folder and when == "open":
            raise refused(folder)
        return real_mkstemp(*args, dir=dir, **kwargs)

    def fdopen(fd, mode="r", *args, **kwargs):
        file = real_fdopen(fd, mode, *args, **kwargs)
        if "w" not in mode or pathlib.Path(os.readlink(f"/proc/self/fd/{fd}")).parent != folder:
            return file
        write = file.write

        def write_half(data):
            write(data[: len(data) // 2])  # half of it fits
            raise refused(folder)

        file.write = write_half
        return file

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "fdopen", fdopen)


def test_export_to_a_read_only_filesystem_is_one_line(cptune_here, db, tmp_path, monkeypatch):
    folder = tmp_path / "mounted-read-only"
    folder.mkdir()
    failing_filesystem(monkeypatch, folder, errno.EROFS, when="open")
    result = cptune_here("export", *SHAPE, "--seq-lens", "64", "--db", db, "-o", folder / "plan.json")
    assert_refused(result, f"cannot write the plan to {folder / 'plan.json'}: Read-only file system",
                   "cptune export -o PATH")
    assert list(folder.iterdir()) == []


def test_a_full_disk_leaves_the_previous_plan_whole(cptune_here, db, tmp_path, monkeypatch):
    folder = tmp_path / "full"
    folder.mkdir()
    plan = folder / "plan.json"
    assert cptune_here("export", *SHAPE, "--seq-lens", "64", "--db", db, "-o", plan).returncode == 0
    before = files(tmp_path)
    failing_filesystem(monkeypatch, folder, errno.ENOSPC, when="write")
    result = cptune_here("export", *SHAPE, "--seq-lens", "64,128", "--db", db, "-o", plan)
    assert_refused(result, f"cannot write the plan to {plan}: No space left on device")
    assert files(tmp_path) == before  # the old plan whole, no partial file left


def test_export_refuses_to_replace_a_file_that_is_not_a_plan(cptune_here, db, tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": "not a plan"}\n')
    before = files(tmp_path)
    for force in ([], ["--force"]):  # --force replaces only a plan edited since (tests/test_own_outputs.py)
        result = cptune_here("export", *SHAPE, "--seq-lens", "64", "--db", db, "-o", notes, *force)
        assert_refused(result, f"{notes} exists and is not a plan written by cptune export")
        assert files(tmp_path) == before


def test_export_replaces_a_plan_it_wrote(cptune_here, db, tmp_path):
    plan = tmp_path / "plan.json"
    for lengths in ("64", "64,128"):
        done = cptune_here("export", *SHAPE, "--seq-lens", lengths, "--db", db, "-o", plan)
        assert done.returncode == 0, done.stderr
    assert [b["seq_len"] for b in json.loads(plan.read_text())["buckets"]] == [64, 128]


def test_export_to_a_directory_names_a_file_to_use(cptune_here, db, tmp_path):
    assert_refused(cptune_here("export", *SHAPE, "--seq-lens", "64", "--db", db, "-o", tmp_path),
                   "it is a directory", f"-o {tmp_path / 'plan.json'}")


# --------------------------------------------------------------------------- values taken without a word


@pytest.mark.parametrize("args, fragment", [
    (["results", "--status", "bogus"], "--status: invalid choice: 'bogus'"),
    (["search", *SHAPE, "--seq-lens", "1024,,2048"],
     "--seq-lens: expected comma-separated values like 1024,2048, without empty entries, got '1024,,2048'"),
    (["search", *SHAPE, "--seq-lens", "1024,"], "without empty entries"),
    (["search", *SHAPE, "--seq-lens", "64", "--ranks", "1,1"], "--ranks: 1 is listed twice in '1,1'"),
    (["search", *SHAPE, "--seq-lens", "64,64"], "--seq-lens: 64 is listed twice"),
    (["search", *SHAPE, "--seq-lens", "64", "--strategies", "ring,,ulysses"], "without empty entries"),
    (["results", "--exclude", "1,,2"], "without empty entries"),
    (["search", *SHAPE, "--seq-lens", "64", "--timeout", "nan"],
     "--timeout: expected a positive number of seconds, at most 31536000 (a year), got nan"),
    (["search", *SHAPE, "--seq-lens", "64", "--timeout", "inf"], "got inf"),
    (["measure", "--timeout", "nan"], "--timeout: expected a positive number of seconds"),
    (["measure", "--timeout", "1e20"], "at most 31536000 (a year), got 1e+20"),
])
def test_a_value_the_flags_used_to_take_silently_is_refused(cptune_here, db, tmp_path, args, fragment):
    before = files(tmp_path)
    assert_refused(run(cptune_here, args, db), fragment, prefix=f"cptune {args[0]}: error: ")
    assert files(tmp_path) == before


@pytest.mark.parametrize("timeout", [math.nan, math.inf, 1e20, 0])
def test_measure_settings_refuse_the_timeouts_the_flags_refuse(timeout):
    with pytest.raises(ValueError, match="timeout: expected a positive number of seconds"):
        MeasureSettings(timeout=timeout)


def test_a_space_files_timeout_is_checked_as_the_flag_is(cptune_here, db, tmp_path):
    space = tmp_path / "space.toml"
    space.write_text('name = "x"\n[model]\nheads = 4\nhead_dim = 16\n[sweep]\nseq_lens = [64]\n'
                     '[measure]\ntimeout = 1e20\n')
    assert_refused(cptune_here("search", space, "--db", db),
                   f"{space}: measure.timeout: out of range: expected a positive number of seconds, at most")


# --------------------------------------------------------------------------- wording


def test_one_token_asks_for_at_most_one_rank_in_words(cptune_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cptune_here("recommend", "--hardware", "h100-sxm-8", "--heads", "8", "--head-dim", "64",
                         "--seq-len", "1")
    assert result.returncode == 0, result.stderr
    assert "use at most 1 rank" in result.stdout
    assert "1 ranks" not in result.stdout
