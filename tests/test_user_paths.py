"""Paths a user names: cptune reads only regular files, up to a bound, and replaces only regular
files - a device, a FIFO, a socket or a folder is refused in one line, ``--force`` included, and
left as it was; a name too long for the filesystem is one line too."""

import os
import socket
import stat

import pytest

from conftest import assert_refused
from cptune import load_plan
from cptune.errors import CPTuneError
from cptune.plans import PlanError

EXPORT = ["export", "--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128", "--seq-lens", "16896"]
TOO_LONG = "x" * 300


def fifo(tmp_path, name="fifo"):
    path = tmp_path / name
    os.mkfifo(path)
    return path


def zero_device(tmp_path):
    """A character device like /dev/zero (endless zeros) of this test's own, where this user may
    make one (root, as CI runs); else /dev/zero itself, only ever read."""
    path = tmp_path / "zero"
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        return "/dev/zero"
    return str(path)


def unix_socket(tmp_path):
    path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    return path, listener


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", ["device", "fifo", "socket"])
def test_export_never_reads_or_replaces_what_is_not_a_regular_file(cptune_here, tmp_path, kind, force):
    target = {"device": lambda: zero_device(tmp_path), "fifo": lambda: fifo(tmp_path),
              "socket": lambda: unix_socket(tmp_path)[0]}[kind]()
    mode = os.stat(target).st_mode
    result = cptune_here(*EXPORT, "-o", target, *(["--force"] if force else []))
    assert_refused(result, str(target), "which cptune never replaces", "cptune export -o PATH")
    assert os.stat(target).st_mode == mode  # still the device, FIFO or socket it was


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_load_plan_refuses_what_is_not_a_regular_file_without_reading_it(tmp_path, kind):
    path = {"device": lambda: zero_device(tmp_path), "fifo": lambda: fifo(tmp_path),
            "folder": lambda: tmp_path}[kind]()
    with pytest.raises(PlanError, match="not a regular file"):
        load_plan(path)  # a FIFO would wait for a writer forever; a device would fill the memory


def test_load_plan_reads_no_more_than_a_plan_can_be(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (5 << 20))
    with pytest.raises(PlanError, match="too large"):
        load_plan(big)


@pytest.mark.parametrize("command", [["search"], ["export", "-o", "plan.json"]])
@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_space_file_that_is_a_device_or_a_fifo_is_refused(cptune_here, tmp_path, monkeypatch, command,
                                                           kind):
    monkeypatch.chdir(tmp_path)
    space = zero_device(tmp_path) if kind == "device" else fifo(tmp_path, "space.toml")
    assert_refused(cptune_here(*command, space, "--db", tmp_path / "c.db"), str(space), "not a regular file")
    assert not (tmp_path / "c.db").exists() and not (tmp_path / "plan.json").exists()


def test_a_hardware_description_that_is_a_device_is_refused(cptune_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    device = zero_device(tmp_path)
    assert_refused(cptune_here("recommend", "--hardware", device, "--heads", "8", "--head-dim", "64",
                               "--seq-len", "8192"), "not a regular file")


@pytest.mark.parametrize("command", [
    [*EXPORT, "-o", f"{TOO_LONG}.json"],
    ["search", f"{TOO_LONG}.toml"],
    ["recommend", "--hardware", TOO_LONG, "--heads", "8", "--head-dim", "64", "--seq-len", "8192"],
])
def test_a_name_too_long_for_the_filesystem_is_one_line(cptune_here, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    assert_refused(cptune_here(*command), "the name is too long for the filesystem")
    assert os.listdir(tmp_path) == []


def test_a_report_folder_holding_a_fifo_where_the_page_goes_is_refused(tmp_path):
    from cptune.report import ReportData, write_report

    page = fifo(tmp_path, "report.html")
    empty = ReportData(url="sqlite://", generated_at="now", version="0", hardware=(), several_hardware=False)
    with pytest.raises(CPTuneError, match="which cptune never replaces"):
        write_report(empty, tmp_path)
    assert stat.S_ISFIFO(os.stat(page).st_mode)


def test_an_exported_plan_gets_the_mode_a_new_file_gets_and_no_partial_file_is_left(cptune_here, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        assert cptune_here(*EXPORT, "-o", "plan.json").returncode == 0
    finally:
        os.umask(old)
    assert os.listdir(tmp_path) == ["plan.json"]
    assert stat.S_IMODE(os.stat(tmp_path / "plan.json").st_mode) == 0o644
    load_plan(tmp_path / "plan.json", hardware="h100-sxm-8")
