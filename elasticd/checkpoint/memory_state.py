"""The in-memory state as a CheckpointManager drives it: when to refresh (memory.Cadence, agreed
across ranks), the refresh itself (memory.Writer, with capture() told it is one), and resuming
from it when every rank holds a step at least as new as the newest disk checkpoint."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import torch
import torch.distributed as dist

import elasticd
from elasticd import memory
from elasticd.checkpoint.collectives import all_gather_bytes, cpu_group, dist_on, rank, world
from elasticd.checkpoint.files import looks_at_disk
from elasticd.checkpoint.format import Entry, candidates
from elasticd.checkpoint.state import REFRESH, Refresh

log = structlog.get_logger()


class MemoryState:
    """This rank's share of the node's in-memory state: on by default under elasticd, which owns
    the directory (memory.ENV); off for good after a refresh that failed."""

    def __init__(self, directory: str | os.PathLike | None, every: int | None, budget: float, overlap: bool):
        mem = directory if directory is not None else os.environ.get(memory.ENV)
        self.directory = os.fspath(mem) if mem else None
        if every is not None and int(every) < 0:
            raise ValueError(f"memory_every must be a number of steps (0: off; None: follow memory_budget), "
                             f"got {every}")
        if not 0 < budget < 1:
            raise ValueError(f"memory_budget is a share of step time, between 0 and 1 (0.01: 1%), "
                             f"got {budget}")
        self.cadence = memory.Cadence(every=int(every or 1), budget=budget if every is None else None)
        self.on = bool(self.directory) and every != 0
        self.overlap = bool(overlap)
        self.last_stall = 0.0
        self.writer: memory.Writer | None = None  # made at the first refresh, after loading
        self.resumed: int | None = None  # the step load() resumed from
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))  # 0 keeps the node's state, others their RNG

    @property
    def every(self) -> int:
        """Steps between refreshes as of now; 0 when the in-memory state is off."""
        return self.cadence.every if self.on else 0

    def proposal(self) -> int:
        """This rank's cadence (medians of recent timings: only on calls that agree)."""
        return self.cadence.proposal() if self.on else 0

    def adopt(self, agreed: int) -> None:
        """The cadence agreed across ranks (the largest proposal)."""
        if not (self.on and self.cadence.adopt(agreed)):
            return
        figures = elasticd._beat_writer()
        if figures is not None:
            figures.note("refresh_every", self.every)
        if rank() == 0:
            refresh, step = self.cadence.measured  # this rank's; the agreed N may come from another
            log.info("memory_cadence", every=self.every, budget=self.cadence.budget,
                     refresh_ms=round(1e3 * refresh, 3), step_ms=round(1e3 * step, 3))

    def load(self, disk: str) -> tuple[dict[str, Any], Entry] | None:
        """Agree on the newest step every rank holds in memory (a collective), then read it;
        None when a disk checkpoint in `disk` is newer or any rank cannot read it."""
        world_size, my_rank, local = world(), rank(), self.local_rank
        mine = memory.steps(self.directory, world=world_size, rank=my_rank, local_rank=local)
        found = candidates(disk) if looks_at_disk() else []
        view = {"mem": mine, "disk": found[0].step if found else -1}
        multi = dist_on() and world_size > 1
        views = ([json.loads(b) for b in all_gather_bytes(json.dumps(view).encode(), cpu_group())]
                 if multi else [view])
        common = set.intersection(*(set(v["mem"]) for v in views))
        newest_disk = max(v["disk"] for v in views)
        step = max(common) if common else None
        state, why = None, None
        if step is None or step < newest_disk:
            why = "no step held by every rank" if step is None else f"disk checkpoint at step {newest_disk} is newer"
        else:
            try:
                state = memory.read(self.directory, step, world=world_size, rank=my_rank, local_rank=local)
            except Exception as e:  # noqa: BLE001 - any damage means: use the disk
                why = f"unreadable: {type(e).__name__}: {e}"
        ok = state is not None
        if multi:
            t = torch.tensor([int(ok)], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group())
            ok = bool(t.item())
        if not ok:
            if any(v["mem"] for v in views):
                log.info("memory_state_skipped", reason=why or "another rank could not read it",
                         action="loading the newest disk checkpoint")
            memory.keep_only(self.directory, local_rank=local, world=world_size, rank=my_rank, step=None)
            return None
        memory.keep_only(self.directory, local_rank=local, world=world_size, rank=my_rank, step=step)
        self.resumed = step
        assert state is not None
        return state, Entry(file=f"memory:{self.directory}/w{world_size}-s{step:012d}", step=step,
                            world_size=world_size)

    def refresh(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> float:
        """Write `state` (or what the callable, around capture(), returns) as `step`; the stall
        in seconds. A full or missing tmpfs, or a state it cannot hold, turns the in-memory
        state off with one warning; disk checkpoints go on."""
        if not self.every:
            return 0.0
        t0 = time.perf_counter()
        owned = None
        if callable(state):
            how = Refresh(whole=self.local_rank == 0, owned=set() if self.overlap else None)
            token = REFRESH.set(how)
            try:
                state = state()
            finally:
                REFRESH.reset(token)
            owned = how.owned
        mapped = True
        writer = self.writer
        try:
            if writer is None:
                writer = self.writer = memory.Writer(self.directory, self.local_rank, keep_step=self.resumed,
                                                     overlap=self.overlap)
            mapped = writer.write(int(step), state, world=world(), rank=rank(), owned=owned, started=t0)
            if writer.notice:
                log.warning("memory_overlap_off", reason=writer.notice, action="copying synchronously from now on")
                writer.notice = None
        except (OSError, TypeError) as e:
            log.warning("memory_state_off", directory=self.directory, error=f"{type(e).__name__}: {e}",
                        action="continuing with disk checkpoints only")
            self.on = False
            if self.writer is not None:
                self.writer.close()
                self.writer = None
        self.last_stall = time.perf_counter() - t0
        figures = elasticd._beat_writer()
        if figures is not None:
            figures.add("refreshes", 1)
            figures.add("refresh_total", self.last_stall)
            figures.note("refresh_last", self.last_stall)
            figures.note("refresh_every", self.every)
        if self.on:
            if not mapped and not writer.queued:
                self.cadence.costs.append(self.last_stall)
            self.cadence.costs.extend(writer.costs())  # overlapped refreshes, once their events passed
        return self.last_stall
