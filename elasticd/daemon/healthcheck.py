"""Node health checks (`HealthCheck`): `--health-check CMD`, an executable run before every start
and restart and every --health-check-interval while training; the summary a leaving node
broadcasts, the line it exits with, and the peers that left, as every node's status shows them.

A check passes when it exits 0 within --health-check-timeout; its last line of output is the reason
shown when it fails (only the last OUTPUT_KEPT bytes are kept: a check printing 100 MB costs the
daemon 64 KiB). It runs on a helper thread (the loop never waits on it, except before a start, where
the loop idles as it does for a rendezvous: stoppable, feeding the watchdog), in its own session,
with the daemon's token in its environment (so a SIGKILLed daemon's guard ends it too), without
systemd's notify socket. What is waited for is the check process itself (through a pidfd), not the
end of its output: whatever it leaves running in its session (a background child holding the pipe)
is killed and said, and a teardown's sweep spares that session while the check runs (`sessions`).

What a failing check does is the agent's (Agent._leave): the node stops its workers, asks the
other nodes to restart with the reason as the restart's summary (so every node's status shows
it, see `peer_left`), and exits 5. Before it ever joined it just does not join: a fixed-size job
waits for it; an elastic job goes on without it.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import psutil

from elasticd import logs, names
from elasticd.config import Config
from elasticd.daemon import systemd
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.reporting.status_snapshot import HealthResult as Result

MAX_REASON = 300  # characters of the check's output kept as its reason
OUTPUT_KEPT = 64 * 1024  # bytes of the check's output kept (its end, where the last line is)
REAP_WAIT = 5.0  # seconds to wait for killed processes to go
# in the summary a leaving node broadcasts ("node N left the job: health check failed: ...")
LEFT = "left the job: health check failed"


class HealthCheck:
    def __init__(
        self, cfg: Config, token: str, event: Callable[..., None], wake: Callable[[], None]
    ) -> None:
        self.cfg = cfg
        self.argv = shlex.split(cfg.health_check) if cfg.health_check else []
        self.token = token
        self.event = event  # Agent.event: logged and shown in status
        self.wake = wake  # wakes the agent loop when a check finishes
        self.last: Result | None = None
        self.runs = 0
        self.failures = 0
        self.peers_left: list[dict[str, Any]] = []  # other nodes that left after failing theirs
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._fresh: Result | None = None  # finished and not yet taken
        self._next = 0.0  # monotonic: when the periodic check is due
        self._closed = False

    @property
    def on(self) -> bool:
        return bool(self.argv)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin(self) -> None:
        """Start a check unless one is running (its result will do)."""
        if not self.on or self.running or self._closed:
            return
        self._next = time.monotonic() + self.cfg.health_check_interval
        self._thread = threading.Thread(target=self._run, name="elasticd-health-check", daemon=True)
        self._thread.start()

    def pids(self) -> frozenset[int]:
        """The check running now, which a teardown's sweep must leave to its own thread to reap."""
        proc = self._proc
        return frozenset({proc.pid}) if proc is not None else frozenset()

    def sessions(self) -> frozenset[int]:
        """The session of the check running now (it leads its own: its id is the check's pid),
        whose processes carry the daemon's token but are the check's, never a worker's."""
        return self.pids()

    def take(self) -> Result | None:
        """The result of the latest check that finished since the last take(), if any."""
        result, self._fresh = self._fresh, None
        return result

    def poll(self, now: float) -> Result | None:
        """While training: a failed result to act on, starting the next check when it is due."""
        if not self.on:
            return None
        result = self.take()
        if result is None and self.cfg.health_check_interval > 0 and now >= self._next:
            self.begin()
        return result if result and not result.ok else None

    def _run(self) -> None:
        t0 = time.monotonic()
        env = systemd.child_env(dict(os.environ))
        env[names.AGENT] = self.token
        try:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            self._finish(False, f"`{self.cfg.health_check}` cannot run: {e.strerror or e}", "", t0)
            return
        self._proc = proc
        try:
            output, exited = _collect(proc, t0 + self.cfg.health_check_timeout)
            left = _end_session(
                proc
            )  # the check has exited (a zombie until reaped here) or timed out
        finally:
            assert proc.stdout is not None
            proc.stdout.close()
            self._proc = None
        if self._closed:
            return  # ended by close(): the daemon is leaving, it judges nothing any more
        if not exited:
            self._finish(
                False,
                f"`{self.cfg.health_check}` timed out after {self.cfg.health_check_timeout:g}s",
                "",
                t0,
            )
            return
        lines = [ln.strip() for ln in output.decode(errors="replace").splitlines() if ln.strip()]
        last = logs.printable(lines[-1])[:MAX_REASON] if lines else ""
        behind = f" (left {len(left)} process(es) behind, killed)" if left else ""
        if left:
            self.event(
                "health_check_left_processes",
                level="warning",
                pids=left[:10],
                killed=len(left),
                hint="the check exited with these still in its session; make it wait for them",
            )
        if proc.returncode == 0:
            self._finish(True, "passed" + behind, last, t0)
        else:
            how = (
                f"was killed by {_signal_name(-proc.returncode)}"
                if proc.returncode < 0
                else f"exited {proc.returncode}"
            )
            self._finish(
                False,
                f"`{self.cfg.health_check}` {how}" + (f": {last}" if last else "") + behind,
                last,
                t0,
            )

    def _finish(self, ok: bool, reason: str, output: str, t0: float) -> None:
        result = Result(ok, reason, output, round(time.monotonic() - t0, 3), time.time())
        self.runs += 1
        if not ok:
            self.failures += 1
            self.event("health_check_failed", level="error", reason=reason, seconds=result.seconds)
        elif self.last is None or not self.last.ok:
            self.event("health_check_passed", output=output, seconds=result.seconds)
        self.last = self._fresh = result
        self.wake()

    def failure(self, result: Result, node: str) -> Failure:
        return Failure(RestartCause.HEALTH, f"health check failed: {result.reason}", node=node)

    def left_summary(self, result: Result, node: str) -> str:
        """What a leaving node asks the others to restart with (their status shows it)."""
        return f"node {node} {LEFT}: {result.reason}"

    def left_line(self, why: Failure, joined: bool) -> str:
        """The one line a node that leaves exits with (daemon/serve.py writes it to stderr)."""
        if joined:
            return f"elasticd: this node left the job: {why.reason}"
        return f"elasticd: not starting: this node's {why.reason}"

    def peer_left(self, why: Failure) -> None:
        """A restart another node asked for: note it if that node left after failing its check."""
        if why.kind is RestartCause.PEER and LEFT in why.reason:
            reason = why.reason.split(f"{LEFT}: ", 1)[-1]
            self.peers_left = [
                *self.peers_left[-4:],
                {"node": why.node, "reason": reason, "at": why.at},
            ]

    def report(self) -> dict[str, Any]:
        """Status's `health`."""
        last = asdict(self.last) if self.last else None
        state = (
            "off"
            if not self.on
            else "unknown"
            if self.last is None
            else "passing"
            if self.last.ok
            else "failing"
        )
        return {
            "check": self.cfg.health_check or None,
            "state": state,
            "interval": self.cfg.health_check_interval,
            "runs": self.runs,
            "failures": self.failures,
            "last": last,
            "running": self.running,
            "peers_left": list(self.peers_left),
        }

    def close(self) -> None:
        """The daemon is leaving: end a check still running (its thread reaps it)."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(
                    proc.pid, signal.SIGKILL
                )  # its own session's group: whatever it started too


def _collect(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bool]:
    """The end of the check's output (its last OUTPUT_KEPT bytes) and whether it exited before
    the deadline. What is waited for is the check process (its pidfd), not the end of the pipe,
    which a child it left running may hold for ever; the check is left a zombie, so that its
    session cannot be mistaken for another (see _end_session)."""
    assert proc.stdout is not None
    out = proc.stdout.fileno()
    os.set_blocking(out, False)
    tail = bytearray()
    exit_fd = _pidfd(proc.pid)
    with selectors.DefaultSelector() as sel:
        sel.register(out, selectors.EVENT_READ)
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ)
        try:
            while not _exited(proc.pid):
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(tail), False
                for key, _ in sel.select(left if exit_fd is not None else min(left, 0.05)):
                    if key.fd == out and not _read(out, tail):
                        sel.unregister(out)  # its end: only the exit is left to wait for
            while time.monotonic() < deadline and _read(out, tail, drain=True):
                pass  # what it wrote before exiting (none of it waits for a writer)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)
    return bytes(tail), True


def _pidfd(pid: int) -> int | None:
    """A descriptor readable once `pid` exits (Linux 5.3); None: the exit is polled."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exited(pid: int) -> bool:
    """Whether our child `pid` has exited, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _read(fd: int, tail: bytearray, drain: bool = False) -> bool:
    """One read of the pipe into `tail`, which keeps its last OUTPUT_KEPT bytes; False at the
    pipe's end, or (`drain`) when nothing is there now."""
    try:
        chunk = os.read(fd, OUTPUT_KEPT)
    except BlockingIOError:
        return not drain
    except OSError:
        return False
    tail += chunk
    del tail[:-OUTPUT_KEPT]
    return bool(chunk)


def _end_session(proc: subprocess.Popen) -> list[int]:
    """Kill every process left in the check's session (the check's pid names it) and reap the
    check; the pids killed besides the check itself."""
    found = []
    try:
        for p in psutil.process_iter():
            with contextlib.suppress(OSError):
                if os.getsid(p.pid) == proc.pid:
                    found.append(p)
    except (OSError, psutil.Error):  # /proc unreadable (no descriptor left): its group still goes
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in found:
        with contextlib.suppress(OSError, psutil.Error):
            p.kill()
    with contextlib.suppress(OSError, psutil.Error):
        psutil.wait_procs(
            [p for p in found if p.pid != proc.pid], timeout=REAP_WAIT
        )  # ours once orphaned
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=REAP_WAIT)
    return [p.pid for p in found if p.pid != proc.pid]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
