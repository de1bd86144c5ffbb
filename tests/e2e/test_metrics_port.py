"""Issue 4: what someone who reaches the metrics port can do to the daemon, with real sockets and
real daemons: idle and slowloris connections cost at most the server's cap of threads and file
descriptors, each for a few seconds, a scrape is still answered at once, and a worker crash
while descriptors are scarce still restarts the job (its teardown never dies of EMFILE)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from elasticd.reporting import metrics, metrics_server
from harness import FAST, RESTART, ROOT, free_port, script, wait_until

IDLE = 400  # connections a test opens and leaves idle
CAP = 32  # the most threads (and descriptors) idle connections may cost: the 16-32


def scrape(port: int, timeout: float = 5.0) -> tuple[str, float]:
    """The metrics page and the seconds it took."""
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode(), time.monotonic() - t0


def scrapes(port: int) -> bool:
    try:
        return bool(scrape(port, 2)[0])
    except OSError:
        return False


def idle_connections(
    port: int, n: int = IDLE, strict: bool = True, within: float = 5.0
) -> list[socket.socket]:
    """`n` connections opened at once (non-blocking, as an attacker would: one after the other,
    a server whose accept queue is full costs a SYN resent a second later each) that never send
    a request. Those not connected `within` seconds fail the test, or (not `strict`) are left
    out."""
    import selectors

    pending: dict[socket.socket, None] = {}
    with selectors.DefaultSelector() as sel:
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            pending[s] = None
            sel.register(s, selectors.EVENT_WRITE)
        conns, failed = [], []
        deadline = time.monotonic() + within
        while pending and time.monotonic() < deadline:
            for key, _ in sel.select(deadline - time.monotonic()):
                s = key.fileobj
                sel.unregister(s)
                del pending[s]
                (failed if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) else conns).append(s)
    close_all([*pending, *failed])
    if strict and len(conns) < n:
        close_all(conns)
        raise AssertionError(
            f"{len(conns)} of {n} connections to the metrics port connected within {within:g} s"
        )
    for s in conns:
        s.setblocking(True)
    return conns


def close_all(conns) -> None:
    for c in conns:
        c.close()


class Pressure:
    """A client that keeps opening connections to a port and holding the latest IDLE of them
    (the oldest closed as it goes): a descriptor the daemon frees is taken again at once, as an
    attacker's would be."""

    def __init__(self, port: int) -> None:
        import collections

        self.port = port
        self.held: collections.deque = collections.deque()
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.held.append(socket.create_connection(("127.0.0.1", self.port), timeout=1))
                self.opened += 1
            except OSError:
                continue
            if len(self.held) > IDLE:
                self.held.popleft().close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        close_all(self.held)


def events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


def no_traceback(d) -> None:
    err = d.stderr()
    assert "Traceback" not in err, err[-4000:]


def test_metrics_server_caps_connections_evicts_idle_ones_and_drops_slowloris():
    """The server itself (in this process, real sockets): idle connections cost at most the cap
    in threads and a fresh scrape is still answered at once; a client trickling its request is
    dropped at the request's deadline; with every slot serving, a new connection is closed at
    once."""
    release = threading.Event()
    slow = {"on": False}
    serving: list[int] = []

    def snapshot():
        if slow["on"]:
            serving.append(1)
            release.wait(10)  # a scrape that takes long: its slot is busy serving
        return {"state": "RUNNING", "run_id": "r", "node": "n"}

    exporter = metrics.Exporter(("127.0.0.1", 0), None, snapshot)
    exporter.start()
    port = exporter._server.server_address[1]  # port 0: the one the kernel chose
    try:
        before = threading.active_count()
        conns = idle_connections(port)
        try:
            time.sleep(0.5)
            assert threading.active_count() <= before + CAP, (before, threading.active_count())
            text, took = scrape(port)
            assert "elasticd_state" in text and took < 1.0, took
        finally:
            close_all(conns)

        trickle = socket.create_connection(("127.0.0.1", port), timeout=10)
        t0 = time.monotonic()
        with pytest.raises(OSError):  # reset or broken pipe once the server dropped it
            for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: abcd":  # 36 bytes, 9 s at this pace
                trickle.send(bytes([byte]))
                time.sleep(0.25)
        dropped_after = time.monotonic() - t0
        trickle.close()
        assert (
            metrics_server.REQUEST_TIMEOUT - 0.5
            < dropped_after
            < metrics_server.REQUEST_TIMEOUT + 2
        ), dropped_after

        slow["on"] = True
        busy = [
            threading.Thread(target=lambda: scrapes(port))
            for _ in range(metrics_server.MAX_CONNECTIONS)
        ]
        for t in busy:
            t.start()
        wait_until(
            lambda: len(serving) == metrics_server.MAX_CONNECTIONS,
            10,
            what="every slot serving a scrape",
        )
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        t0 = time.monotonic()
        assert extra.recv(100) == b"" and time.monotonic() - t0 < 1.0  # closed at once, not queued
        extra.close()
        release.set()
        for t in busy:
            t.join(10)
    finally:
        release.set()
        exporter.close()


