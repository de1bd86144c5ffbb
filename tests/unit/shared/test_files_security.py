"""Issue 18: the daemon runs as root on shared nodes. What it writes must be fresh, private and
never reached through someone else's symlink; what it reaps must be dead for sure; and a
squatted socket directory must neither stop it nor let another user pose as it.

Tests that need a second user run as root (as CI does) with uid 65534 (nobody) as the attacker."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.checkpoint.memory import directory
from elasticd.control import client, paths
from elasticd.control.server import ControlServer
from elasticd.worker import heartbeat
from harness import ROOT, as_user, script

NOBODY = 65534


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def _stamps(seconds: int) -> list[str]:
    now = time.time()
    return [time.strftime("%Y%m%d-%H%M%S", time.localtime(now + i)) for i in range(-1, seconds)]


@root_only
def test_planted_run_directory_is_never_written_through(tmp_path):
    """The run directory's name (<rdzv id>-<time>-<pid>) is predictable. In a shared sticky base
    (like /tmp) another user plants it ahead, with symlinks where the daemon writes
    (attempt1/ to their directory, spares.log to a file of root's): the daemon must make its own
    fresh directory and leave the planted one and the targets alone."""
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(0o1777)  # world-writable with the sticky bit, as /tmp: accepted
    precious = tmp_path / "precious"
    precious.write_text("root's data\n")
    loot = tmp_path / "loot"
    loot.mkdir()
    os.chown(loot, NOBODY, NOBODY)
    # the daemon's pid is known before it picks the name: it waits for a line on stdin first
    go = (
        "import sys; sys.stdin.readline(); "
        "from elasticd.ops.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-c",
                go,
                "run",
                "--log-dir",
                str(base),
                "--socket",
                str(tmp_path / "s"),
                "--rdzv-id",
                "job",
                "--nproc-per-node",
                "1",
                "--log-format",
                "json",
                script("faulty.py"),
                "--steps",
                "2",
            ],
            stdin=subprocess.PIPE,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
    planted = []
    try:
        for stamp in _stamps(30):
            d = base / f"job-{stamp}-{daemon.pid}"
            d.mkdir()
            (d / "attempt1").symlink_to(loot)
            (d / "spares.log").symlink_to(precious)
            for p in (d, d / "attempt1", d / "spares.log"):
                os.lchown(p, NOBODY, NOBODY)
            planted.append(d)
        daemon.stdin.write(b"go\n")
        daemon.stdin.close()
        assert daemon.wait(timeout=120) == 0, out.read_text()[-3000:]
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert precious.read_text() == "root's data\n"
    assert os.listdir(loot) == []
    for d in planted:
        assert sorted(os.listdir(d)) == ["attempt1", "spares.log"]
    ours = [d for d in base.iterdir() if d not in planted and d.name != "checkpoints"]
    assert len(ours) == 1 and ours[0].name.startswith(planted[0].name[:4]), ours
    st = os.lstat(ours[0])
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) & 0o027 == 0
    assert "done" in (ours[0] / "attempt1" / "rank0.log").read_text()


def test_heartbeat_file_is_never_created_through_a_symlink(tmp_path):
    """heartbeat.create (the daemon pre-creates each rank's heartbeat) must not truncate what a
    planted symlink points at."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "rank0.heartbeat"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        heartbeat.create(str(link))
    assert victim.read_text() == "keep me"
    fresh = tmp_path / "rank1.heartbeat"
    heartbeat.create(str(fresh))
    assert heartbeat.read(str(fresh)).beats == 0


def test_memory_directory_of_a_live_daemon_in_another_pid_namespace_is_kept(tmp_path, monkeypatch):
    """A daemon in a container that shares /dev/shm records a pid of its own pid namespace, which
    names no process here (or an unrelated one). Modelled faithfully without a container: a live
    process holds the directory (directory.create, as the daemon does) and its owner file names a
    pid that is dead here; that is what made a daemon starting on the host delete live state. Its
    lock is what counts: kept while held, reaped once the holder is gone (SIGKILL, no cleanup)."""
    monkeypatch.setattr(directory, "ROOT", str(tmp_path))
    code = (
        "import sys; from elasticd.checkpoint.memory import directory; "
        "directory.ROOT = sys.argv[1]; "
        "print(directory.create('job'), flush=True); sys.stdin.readline()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        live = holder.stdout.readline().strip()
        assert live.startswith(str(tmp_path)), live
        dead = subprocess.Popen(["true"])
        dead.wait()
        Path(live, "owner").write_text(str(dead.pid))  # its pid, in its namespace: nobody here
        (tmp_path / f"{directory.PREFIX}link-x").symlink_to(live)  # never followed
        other = tmp_path / f"{directory.PREFIX}other-x"
        if os.geteuid() == 0:  # another user's, its lock free: not ours to delete
            other.mkdir()
            (other / "owner").write_text(str(dead.pid))
            (other / "lock").write_text("")
            os.chown(other, NOBODY, NOBODY)
        assert directory.reap_stale() == []
        assert os.path.isdir(live) and os.path.exists(os.path.join(live, "lock"))
    finally:
        holder.kill()
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    assert directory.reap_stale() == [live]  # no holder now: stale
    assert not os.path.exists(live) and other.is_dir() == (os.geteuid() == 0)


def _serve_and_find() -> dict:
    """What a daemon of this user does with the default socket path, then what the CLI finds."""
    path = paths.default_socket_path()
    server = ControlServer(
        path,
        snapshot=lambda: {"state": "RUNNING", "me": os.getuid()},
        command=lambda req: {"ok": True},
    )
    server.start()
    try:
        found = paths.find_daemons()
        replies = [
            client.request(p, {"version": 1, "command": "status"}, timeout=3)["status"]
            for p in found
        ]
        st = os.lstat(path.parent)
        return {
            "path": str(path),
            "found": [str(p) for p in found],
            "replies": replies,
            "dir_uid": st.st_uid,
            "dir_mode": stat.S_IMODE(st.st_mode),
        }
    finally:
        server.close()


@root_only
@pytest.mark.parametrize("squat", ["another user's directory", "symlink", "writable by others"])
def test_squatted_fallback_socket_directory_neither_stops_nor_fools_the_daemon(tmp_path, squat):
    """/tmp/elasticd-UID (an unprivileged daemon's socket directory without XDG_RUNTIME_DIR) is a
    predictable name in /tmp: another user makes it first, maybe with a socket of theirs inside.
    The daemon still starts, in a private /tmp/elasticd-UID-XXXXXXXX only this user can have made,
    and the CLI finds it there, and only it."""
    uid = (
        200_000 + os.getpid() % 100_000
    )  # a user of this test alone: nobody else's /tmp/elasticd-UID
    primary = Path(f"/tmp/elasticd-{uid}")
    fake = Path(f"/tmp/elasticd-squat-{uid}")
    for p in (primary, fake):
        assert not os.path.lexists(p), p
    impostor = socket.socket(socket.AF_UNIX)
    try:
        if squat == "writable by others":
            primary.mkdir()
            os.chown(primary, uid, uid)
            primary.chmod(0o777)
            where = primary
        else:
            fake.mkdir(mode=0o755)
            os.chown(fake, NOBODY, NOBODY)
            where = fake
            if squat == "symlink":
                primary.symlink_to(fake)
                os.lchown(primary, NOBODY, NOBODY)
            else:
                fake.rename(primary)
                where = primary
        impostor.bind(str(where / "control.sock"))  # an impostor the CLI must not ask
        os.chmod(where / "control.sock", 0o777)
        impostor.listen(1)
        got = as_user(
            uid,
            _serve_and_find,
            clear_env=("ELASTICD_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"),
        )
    finally:
        impostor.close()
        shutil.rmtree(fake, ignore_errors=True)
        if primary.is_symlink():
            primary.unlink()
        shutil.rmtree(primary, ignore_errors=True)
        for p in Path("/tmp").glob(f"elasticd-{uid}-*"):
            shutil.rmtree(p, ignore_errors=True)
    assert "raised" not in got, got
    path = Path(got["path"])
    assert path.parent.name.startswith(f"elasticd-{uid}-") and path.parent.parent == Path("/tmp"), (
        got
    )
    assert got["dir_uid"] == uid and got["dir_mode"] == 0o700, got
    assert got["found"] == [got["path"]] and got["replies"] == [{"state": "RUNNING", "me": uid}], (
        got
    )
