"""Running as a service: status/stop over the control socket, admission, sd_notify, the unit file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.control import client, protocol
from elasticd.control.server import ControlServer
from harness import ROOT, script


def test_unadmitted_user_is_refused(tmp_path):
    sockdir = Path("/tmp") / f"elasticd-test-{os.getpid()}"
    sockdir.mkdir(mode=0o755, exist_ok=True)
    path = sockdir / "c.sock"
    server = ControlServer(
        path, snapshot=lambda: {"state": "RUNNING"}, command=lambda r: {"ok": True}
    )
    server.start()
    try:
        assert (path.stat().st_mode & 0o777) == 0o600
        os.chmod(path, 0o666)  # let the file through: the credential check alone must refuse
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.setgid(65534)
                os.setuid(65534)
                reply = client.request(path, {"version": 1, "command": "status"}, timeout=5)
                os.write(w, json.dumps(reply).encode())
            finally:
                os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        reply = json.loads(os.read(r, 65536) or b"{}")
        assert reply.get("ok") is False and "permission denied: uid 65534" in reply.get(
            "error", ""
        ), reply
        # root (us) is admitted
        assert (
            client.request(path, {"version": 1, "command": "status"})["status"]["state"]
            == "RUNNING"
        )
    finally:
        server.close()
        shutil.rmtree(sockdir, ignore_errors=True)
    assert not path.exists()


def test_protocol_errors_and_live_socket_refused(tmp_path):
    path = tmp_path / "c.sock"
    seen = []
    server = ControlServer(
        path,
        snapshot=lambda: {"state": "RUNNING"},
        command=lambda r: seen.append(r) or {"ok": True, "accepted": "stop"},
    )
    server.start()
    try:
        assert client.request(path, {"version": 2, "command": "status"})["error"].startswith(
            "unsupported protocol"
        )
        assert (
            "unknown command" in client.request(path, {"version": 1, "command": "reboot"})["error"]
        )
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
            s.sendall(b"not json\n")
            assert b"not a JSON object" in s.recv(4096)
        assert (
            client.request(path, {"version": 1, "command": "stop", "timeout": 3})["accepted"]
            == "stop"
        )
        assert seen and seen[0]["timeout"] == 3
        with pytest.raises(protocol.ControlError, match="another elasticd is running"):
            ControlServer(path, snapshot=dict, command=dict).start()
    finally:
        server.close()
    with pytest.raises(protocol.NoDaemon):
        client.request(path, {"version": 1, "command": "status"})
    # a stale socket file (no daemon behind it) is replaced
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    server = ControlServer(path, snapshot=lambda: {"state": "X"}, command=dict)
    server.start()
    assert client.request(path, {"version": 1, "command": "status"})["status"]["state"] == "X"
    server.close()


def _notify_socket(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    s.bind(str(path))
    s.settimeout(0.2)
    return s, path


def _drain(s, seconds):
    msgs, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            msgs.append(s.recv(4096).decode())
        except TimeoutError:
            pass
    return msgs


def test_sd_notify_stopping_and_stalled_loop_starves_watchdog(tmp_path):
    """The watchdog is fed by the main loop only: stall the loop (its snapshot hook sleeps) and
    the pings stop while the daemon's other threads go on; STOPPING=1 comes on stop."""
    s, path = _notify_socket(tmp_path)
    stall = tmp_path / "stall"
    prog = f"""
import sys, time, pathlib
from elasticd import config, logs
from elasticd.daemon import preflight, systemd
from elasticd.daemon.agent import Agent
cfg = config.build({{"entrypoint": {script("silent.py")!r}, "args": ["60"], "nproc_per_node": 1,
                     "stop_grace": 1, "warm_spawn": False}})
logs.setup("json")
def hook(snap):
    while pathlib.Path({str(stall)!r}).exists():
        time.sleep(0.05)
a = Agent(cfg, preflight.make_run_dir(pathlib.Path({str(tmp_path)!r}), "run"), on_snapshot=hook)  # as the CLI makes it
a.notify = systemd
a.install_signals()
sys.exit(a.run())
"""
    env = dict(os.environ, NOTIFY_SOCKET=str(path), WATCHDOG_USEC="200000")
    p = subprocess.Popen([sys.executable, "-c", prog], env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        first = time.monotonic() + 60
        while time.monotonic() < first and not any("WATCHDOG=1" in m for m in _drain(s, 0.2)):
            pass  # the loop starts pinging once the daemon is up (torch imported)
        before = [m for m in _drain(s, 2) if "WATCHDOG=1" in m]
        assert len(before) >= 5
        stall.touch()
        time.sleep(0.6)  # let the loop enter the stalled hook
        _drain(s, 0.3)
        during = [m for m in _drain(s, 2) if "WATCHDOG=1" in m]
        stall.unlink()
        after = [m for m in _drain(s, 2) if "WATCHDOG=1" in m]
        assert during == [] and len(after) >= 3
        p.send_signal(signal.SIGTERM)
        msgs = _drain(s, 3)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        s.close()
    flat = [line for m in msgs for line in m.split("\n")]
    assert "STOPPING=1" in flat
    assert any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in flat)
    assert flat.index("STOPPING=1") < max(
        i for i, line in enumerate(flat) if line.startswith("STATUS=STOPPED")
    )


def test_abstract_notify_socket(monkeypatch):
    from elasticd.daemon import systemd

    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"elasticd-test-{os.getpid()}"
    s.bind("\0" + name)
    s.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    assert systemd.ready("hello")
    assert s.recv(100) == b"READY=1\nSTATUS=hello"
    s.close()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert systemd.watchdog() is False
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert systemd.watchdog_interval() is None  # meant for another process
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0


def test_unit_file_verifies_cleanly(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    unit = (ROOT / "systemd" / "elasticd.service").read_text()
    exe = shutil.which("elasticd") or sys.executable
    (tmp_path / "elasticd.service").write_text(unit.replace("/usr/local/bin/elasticd", exe))
    r = subprocess.run(
        [analyze, "verify", str(tmp_path / "elasticd.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    for key in (
        "Type=notify",
        "WatchdogSec=",
        "KillMode=mixed",
        "TimeoutStopSec=",
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
        "RuntimeDirectory=",
        "EnvironmentFile=",
        "LimitMEMLOCK=infinity",
        "LimitNOFILE=",
    ):
        assert key in unit
    settings = [ln for ln in unit.splitlines() if not ln.lstrip().startswith("#")]
    # hardening that would take the GPUs from the workers (see the unit's comments)
    assert not [
        ln
        for ln in settings
        if ln.startswith(
            (
                "PrivateDevices",
                "DevicePolicy",
                "DeviceAllow",
                "ProtectClock",
                "ProtectKernelModules",
                "MemoryDenyWriteExecute",
            )
        )
    ]
