"""Where `elasticd run` writes its runs without --log-dir: the state directory a user of a
command-line tool expects, never the working directory (often the user's checkout)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticd.ops import cli


@pytest.mark.parametrize(
    "uid, env, expected",
    [
        (0, {}, "/var/lib/elasticd"),
        (0, {"XDG_STATE_HOME": "/srv/state"}, "/srv/state/elasticd"),
        (1000, {"HOME": "/home/u"}, "/home/u/.local/state/elasticd"),
        (1000, {"HOME": "/home/u", "XDG_STATE_HOME": "/x/s"}, "/x/s/elasticd"),
        (1000, {"HOME": "/home/u", "XDG_STATE_HOME": "rel"}, "/home/u/.local/state/elasticd"),
        (1000, {"HOME": "/"}, "TMP/elasticd-runs-1000"),
    ],
)
def test_default_log_base(monkeypatch, uid, env, expected):
    import tempfile

    monkeypatch.setattr(os, "geteuid", lambda: uid)
    for key in ("HOME", "XDG_STATE_HOME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.default_log_base() == Path(expected.replace("TMP", tempfile.gettempdir()))
    assert cli.default_log_base() != Path.cwd() / "elasticd-runs"


def test_log_dir_and_systemd_come_first(monkeypatch):
    from elasticd import config

    monkeypatch.setenv("LOGS_DIRECTORY", "/var/log/elasticd")
    assert cli._log_base(config.build({"nproc_per_node": "1"})) == Path("/var/log/elasticd")
    given = config.build({"nproc_per_node": "1", "log_dir": "/l"})
    assert cli._log_base(given) == Path("/l")
