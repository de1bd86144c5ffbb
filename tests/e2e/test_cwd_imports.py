"""A root daemon started in a directory another user can write must not run that user's code:
elasticd's own processes (the guard, the fork server, fresh spares, cold workers' bootstrap)
import elasticd and torch from the installation, never from the working directory, as torchrun
run from the same directory would. The attacker is uid 65534 (nobody), planting packages named
`elasticd` and `torch` that leave a marker when imported and then step aside for the real one, so
the job would run on as if nothing happened."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from harness import as_user, script

NOBODY = 65534

# What the attacker plants as NAME/__init__.py: a marker with the importer's uid and command,
# then the real package in its place (the attacker's directory dropped from sys.path).
SHIM = """\
import importlib, os, sys
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(here, f"RAN-{__name__}-{os.getpid()}"), "w") as f:
    f.write(f"uid {os.getuid()}: {sys.orig_argv}\\n")
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules[__name__]
sys.modules[__name__] = importlib.import_module(__name__)
"""


def _plant(where: str) -> list[str]:
    for name in ("elasticd", "torch"):
        os.mkdir(os.path.join(where, name))
        with open(os.path.join(where, name, "__init__.py"), "w") as f:
            f.write(SHIM)
    return sorted(os.listdir(where))


@pytest.fixture
def their_dir():
    """A directory nobody owns, with their `elasticd` and `torch` planted (by them)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    where = tempfile.mkdtemp(prefix="elasticd-theirs-")
    try:
        os.chown(where, NOBODY, NOBODY)
        os.chmod(where, 0o755)
        assert as_user(NOBODY, _plant, where) == ["elasticd", "torch"]
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _daemon_command() -> list[str]:
    """`elasticd` as installed (its console script puts its own directory on sys.path, not the
    working directory); else the module, with -P for the same effect."""
    installed = os.path.join(os.path.dirname(sys.executable), "elasticd")
    if os.access(installed, os.X_OK):
        return [installed]
    return [sys.executable, "-P", "-m", "elasticd"]


@pytest.mark.parametrize("spawn", ["warm", "cold"])
def test_nothing_is_imported_from_a_working_directory_others_write(tmp_path, their_dir, spawn):
    r = subprocess.run(
        [
            *_daemon_command(),
            "run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
            "--socket",
            str(tmp_path / "control.sock"),
            *(["--no-warm-spawn"] if spawn == "cold" else []),
            script("faulty.py"),
            "--steps",
            "3",
            "--step-time",
            "0.01",
        ],
        cwd=their_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ran = {
        name: open(os.path.join(their_dir, name)).read()
        for name in os.listdir(their_dir)
        if name.startswith("RAN-")
    }
    assert ran == {}, ran  # none of their code ran, as root or otherwise
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(their_dir)) == ["elasticd", "torch"]
