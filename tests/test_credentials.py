"""A database URL's password is never shown: not in messages, hints, errors (SQLAlchemy's
or the driver's), nor files. The successes against a real server are in test_postgres.py."""

import sys

import pytest

from cptune.cli import main
from cptune.store import Store, StoreError, database_url, display_url

SECRET = "Zq7-secret-Wv3"
#: Nothing listens on port 1: the connection is refused at once.
UNREACHABLE = f"postgresql://cptune:{SECRET}@127.0.0.1:1/cptune"
SHAPE = ["--heads", "4", "--head-dim", "16"]


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:pw@h:5432/db", "postgresql://u:***@h:5432/db"),
    ("postgresql+psycopg://u:p%40w@h/db", "postgresql+psycopg://u:***@h/db"),
    # an unencoded @ in the password: everything up to the last @ is hidden
    ("postgresql://u:Zq7@Kx9@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u@h/db?password=Kx9&sslmode=require", "postgresql://u@h/db?password=***&sslmode=require"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
    ("sqlite:////tmp/cptune.db", "sqlite:////tmp/cptune.db"),
])
def test_display_url_hides_every_password(url, shown):
    assert display_url(url) == shown


def test_a_plain_postgresql_url_gets_the_postgres_extras_driver(monkeypatch):
    monkeypatch.delenv("CPTUNE_DB", raising=False)
    assert database_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert database_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert database_url("postgresql+psycopg2://u@h/db") == "postgresql+psycopg2://u@h/db"  # asked for


@pytest.mark.parametrize("argv", [
    ["search", *SHAPE, "--seq-lens", "64", "--ranks", "1", "--no-calibrate"],
    ["results"], ["results", "--csv"], ["results", "--json"],
    ["calibrate", "--max-ranks", "1"],
    ["fit"],
    ["recommend", *SHAPE, "--seq-len", "64"],
    ["export", *SHAPE, "--seq-lens", "64", "-o", "{tmp}/plan.json"],
    ["report", "-o", "{tmp}/report"], ["report", "--text"],
], ids=lambda argv: " ".join(a for a in argv if not a.startswith("{")))
def test_a_server_that_refuses_is_one_line_without_the_password(argv, tmp_path, capsys):
    pytest.importorskip("psycopg")  # the driver that tries the server (the postgres and test extras')
    code = main([a.format(tmp=tmp_path) for a in argv] + ["--db", UNREACHABLE])
    out, err = capsys.readouterr()
    assert code == 2
    assert SECRET not in out + err and "Traceback" not in out + err
    assert "cannot open database postgresql+psycopg://cptune:***@127.0.0.1:1/cptune" in out + err
    assert "Connection refused" in out + err and "check that the server is up" in out + err
    assert list(tmp_path.iterdir()) == []  # no plan, no report


def test_a_missing_postgresql_driver_gives_the_install_that_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg now fails
    with pytest.raises(StoreError) as refused:
        Store(UNREACHABLE)
    message = str(refused.value)
    assert SECRET not in message
    assert "driver psycopg is not installed; pip install 'cptune[postgres]'" in message
    assert "postgresql://user:password@host/database" in message


@pytest.mark.parametrize("url, hidden", [
    (f"mysql+pymysql://cptune:{SECRET}@127.0.0.1/cptune", [SECRET]),  # no such driver here
    ("postgresql://cptune:Zq7@Kx9:Wv3@127.0.0.1:x/db", ["Zq7", "Kx9", "Wv3"]),  # does not parse
    (f"nosuchdialect://cptune:{SECRET}@somewhere/db", [SECRET]),
])
def test_an_unusable_url_is_refused_without_the_password(url, hidden, capsys):
    assert main(["results", "--db", url]) == 2
    out, err = capsys.readouterr()
    assert "cannot use database" in out + err and "Traceback" not in out + err
    assert not any(piece in out + err for piece in hidden)
