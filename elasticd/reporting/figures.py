"""The job's figures as this node sees them (`Figures`), for status and metrics: restarts by
cause (`CAUSES`: the label of every RestartCause that restarts), each
recovery's time, steps lost, goodput, step times, and what checkpoints and in-memory refreshes
cost.

The agent loop feeds it (hooks: on_restart, on_recovered, observe at every status publish) and
it reads nothing itself but the heartbeats it is handed: the workers' own clock marks (first and
last beat) and the running figures the worker side writes into its heartbeat file
(heartbeat.FIGURES: its own work per step, the step resumed from, save and refresh costs).

Definitions (docs/metrics.md, "How the figures are reckoned"):
- productive time: per attempt, from the moment every local rank has stepped to the latest beat
  of any of them (a hang's silence, a start-up, a restart are not productive), less the time of
  the steps lost;
- steps lost by a restart: the last training step this node's ranks reported before it, less the
  step the next attempt resumed from. Known when the script uses elasticd.checkpoint (which
  reports both); otherwise the restart counts as `unknown`, and so do the total steps lost,
  the productive and lost seconds and goodput from then on (None: status says "unknown",
  /metrics leaves the sample out), since a script elasticd cannot see resume may have started
  again from step 0;
- goodput: productive time / wall time since this daemon started.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

from elasticd.lifecycle.states import Failure, RestartCause, Scale
from elasticd.worker import heartbeat

# the causes counted in restarts_total{cause=...}, by label: every one that restarts the group
CAUSES = tuple(cause.label for cause in RestartCause if cause.restarts)
# how a hang inquiry this node asked or answered ended (daemon/hangs.py): a hang (its culprit
# replaced, or the group restarted for it), cleared (no hang: a straggler, or no culprit), or
# none (no verdict in time, or the culprit's node never acted: the group restarted)
INQUIRY_VERDICTS = ("hang", "cleared", "none")
# upper bounds of the recovery histogram's buckets, seconds (+Inf implied)
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SAMPLES = 20  # distinct heartbeat readings a rank's step time is measured over (about 10 s at 2 Hz)
# heartbeat.FIGURES of the checkpoint library that are totals or counts (kept across attempts)
TOTALS = (
    "saves",
    "save_stall_total",
    "save_write_total",
    "refreshes",
    "refresh_total",
    "sdc_audits",
    "audit_total",
)
LASTS = ("save_stall_last", "save_write_last", "refresh_last", "refresh_every")


class _Rate:
    """Seconds per unit from a running (count, total) pair, over its last SAMPLES changes."""

    def __init__(self) -> None:
        self.points: collections.deque = collections.deque(maxlen=SAMPLES)

    def add(self, count: float, total: float) -> None:
        if not self.points or count != self.points[-1][0]:
            self.points.append((count, total))

    def value(self) -> float | None:
        if len(self.points) < 2:
            return None
        (c0, t0), (c1, t1) = self.points[0], self.points[-1]
        return (t1 - t0) / (c1 - c0) if c1 > c0 else None


class Figures:
    def __init__(self, started: float) -> None:
        self.started = started  # monotonic: when the daemon started (the job, for this node)
        self.restarts = dict.fromkeys(CAUSES, 0)
        self.in_place = dict.fromkeys(CAUSES, 0)  # failures recovered in place (daemon/inplace.py)
        self.hang_inquiries = dict.fromkeys(INQUIRY_VERDICTS, 0)  # by how each ended
        self.failures: dict[str, int] = {}  # by class (lifecycle/triage.py's FailureClass values)
        self.recoveries = [0] * (
            len(RECOVERY_BUCKETS) + 1
        )  # per bucket (not cumulative), +Inf last
        self.recovery_sum = 0.0
        self.steps_lost_total = 0
        self.steps_lost_last: int | None = None
        self.steps_lost_unknown = 0  # restarts whose loss could not be told
        self.lost_seconds = 0.0
        self.productive_closed = 0.0  # seconds, attempts that ended
        self._attempt = 0  # the attempt the per-rank state below belongs to
        self._span: tuple[float, float] | None = None  # this attempt's (all stepped, latest beat)
        # a recovery's (step reached, step time, when: monotonic), until every rank of the group
        # after it has loaded its state since (a new attempt's, or a generation's in place)
        self._pending: tuple[int, float, float] | None = None
        self._rates: dict[int, tuple[_Rate, _Rate]] = {}  # local rank -> (step interval, own work)
        self._base = dict.fromkeys(TOTALS, 0.0)  # totals of attempts that ended
        self._now_totals = dict.fromkeys(TOTALS, 0.0)  # this attempt's, as last read
        self._lasts = dict.fromkeys(LASTS, 0.0)
        self.sdc: dict[str, Any] = {}  # the replicas' audit's detections (daemon/sdc.py report)
        self.step: int | None = None
        self.rank_times: dict[
            int, tuple[float | None, float | None]
        ] = {}  # local rank -> (step, work) s

    # --- hooks ---

    def on_hang_inquiry(self, verdict: str) -> None:
        """A hang inquiry this node took part in ended so (INQUIRY_VERDICTS)."""
        self.hang_inquiries[verdict] += 1

    def on_sdc(self, detections: dict[str, Any]) -> None:
        """The replicas' audit's detections so far (daemon/sdc.py `Corruption.report`)."""
        self.sdc = dict(detections)

    def on_restart(
        self,
        why: Failure | Scale,
        beats: list[heartbeat.Beat | None],
        in_place: bool = False,
        now: float | None = None,
    ) -> None:
        """A running group ends early (before its teardown), or `in_place` a failure is recovered
        with its survivors kept (daemon/inplace.py): count the cause, and note the step its ranks
        reached, to tell the steps lost once the group after it has resumed (every rank loaded
        its state after `now`, monotonic as the heartbeat's marks)."""
        if why.kind.restarts:
            (self.in_place if in_place else self.restarts)[why.kind.label] += 1
        if why.kind is not RestartCause.SCALE:
            self.on_failure(why.failure_class)
        reported = [b for b in beats if b and b.state_loaded and b.beats]
        if reported and len(reported) == len(beats):
            reached, at = max(b.step for b in reported), time.monotonic() if now is None else now
            self._pending = (reached, self.step_time() or 0.0, at)
        else:
            self._pending = None
            self.steps_lost_unknown += 1
            self.steps_lost_last = None  # this restart's: not told

    def on_failure(self, failure_class: str) -> None:
        """A failure of this class (counted at its restart, or where it ends the job at once)."""
        self.failures[failure_class] = self.failures.get(failure_class, 0) + 1

    def on_recovered(self, timeline: dict[str, float]) -> None:
        """The latest recovery's timeline (seconds after detection), once every new rank stepped."""
        seconds = timeline.get("first_step")
        if seconds is None:
            return
        self.recovery_sum += seconds
        self.recoveries[
            next(
                (i for i, le in enumerate(RECOVERY_BUCKETS) if seconds <= le), len(RECOVERY_BUCKETS)
            )
        ] += 1

    def observe(
        self, attempt: int, local_ranks: list[int], beats: list[heartbeat.Beat | None], now: float
    ) -> None:
        """The current attempt's workers (local ranks, and their heartbeats as of now)."""
        if attempt != self._attempt:
            self._close_attempt()
            self._attempt = attempt
        if not beats:
            self._close_attempt()
            return
        live = [b for b in beats if b is not None]
        for local_rank, b in zip(local_ranks, beats):
            if b is None:
                continue
            if local_rank not in self._rates:
                self._rates[local_rank] = (_Rate(), _Rate())
                self._rates[local_rank][1].add(0, 0.0)  # from the attempt's start: no work yet
            step_rate, work_rate = self._rates[local_rank]
            if b.beats:
                if not step_rate.points:
                    step_rate.add(
                        1, b.first
                    )  # from its first beat: a figure as soon as it took two steps
                step_rate.add(b.beats, b.last)
            work_rate.add(b.figure("work_steps"), b.figure("work_total"))
            self.rank_times[local_rank] = (step_rate.value(), work_rate.value())
        if len(live) == len(beats) and all(b.beats for b in live):
            self._span = (max(b.first for b in live), max(b.last for b in live))
            self.step = max(b.step for b in live)
        for name in TOTALS:
            self._now_totals[name] = max((b.figure(name) for b in live), default=0.0)
        for name in LASTS:
            values = [b.figure(name) for b in live if b.figure(name)]
            if values:
                self._lasts[name] = max(values)
        if (
            self._pending
            and len(live) == len(beats)
            and all(b.state_loaded >= self._pending[2] for b in live)
        ):  # every rank loaded its state since: a survivor kept in place, run again, too
            reached, step_time, _ = self._pending
            self._pending = None
            lost = max(0, reached - int(min(b.figure("resumed") for b in live)))
            self.steps_lost_last = lost
            self.steps_lost_total += lost
            self.lost_seconds += lost * step_time

    def _close_attempt(self) -> None:
        if self._span:
            self.productive_closed += max(0.0, self._span[1] - self._span[0])
        self._span = None
        for name in TOTALS:
            self._base[name] += self._now_totals[name]
            self._now_totals[name] = 0.0
        self._rates.clear()
        self.rank_times = {}

    # --- what they come to ---

    def step_time(self) -> float | None:
        """The node's step time: the median over its ranks of seconds per step (beat to beat)."""
        times = [s for s, _ in self.rank_times.values() if s is not None]
        return statistics.median(times) if times else None

    def work_time(self) -> float | None:
        """The median over the node's ranks of their own work per step (outside the gradient
        sync)."""
        times = [w for _, w in self.rank_times.values() if w is not None]
        return statistics.median(times) if times else None

    def productive(self) -> float:
        current = max(0.0, self._span[1] - self._span[0]) if self._span else 0.0
        return max(0.0, self.productive_closed + current - self.lost_seconds)

    def report(self, now: float) -> dict[str, Any]:
        """The status snapshot's part (status --json; metrics are made from it)."""
        wall = max(0.0, now - self.started)
        productive = self.productive()
        trained = self.productive_closed > 0 or self._span is not None
        told = not self.steps_lost_unknown  # else what restarts lost is unknown, and so goodput
        totals = {name: self._base[name] + self._now_totals[name] for name in TOTALS}
        step_time, work_time = self.step_time(), self.work_time()
        return {
            "goodput": {
                "ratio": round(min(1.0, productive / wall), 4)
                if told and trained and wall > 0
                else None,
                "productive_seconds": round(productive, 3) if told else None,
                "wall_seconds": round(wall, 3),
                "lost_seconds": round(self.lost_seconds, 3) if told else None,
            },
            "restarts_by_cause": dict(self.restarts),
            "in_place_by_cause": dict(self.in_place),
            "hang_inquiries": dict(self.hang_inquiries),
            "failures_by_class": dict(self.failures),
            "steps_lost": {
                "total": self.steps_lost_total if told else None,
                "last": self.steps_lost_last,
                "unknown": self.steps_lost_unknown,
            },
            "recoveries": {
                "count": sum(self.recoveries),
                "sum": round(self.recovery_sum, 3),
                "buckets": [[le, n] for le, n in zip([*RECOVERY_BUCKETS, "+Inf"], self.recoveries)],
            },
            "step": self.step,
            "step_time": None if step_time is None else round(step_time, 6),
            "work_time": None if work_time is None else round(work_time, 6),
            "checkpoint_costs": {
                "saves": int(totals["saves"]),
                "stall_seconds_total": round(totals["save_stall_total"], 6),
                "write_seconds_total": round(totals["save_write_total"], 6),
                "last_stall_seconds": round(self._lasts["save_stall_last"], 6),
                "last_write_seconds": round(self._lasts["save_write_last"], 6),
            },
            "memory_refresh": {
                "refreshes": int(totals["refreshes"]),
                "seconds_total": round(totals["refresh_total"], 6),
                "last_seconds": round(self._lasts["refresh_last"], 6),
                "every": int(self._lasts["refresh_every"]),
            },
            "sdc_audit": {
                "audits": int(totals["sdc_audits"]),
                "seconds_total": round(totals["audit_total"], 6),
                **self.sdc,
            },
        }

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        """Each status row of a worker gets its step time and its own work per step."""
        for row in rows:
            step, work = self.rank_times.get(row["local_rank"], (None, None))
            row["step_time"] = None if step is None else round(step, 6)
            row["work_time"] = None if work is None else round(work, 6)
