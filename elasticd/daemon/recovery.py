"""What a restart costs (`Recovery`): the backoff before it (the crash streak) and the recovery
timeline after it.

Backoff is for crash loops: its exponent is the number of consecutive failed attempts that never
trained, so a job that trained for hours does not pay 30 s per crash. The timeline marks the
latest restart's steps (monotonic times) and is reported once every new rank has stepped.
"""

from __future__ import annotations

import time

import tenacity

from elasticd.config import Config
from elasticd.reporting.status_snapshot import STEPS
from elasticd.worker import heartbeat


def backoff_delay(cfg: Config, attempt: int) -> float:
    """Exponential backoff with jitter (tenacity's policy) before restart number `attempt`."""
    if cfg.restart_backoff <= 0:
        return 0.0
    wait = tenacity.wait_exponential_jitter(
        multiplier=cfg.restart_backoff, max=cfg.restart_backoff_max, jitter=cfg.restart_backoff
    )
    state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return float(wait(state))


class Recovery:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.marks: dict[str, float] = {}  # the restart under way: step -> monotonic time
        self.last: dict[str, float] | None = None  # the latest recovery, reported
        self.attempt_started = time.monotonic()
        self.crash_streak = 0  # consecutive failed attempts that never trained (backoff exponent)
        self.stepped = False  # every rank of the attempt stepped once (before a rank in place)

    def detected(self) -> None:
        """A failure (or scale event) was detected: a new timeline starts."""
        self.marks = {"detected": time.monotonic()}

    def mark(self, step: str) -> None:
        if self.marks:
            self.marks[step] = time.monotonic()

    def started(self) -> None:
        """A new attempt began (the rendezvous is done)."""
        self.attempt_started = time.monotonic()
        self.stepped = False

    def replaced_in_place(self) -> None:
        """Every rank had stepped when one was replaced in place (daemon/inplace.py checks):
        the attempt trained, whatever its replacement's beats say when the next fault comes
        (else every such fault grew the crash streak: bench/chaos.py --in-place auto waited
        25.6 s of backoff after 10 of them)."""
        self.stepped = True

    def trained(self, beats: list[heartbeat.Beat | None]) -> bool:
        """Did the failed attempt get anywhere? Every rank stepped, or (for a script that never
        beats) it ran longer than the longest backoff."""
        if self.stepped or time.monotonic() - self.attempt_started >= self.cfg.restart_backoff_max:
            return True
        return bool(beats) and all(b and b.beats for b in beats)

    def backoff(self, trained: bool) -> float:
        """The wait before the next round: a trained attempt starts a new crash streak."""
        self.crash_streak = 0 if trained else self.crash_streak + 1
        return backoff_delay(self.cfg, max(1, self.crash_streak))

    def report(self, beats: list[heartbeat.Beat]) -> dict[str, float]:
        """Once every new rank stepped (`beats`, one each): the timeline, which becomes `last`."""
        t = dict(self.marks)
        # the workers' own marks: the slowest rank decides when the group is ready
        for mark in ("pg_ready", "state_loaded"):
            if all(getattr(b, mark) for b in beats):
                t[mark] = max(getattr(b, mark) for b in beats)
        # a rank that stayed in its process (in place) first beat long before: its latest beat
        # (this report comes at the first look that finds every rank stepped since)
        t["first_step"] = max(b.first if b.first >= t["detected"] else b.last for b in beats)
        self.last = {k: round(t[k] - t["detected"], 3) for k in STEPS if k in t}
        self.marks = {}
        return self.last
