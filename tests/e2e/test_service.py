"""Running as a service: status/stop over the control socket, admission, sd_notify, the unit
file."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elasticd.control import client, protocol
from elasticd.control.server import ControlServer
from harness import ROOT, script, secret_flags, wait_until


def cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_status_and_stop_against_a_running_daemon(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--stop-grace",
        "2",
        args=["--steps", "100000", "--step-time", "0.05"],
    )
    d.wait_for_step(1, 3, timeout=60)
    wait_until(lambda: d.status().returncode == 0, 30, what="status to answer")
    r = d.status()
    assert "elasticd RUNNING" in r.stdout and "restarts 0/3" in r.stdout
    assert "RANK  PID" in r.stdout and "logs " in r.stdout
    j = json.loads(d.status("--json").stdout)
    assert j["state"] == "RUNNING" and j["world_size"] == 2 and len(j["workers"]) == 2
    assert {w["rank"] for w in j["workers"]} == {0, 1} and all(w["pid"] for w in j["workers"])
    assert j["workers"][0]["rss_bytes"] > 0
    t0 = time.monotonic()
    r = cli("stop", "--socket", str(d.socket), "--timeout", "2")
    assert r.returncode == 0, r.stderr
    assert d.wait(30) == 0
    assert time.monotonic() - t0 < 15
    assert not d.socket.exists()
    # no daemon any more: status says so with LSB code 3; stop succeeds
    r = d.status()
    assert r.returncode == 3 and "not running" in r.stdout
    assert cli("stop", "--socket", str(d.socket)).returncode == 0


def test_stacks_shows_every_workers_threads_and_the_job_goes_on(daemons, tmp_path):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--stop-grace",
        "2",
        args=["--steps", "100000", "--step-time", "0.05"],
    )
    d.wait_for_step(1, 3, timeout=60)
    wait_until(lambda: d.status().returncode == 0, 30, what="status to answer")
    pids = d.worker_pids()
    r = cli("stacks", "--socket", str(d.socket))
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"=== rank {rank} (local rank {rank}, pid {pids[rank]};" in r.stdout, r.stdout
    sections = r.stdout.split("=== rank ")[1:]
    assert all('faulty.py", line' in sec and "in main" in sec for sec in sections), (
        r.stdout
    )  # where each is now
    # and each rank's collectives, from torch's Flight Recorder (daemon/collective_seq.py)
    assert all(re.search(r"^collectives: default_pg: ", sec, re.M) for sec in sections), r.stdout
    with ThreadPoolExecutor(8) as pool:  # asked at once: one dump answers them together
        replies = list(
            pool.map(
                lambda _: client.request(d.socket, {"version": 1, "command": "stacks"}, timeout=20),
                range(8),
            )
        )
    assert all(r["ok"] and len(r["stacks"]) == 2 for r in replies)
    assert (
        len([e for e in d.events() if e.get("event") == "stacks_dumped"]) <= 4
    )  # 1 before, 8 asked: 2 or 3
    dumped = json.loads(cli("stacks", "--socket", str(d.socket), "--json").stdout)
    assert [x["rank"] for x in dumped] == [0, 1] and all(
        "thread 0x" in x["text"].lower() for x in dumped
    )
    assert all(
        'faulty.py", line' in Path(x["path"]).read_text() for x in dumped
    )  # kept beside the logs
    d.wait_for_step(
        1, int(re.findall(r"^step (\d+)", d.log_text(1), re.M)[-1]) + 3, timeout=30
    )  # trains on
    assert d.worker_pids() == pids and [e for e in d.events() if e.get("event") == "stacks_dumped"]
    assert cli("stop", "--socket", str(d.socket), "--timeout", "2").returncode == 0
    assert d.wait(30) == 0
    r = cli("stacks", "--socket", str(d.socket))
    assert r.returncode == 3 and "not running" in r.stdout


def test_stacks_before_any_worker_runs_says_so(daemons):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemons(
        script("faulty.py"),
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--join-timeout",
        "60",
        "--stop-grace",
        "2",
        *secret_flags(),
    )  # waits for a second node that never comes
    wait_until(
        lambda: d.status().returncode == 0 and "RENDEZVOUS" in d.status().stdout,
        30,
        what="rendezvous",
    )
    r = cli("stacks", "--socket", str(d.socket))
    assert r.returncode == 4 and "no worker is running right now (state RENDEZVOUS)" in r.stderr, (
        r.stdout,
        r.stderr,
    )
    assert cli("stop", "--socket", str(d.socket), "--timeout", "2").returncode == 0
    assert d.wait(30) == 0


def test_a_second_job_on_the_node_gets_its_own_socket_and_the_cli_finds_both(tmp_path):
    """Two jobs of one user on one node, neither with --socket (torchrun runs both): the second
    daemon listens beside the first; status shows both; stop and stacks ask which one."""
    runtime = tmp_path / "rt"
    env = {k: v for k, v in os.environ.items() if k != "ELASTICD_SOCKET"}
    env["RUNTIME_DIRECTORY"] = str(runtime)  # the default socket directory, as systemd sets it

    def cli_here(*args):
        return subprocess.run(
            [sys.executable, "-m", "elasticd", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=env,
        )

    jobs = []
    try:
        for i in range(2):
            jobs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "elasticd",
                        "run",
                        "--log-dir",
                        str(tmp_path / f"logs{i}"),
                        "--log-format",
                        "json",
                        "--stop-grace",
                        "2",
                        script("faulty.py"),
                        "--steps",
                        "100000",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd=ROOT,
                    env=env,
                    start_new_session=True,
                )
            )
            wait_until(
                lambda: len(list(runtime.glob("*.sock"))) == i + 1, 60, what=f"daemon {i}'s socket"
            )
        first, second = runtime / "control.sock", next(runtime.glob("control-*.sock"))
        r = wait_until(
            lambda: (lambda r: r if r.stdout.count("elasticd RUNNING") == 2 else None)(
                cli_here("status")
            ),
            60,
            what="both daemons running",
        )
        assert (
            r.returncode == 0 and f"socket {first}" in r.stdout and f"socket {second}" in r.stdout
        ), r.stdout
        assert len(set(re.findall(r"run (\w+)", r.stdout))) == 2
        for command in ("stop", "stacks"):
            r = cli_here(command)
            assert (
                r.returncode == 2
                and "2 elasticd daemons run here" in r.stderr
                and str(second) in r.stderr
            )
        for path, job in zip((first, second), jobs):
            assert cli_here("stop", "--socket", str(path), "--timeout", "2").returncode == 0
            assert job.wait(30) == 0
        r = cli_here("status")
        assert r.returncode == 3 and "not running" in r.stdout
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait(10)


def test_sigterm_stops_plain_script_after_grace(daemons, tmp_path):
    # the script ignores SIGTERM: the grace runs out, then SIGKILL; the daemon still exits 0
    d = daemons("tests.scripts.stubborn", "--nproc-per-node", "1", "--stop-grace", "1", args=[])
    wait_until(lambda: "ignoring SIGTERM" in d.log_text(0), 60, what="the script to start")
    t0 = time.monotonic()
    d.kill(signal.SIGTERM)
    assert d.wait(30) == 0
    assert 1.0 <= time.monotonic() - t0 < 10
    ev = [e for e in d.events() if e.get("event") == "workers_stopped"][-1]
    assert ev["exits"] == {"0": -9}


def test_second_signal_forces_the_stop(daemons):
    d = daemons("tests.scripts.stubborn", "--nproc-per-node", "1", "--stop-grace", "60", args=[])
    wait_until(lambda: "ignoring SIGTERM" in d.log_text(0), 60, what="the script to start")
    d.kill(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    d.kill(signal.SIGINT)
    assert d.wait(30) == 0
    assert time.monotonic() - t0 < 10


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


def test_sd_notify_sequence_and_workers_do_not_inherit(daemons, tmp_path):
    s, path = _notify_socket(tmp_path)
    out = tmp_path / "env.json"
    d = daemons(
        "tests.scripts.dump_env",
        "--nproc-per-node",
        "1",
        args=[str(out)],
        env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"},
    )
    # dump_env exits at once; the daemon finishes; stop semantics are covered elsewhere. Drained
    # all along: a full datagram queue (max_dgram_qlen, 10 here) would drop the daemon's sends
    msgs, deadline = [], time.monotonic() + 60
    while d.proc.poll() is None and time.monotonic() < deadline:
        msgs += _drain(s, 0.2)
    assert d.wait(1) == 0
    msgs += _drain(s, 0.5)
    s.close()
    flat = [line for m in msgs for line in m.split("\n")]
    assert flat[0] == "READY=1" and flat[1].startswith("STATUS=")
    assert any(line.startswith("STATUS=RUNNING") for line in flat), flat
    assert flat.count("WATCHDOG=1") >= 2
    env = json.loads(out.read_text().splitlines()[0])
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env


def test_sd_notify_stopping_and_stalled_loop_starves_watchdog(tmp_path):
    """The watchdog is fed by the main loop only: stall the loop (its snapshot hook sleeps) and
    the pings stop while the daemon's other threads go on; STOPPING=1 comes on stop."""
    s, path = _notify_socket(tmp_path)
    stall, running = tmp_path / "stall", tmp_path / "running"
    prog = f"""
import sys, time, pathlib
from elasticd import config, logs
from elasticd.daemon import preflight, systemd
from elasticd.daemon.agent import Agent
cfg = config.build({{"entrypoint": {script("silent.py")!r}, "args": ["60"], "nproc_per_node": 1,
                     "stop_grace": 1, "warm_spawn": False}})
logs.setup("json")
def hook(snap):
    if snap.get("state") == "RUNNING":
        pathlib.Path({str(running)!r}).touch()
    while pathlib.Path({str(stall)!r}).exists():
        time.sleep(0.05)
# as the CLI makes it
a = Agent(cfg, preflight.make_run_dir(pathlib.Path({str(tmp_path)!r}), "run"), on_snapshot=hook)
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
        # the loop publishes (calls the hook) at every turn once the worker runs; before, a
        # start's bounded waits feed the watchdog themselves, and a slow machine stays there
        wait_until(running.exists, 60, what="the worker running")
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
        "RestartPreventExitStatus=2 6 7",
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
