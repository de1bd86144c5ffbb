"""elasticd's own parts come back when killed: the fork server, its spares, the guard, the control
and tee threads (elasticd/lifecycle/supervise.py); a part that keeps dying is given up, and status
says so."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from e2e.test_forkserver import _forked_spares, _training_with_spares
from elasticd.control import client, protocol
from elasticd.control.server import ControlServer
from elasticd.daemon.tee import Tee
from elasticd.lifecycle import supervise
from harness import leftover_processes, script, wait_until


def _parts(d) -> dict:
    r = d.status("--json")
    return json.loads(r.stdout).get("parts", {}) if r.returncode == 0 else {}


def _helper(d, module: str) -> list[psutil.Process]:
    return [
        p for p in psutil.Process(d.pid).children() if f"elasticd.{module}" in " ".join(p.cmdline())
    ]


def test_killed_fork_server_and_spares_come_back_and_restarts_stay_warm(daemons, tmp_path):
    d, first, spares = _training_with_spares(daemons, tmp_path)
    server = [
        p for p in _helper(d, "worker.forkserver") if p.pid not in spares | set(first.values())
    ]
    assert len(server) == 1
    server[0].kill()
    up = wait_until(
        lambda: (
            p
            if (p := _parts(d).get("fork_server", {})).get("restarts") == 1 and p["state"] == "up"
            else None
        ),
        20,
        what="a new fork server",
    )
    assert "SIGKILL" in up["why"]
    # the spares killed too (an OOM killer's next picks): the new server forks their replacements
    for pid in spares:
        os.kill(pid, signal.SIGKILL)
    fresh = wait_until(
        lambda: s if len(s := _forked_spares(d.pid, set(first.values())) - spares) == 2 else None,
        30,
        what="two spares forked by the new server",
    )
    os.kill(first[1], signal.SIGKILL)
    recovered = wait_until(
        lambda: [e for e in d.events() if e.get("event") == "recovered"], 60, what="the recovery"
    )[-1]
    # the ranks went to the new server's spares, or to the ones it forked in their place when the
    # restart learned more of the job's imports (preload_learned's `replaced`); warm either way
    now = set(d.worker_pids().values())
    replaced = {p for e in d.events() if e["event"] == "preload_learned" for p in e["replaced"]}
    assert now == fresh or (fresh <= replaced and not now & (spares | set(first.values())))
    print("recovery after the fork server's respawn:", recovered)
    # spawn to first step: a warm spare's start-up; a cold start's (importing torch) takes 2-5 s
    assert recovered["first_step"] - recovered["spawned"] < 1.0, recovered
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0, d.stderr()[-3000:]
    assert [e["event"] for e in d.events() if e["event"].startswith("fork_server_")] == [
        "fork_server_died",
        "fork_server_restarted",
    ]


def test_killed_guard_comes_back_and_still_sweeps_after_daemon_sigkill(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "1",
        "--restart-grace",
        "1",
        args=["--steps", "100000", "--spawn-child", "--step-time", "0.05"],
    )
    d.wait_for_step(0, 2, timeout=60)
    old = _helper(d, "daemon.guard")
    assert len(old) == 1
    old[0].kill()
    wait_until(lambda: _parts(d).get("guard", {}).get("restarts") == 1, 20, what="a new guard")
    new = _helper(d, "daemon.guard")
    assert len(new) == 1 and new[0].pid != old[0].pid
    died = [e for e in d.events() if e.get("event") == "guard_died"]
    assert died and "behind" in died[0]["risk"]
    tree = psutil.Process(d.pid).children(recursive=True)
    assert any(p.ppid() != d.pid for p in tree)  # the worker's sleeping child
    d.kill(signal.SIGKILL)
    d.proc.wait(10)
    wait_until(
        lambda: not leftover_processes(), 15, what="the new guard sweeping the workers' tree"
    )


def test_a_thread_that_keeps_failing_is_restarted_then_given_up():
    events = []
    calls = []

    def run():
        calls.append(time.monotonic())
        raise RuntimeError("boom")

    t = supervise.thread(
        "selftest", run, limit=3, event=lambda name, level="info", **f: events.append(name)
    )
    t.start()
    t.join(10)
    assert not t.is_alive() and len(calls) == 3
    assert (
        calls[1] - calls[0] >= supervise.BACKOFF_FIRST
        and calls[2] - calls[1] >= 2 * supervise.BACKOFF_FIRST
    )
    assert events == [
        "selftest_died",
        "selftest_restarted",
        "selftest_died",
        "selftest_restarted",
        "selftest_off",
    ]
    assert supervise.report()["selftest"] == {
        "state": "off",
        "restarts": 2,
        "why": "RuntimeError('boom'); gave up after 3 failures in 600s",
    }


def test_a_helper_process_that_keeps_dying_is_started_again_then_given_up():
    started = []

    def start():
        p = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        started.append(p)
        return p

    kept = supervise.Kept("selfproc", start, limit=2)
    for n in (1, 2):  # kill each process the part runs, as an OOM killer could
        wait_until(
            lambda: len(started) == n and started[-1].poll() is None, 10, what=f"process {n}"
        )
        time.sleep(0.1)
        started[-1].kill()
    part = supervise.PARTS["selfproc"]
    wait_until(lambda: part.state == "off", 10, what="giving up")
    assert part.restarts == 1 and len(started) == 2
    kept.close()


def test_control_thread_serves_again_after_a_crash(tmp_path):
    server = ControlServer(
        tmp_path / "s.sock", snapshot=lambda: {"state": "RUNNING"}, command=lambda req: {"ok": True}
    )
    accept = server._accept
    crashes = []

    def crash_once(*a):
        if not crashes:
            crashes.append(1)
            raise OSError("injected")
        return accept(*a)

    server._accept = crash_once
    server.start()
    try:
        with socket.socket(socket.AF_UNIX) as s:  # taken down with the crash
            s.connect(str(server.path))
        reply = wait_until(lambda: _status(server.path), 10, what="a status reply after the crash")
        assert reply["status"]["state"] == "RUNNING"
        assert supervise.report()["control"]["restarts"] == 1
    finally:
        server.close()


def _status(path):
    try:
        return client.request(path, {"version": protocol.VERSION, "command": "status"}, timeout=2)
    except protocol.ControlError:
        return None


def test_tee_thread_echoes_again_after_a_crash(tmp_path):
    out = io.StringIO()
    tee = Tee(out, interval=0.01, idle_interval=0.01)
    pump = tee._pump
    crashes = []

    def crash_once(*a, **kw):
        if not crashes:
            crashes.append(1)
            raise OSError("injected")
        return pump(*a, **kw)

    tee._pump = crash_once
    log = tmp_path / "rank0.log"
    log.write_bytes(b"")
    tee.follow(log, "[rank0]: ")
    tee.start()
    try:
        with open(log, "ab") as f:
            f.write(b"hello\n")
        wait_until(
            lambda: "[rank0]: hello" in out.getvalue(), 10, what="the line echoed after the crash"
        )
        assert crashes and supervise.report()["tee"]["restarts"] == 1
    finally:
        tee.close()
