"""elasticd's own parts kept alive: the fork server, the guard, the control and tee threads.

An OOM killer picks exactly the fork server (torch imported, a large RSS); a bug can end a thread.
Each part that dies is noticed, logged and started again after an exponential backoff; after
GIVE_UP_AFTER failures within GIVE_UP_WINDOW seconds it is left off (a part that keeps dying at once
would only burn CPU), with one event and its state in status (`parts`, from `report()`). A `Part` is
up, restarting or off; by default it gives up after 5 failures in 10 minutes. `thread()` does this
for a thread's function, `Kept` for a helper process watched through its stdin pipe; the spare pool
does it for the fork server with a `Part` of its own.
"""

from __future__ import annotations

import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elasticd import logs

log = logs.get("elasticd.supervise")

BACKOFF_FIRST = (
    0.5  # seconds before the first restart, doubled for each failure since (in the window)
)
BACKOFF_MAX = 30.0
GIVE_UP_AFTER = 5  # failures within GIVE_UP_WINDOW seconds: the part is left off
GIVE_UP_WINDOW = 600.0


def _log_event(name: str, level: str = "info", **fields: Any) -> None:
    getattr(log, level)(name, **fields)


@dataclass
class Part:
    """One part's health: `up`, `restarting` (dead, backoff running) or `off` (given up, or
    unfit)."""

    name: str
    event: Callable[..., None] = _log_event  # Agent.event once the agent wires it (see report_to)
    limit: int = GIVE_UP_AFTER
    window: float = GIVE_UP_WINDOW
    risk: str = ""  # what is at stake while it is down, said in its events
    state: str = "up"
    restarts: int = 0
    why: str = ""
    failures: list[float] = field(default_factory=list)  # monotonic times, within the window

    def failed(self, why: str) -> float | None:
        """It died: the seconds to wait before starting it again, or None to give up."""
        now = time.monotonic()
        self.failures = [t for t in self.failures if now - t < self.window] + [now]
        self.why = why
        if len(self.failures) >= self.limit:
            self.off(f"{why}; gave up after {len(self.failures)} failures in {self.window:g}s")
            return None
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (len(self.failures) - 1))
        self.state = "restarting"
        self.event(
            f"{self.name}_died",
            level="warning",
            why=why,
            restart_in=delay,
            failures=len(self.failures),
            **self._risk(),
        )
        return delay

    def restarted(self) -> None:
        self.state = "up"
        self.restarts += 1
        self.event(f"{self.name}_restarted", restarts=self.restarts)

    def off(self, why: str, level: str = "error") -> None:
        self.state, self.why = "off", why
        self.event(f"{self.name}_off", level=level, reason=why, **self._risk())

    def _risk(self) -> dict[str, str]:
        return {"risk": self.risk} if self.risk else {}

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "restarts": self.restarts, "why": self.why}


PARTS: dict[str, Part] = {}  # this daemon process's parts, by name, for status


def part(name: str, **kw: Any) -> Part:
    """A new Part registered for status under `name` (a later one of the same name replaces it)."""
    kw.setdefault("event", _sink[0])
    PARTS[name] = p = Part(name, **kw)
    return p


_sink: list[Callable[..., None]] = [_log_event]  # where new parts report their events


def report_to(event: Callable[..., None]) -> None:
    """Route the parts' events through `event` (Agent.event: logged and shown in status)."""
    for p in PARTS.values():
        p.event = event
    _sink[0] = event


def report() -> dict[str, dict[str, Any]]:
    return {name: p.status() for name, p in sorted(PARTS.items())}


def thread(name: str, run: Callable[[], None], **kw: Any) -> threading.Thread:
    """A daemon thread running `run` until it returns; if it raises, `run` is started again after
    the part's backoff, until the part gives up. Started by the caller."""
    p = part(name, **kw)

    def supervised() -> None:
        while True:
            try:
                run()
                return
            except Exception as e:  # noqa: BLE001 - the part's failure, logged by Part.failed
                delay = p.failed(repr(e))
            if delay is None:
                return
            time.sleep(delay)
            p.restarted()

    return threading.Thread(target=supervised, name=f"elasticd-{name}", daemon=True)


class ProcessDied(Exception):
    pass


class Kept:
    """A helper process that must always be there (the guard): started by `start()` with a pipe on
    its stdin, which we hold; the pipe reports an error once the process is gone, however it died,
    and the watching thread then starts another (see `thread`)."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen], **kw: Any) -> None:
        self._start = start
        self.proc = start()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = thread(name, self._watch, **kw)
        self._thread.start()

    def _watch(self) -> None:
        if self.proc.poll() is not None:  # died before: this is a restart
            self.proc = self._start()
        assert self.proc.stdin is not None
        poller = select.poll()
        poller.register(self.proc.stdin.fileno(), select.POLLERR)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._stop_r:
                    return
                code = self.proc.wait()
                raise ProcessDied(f"pid {self.proc.pid} ended with {code}")

    def close(self, timeout: float = 10.0) -> None:
        """Stop watching, then close its pipe (the guard exits on that) and wait for it."""
        os.write(self._stop_w, b"x")
        self._thread.join(timeout)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
