"""A rank silent past the learned deadline (daemon/deadlines.py) is a suspect, not yet a hang:
the evidence that makes it one, taken before anything is killed.

The deadline is learned from gaps the job has shown, so a slow step it has not shown yet (the
first checkpoint save, an evaluation, a data stall) would pass it. A hang is declared at the
learned deadline only where:
- a silent rank is stopped by a signal (state T: SIGSTOP, a terminal's ^Z), or
- a silent rank is idle (asleep, and under IDLE_SHARE of a CPU over the last part of its
  silence: not computing, not starved of a CPU it wants, not in a disk's I/O) and the ranks'
  collectives' sequence numbers (daemon/collective_seq.py) say it never arrived at the
  collective the others wait in, or show a desync; else where the stack dumps (daemon/culprit.py)
  name it the culprit, elsewhere while other ranks wait in a collective, or show a desync.
A rank that computes (a straggler: the sequence numbers show it behind while it uses the CPU) is
left alone. So are idle ranks that all wait in one collective (the culprit is on another node, or
the network holds them: every rank arrived at the same sequence number), or all in the same code
(an evaluation), where the job has no other node; where it has, that silence is a hang to judge
on every node's stacks (`Verdict.across`: daemon/hangs.py asks the other nodes, and a culprit
there that computes, or none, is no hang). What is left alone is said in one event
(`hang_deadline_passed`), and the next look is when the silence has doubled; the ceiling
(--heartbeat-timeout) still ends any silence. A rank stopped by a tracer (state t: gdb, py-spy)
is never judged here.

`Suspicion.sample` takes each live rank's state and CPU time every tick (a few seconds kept);
`judge` decides for the ranks past the deadline, with the dumps taken by the caller only once
a rank is stopped or idle.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elasticd.daemon import collective_seq, culprit

IDLE_SHARE = 0.1  # of one CPU: a rank under it over the window is not computing
IDLE_WINDOW = 2.0  # seconds: the longest stretch of the silence judged (its latest part)
KEPT = 64  # samples kept per rank (6.4 s at the default monitor interval)
_HZ = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Silent:
    """A rank past the deadline: its rank, pid, when it last beat (monotonic), its last step."""

    rank: int
    pid: int
    last: float
    step: int


@dataclass(frozen=True)
class Verdict:
    rank: int  # whom the hang is put on
    why: str  # what the evidence was
    # not proven here: this node's silent ranks idle, every one in one collective or none in any
    # (the culprit may be on another node); judged on every node's stacks (daemon/hangs.py)
    across: bool = False


class Suspicion:
    def __init__(self) -> None:
        self._cpu: dict[int, deque[tuple[float, int]]] = {}  # pid -> (time, CPU ticks)
        self._state: dict[int, str] = {}  # pid -> its latest state letter
        self._next: tuple[tuple[int, float], float] | None = None  # (episode, silence to look)

    def sample(self, pid: int, now: float, found: tuple[str, int] | None) -> None:
        """A rank's state and CPU time (heartbeat.ProcessWatch.sample) at `now`."""
        if found is None:
            return
        self._state[pid] = found[0]
        self._cpu.setdefault(pid, deque(maxlen=KEPT)).append((now, found[1]))

    def forget(self) -> None:
        """A new attempt: its ranks are new processes."""
        self._cpu.clear()
        self._state.clear()
        self._next = None

    def stopped(self, pid: int) -> bool:
        return self._state.get(pid) == "T"

    def idle(self, pid: int, now: float, silence: float) -> bool:
        """Asleep now (not R, running or starved; not D, in a disk's I/O), and under IDLE_SHARE
        of a CPU over the latest min(silence / 2, IDLE_WINDOW) seconds."""
        samples = self._cpu.get(pid)
        if not samples or self._state.get(pid) in ("R", "D"):  # running (or starved), in I/O
            return False
        since = now - min(silence / 2, IDLE_WINDOW)
        start = next((s for s in samples if s[0] >= since), samples[0])
        end = samples[-1]
        span = end[0] - start[0]
        if span <= 0:
            return False
        return (end[1] - start[1]) / _HZ <= IDLE_SHARE * span

    def due(self, first: Silent, now: float) -> bool:
        """Whether to look at this silence now: the first time past the deadline, then once it
        has doubled since the last look (set by `judge`)."""
        episode = (first.pid, first.last)
        return self._next is None or self._next[0] != episode or now - first.last >= self._next[1]

    def judge(
        self,
        silent: list[Silent],
        now: float,
        dumps: Callable[[], list[dict[str, Any]]],
        event: Callable[..., None],
        deadline: str,
        across: bool = False,
    ) -> Verdict | None:
        """The hang among `silent` (past the deadline, longest silent first), or None (the event
        says why not). `dumps` takes every live rank's stacks (daemon/group.py's rows). `across`:
        the job has ranks on other nodes, where an idle rank's silence this node cannot explain
        is a hang to judge on every node's stacks (`Verdict.across`)."""
        first = silent[0]
        silence = now - first.last
        self._next = ((first.pid, first.last), 2 * silence)
        stopped = [s for s in silent if self.stopped(s.pid)]
        idle = {s.rank for s in silent if self.idle(s.pid, now, now - s.last)}
        if stopped:
            dumps()  # its stack, for the record (the dump continues it: it is ended next)
            return Verdict(stopped[0].rank, "stopped by a signal (state T)")
        if not idle:
            event(first, "busy: every silent rank uses the CPU", deadline)
            return None
        rows = dumps()
        seqs = collective_seq.judge(
            {r["rank"]: collective_seq.parse_compact(r.get("collectives", "")) for r in rows}
        )
        wheres = {r["rank"]: culprit.where(r["text"]) if r.get("text") else None for r in rows}
        behind = culprit.roots_first((r for r in seqs.culprits if r in idle), wheres)
        if seqs.decides and (behind or seqs.kind == "desync"):
            return Verdict(behind[0] if behind else first.rank, f"idle; {seqs.text}")
        if seqs.decides:  # behind, and computing: a straggler (or a long step), not a hang
            event(first, f"busy: {seqs.text}; it uses the CPU (a straggler?)", deadline)
            return None
        verdict = culprit.judge_hang(wheres)
        named = [r for r in verdict.culprits if r in idle]
        if named or verdict.desync:
            return Verdict(named[0] if named else first.rank, f"idle; {verdict.text}")
        if verdict.culprits:
            event(first, f"busy: its culprit uses the CPU ({verdict.text})", deadline)
            return None
        if across:  # every idle rank waits on another node's, or another node's wait on it
            rank = next(s.rank for s in silent if s.rank in idle)
            return Verdict(rank, f"idle; {verdict.text}; judged on every node's stacks", True)
        event(first, f"not a hang by the stacks: {verdict.text}", deadline)
        return None
