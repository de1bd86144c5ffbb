"""Prometheus metrics, made from the status snapshot the agent loop publishes.

`--metrics-address HOST:PORT` serves them over HTTP (prometheus-client's exposition handler on a
bounded server of ours, metrics_server.py, bound to that one address); `--metrics-textfile FILE`
writes them for node_exporter's textfile collector (replaced atomically every TEXTFILE_EVERY
seconds and at every state change). Either way the figures are those of the latest snapshot: the
collector reads it at scrape time, so the loop never waits on a scrape, and `elasticd status
--json` holds every number exported.

Every series carries the labels run_id and node. METRICS lists them all (name, type, help,
labels); docs/metrics-reference.md is generated from it (python3 -m elasticd.ops.docs), and a test
checks it is current. `families` makes the samples of each; `Exporter` is the HTTP endpoint and
the textfile.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from elasticd import __version__, logs, safeio
from elasticd.lifecycle.states import State
from elasticd.reporting import replication
from elasticd.reporting.figures import CAUSES
from elasticd.reporting.metrics_server import BoundedServer, Handler, serve
from elasticd.reporting.status_snapshot import STEPS, Recoveries, Snapshot, from_json

log = logs.get("elasticd.metrics")

TEXTFILE_EVERY = 5.0  # seconds between textfile writes (besides state changes)
RANK = ("rank", "local_rank")

# name, type, help, labels (besides run_id and node)
METRICS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("elasticd_info", "gauge", "Always 1; the daemon's version as a label", ("version",)),
    ("elasticd_state", "gauge", "1 for the agent's current state, 0 for the others", ("state",)),
    ("elasticd_uptime_seconds", "gauge", "Seconds since the daemon started", ()),
    ("elasticd_world_size", "gauge", "Workers in the job this round (all nodes)", ()),
    ("elasticd_group_rank", "gauge", "This node's rank among the job's nodes this round", ()),
    ("elasticd_group_world_size", "gauge", "Nodes in the job this round", ()),
    ("elasticd_round", "gauge", "Attempts this node has started (its workers' generations)", ()),
    (
        "elasticd_restarts_total",
        "counter",
        "Restarts of this node's workers, by cause as this node saw it: "
        + ", ".join(CAUSES)
        + " (peer: another node asked)",
        ("cause",),
    ),
    (
        "elasticd_hang_inquiries_total",
        "counter",
        "Hang inquiries this node asked or answered (a silence judged on every node's stacks), "
        "by verdict: hang, cleared (no hang: a straggler, or no culprit), none (no verdict in "
        "time: the group restarted)",
        ("verdict",),
    ),
    (
        "elasticd_in_place_recoveries_total",
        "counter",
        "Failures recovered in place (the failed ranks replaced alone, the survivors kept in "
        "their processes), by cause as this node saw it; the others restart the workers",
        ("cause",),
    ),
    (
        "elasticd_failures_total",
        "counter",
        "Failures this node saw, by class (what kind of trouble: user, oom, hardware, hang, "
        "node_lost, store_unreachable, killed, ...; a peer's as it said)",
        ("class",),
    ),
    (
        "elasticd_restart_budget_used",
        "gauge",
        "Failure restarts the job has spent (all nodes together)",
        (),
    ),
    (
        "elasticd_restart_budget_left",
        "gauge",
        "Failure restarts the job may still spend before it fails",
        (),
    ),
    (
        "elasticd_last_failure_timestamp_seconds",
        "gauge",
        "Unix time of the last failure that spent the budget here",
        (),
    ),
    (
        "elasticd_recovery_seconds",
        "histogram",
        "Seconds from a failure's detection to every new rank's first step",
        (),
    ),
    (
        "elasticd_last_recovery_phase_seconds",
        "gauge",
        "The last recovery's timeline: seconds after the failure "
        "was detected at which each phase ended",
        ("phase",),
    ),
    (
        "elasticd_steps_lost_total",
        "counter",
        "Training steps done again after restarts (the step reached before "
        "a restart less the step the next attempt resumed from); absent once a restart's "
        "loss is unknown",
        (),
    ),
    (
        "elasticd_last_restart_steps_lost",
        "gauge",
        "Training steps the last restart lost; absent where it is unknown",
        (),
    ),
    (
        "elasticd_steps_lost_unknown_total",
        "counter",
        "Restarts whose steps lost are unknown (the script does not use elasticd.checkpoint)",
        (),
    ),
    (
        "elasticd_goodput_ratio",
        "gauge",
        "Productive training time over wall time since the daemon started; lost "
        "steps count as lost; absent once a restart's steps lost are unknown",
        (),
    ),
    (
        "elasticd_productive_seconds",
        "gauge",
        "Seconds of productive training since the daemon started; absent once a "
        "restart's steps lost are unknown",
        (),
    ),
    (
        "elasticd_lost_seconds",
        "gauge",
        "Seconds of training lost to steps done again; absent once a restart's steps lost "
        "are unknown",
        (),
    ),
    ("elasticd_training_step", "gauge", "The highest training step this node's ranks reported", ()),
    (
        "elasticd_step_seconds",
        "gauge",
        "Seconds per training step, median over this node's ranks",
        (),
    ),
    (
        "elasticd_step_work_seconds",
        "gauge",
        "Seconds of own work per step (outside the gradient sync), median "
        "over this node's ranks: compare nodes with it",
        (),
    ),
    ("elasticd_checkpoint_saves_total", "counter", "Checkpoint saves (elasticd.checkpoint)", ()),
    (
        "elasticd_checkpoint_stall_seconds_total",
        "counter",
        "Seconds training was blocked by checkpoint saves",
        (),
    ),
    (
        "elasticd_checkpoint_write_seconds_total",
        "counter",
        "Seconds of background checkpoint writes",
        (),
    ),
    (
        "elasticd_checkpoint_last_stall_seconds",
        "gauge",
        "Seconds the last checkpoint save blocked training",
        (),
    ),
    (
        "elasticd_checkpoint_last_write_seconds",
        "gauge",
        "Seconds the last checkpoint took to write",
        (),
    ),
    ("elasticd_checkpoint_step", "gauge", "Step of the newest checkpoint on this node", ()),
    (
        "elasticd_checkpoint_age_seconds",
        "gauge",
        "Seconds since the newest checkpoint on this node was saved",
        (),
    ),
    ("elasticd_memory_refreshes_total", "counter", "In-memory state refreshes", ()),
    (
        "elasticd_memory_refresh_seconds_total",
        "counter",
        "Seconds training was blocked by in-memory refreshes",
        (),
    ),
    (
        "elasticd_memory_refresh_last_seconds",
        "gauge",
        "Seconds the last in-memory refresh blocked training",
        (),
    ),
    (
        "elasticd_memory_refresh_interval_steps",
        "gauge",
        "The in-memory refresh cadence: steps between refreshes",
        (),
    ),
    ("elasticd_memory_step", "gauge", "The newest step held in memory on this node", ()),
    (
        "elasticd_sdc_audits_total",
        "counter",
        "Audits of the replicas' parameters and optimizer state run by this node's ranks",
        (),
    ),
    (
        "elasticd_sdc_audit_seconds_total",
        "counter",
        "Seconds the replicas' audits took (part of the refreshes' and saves' stalls)",
        (),
    ),
    (
        "elasticd_sdc_detected_total",
        "counter",
        "Silent data corruption the replicas' audit found on this node (a rank of it named)",
        (),
    ),
    (
        "elasticd_sdc_undecided_total",
        "counter",
        "Disagreements of the replicas' audit with no majority to name a rank (two replicas)",
        (),
    ),
    (
        "elasticd_rank_heartbeat_age_seconds",
        "gauge",
        "Seconds since each local rank's last heartbeat",
        RANK,
    ),
    (
        "elasticd_rank_rss_bytes",
        "gauge",
        "Resident memory of each local rank's worker process",
        RANK,
    ),
    ("elasticd_rank_step", "gauge", "Each local rank's training step", RANK),
    (
        "elasticd_rank_step_seconds",
        "gauge",
        "Each local rank's seconds per step, beat to beat",
        RANK,
    ),
    (
        "elasticd_rank_step_work_seconds",
        "gauge",
        "Each local rank's own work per step (outside the gradient sync)",
        RANK,
    ),
    (
        "elasticd_rank_straggler_ratio",
        "gauge",
        "Each local rank's own work per step over the node's median, over the straggler window",
        RANK,
    ),
    ("elasticd_stragglers", "gauge", "Local ranks reported as stragglers now", ()),
    ("elasticd_straggler_reports_total", "counter", "Stragglers reported", ()),
    (
        "elasticd_health_check_up",
        "gauge",
        "1 if the last health check passed, 0 if it failed (absent before the "
        "first or without --health-check)",
        (),
    ),
    ("elasticd_health_check_runs_total", "counter", "Health checks run", ()),
    ("elasticd_health_check_failures_total", "counter", "Health checks that failed", ()),
    ("elasticd_health_check_duration_seconds", "gauge", "Seconds the last health check took", ()),
    (
        "elasticd_health_check_timestamp_seconds",
        "gauge",
        "Unix time the last health check finished",
        (),
    ),
    (
        "elasticd_peers_left_total",
        "counter",
        "Other nodes that left the job after failing their health check",
        (),
    ),
    (
        "elasticd_node_quarantined",
        "gauge",
        "1 once this node is quarantined (too many failed health checks or faults the GPU "
        "driver reported: it leaves the job and refuses to start until `elasticd node clear`), "
        "else 0",
        (),
    ),
    (
        "elasticd_node_failures",
        "gauge",
        "This node's failed health checks, and worker failures while the GPU driver reported a "
        "fault, within --quarantine-window (a worker's error text never counts)",
        (),
    ),
    (
        "elasticd_peer_beat_age_seconds",
        "gauge",
        "Seconds since each peer node's liveness beat last moved",
        ("peer_group_rank",),
    ),
    # a sharded job's replica and the /dev/shm held (reporting/replication.py)
    *replication.METRICS,
)
_BY_NAME = {m[0]: m for m in METRICS}


Put = Callable[..., None]  # put(metric name, value, **labels): one sample (None: none)


class SnapshotCollector:
    """prometheus-client collector: the metrics of the latest status snapshot, made at scrape
    time."""

    def __init__(self, snapshot: Callable[[], Snapshot | dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s:
            yield from families(snapshot_of(s))


def snapshot_of(s: Snapshot | dict[str, Any]) -> Snapshot:
    """The snapshot as types, from its wire form (what the status board serves) if need be."""
    return s if isinstance(s, Snapshot) else from_json(Snapshot, s)


def families(s: Snapshot) -> Iterator[Metric]:
    """Every metric of METRICS with its samples from the snapshot `s` (a metric with no value
    now, e.g. a step time before the first steps, is left out)."""
    base = {"run_id": str(s.run_id), "node": str(s.node)}
    samples: dict[str, list[tuple[dict[str, str], Any]]] = {name: [] for name in _BY_NAME}

    def put(name: str, value: Any, **labels: Any) -> None:
        if value is not None:
            samples[name].append(({k: str(v) for k, v in labels.items()}, float(value)))

    for part in (_job, _restarts, _training, _costs, _ranks, _health, replication.put_metrics):
        part(put, s)
    for name, kind, doc, labels in METRICS:
        if kind == "histogram":
            if s.recoveries is not None:
                yield _histogram(name, doc, base, s.recoveries)
            continue
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            name, doc, labels=[*base, *labels]
        )
        for labels_of, value in samples[name]:
            family.add_metric([*base.values(), *(labels_of[k] for k in labels)], value)
        yield family


def _histogram(name: str, doc: str, base: dict[str, str], rec: Recoveries) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=list(base))
    cumulative, buckets = 0, []
    for le, n in rec.buckets:
        cumulative += n
        buckets.append((str(float(le)) if le != "+Inf" else "+Inf", cumulative))
    family.add_metric(list(base.values()), buckets, rec.sum)
    return family


def _job(put: Put, s: Snapshot) -> None:
    put("elasticd_info", 1, version=__version__)
    for state in State:
        put("elasticd_state", int(s.state == state.value), state=state.value)
    put("elasticd_uptime_seconds", s.uptime)
    put("elasticd_world_size", s.world_size)
    put("elasticd_group_rank", s.group_rank)
    put("elasticd_group_world_size", s.group_world_size)
    put("elasticd_round", s.round)
    for peer, age in s.peers.items():
        put("elasticd_peer_beat_age_seconds", age, peer_group_rank=peer)


def _restarts(put: Put, s: Snapshot) -> None:
    for cause, n in s.restarts_by_cause.items():
        put("elasticd_restarts_total", n, cause=cause)
    for cause, n in s.in_place_by_cause.items():
        put("elasticd_in_place_recoveries_total", n, cause=cause)
    for verdict, n in s.hang_inquiries.items():
        put("elasticd_hang_inquiries_total", n, verdict=verdict)
    for klass, n in s.failures_by_class.items():
        put("elasticd_failures_total", n, **{"class": klass})
    put("elasticd_restart_budget_used", s.restarts)
    put("elasticd_restart_budget_left", s.budget_left)
    if s.last_failure:
        put("elasticd_last_failure_timestamp_seconds", s.last_failure.at)
    last_recovery = s.last_recovery or {}
    for phase in STEPS:
        put("elasticd_last_recovery_phase_seconds", last_recovery.get(phase), phase=phase)
    put("elasticd_steps_lost_total", s.steps_lost.total)
    put("elasticd_last_restart_steps_lost", s.steps_lost.last)
    put("elasticd_steps_lost_unknown_total", s.steps_lost.unknown)


def _training(put: Put, s: Snapshot) -> None:
    put("elasticd_goodput_ratio", s.goodput.ratio)
    put("elasticd_productive_seconds", s.goodput.productive_seconds)
    put("elasticd_lost_seconds", s.goodput.lost_seconds)
    put("elasticd_training_step", s.step)
    put("elasticd_step_seconds", s.step_time)
    put("elasticd_step_work_seconds", s.work_time)
    put("elasticd_stragglers", len(s.stragglers))
    put("elasticd_straggler_reports_total", s.straggler_reports)


def _costs(put: Put, s: Snapshot) -> None:
    """What checkpoints and in-memory refreshes cost, and the newest of each."""
    ckpt, mem = s.checkpoint_costs, s.memory_refresh
    put("elasticd_checkpoint_saves_total", ckpt.saves)
    put("elasticd_checkpoint_stall_seconds_total", ckpt.stall_seconds_total)
    put("elasticd_checkpoint_write_seconds_total", ckpt.write_seconds_total)
    if ckpt.saves:
        put("elasticd_checkpoint_last_stall_seconds", ckpt.last_stall_seconds)
        put("elasticd_checkpoint_last_write_seconds", ckpt.last_write_seconds)
    newest = s.checkpoint or {}  # the checkpoint format's manifest entry
    put("elasticd_checkpoint_step", newest.get("step"))
    put("elasticd_checkpoint_age_seconds", newest.get("age"))
    put("elasticd_memory_refreshes_total", mem.refreshes)
    put("elasticd_memory_refresh_seconds_total", mem.seconds_total)
    if mem.refreshes:
        put("elasticd_memory_refresh_last_seconds", mem.last_seconds)
        put("elasticd_memory_refresh_interval_steps", mem.every)
    put("elasticd_memory_step", s.memory_step)
    put("elasticd_sdc_audits_total", s.sdc_audit.audits)
    put("elasticd_sdc_audit_seconds_total", s.sdc_audit.seconds_total)
    put("elasticd_sdc_detected_total", s.sdc_audit.detected)
    put("elasticd_sdc_undecided_total", s.sdc_audit.undecided)


def _ranks(put: Put, s: Snapshot) -> None:
    for w in s.workers:
        who = {"rank": w.rank, "local_rank": w.local_rank}
        put("elasticd_rank_heartbeat_age_seconds", w.heartbeat_age, **who)
        put("elasticd_rank_rss_bytes", w.rss_bytes, **who)
        put("elasticd_rank_step", w.step, **who)
        put("elasticd_rank_step_seconds", w.step_time, **who)
        put("elasticd_rank_step_work_seconds", w.work_time, **who)
        put("elasticd_rank_straggler_ratio", w.straggler_ratio, **who)


def _health(put: Put, s: Snapshot) -> None:
    health = s.health
    if health.last:
        put("elasticd_health_check_up", int(bool(health.last.ok)))
        put("elasticd_health_check_duration_seconds", health.last.seconds)
        put("elasticd_health_check_timestamp_seconds", health.last.at)
    if health.check:
        put("elasticd_health_check_runs_total", health.runs)
        put("elasticd_health_check_failures_total", health.failures)
    put("elasticd_peers_left_total", len(health.peers_left))
    if health.quarantine_after is not None:
        put("elasticd_node_quarantined", int(health.quarantined))
        put("elasticd_node_failures", health.strikes)


class Exporter:
    """The HTTP endpoint and the textfile, both made from the latest snapshot."""

    def __init__(
        self,
        address: tuple[str, int] | None,
        textfile: str | None,
        snapshot: Callable[[], Snapshot | dict[str, Any]],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(snapshot))
        self.textfile = Path(textfile) if textfile else None
        self.address = address
        self._server: BoundedServer | None = None
        self._next_write = 0.0
        self._state: str | None = None
        self._warned = False

    def start(self) -> None:
        """Bind and serve (an OSError, e.g. the port in use, is the caller's: exit 2)."""
        if self.address is not None:
            self._server = serve(self.address, Handler.factory(self.registry))

    def published(self, snapshot: Snapshot | dict[str, Any], now: float) -> None:
        """After each status publish (the loop's thread): the textfile, when due or the state
        changed."""
        if self.textfile is None:
            return
        state = snapshot_of(snapshot).state
        if now < self._next_write and state == self._state:
            return
        self._next_write, self._state = now + TEXTFILE_EVERY, state
        self.write_textfile()

    def write_textfile(self) -> None:
        """The metrics into a new file beside the textfile, then renamed over it (0644:
        node_exporter runs as its own user); a failure is logged once and retried at the next
        write."""
        assert self.textfile is not None
        tmp = self.textfile.with_name(f".{self.textfile.name}.{os.getpid()}.tmp")
        try:
            data = generate_latest(self.registry)
            try:
                os.unlink(tmp)  # our own leftover from a write that failed half-way
            except FileNotFoundError:
                pass
            fd = safeio.create(tmp)
            try:
                os.fchmod(fd, 0o644)
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self.textfile)
            self._warned = False
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("metrics_textfile_failed", path=str(self.textfile), error=str(e))

    def close(self) -> None:
        if self.textfile is not None and self._state is not None:
            self.write_textfile()  # the final state (none if the job never started)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
