"""The hang deadline learned from the job: how long a rank may go without a beat, from the gaps
between beats this node's ranks have shown, so that nobody has to guess --heartbeat-timeout. Pure:
beats in, seconds out (tests/unit/daemon/test_deadlines.py runs 10,000 heavy-tailed steps through
it).

`StepTimes.observe` takes each rank's heartbeat as the loop reads it (every monitor_interval):
where its count went up by k since the last reading, the time between its latest beats is one
sample of weight k (an upper bound of each of those k gaps: the loop does not see them one by
one). Samples go into a log-spaced histogram (a quarter octave a bucket) kept for the daemon's
life, across attempts, with the longest gap seen.

`deadline(ceiling)`: until WARMUP steps per rank are seen, the ceiling (--heartbeat-timeout)
rules; then max(2 x p99, LONGEST x the longest gap seen), never under FLOOR, never over the
ceiling. The p99 is the issue's rule for a job whose steps are regular; the longest gap keeps a
job with a tail (a data stall, a periodic long step) from being called hung at its next slow
step, which a p99 alone would do about once per 300 steps of a log-normal tail. The deadline
is a suspicion, not a verdict: group.py declares a hang past it only with evidence (the rank
stopped, or idle while the others wait in a collective: daemon/group.py `_suspect`).
A rank stopped by a signal (state T) is its own evidence, and a job's tail is no excuse for it:
its deadline is `Deadline.stopped`, 2 x p99 alone less the loop's tick (it is acted on within a
tick of passing it), never under STOP_FLOOR: the rank is named within 2 x p99 of its stop, also
where a tail puts the job's deadline over the ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOOR = 1.0  # seconds: the least learned deadline (a loaded host's pauses, the loop's tick)
STOP_FLOOR = 0.2  # seconds: the least for a rank stopped by a signal (two of the loop's ticks)
WARMUP = 50  # steps per rank (pooled over the node's ranks) before the deadline is learned
RANK_WARMUP = 10  # beats of a rank in its attempt before the learned deadline judges it
P99_TIMES = 2.0
LONGEST = 3.0  # times the longest gap seen
_PER_OCTAVE = 4
_LOW = 1e-3  # seconds: the first bucket's upper bound
_BUCKETS = 4 * 24  # up to about 4.6 hours


def _bucket(gap: float) -> int:
    if gap <= _LOW:
        return 0
    return min(_BUCKETS - 1, math.ceil(math.log2(gap / _LOW) * _PER_OCTAVE))


def _upper(index: int) -> float:
    return _LOW * 2 ** (index / _PER_OCTAVE)


@dataclass(frozen=True)
class Deadline:
    seconds: float
    learned: bool  # False: the ceiling rules (warming up, or the learned one would be above it)
    p99: float = 0.0
    longest: float = 0.0
    steps: int = 0
    stopped: float = 0.0  # the deadline of a rank stopped by a signal (state T); 0: `seconds`

    @property
    def for_stopped(self) -> float:
        return self.stopped or self.seconds

    def basis(self, stopped: bool = False) -> str:
        """How it was made, for the hang's reason and the events."""
        if not (self.learned or (stopped and self.stopped)):
            return f"heartbeat timeout {self.seconds:g}s"
        if stopped:
            return (
                f"a stopped rank's deadline {self.for_stopped:.2f}s: 2 x p99 {self.p99:.3f}s less "
                "a tick, "
                f"floor {STOP_FLOOR:g}s, over {self.steps} steps"
            )
        return (
            f"the job's deadline {self.seconds:.2f}s: 2 x p99 {self.p99:.3f}s, "
            f"{LONGEST:g} x longest {self.longest:.3f}s, floor {FLOOR:g}s, over {self.steps} steps"
        )


class StepTimes:
    """The gaps between beats of this node's ranks (see the module's docstring)."""

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.total = 0
        self.longest = 0.0
        self._last: dict[int, tuple[int, float]] = {}  # key (a worker's pid) -> (beats, last)

    def observe(self, key: int, beats: int, last: float, since: float = 0.0) -> None:
        """One reading of a rank's heartbeat (its count and latest beat's time). A gap that
        began before `since` (the group re-formed in place then) is a recovery's, not a step's:
        a survivor keeps its pid and its count across it, and taken as a step it made a job
        whose recoveries took a second or more (LONGEST x, over the ceiling) lose its learned
        deadline for good, a stopped rank's too (the chaos soak's SIGSTOPs found at the 3 s
        ceiling, not at 2 x p99, after its first slow recovery)."""
        if beats <= 0:
            return
        prev = self._last.get(key)
        self._last[key] = (beats, last)
        if prev is None or beats <= prev[0] or last <= prev[1] or prev[1] < since:
            return
        self.add(last - prev[1], beats - prev[0])

    def add(self, gap: float, weight: int = 1) -> None:
        self.counts[_bucket(gap)] += weight
        self.total += weight
        self.longest = max(self.longest, gap)

    def forget(self, keys: set[int]) -> None:
        """Drop the readings of ranks no longer running (their pids), keeping what they taught."""
        for key in set(self._last) - keys:
            del self._last[key]

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the q-th quantile (0 with no sample)."""
        if not self.total:
            return 0.0
        want, seen = q * self.total, 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= want:
                return _upper(i)
        return _upper(_BUCKETS - 1)

    def deadline(self, ceiling: float, ranks: int, tick: float = 0.0) -> Deadline:
        """The deadline now, for a node of `ranks` ranks looked at every `tick` seconds (see the
        module's docstring)."""
        steps = self.total // max(1, ranks)
        if steps < WARMUP:
            return Deadline(ceiling, False, steps=steps)
        p99 = self.quantile(0.99)
        seconds = max(FLOOR, P99_TIMES * p99, LONGEST * self.longest)
        stopped = max(STOP_FLOOR, P99_TIMES * p99 - tick)
        if seconds >= ceiling:  # the ceiling rules a silent rank; a stopped one's stands
            return Deadline(
                ceiling, False, p99, self.longest, steps, stopped if stopped < ceiling else 0.0
            )
        return Deadline(seconds, True, p99, self.longest, steps, min(stopped, seconds))