def _hold_idle(port: int, pid: int) -> dict:
    """As an unprivileged local user: IDLE connections held open, the daemon's thread count read
    from /proc (world-readable), a scrape timed, then everything closed."""
    conns = idle_connections(port)
    try:
        time.sleep(0.5)
        with open(f"/proc/{pid}/status") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        text, took = scrape(port)
        return {
            "connected": len(conns),
            "threads": threads,
            "scraped": "elasticd_state{node=" in text,
            "took": took,
        }
    finally:
        close_all(conns)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged uid needs root")
def test_idle_connections_to_the_metrics_port_cost_the_daemon_bounded_threads(daemons):
    from harness import as_user

    port = free_port()
    d = daemons(
        script("silent.py"),
        "--nproc-per-node",
        "1",
        *FAST,
        "--metrics-address",
        f"127.0.0.1:{port}",
        args=["60"],
    )
    wait_until(
        lambda: d.worker_pids() and scrapes(port), 60, what="the daemon running and serving metrics"
    )
    threads = psutil.Process(d.pid).num_threads()
    got = as_user(65534, _hold_idle, port, d.pid, timeout=60)
    assert got.get("connected") == IDLE, got
    assert got["threads"] <= threads + CAP and got["scraped"] and got["took"] < 1.0, (threads, got)
    d.kill(signal.SIGTERM)
    assert d.wait(30) == 0, d.stderr()[-3000:]
    assert events(d, "metrics_connection_evicted")  # said once, not 384 times
    assert len(events(d, "metrics_connection_evicted")) == 1
    no_traceback(d)


def test_a_worker_killed_while_file_descriptors_are_scarce_restarts_and_the_job_finishes(daemons):
    """The daemon runs with 128 file descriptors (it uses ~50) while 400 connections are held
    open to its metrics port and more keep coming, and a worker is SIGKILLed: the job restarts
    and exits 0, without a traceback."""
    port = free_port()
    d = daemons(
        script("ops_train.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        *FAST,
        "--metrics-address",
        f"127.0.0.1:{port}",
        args=["--steps", "250", "--step-time", "0.03", "--checkpoint-every", "10"],
        prefix=("prlimit", "--nofile=128:128", "--"),
    )
    d.wait_for_step(1, 3, timeout=60)
    conns = idle_connections(
        port, strict=False
    )  # all of them, once capped (else until it has no fd left)
    pressure = Pressure(port)
    try:
        pids = d.worker_pids()
        assert 1 in pids and d.proc.poll() is None, d.stderr()[
            -3000:
        ]  # the job still runs: kill a worker
        os.kill(pids[1], signal.SIGKILL)
        assert d.wait(60) == 0, d.stderr()[-3000:]
    finally:
        pressure.close()
        close_all(conns)
    no_traceback(d)
    assert len(conns) == IDLE and pressure.opened > 100, (len(conns), pressure.opened)
    assert [e for e in events(d, "state") if e.get("new") == "RESTARTING"]
    assert "done" in d.log_text(0) and "resumed at step 0" not in d.log_text(0)


def test_teardown_that_cannot_read_proc_says_so_and_carries_on(tmp_path):
    """processes.stop with every file descriptor in use (psutil cannot open /proc): the workers'
    sessions are still killed, one line says the sweep failed, nothing raises."""
    code = f"""
import json, os, resource, subprocess, sys, time
from pathlib import Path
from elasticd import logs
from elasticd.daemon import processes, spawn
logs.setup("json")
token = "t" * 32
proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                        start_new_session=True, env=dict(os.environ, ELASTICD_AGENT=token))
time.sleep(0.2)
p = Path({str(tmp_path)!r})
w = spawn.Worker(0, 0, proc, p / "log", p / "err", p / "st", p / "hb", time.monotonic())
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
stuck = processes.stop([w], token, grace=0.5, kill_timeout=1.0)
for fd in held:
    os.close(fd)
print(json.dumps({{"stuck": stuck, "exit": w.exit_code}}))
"""
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {"stuck": [], "exit": -signal.SIGTERM}, result
    failed = [json.loads(ln) for ln in r.stderr.splitlines() if "teardown_sweep_failed" in ln]
    assert len(failed) == 1 and "Too many open files" in failed[0]["error"], r.stderr
