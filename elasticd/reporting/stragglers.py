"""Stragglers: the rule, pure (`judge`: a local rank whose own work per step, outside the gradient
sync, stays more than --straggler-threshold above the node's median for --straggler-window), and
`Stragglers`, which measures each rank's figures from the heartbeats, calls it and reports (an
event, a metric, a status field naming rank, node and ratio).

Nothing is restarted for it: `--straggler-action report` is the only action so far; `restart` and
`exclude-node` would act on the `Straggler` records this module keeps (rank, node, ratio, since
when), from the agent loop, as any other RestartCause. Nodes are compared in Prometheus, not
through the store (below).

What is compared. In a synchronous job (DDP) every rank's step takes as long as the slowest's:
the others wait for it in the gradient all-reduce, so beat-to-beat step times are the same on
every rank. What differs is each rank's *own work*: the time from the end of one step's
gradient sync (backward() returning) to the start of the next backward() (data, forward,
optimizer, anything the script does), which the worker side measures around backward()
(heartbeat.Writer.optimizer_stepped) and writes into its heartbeat. Where a rank has no such figure
(no backward(), e.g. a script that only calls elasticd.heartbeat()), beat-to-beat step times are
compared instead, which tells stragglers apart only where ranks do not wait for each other.

Across nodes: each node compares its own ranks, and exports its median own work per step
(`elasticd_step_work_seconds`) and its ranks' ratios; the job-wide comparison of nodes is a
Prometheus rule over those (deploy/prometheus/elasticd-alerts.yml, ElasticdNodeStraggling), so
the daemons exchange nothing more through the store for it (its traffic stays O(1) per node).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from elasticd.config import Config
from elasticd.reporting.status_snapshot import Straggler
from elasticd.worker import heartbeat

SAMPLE_EVERY = 1.0  # seconds between comparisons


@dataclass(frozen=True)
class Judgement:
    """What the straggler rule found at one comparison."""

    median: float  # the node's median own work per step, over the window
    ratios: dict[int, float]  # local rank -> its windowed figure over the median
    above: dict[int, tuple[float, float]]  # local rank -> (monotonic, wall) since when above
    slow: frozenset[int]  # local ranks above for the whole window, and over it on the whole


def judge(
    means: dict[int, float],
    latest: dict[int, float],
    above: dict[int, tuple[float, float]],
    now: float,
    wall: float,
    *,
    threshold: float,
    window: float,
) -> Judgement:
    """The straggler rule, on figures alone: `means`, each local rank's own work per step over
    the window (at least two ranks); `latest`, over the last period only (ranks that stepped in
    it); `above`, since when each rank has been above the threshold in every period (`now` and
    `wall` date a new one). A rank is above when its last period's figure is more than
    1 + threshold times that period's median (a period with fewer than two ranks' figures
    changes nothing), and slow once above for `window` seconds with its windowed figure also
    over the limit: one slow period is no straggler, and neither is one that has caught up."""
    median = statistics.median(means.values())
    period_median = statistics.median(latest.values()) if len(latest) >= 2 else None
    limit = 1 + threshold
    ratios: dict[int, float] = {}
    above = dict(above)
    slow = set()
    for local, mean in means.items():
        ratios[local] = ratio = mean / median if median > 0 else 1.0
        if local in latest and period_median is not None:
            if period_median > 0 and latest[local] > limit * period_median:
                above.setdefault(local, (now, wall))
            else:
                above.pop(local, None)
        since = above.get(local)
        if since and now - since[0] >= window and ratio > limit:
            slow.add(local)
    return Judgement(median, ratios, above, frozenset(slow))


class Stragglers:
    def __init__(
        self, cfg: Config, node: str, event: Callable[..., None], clock: Callable[[], float]
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.event = event  # Agent.event: logged and shown in status
        self.wall = clock  # time.time, for `since`
        self.reports = 0  # stragglers reported since the daemon started
        self._attempt = -1
        self._next = 0.0
        # local rank -> (t, count, total) over the window
        self._samples: dict[int, collections.deque] = {}
        # local rank -> (monotonic, wall) first above
        self._above: dict[int, tuple[float, float]] = {}
        self.current: dict[int, Straggler] = {}  # local rank -> reported and still slow
        self.ratios: dict[int, float] = {}  # local rank -> latest windowed ratio to the median

    @property
    def on(self) -> bool:
        return self.cfg.straggler_threshold > 0

    def observe(
        self,
        attempt: int,
        ranks: list[tuple[int, int]],
        beats: list[heartbeat.Beat | None],
        now: float,
    ) -> None:
        """`ranks`: (global rank, local rank) of each worker of `attempt`, with its heartbeat."""
        if attempt != self._attempt or not beats:
            self._attempt = attempt
            self._samples.clear()
            self._above.clear()
            self.current.clear()
            self.ratios.clear()
        if not self.on or now < self._next or len(beats) < 2:
            return
        self._next = now + SAMPLE_EVERY
        means, latest = self._measure(ranks, beats, now)
        if len(means) < 2:
            return
        verdict = judge(
            means,
            latest,
            self._above,
            now,
            self.wall(),
            threshold=self.cfg.straggler_threshold,
            window=self.cfg.straggler_window,
        )
        self._above = verdict.above
        for rank, local in ranks:
            if local in means:
                self._act(rank, local, means[local], verdict)

    def _measure(
        self, ranks: list[tuple[int, int]], beats: list[heartbeat.Beat | None], now: float
    ) -> tuple[dict[int, float], dict[int, float]]:
        """Each rank's own work per step over the window, and over the last period only (beat to
        beat step times where some rank has no own-work figure)."""
        by_work = all(b is not None and b.figure("work_steps") for b in beats)
        means: dict[int, float] = {}
        latest: dict[int, float] = {}  # this period's figure, per rank
        for (_, local), b in zip(ranks, beats):
            if b is None:
                continue
            count, total = (
                (b.figure("work_steps"), b.figure("work_total")) if by_work else (b.beats, b.last)
            )
            samples = self._samples.setdefault(local, collections.deque())
            if samples and count > samples[-1][1]:
                latest[local] = (total - samples[-1][2]) / (count - samples[-1][1])
            samples.append((now, count, total))
            while len(samples) > 2 and samples[1][0] <= now - self.cfg.straggler_window:
                samples.popleft()
            t0, c0, s0 = samples[0]
            if count > c0:
                means[local] = (total - s0) / (count - c0)
        return means, latest

    def _act(self, rank: int, local: int, mean: float, verdict: Judgement) -> None:
        """Report a rank found slow (once, until it recovers), or say it recovered."""
        ratio = verdict.ratios[local]
        self.ratios[local] = round(ratio, 3)
        if local in verdict.slow:
            if local not in self.current:
                self.reports += 1
                self.event(
                    "straggler",
                    level="warning",
                    rank=rank,
                    local_rank=local,
                    node=self.node,
                    ratio=round(ratio, 2),
                    work_time=round(mean, 4),
                    median=round(verdict.median, 4),
                    window=self.cfg.straggler_window,
                    action=self.cfg.straggler_action,
                )
            self.current[local] = Straggler(
                rank,
                local,
                self.node,
                round(ratio, 3),
                round(mean, 6),
                round(verdict.median, 6),
                verdict.above[local][1],
            )
        elif local in self.current and local not in verdict.above:
            gone = self.current.pop(local)
            self.event(
                "straggler_recovered",
                rank=gone.rank,
                local_rank=local,
                node=self.node,
                ratio=round(ratio, 2),
            )

    def report(self) -> list[dict[str, Any]]:
        """Status's `stragglers`: the ranks reported and still slow."""
        return [asdict(s) for s in self.current.values()]

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            row["straggler_ratio"] = self.ratios.get(row["local_rank"])
            row["straggler"] = row["local_rank"] in self.current
