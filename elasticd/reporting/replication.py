"""What a sharded job's replication costs, as operators see it: each rank's exchanges with the
next node (checkpoint/memory/replica.py: bytes sent per refresh and in all, the seconds they took
in the background, whether it is on and why not) and the /dev/shm bytes this node holds for the
in-memory state, its own slots and the replicas it keeps of another node's ranks.

The worker side writes its running figures into its heartbeat file (heartbeat.FIGURES, `replica_*`);
`Replication` reads them at every status publish, as figures.py reads the checkpoint costs, and
keeps the totals of attempts that ended. Its metrics (`METRICS`, joined into metrics.py's table,
and `put_metrics`) are made from the snapshot like every other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticd.worker import heartbeat

COUNTS = ("replica_sends", "replica_bytes_total", "replica_seconds_total")  # kept across attempts
# a node's state when its ranks disagree: the first of these any rank is in, else "on" (the off
# states of heartbeat.REPLICA_STATES, the later listed there the stronger)
OFF_FIRST = heartbeat.REPLICA_STATES[:1:-1]
RANK = ("rank", "local_rank")

METRICS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "elasticd_memory_replica_state",
        "gauge",
        "A sharded job's replica of each rank's shards on the next node: 1 for this node's "
        "state (on, or off and why: one_node, uneven_nodes, no_directory, failed), 0 for the "
        "others; absent before the first sharded refresh",
        ("state",),
    ),
    (
        "elasticd_memory_replica_sends_total",
        "counter",
        "Replica exchanges this node's ranks completed (one per rank per refresh)",
        (),
    ),
    (
        "elasticd_memory_replica_bytes_total",
        "counter",
        "Bytes this node's ranks sent to the next node's as replicas (about as many received)",
        (),
    ),
    (
        "elasticd_memory_replica_last_bytes",
        "gauge",
        "Bytes this node's ranks sent at their last replica exchange, summed: the network cost "
        "of one refresh",
        (),
    ),
    (
        "elasticd_memory_replica_seconds_total",
        "counter",
        "Seconds of replica exchanges in the background, summed over this node's ranks",
        (),
    ),
    (
        "elasticd_memory_replica_last_seconds",
        "gauge",
        "Seconds the slowest of this node's ranks' last replica exchange took (background)",
        (),
    ),
    (
        "elasticd_memory_shm_bytes",
        "gauge",
        "Bytes of /dev/shm this node holds for the in-memory state: its ranks' own slots "
        "(slots=own) and the replicas of another node's ranks (slots=replica)",
        ("slots",),
    ),
    (
        "elasticd_rank_replica_bytes",
        "gauge",
        "Bytes each local rank sent as replicas this attempt",
        RANK,
    ),
    (
        "elasticd_rank_replica_last_bytes",
        "gauge",
        "Bytes of each local rank's last replica exchange",
        RANK,
    ),
    (
        "elasticd_rank_replica_last_seconds",
        "gauge",
        "Seconds each local rank's last replica exchange took (background)",
        RANK,
    ),
)


def state_of(code: float) -> str | None:
    """The replica_state figure as a word; None while undecided (or an unknown code)."""
    i = int(code)
    return heartbeat.REPLICA_STATES[i] or None if 0 <= i < len(heartbeat.REPLICA_STATES) else None


def node_state(states: list[str | None]) -> str | None:
    """The node's state from its ranks': on when every decided rank is on, else why one is off."""
    decided = {s for s in states if s}
    if not decided:
        return None
    return next((s for s in OFF_FIRST if s in decided), "on")


class Replication:
    """The node's replication figures from its ranks' heartbeats (fed at every status publish)."""

    def __init__(self) -> None:
        self._attempt = 0
        self._base = dict.fromkeys(COUNTS, 0.0)  # attempts that ended, the node's ranks summed
        self._now: dict[int, heartbeat.Beat] = {}  # local rank -> its latest beat, this attempt
        self._states: dict[int, str | None] = {}  # local rank -> its latest state (kept)
        self._lasts: dict[int, tuple[float, float]] = {}  # local rank -> (bytes, seconds) last
        self.held = (0, 0)  # /dev/shm bytes: own slots, replica slots (daemon/status.py reads)

    def observe(
        self, attempt: int, local_ranks: list[int], beats: list[heartbeat.Beat | None]
    ) -> None:
        if attempt != self._attempt:
            for name in COUNTS:
                self._base[name] += sum(b.figure(name) for b in self._now.values())
            self._now, self._attempt = {}, attempt
        for local_rank, b in zip(local_ranks, beats):
            if b is None:
                continue
            self._now[local_rank] = b
            state = state_of(b.figure("replica_state"))
            if state or local_rank not in self._states:
                self._states[local_rank] = state
            if b.figure("replica_sends"):
                self._lasts[local_rank] = (
                    b.figure("replica_bytes_last"),
                    b.figure("replica_seconds_last"),
                )

    def report(self) -> dict[str, Any]:
        """The status snapshot's `memory_replica` record (JSON values)."""
        totals = {
            name: self._base[name] + sum(b.figure(name) for b in self._now.values())
            for name in COUNTS
        }
        lasts = list(self._lasts.values())
        return {
            "state": node_state(list(self._states.values())),
            "sends": int(totals["replica_sends"]),
            "bytes_total": int(totals["replica_bytes_total"]),
            "last_bytes": int(sum(b for b, _ in lasts)),
            "seconds_total": round(totals["replica_seconds_total"], 6),
            "last_seconds": round(max((s for _, s in lasts), default=0.0), 6),
            "shm_own_bytes": self.held[0],
            "shm_replica_bytes": self.held[1],
        }

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        """Each status row of a worker gets its replica state and figures (this attempt's)."""
        for row in rows:
            b = self._now.get(row["local_rank"])
            row["replica"] = self._states.get(row["local_rank"])
            row["replica_bytes"] = int(b.figure("replica_bytes_total")) if b else None
            row["replica_last_bytes"] = int(b.figure("replica_bytes_last")) if b else None
            row["replica_last_seconds"] = round(b.figure("replica_seconds_last"), 6) if b else None


def put_metrics(put: Callable[..., None], s: Any) -> None:
    """The samples of METRICS from the snapshot `s` (reporting/status_snapshot.py's Snapshot)."""
    rep = s.memory_replica
    if rep.state:
        for state in ("on", *OFF_FIRST):
            put("elasticd_memory_replica_state", int(rep.state == state), state=state)
    if rep.sends or rep.state == "on":
        put("elasticd_memory_replica_sends_total", rep.sends)
        put("elasticd_memory_replica_bytes_total", rep.bytes_total)
        put("elasticd_memory_replica_last_bytes", rep.last_bytes)
        put("elasticd_memory_replica_seconds_total", rep.seconds_total)
        put("elasticd_memory_replica_last_seconds", rep.last_seconds)
    if s.memory_step is not None or rep.shm_own_bytes or rep.shm_replica_bytes:
        put("elasticd_memory_shm_bytes", rep.shm_own_bytes, slots="own")
        put("elasticd_memory_shm_bytes", rep.shm_replica_bytes, slots="replica")
    for w in s.workers:
        if w.replica:
            who = {"rank": w.rank, "local_rank": w.local_rank}
            put("elasticd_rank_replica_bytes", w.replica_bytes, **who)
            put("elasticd_rank_replica_last_bytes", w.replica_last_bytes, **who)
            put("elasticd_rank_replica_last_seconds", w.replica_last_seconds, **who)
