"""Node health checks: `--health-check CMD`, an executable run before every start and restart
and every --health-check-interval while training.

A check passes when it exits 0 within --health-check-timeout; its last line of output is the
reason shown when it fails. It runs on a helper thread (the loop never waits on it, except
before a start, where the loop idles as it does for a rendezvous: stoppable, feeding the
watchdog), in its own session, with the daemon's token in its environment (so a SIGKILLed
daemon's guard ends it too), without systemd's notify socket.

What a failing check does is the agent's (Agent._leave): the node stops its workers, asks the
other nodes to restart with the reason as the restart's summary (so every node's status shows
it, see `peer_left`), and exits 5. Before it ever joined it just does not join: a fixed-size job
waits for it; an elastic job goes on without it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from elasticd import logs, names, systemd
from elasticd.config import Config
from elasticd.states import Failure, RestartCause

EXIT_UNHEALTHY = 5  # `elasticd run`'s exit code when this node's health check failed
MAX_REASON = 300  # characters of the check's output kept as its reason
# in the summary a leaving node broadcasts ("node N left the job: health check failed: ...")
LEFT = "left the job: health check failed"


@dataclass(frozen=True)
class Result:
    ok: bool
    reason: str  # "passed" or why it failed: exit code or signal, and its last line of output
    output: str  # its last line of output (escaped, cut)
    seconds: float
    at: float  # wall-clock time it finished


class HealthCheck:
    def __init__(self, cfg: Config, token: str, event: Callable[..., None], wake: Callable[[], None]) -> None:
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
            self._proc = proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            self._finish(False, f"`{self.cfg.health_check}` cannot run: {e.strerror or e}", "", t0)
            return
        try:
            out, _ = proc.communicate(timeout=self.cfg.health_check_timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out = b""
            self._finish(False, f"`{self.cfg.health_check}` timed out after {self.cfg.health_check_timeout:g}s",
                         "", t0)
            return
        finally:
            self._proc = None
        lines = [ln.strip() for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        last = logs.printable(lines[-1])[:MAX_REASON] if lines else ""
        if proc.returncode == 0:
            self._finish(True, "passed", last, t0)
        else:
            how = (f"was killed by {_signal_name(-proc.returncode)}" if proc.returncode < 0
                   else f"exited {proc.returncode}")
            self._finish(False, f"`{self.cfg.health_check}` {how}" + (f": {last}" if last else ""), last, t0)

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

    def peer_left(self, why: Failure) -> None:
        """A restart another node asked for: note it if that node left after failing its check."""
        if why.kind is RestartCause.PEER and LEFT in why.reason:
            reason = why.reason.split(f"{LEFT}: ", 1)[-1]
            self.peers_left = [*self.peers_left[-4:], {"node": why.node, "reason": reason, "at": why.at}]

    def report(self) -> dict[str, Any]:
        """Status's `health`."""
        last = asdict(self.last) if self.last else None
        state = "off" if not self.on else "unknown" if self.last is None else "passing" if self.last.ok else "failing"
        return {"check": self.cfg.health_check or None, "state": state, "interval": self.cfg.health_check_interval,
                "runs": self.runs, "failures": self.failures, "last": last, "running": self.running,
                "peers_left": list(self.peers_left)}

    def close(self) -> None:
        """The daemon is leaving: end a check still running."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: whatever it started too
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
