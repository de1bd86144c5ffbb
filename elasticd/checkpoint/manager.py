"""CheckpointManager: periodic, atomic, asynchronous checkpoints (rank 0's file, or every rank's
shards through shard_files.py) with retention and error reporting, the stop agreed across ranks
(`maybe_save`, `should_stop`), (through elasticd.checkpoint.memory.state) the in-memory state's
refreshes, and (through elasticd.checkpoint.audit) the replicas' audit before a state is kept."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd import names
from elasticd.checkpoint import audit, bundle, sharded, stop
from elasticd.checkpoint.collectives import cpu_group, dist_on, rank, world
from elasticd.checkpoint.disk import files, shard_files
from elasticd.checkpoint.disk.format import (
    FORMAT,
    Entry,
    candidates,
    remove_checkpoint,
    remove_temporaries,
    resolve_dir,
    write_manifest,
)
from elasticd.checkpoint.disk.snapshot import Snapshot
from elasticd.checkpoint.memory.state import MemoryState
from elasticd.worker import heartbeat, reconfigure

log = structlog.get_logger()


class CheckpointError(RuntimeError):
    """A save that did not complete (the previous checkpoint is intact and still latest)."""


def _mark_state_loaded(step: int) -> None:
    """For the daemon's recovery timeline ("state loaded") and its count of steps lost (the step
    resumed from, 0 for a fresh start), when running under elasticd."""
    writer = heartbeat.writer()
    if writer is not None:
        writer.note("resumed", step)
    path = os.environ.get(names.HEARTBEAT_FILE)
    if path:
        heartbeat.mark(path, "state_loaded")


def _regroup(agreed: bool, step: int) -> None:
    """Every rank at this boundary agreed to re-form its group (a node joins in place): unwind
    the script from here, its state of `step` in memory, to the bootstrap, which re-forms the
    group and runs the script again (worker/reconfigure.py)."""
    if agreed:
        log.info("regroup_at_boundary", step=step)
        raise reconfigure.Regroup(f"the group re-forms in place at step {step}: a node joins")


def _figures():
    """The heartbeat file's writer, through which the daemon reads this rank's save and refresh
    costs (heartbeat.FIGURES); None outside elasticd."""
    return heartbeat.writer()


def _failure(directory: str, err: BaseException) -> str:
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return (
        f"saving a checkpoint in {directory} failed: {type(err).__name__}: {err}"
        + (" (the disk, a quota or a file size limit is full)" if full else "")
        + "; the previous checkpoint is intact"
    )


class CheckpointManager:
    """Periodic, atomic, asynchronous checkpoints written by global rank 0 only.

    save() blocks only to copy the state into host memory (and to wait for the previous save,
    at most one is in flight); a background thread serializes, writes, fsyncs and commits it.
    `last_stall` is that blocking time in seconds, `last_write` the background time.
    A failed save (disk full, unwritable directory) leaves the previous checkpoint intact and
    latest, removes its temporary file, is logged at once and raised as CheckpointError from the
    next save()/wait()/close() (errors="raise") or only logged (errors="log").

    Under elasticd, maybe_save() also refreshes the in-memory state (elasticd.checkpoint.memory):
    every `memory_every` steps, or by default as often as keeps its cost under `memory_budget` of
    the step time (every step unless the state is big for the step: memory.cadence), and at every
    disk save (the state is captured already; a resume then never reads a disk checkpoint newer
    than memory: at 1 GB on CPU, 0.84 s against 0.20 s from memory). The default
    budget, 0.75%, leaves a quarter of the 1% that elasticd may cost a job in steady state to
    what the charge misses (it is the lower quartile of refresh costs; their mean runs 10-20%
    above it). A state with 8 MiB or more on the GPU is copied beside the next step
    (`memory_overlap`, elasticd.checkpoint.overlap: on an H100 a 200 MB state's refresh costs the
    step about 1 ms instead of 17 ms, so the same budget refreshes it about fifteen times as often);
    memory_overlap=False copies it at once, for a script that writes its parameters by hand
    between a refresh and its next optimizer step.

    Every state kept (refreshed or saved) is first audited across the DDP replicas
    (elasticd.checkpoint.audit; `audit_replicas=False` turns it off): a disagreement keeps nothing
    and ends every rank with names.SDC_EXIT, so the daemon resumes them from the newest state
    that passed. A sharded (FSDP2) state is audited in time instead: each rank's shards are
    digested at the boundary before a keep and again as the optimizer's next step begins."""

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        keep: int = 3,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        *,
        handle_sigterm: bool = True,
        stop_timeout: float = 10.0,
        errors: str = "raise",
        sync_every: int = 1,
        memory_every: int | None = None,
        memory_budget: float = 0.0075,
        memory_dir: str | os.PathLike | None = None,
        memory_overlap: bool = True,
        audit_replicas: bool = True,
    ):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if errors not in ("raise", "log"):
            raise ValueError(f"errors must be 'raise' or 'log', got {errors!r}")
        self.directory = resolve_dir(directory)
        self.keep, self.every_steps, self.every_seconds = keep, every_steps, every_seconds
        self.errors, self.sync_every = errors, max(1, int(sync_every))
        self.last_stall = 0.0
        self.last_write = 0.0
        self.last_error: BaseException | None = None
        self.last_saved: Entry | None = None  # the latest committed save of this manager
        self.loaded: Entry | None = None  # what load_latest() returned
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._entries: list[Entry] | None = None  # writer's view of the manifest, oldest first
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._stopping = False
        self._stop_saved = False
        self._agreed = False  # a maybe_save agreed on the stop flag since should_stop last asked
        self._calls = 0
        self._snap = Snapshot()
        self._shards: shard_files.ShardedSaver | None = None  # made at the first sharded save
        self._stop = stop.PROCESS
        self._signals = stop.install_sigterm_handler(stop_timeout) if handle_sigterm else False
        self._memory = MemoryState(memory_dir, memory_every, memory_budget, memory_overlap)
        self._audit = audit.Auditor(audit_replicas)
        self._boundary: int | None = None  # the last maybe_save's step (a repro bundle's)
        bundle.arm(self)

    @property
    def memory_every(self) -> int:
        """Steps between in-memory refreshes as of now; 0 when the in-memory state is off."""
        return self._memory.every

    @property
    def memory_dir(self) -> str | None:
        return self._memory.directory

    @property
    def last_memory_stall(self) -> float:
        """Seconds the latest in-memory refresh blocked the training loop."""
        return self._memory.last_stall

    # -- loading ---------------------------------------------------------------------------------
    def load_latest(self) -> dict[str, Any] | None:
        """The newest state: the in-memory state when every rank can resume from it at a step at
        least as new as the newest disk checkpoint (at this world size or another: ranks whose
        node lacks it receive it from one that holds it; see memory/state.py: choose), else the
        module function's disk checkpoint. Records the entry in `self.loaded` (its file is
        "memory:..." for in-memory state; "replay:..." in `elasticd replay`)."""
        if bundle.replaying():
            return self._took(bundle.replay_state())
        got = self._memory.load(self.directory, self._took) if self._memory.wanted else None
        if got is None:
            got = files.load_latest_entry(self.directory)
        return self._took(got)

    def _took(self, got: tuple[dict[str, Any], Entry] | None) -> dict[str, Any] | None:
        """The state load_latest gives, recorded: also the disk's that a sharded resume from
        memory that failed in restore() takes instead (MemoryState.load's `took`)."""
        _mark_state_loaded(got[1].step or 0 if got is not None else 0)
        if got is None:
            self.loaded = None
            return None
        state, self.loaded = got
        self._last_step = self.loaded.step
        if self.loaded.step is not None:
            path = (
                self.loaded.file
                if self.loaded.file.startswith(("memory:", "replay:"))
                else os.path.join(self.directory, self.loaded.file)
            )
            log.info(
                "checkpoint_loaded",
                path=path,
                step=self.loaded.step,
                source=path.split(":", 1)[0] if path.startswith(("memory:", "replay:")) else "disk",
            )
        return state

    def save_memory(
        self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]
    ) -> float:
        """Refresh the in-memory state (every rank calls it at the same steps; no collective when
        `state` is a callable around capture()). Returns the stall in seconds. A full or missing
        tmpfs, or a state it cannot hold, turns in-memory state off with one warning; disk
        checkpoints go on."""
        if bundle.replaying():
            return 0.0
        return self._memory.refresh(step, state, self._audit)

    @property
    def audits(self) -> int:
        """Audits of the replicas this manager ran (checkpoint/audit.py)."""
        return self._audit.audits

    @property
    def audit_seconds(self) -> float:
        """Seconds its audits took, summed (part of the refreshes' and saves' stalls)."""
        return self._audit.seconds

    def _captured(
        self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]
    ) -> Mapping[str, Any]:
        """The state to keep at `step`: what the callable (around capture()) returns, audited
        across the replicas first (raises audit.SilentDataCorruption when they disagree). A
        state given as a mapping is kept unaudited: capture() never saw the live objects."""
        if not callable(state):
            return state
        seen = self._audit.wanted()
        token = audit.SEEN.set(seen)
        try:
            state = state()
        finally:
            audit.SEEN.reset(token)
        self._audit.check(step, seen)
        return state

    # -- saving ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        epoch: int | None = None,
        position: int | None = None,
    ) -> float:
        """Checkpoint `state` (or what the callable returns: it is called on every rank, so
        capture() may be passed) as `step`. Returns the stall in seconds. epoch/position default
        to the sampler's state inside `state`."""
        if bundle.replaying():
            return 0.0  # a replay keeps nothing
        t0 = time.perf_counter()
        self._join()
        state = self._captured(step, state)
        self._last_step, self._last_time = int(step), time.monotonic()
        shards = sharded.holds_shards(state)
        if rank() != 0 and not shards:
            self.last_stall = time.perf_counter() - t0
            self._report_stall()
            return self.last_stall
        sampler = state.get("sampler") if isinstance(state, Mapping) else None
        if isinstance(sampler, Mapping):
            epoch = sampler.get("epoch") if epoch is None else epoch
            position = sampler.get("consumed") if position is None else position
        meta = {
            "step": int(step),
            "epoch": epoch,
            "position": position,
            "world_size": world(),
            "time": time.time(),
        }
        if shards:  # every rank writes its own shards (elasticd.checkpoint.disk.shard_files)
            if self._shards is None:
                self._shards = shard_files.ShardedSaver(self.directory, self.keep)
            job = self._shards.stage(int(step), state, meta)
            target, args = self._persist_shards, (job,)
        else:
            payload = {
                "format": FORMAT,
                "step": int(step),
                "meta": meta,
                "state": self._snap.take(state),
            }
            target, args = self._persist, (payload, meta)
        self._thread = threading.Thread(target=target, args=args, name="elasticd-checkpoint-writer")
        self._thread.start()
        self.last_stall = time.perf_counter() - t0
        self._report_stall()
        return self.last_stall

    def _report_stall(self) -> None:
        writer = _figures()
        if writer is not None:
            writer.add("saves", 1)
            writer.add("save_stall_total", self.last_stall)
            writer.note("save_stall_last", self.last_stall)

    def _persist(self, payload: dict[str, Any], meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        d = self.directory
        try:
            if self._entries is None:
                os.makedirs(d, 0o750, exist_ok=True)
                remove_temporaries(d)
                self._entries = list(reversed(candidates(d)))
            entry = files.write_checkpoint(d, payload, meta)
            # A save at a step already present replaces it; the oldest beyond `keep` go.
            before = self._entries
            entries = [e for e in before if e.step != entry.step and e.file != entry.file] + [entry]
            kept = entries[-self.keep :]
            write_manifest(d, kept)  # commit first, delete after: the manifest never dangles
            self._entries = kept
            live = {e.file for e in kept}
            for name in {e.file for e in before} - live:
                remove_checkpoint(d, name)
            self._saved(entry, t0)
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            self._entries = None  # re-read the directory next time
            self._failed(payload["step"], e)

    def _persist_shards(self, job: shard_files.Job) -> None:
        t0 = time.perf_counter()
        try:
            assert self._shards is not None
            self._saved(self._shards.commit(job), t0)
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            self._failed(job.step, e)

    def _saved(self, entry: Entry, t0: float) -> None:
        self.last_saved = entry
        self.last_write = time.perf_counter() - t0
        writer = _figures()
        if writer is not None:  # two stores from this thread; the training thread writes others
            writer.add("save_write_total", self.last_write)
            writer.note("save_write_last", self.last_write)
        log.info(
            "checkpoint_saved",
            path=os.path.join(self.directory, entry.file),
            step=entry.step,
            bytes=entry.bytes,
            seconds=round(self.last_write, 3),
        )

    def _failed(self, step: int, e: BaseException) -> None:
        self._error = e
        log.error(
            "checkpoint_save_failed",
            directory=self.directory,
            step=step,
            error=_failure(self.directory, e),
            latest=self.last_saved and self.last_saved.file,
        )

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            self.last_error = err
            if self.errors == "raise":
                raise CheckpointError(_failure(self.directory, err)) from err

    def wait(self) -> Entry | None:
        """Block until the save in flight is on disk; raise CheckpointError if it failed."""
        self._join()
        return self.last_saved

    def close(self) -> None:
        self.wait()
        self._memory.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self._thread is not None:
            self._thread.join()

    # -- cadence and stop ------------------------------------------------------------------------
    def _agree(self, step: int | None = None) -> tuple[bool, bool, bool]:
        """(stop, time due, regroup), the same on every rank: any rank's SIGTERM or timer counts,
        and any rank the daemon asked to re-form its group at this boundary (a node joins in
        place: worker/reconfigure.py `regroup_asked`). The
        in-memory cadence is agreed in the same call (the largest rank's proposal), and, where a
        keep is due at `step`, the replicas' audit (audit.Auditor.ballot: their digests' largest
        and smallest; raises audit.SilentDataCorruption when they differ).

        Under torch.distributed this is one small all_reduce on CPU every `sync_every`-th call
        (on other calls both are False), so every rank must call in the same pattern."""
        self._calls += 1
        local = [
            self._stop.requested.is_set() or self._stopping,
            self.every_seconds is not None
            and time.monotonic() - self._last_time >= self.every_seconds,
        ]  # and the regroup's word, read only where it is agreed on (a file read: not every call)
        if dist_on() and dist.get_world_size() > 1:
            if self._stopping:
                flags = [True, False, 0, 0]  # agreed everywhere already; timers no longer matter
            elif self._calls % self.sync_every:
                flags = [False, False, 0, 0]
            else:
                due = step is not None and self._keep_due(step)
                ballot = self._audit.ballot(step, due, self._memory.cadence.step_time())
                regroup = reconfigure.regroup_asked()
                t = torch.tensor(
                    [*map(int, local), regroup, self._memory.proposal(), *ballot],
                    dtype=torch.int64,
                )
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
                flags = t.tolist()
                self._audit.tally(flags[4:])  # raises audit.SilentDataCorruption
        else:
            flags = [*local, reconfigure.regroup_asked(), self._memory.proposal()]
        if flags[3]:
            self._memory.adopt(int(flags[3]))
        if flags[0] and not self._stopping:
            self._stopping = True
            log.info("checkpoint_stop_requested", action="saving and stopping at this step")
        return bool(flags[0]), bool(flags[1]), bool(flags[2]) and not flags[0]

    def _keep_due(self, step: int) -> bool:
        """Whether a refresh or a disk save is foreseen at `step` from what every rank agreed
        before it (a timer's save or a cadence changed in this call is not: its keep gathers
        the digests itself)."""
        every = self._memory.every
        disk = bool(self.every_steps) and step % self.every_steps == 0 and step != self._last_step
        return disk or (bool(every) and step % every == 0)

    def maybe_save(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        epoch: int | None = None,
        position: int | None = None,
    ) -> bool:
        """Save if `step` is a multiple of every_steps, every_seconds have passed, or a stop was
        requested (then once: the final save). Call it on every rank at every step boundary.
        The in-memory state is refreshed every `memory_every` steps (see cadence.Cadence) and at
        every disk save, so a resume never finds the disk newer than memory and reads it."""
        self._boundary = step
        if bundle.replaying():
            bundle.boundary(step, state)  # past the failed step: ends the replay
            return False
        cadence = self._memory.cadence
        writer = _figures()
        if writer is not None:
            writer.name_step(
                step
            )  # status and metrics show the training step, not a count of beats
        cadence.step_began()
        try:
            kept = self._maybe_save(step, state, epoch, position)
            self._audit.arm(step)  # sharded: the window up to the next update, when due
            return kept
        finally:
            cadence.step_ended()

    def _maybe_save(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        epoch: int | None,
        position: int | None,
    ) -> bool:
        self._stop.at_boundary()
        if not callable(state):
            self._audit.off("a state passed as a mapping, not as lambda: capture(...)")
        stop, time_due, regroup = self._agree(step)
        self._agreed = True
        step_due = (
            bool(self.every_steps) and step % self.every_steps == 0 and step != self._last_step
        )
        final = stop and not self._stop_saved
        every = self._memory.every
        # a regroup's step in memory too: every rank resumes from it, none of it trained again
        memory_due = bool(every) and (step % every == 0 or regroup)
        if not (step_due or time_due or final):
            if memory_due:
                self._memory.refresh(step, state, self._audit)
            _regroup(regroup, step)
            return False
        state = self._captured(step, state)
        self.save(step, state, epoch=epoch, position=position)
        if every:  # a disk save's step in memory too: a resume never finds the disk newer and
            self._memory.refresh(step, state)  # reads it (the stop's: a node joining, say)
        self._stop_saved = self._stop_saved or stop
        _regroup(regroup, step)
        return True

    def should_stop(self) -> bool:
        """True on every rank once any rank was asked to stop. After maybe_save() at the same
        boundary it costs nothing; alone, it is a small collective."""
        self._stop.at_boundary()
        if self._stopping:
            return True
        if not self._agreed:
            self._agree()
        self._agreed = False
        return self._stopping
