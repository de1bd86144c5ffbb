"""The status the control socket serves (`StatusBoard`): an immutable snapshot the agent loop
publishes (at every state change and every PUBLISH_EVERY seconds while running), with the recent
events, what a restart would resume from, and the operators' figures: the board owns the job's
figures (reporting/figures.py), the stragglers (reporting/stragglers.py) and the replication
(reporting/replication.py), which read the workers' heartbeats at every publish; the loop feeds the
figures its restarts and recoveries.

At every publish the board builds an reporting/status_snapshot.py `Snapshot` and keeps its JSON
form, which the control socket and the metrics read; the health check's report and the checkpoint
and in-memory step a restart would resume from go into it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticd import names
from elasticd.checkpoint.memory import directory
from elasticd.cluster.rounds import Round
from elasticd.config import Config
from elasticd.lifecycle import supervise
from elasticd.lifecycle.states import Failure, State
from elasticd.reporting.figures import Figures
from elasticd.reporting.replication import Replication
from elasticd.reporting.status_snapshot import (
    LastFailure,
    Part,
    Snapshot,
    Worker,
    fields_from_json,
    from_json,
)
from elasticd.reporting.stragglers import Stragglers

if TYPE_CHECKING:
    from elasticd.daemon.group import LocalGroup

PUBLISH_EVERY = 0.5  # seconds between status snapshots while running
RESUME_READ_EVERY = 2.0  # seconds between reads of the checkpoint and in-memory state for status


class StatusBoard:
    def __init__(
        self,
        cfg: Config,
        node: str,
        run_dir: Path,
        event: Callable[..., None],
        on_snapshot: Callable[[dict], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.run_dir = run_dir
        self.event = event  # Agent.event, for the checkpoints it sees
        self.on_snapshot = on_snapshot or (lambda snap: None)
        self.started = time.time()
        self.events: collections.deque = collections.deque(maxlen=50)
        self.current = Snapshot()  # the latest, as types
        self.snapshot: dict[str, Any] = {}  # the same as JSON values: the wire form
        self.last_publish = 0.0
        self._next_resume_read = 0.0
        self._last_checkpoint: str | None = None  # path of the newest checkpoint reported
        self._checkpoint: dict[str, Any] | None = None  # its manifest entry, as last read
        self._memory_step: int | None = None  # the newest in-memory state, as last read
        self.figures = Figures(time.monotonic())
        self.stragglers = Stragglers(cfg, node, event, time.time)
        self.replication = Replication()  # a sharded job's replica costs, /dev/shm held

    def record(self, name: str, fields: dict[str, Any]) -> None:
        self.events.append({"time": time.time(), "event": name, **fields})

    def due(self, now: float) -> bool:
        return now - self.last_publish > PUBLISH_EVERY

    def read_afresh(self) -> None:
        """The next snapshot reads the resume points again (a new state's snapshot reads
        everything)."""
        self._next_resume_read = 0.0

    def publish(
        self,
        *,
        state: State,
        rnd: Round | None,
        group: LocalGroup,
        restarts: int,
        last_failure: Failure | None,
        last_recovery: dict[str, float] | None,
        memory_dir: str | None,
        health: dict[str, Any],
        peers: dict[int, float],
        now: float,
    ) -> None:
        """`group`: the local workers, their rows and the heartbeats the figures read; `health`:
        the health check's report (daemon/healthcheck.py); `peers`: the watched ring
        neighbours' silences (cluster/peers.py)."""
        ranks = group.rows(now)
        checkpoint, memory_step = self._resume_points(now, memory_dir)
        figures = self._figures(group, ranks, health, now)
        self.last_publish = now
        self.current = Snapshot(
            state=state.value,
            run_id=self.cfg.rdzv_id,
            node=self.node,
            pid=os.getpid(),
            group_rank=rnd.group_rank if rnd else None,
            group_world_size=rnd.group_world_size if rnd else None,
            world_size=rnd.world_size if rnd else None,
            round=group.attempt,
            restarts=restarts,
            max_restarts=self.cfg.max_restarts,
            budget_left=max(0, self.cfg.max_restarts - restarts),
            uptime=round(time.time() - self.started, 1),
            run_dir=str(self.run_dir),
            entrypoint=self.cfg.entrypoint,
            workers=[from_json(Worker, _known(Worker, row)) for row in ranks],
            # its ring neighbours, the peer nodes it watches
            peers=peers if rnd else {},
            node_id=rnd.node_id if rnd else None,
            lost_nodes=list(rnd.lost) if rnd else [],
            hang_deadline=round(group.deadline.seconds, 3),
            hang_deadline_basis=group.deadline.basis(),
            last_failure=from_json(LastFailure, asdict(last_failure)) if last_failure else None,
            last_recovery=last_recovery,
            checkpoint=checkpoint,
            memory_step=memory_step,
            parts={
                name: from_json(Part, _known(Part, p)) for name, p in supervise.report().items()
            },
            **fields_from_json(Snapshot, _known(Snapshot, figures)),
            events=list(self.events)[-10:],
        )
        self.snapshot = self.current.to_json()  # what the control socket serves
        self.on_snapshot(self.snapshot)

    def _figures(
        self, group: LocalGroup, ranks: list[dict], health: dict[str, Any], now: float
    ) -> dict[str, Any]:
        """The operators' figures of a snapshot (and so of the metrics), in their JSON form,
        from the workers' heartbeats as of now; each worker's row gets its own."""
        beats = group.beats()
        self.figures.observe(group.attempt, [w.local_rank for w in group.workers], beats, now)
        self.stragglers.observe(
            group.attempt,
            [(w.global_rank, w.local_rank) for w in group.workers],
            beats,
            now,
        )
        self.replication.observe(group.attempt, [w.local_rank for w in group.workers], beats)
        self.figures.annotate(ranks)
        self.stragglers.annotate(ranks)
        self.replication.annotate(ranks)
        return {
            **self.figures.report(now),
            "stragglers": self.stragglers.report(),
            "straggler_reports": self.stragglers.reports,
            "health": health,
            "memory_replica": self.replication.report(),
        }

    def _resume_points(
        self, now: float, memory_dir: str | None
    ) -> tuple[dict[str, Any] | None, int | None]:
        """What a restart would resume from: the newest checkpoint on this node (with its age)
        and the newest in-memory step. Read every RESUME_READ_EVERY seconds, not at every
        publish: they are files (the checkpoint directory perhaps on a shared filesystem that
        every node's daemon would keep busy), and status does not need them to the step."""
        if now >= self._next_resume_read:
            self._next_resume_read = now + RESUME_READ_EVERY
            self._checkpoint = self._read_checkpoint()
            self._memory_step = directory.newest_step(memory_dir)
            self.replication.held = directory.held_bytes(memory_dir)
        info = self._checkpoint
        if info and info.get("time"):
            info = {**info, "age": round(time.time() - info["time"], 1)}
        return info, self._memory_step

    def _read_checkpoint(self) -> dict[str, Any] | None:
        """The newest checkpoint on this node, from its manifest (the daemon never writes any)."""
        directory = os.environ.get(names.CHECKPOINT_DIR) or self.cfg.checkpoint_dir
        if not directory:
            return None
        # torch-free: all the daemon reads of it
        from elasticd.checkpoint.disk.format import latest_info

        try:
            info = latest_info(directory)
        except Exception:  # noqa: BLE001 - status must never fail on a damaged directory
            return None
        if not info:
            return None
        if info.get("path") != self._last_checkpoint:
            self._last_checkpoint = info.get("path")
            self.event(
                "checkpoint_seen",
                step=info.get("step"),
                epoch=info.get("epoch"),
                path=info.get("path"),
            )
        return info


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """`data`, whose every key must be a field of `cls`: one that is not would vanish from the
    wire without a word, so a figure or a row without its field in reporting/status_snapshot.py
    fails
    here, in every test that runs a daemon."""
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise KeyError(
            f"{sorted(unknown)}: not fields of {cls.__name__} (reporting/status_snapshot.py)"
        )
    return data
