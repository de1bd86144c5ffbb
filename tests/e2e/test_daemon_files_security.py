"""Issue 18: the daemon runs as root on shared nodes. What it writes must be fresh, private and
never reached through someone else's symlink; what it reaps must be dead for sure; and a
squatted socket directory must neither stop it nor let another user pose as it.

Tests that need a second user run as root (as CI does) with uid 65534 (nobody) as the attacker."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, assert_one_error, run_cli, script, wait_until

NOBODY = 65534


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


@root_only
@pytest.mark.parametrize(
    "case", ["owned", "parent owned", "world-writable", "group-writable", "checkpoints"]
)
def test_log_or_checkpoint_dir_others_control_is_refused(tmp_path, case):
    """A base directory another user owns or may add entries to (anywhere on its path) would let
    them plant symlinks that make a root daemon write to any file: exit 2 with one line naming
    the directory and the fix, before anything is created in it."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    log_dir, ckpt_dir, flag = theirs, tmp_path / "ckpt", "--log-dir"
    needles = [f"{theirs} belongs to uid {NOBODY}", "use a directory owned by root"]
    if case in ("owned", "parent owned", "checkpoints"):
        os.chown(theirs, NOBODY, NOBODY)
    if case == "parent owned":
        log_dir = theirs / "runs"
    elif case == "world-writable":
        theirs.chmod(0o777)
        needles = [
            f"{theirs} is writable by other users without the sticky bit",
            f"chmod go-w {theirs}",
        ]
    elif case == "group-writable":
        theirs.chmod(0o770)
        needles = [f"{theirs} is writable by its group", f"chmod go-w {theirs}"]
    elif case == "checkpoints":
        log_dir, ckpt_dir, flag = tmp_path / "logs", theirs, "--checkpoint-dir"
    r = run_cli(
        "run",
        "--log-dir",
        str(log_dir),
        "--checkpoint-dir",
        str(ckpt_dir),
        "--socket",
        str(tmp_path / "s"),
        "--nproc-per-node",
        "1",
        script("faulty.py"),
        "--steps",
        "1",
    )
    assert_one_error(
        r,
        f"{flag} {log_dir if flag == '--log-dir' else ckpt_dir}: ",
        *needles,
        f"or choose another {flag}",
    )
    assert os.listdir(theirs) == []  # nothing made in it: no run directory, no checkpoints
    assert not (tmp_path / "s").exists()  # nothing started


def _modes(top: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            out[str(p.relative_to(top))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def test_logs_stacks_heartbeats_and_checkpoints_are_not_world_readable(daemons, tmp_path):
    """A real run with the everyday umask 022 leaves logs, heartbeats, a stack dump, an error
    file, checkpoints and in-memory state that other users cannot read: files 0640 at most,
    directories 0750 at most."""
    flag = tmp_path / "flag"
    old = os.umask(0o022)
    try:
        d = daemons(
            script("private_files.py"),
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "1",
            "--restart-grace",
            "1",
            args=[str(flag)],
        )
    finally:
        os.umask(old)
    wait_until(
        lambda: "saved" in d.log_text(0, attempt=1), 90, what="the first attempt's checkpoints"
    )
    mem = wait_until(
        lambda: [e["directory"] for e in d.events() if e.get("event") == "memory_state"],
        10,
        what="the memory directory",
    )[0]
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "stacks", "--socket", str(d.socket)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    in_memory = _modes(Path(mem))
    assert stat.S_IMODE(os.stat(mem).st_mode) == 0o700 and in_memory, in_memory
    flag.write_text("")
    assert d.wait(90) == 0, d.stderr()[-3000:]
    run_dir = d.run_dir()
    files = {
        **_modes(run_dir),
        **{f"checkpoints/{k}": v for k, v in _modes(d.log_dir / "checkpoints").items()},
        **{f"shm/{k}": v for k, v in in_memory.items()},
    }
    for name in (
        "attempt1/rank0.log",
        "attempt1/rank0.heartbeat",
        "attempt1/rank0.stacks.txt",
        "attempt1/rank0.error.json",
        "spares.log",
    ):
        assert name in files, sorted(files)
    assert any(k.startswith("checkpoints/") and k.endswith(".pt") for k in files), sorted(files)
    loose = {
        k: oct(v) for k, v in files.items() if v & 0o027
    }  # other users: nothing; group: no writes
    assert not loose, loose
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o750
