"""Idle connections cannot starve the control socket: 200 of them, held open and reopened by
real processes (another admitted user's, or the daemon's own workers'), and `elasticd status`
from the CLI still answers at once; caps per process, per user and for the workers together."""

from __future__ import annotations

import grp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.control import access, client
from elasticd.control.server import ControlServer
from harness import script, wait_until
from scripts.hog_control import hog

NOBODY = 65534
STATUS_BOUND = 5.0  # seconds for a whole `elasticd status` run (interpreter start included)


def _served_while(d, report: Path, expected_holders: int) -> None:
    """With the hogs holding their connections, status answers every time, within the bound."""
    wait_until(lambda: _idle_peers(d) >= 8, 30, what="the hog's idle connections")
    # the job may still be forming on a slow machine: status is answered meanwhile (RENDEZVOUS)
    wait_until(lambda: "RUNNING" in d.status().stdout, 60, what="the job to run")
    for _ in range(5):
        t0 = time.monotonic()
        r = d.status()
        took = time.monotonic() - t0
        assert r.returncode == 0 and "RUNNING" in r.stdout, (
            r.returncode,
            r.stdout[-500:],
            r.stderr[-500:],
        )
        assert took < STATUS_BOUND, took
    lines = wait_until(
        lambda: (
            (t := report.read_text() if report.exists() else "").count("\n") == expected_holders
            and t.splitlines()
        ),
        30,
        what="the hogs' reports",
    )
    opened = sum(int(ln.split()[1]) for ln in lines)
    busy = sum(int(ln.split()[3]) for ln in lines)
    assert opened >= 200 and busy > 0, lines  # they tried for more than the caps allow


def _idle_peers(d) -> int:
    """Connections the daemon holds on its control socket now (from /proc: a socket count)."""
    try:
        return len(
            [
                fd
                for fd in os.listdir(f"/proc/{d.pid}/fd")
                if os.readlink(f"/proc/{d.pid}/fd/{fd}").startswith("socket:")
            ]
        )
    except OSError:
        return 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the hog as another uid")
def test_another_admitted_users_idle_connections_do_not_starve_status(daemons, tmp_path, open_dir):
    group = grp.getgrgid(NOBODY).gr_name
    d = daemons(
        script("silent.py"),
        "--nproc-per-node",
        "1",
        "--no-warm-spawn",
        "--operators-group",
        group,
        "--socket",
        str(open_dir / "c.sock"),
        args=["60"],
    )
    d.socket = open_dir / "c.sock"
    wait_until(lambda: d.status().returncode == 0, 30, what="the daemon's socket")
    report = open_dir / "report"
    report.touch(mode=0o666)
    os.chmod(report, 0o666)  # whatever the umask: the hog, as nobody, appends to it
    pid = os.fork()
    if pid == 0:  # the hog, as uid nobody in the operators group: admitted
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            hog(str(d.socket), 20, 10, 6.0, str(report))  # 200 connections from 20 processes
            code = 0
        finally:
            os._exit(code)
    try:
        _served_while(d, report, 20)
    finally:
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
    d.kill(15)
    assert d.wait(30) == 0


def test_the_workers_idle_connections_do_not_starve_status(daemons, tmp_path):
    report = tmp_path / "report"
    sock = tmp_path / "node0" / "control.sock"
    d = daemons(
        script("hog_control.py"),
        "--nproc-per-node",
        "1",
        "--no-warm-spawn",
        args=[str(sock), "20", "10", "6", str(report)],
    )  # a worker and 20 children of it
    _served_while(d, report, 20)
    assert d.wait(60) == 0


# --- the caps, in-process -----------------------------------------------------------------------


def _connect(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    s.connect(str(path))
    return s


def _answered(s: socket.socket, wait: float = 0.2) -> bytes:
    s.settimeout(wait)
    try:
        return s.recv(4096)
    except TimeoutError:
        return b""


def test_one_process_holds_at_most_its_cap_and_the_others_are_served(tmp_path):
    with ControlServer(tmp_path / "c.sock", snapshot=dict, command=dict) as server:
        held = [_connect(server.path) for _ in range(access.PER_PROCESS)]
        extra = _connect(server.path)
        try:
            assert b"busy: too many open control connections from pid" in _answered(extra, 3)
            assert not any(_answered(s, 0.01) for s in held)  # those wait for their request
            r = subprocess.run(
                [sys.executable, "-m", "elasticd", "status", "--socket", str(server.path)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert r.returncode == 0, r.stderr  # another process is served
            held.pop().close()
            assert client.request(server.path, {"version": 1, "command": "status"})["ok"] is True
        finally:
            for s in [*held, extra]:
                s.close()


def test_the_daemons_descendants_share_one_cap(tmp_path):
    """Children of this process are its descendants, as workers are the daemon's."""
    with ControlServer(tmp_path / "c.sock", snapshot=dict, command=dict) as server:
        r, w = os.pipe()
        pids = []
        for _ in range(access.PER_WORKERS // 2 + 1):  # each holds 2 idle connections, then reports
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    socks = [_connect(server.path) for _ in range(2)]
                    os.write(
                        w, b"".join(b"B" if b"busy" in _answered(s, 0.5) else b"." for s in socks)
                    )
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        os.close(w)
        try:
            got = b""
            while chunk := os.read(r, 64):
                got += chunk
        finally:
            os.close(r)
            for pid in pids:
                os.waitpid(pid, 0)
        assert got.count(b".") == access.PER_WORKERS and got.count(b"B") == 2, got
