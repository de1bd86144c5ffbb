"""The in-memory state as a CheckpointManager drives it: when to refresh (cadence.Cadence, agreed
across ranks), the refresh itself (Writer, with capture() told it is one), and resuming
from it, at the same world size or another one (choose() has the rules).

Resuming after a world-size change. In DDP every node's local rank 0 slot holds the whole state
(model, optimizer, scheduler, scaler, sampler, user values), the same on every node at a step;
what is per rank is only the RNG. So after a node is lost the survivors resume from their own
memory, and after nodes join, a rank whose node lacks the step receives the slot's bytes from a
rank that holds it (point to point over the library's gloo group, no pickle: reader.raw() and
reader.decode(), with a MAC made with the job's key: memory.seal). The sampler's state (epoch,
positions consumed) does not depend on the world size, so the rest of the epoch is dealt out over
the new world and each sample is still seen once.

A sharded job (FSDP2) differs: every rank keeps its own shards, over nodes with a replica on the
next node (memory.replica), and a resume takes each old rank's shards from whoever holds them and
places them in the new mesh (memory.shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from elasticd import names
from elasticd.checkpoint import audit, sharded
from elasticd.checkpoint.collectives import (
    all_gather_bytes,
    all_ok,
    cpu_group,
    dist_on,
    rank,
    recv_bytes,
    send_bytes,
    world,
)
from elasticd.checkpoint.disk.files import load_latest_entry, looks_at_disk
from elasticd.checkpoint.disk.format import Entry, candidates
from elasticd.checkpoint.memory import cadence, reader, replica, seal, shards, slots
from elasticd.checkpoint.memory import directory as memdir
from elasticd.checkpoint.memory.choice import newest
from elasticd.checkpoint.memory.writer import Writer
from elasticd.checkpoint.training_state import REFRESH, Refresh
from elasticd.worker import heartbeat

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True)
class Choice:
    """The step a resume from memory takes, the same on every rank (see choose())."""

    step: int
    lineage: int
    world: int  # the world size that wrote it
    holders: tuple[int, ...]  # ranks whose node holds its whole state
    keepers: tuple[int, ...]  # ranks whose own slot holds their RNG at it: they keep it


def choose(views: list[dict[str, Any]]) -> tuple[Choice | None, str]:
    """The newest (step, lineage) that every rank of the new world can resume from, from what
    each rank (its index in `views`) reported: "whole", its node's local rank 0 slots as
    [step, lineage, local world size, world size]; "own", its own local rank's slots as
    [step, lineage]; "local", its local rank; "disk", the newest disk checkpoint it sees (-1).

    - The whole state must be held by at least one rank's node: every other rank receives it
      from one that holds it, so no rank is ever asked to resume a step it cannot get.
    - A step older than the newest disk checkpoint is not taken (the disk's is; equal: memory).
    - A rank that took part in the step's lineage (its own slot holds a step of it, or its node
      held that lineage's whole state with at least local rank + 1 local ranks) must hold its own
      RNG at the step: for a same-world crash resume that keeps the run bit-exact, and a torn
      refresh on one rank means the step before. A rank that did not (its node was lost or is
      new, or this local rank did not exist on it) gets its RNG re-derived (derived_base()).
    - Ties (the same step in two lineages, from a node that missed a resume): the one more ranks
      hold, then the larger lineage number, so that every rank picks the same.

    Returns (the choice or None, why none)."""
    holders: dict[tuple[int, int], list[int]] = {}
    wrote: dict[tuple[int, int], int] = {}
    for r, v in enumerate(views):
        for step, lineage, _local_world, world_size in v["whole"]:
            holders.setdefault((step, lineage), []).append(r)
            wrote[(step, lineage)] = world_size

    def fits(step: int, lineage: int) -> tuple[Choice | None, str]:
        lacking = [r for r, v in enumerate(views) if not _fits(v, step, lineage)]
        if lacking:
            return None, f"rank {lacking[0]} lacks its own RNG state at step {step}"
        keepers = tuple(r for r, v in enumerate(views) if [step, lineage] in v["own"])
        have = tuple(holders[(step, lineage)])
        return Choice(step, lineage, wrote[(step, lineage)], have, keepers), ""

    disk = max(v["disk"] for v in views)
    return newest({k: len(v) for k, v in holders.items()}, disk, fits)


def _fits(view: dict[str, Any], step: int, lineage: int) -> bool:
    if [step, lineage] in view["own"]:
        return True
    took_part = any(x == lineage for _, x in view["own"]) or any(
        x == lineage and lw > view["local"] for _, x, lw, _ in view["whole"]
    )
    return not took_part


def derived_base(step: int, world_size: int) -> int:
    """The base of the RNG seeds of ranks that resume from memory without their own RNG state:
    a hash of the step and the new world size, so a rank's seed (rng.derived_seed: a hash of this
    base and its global rank) is reproducible, differs from rank to rank and from resume to
    resume, and a resume repeated at the same step and world draws the same numbers again. (The
    lost ranks' own states cannot be copied: they were only ever in the lost node's memory.)"""
    data = (
        b"elasticd in-memory resume"
        + step.to_bytes(8, "little", signed=True)
        + world_size.to_bytes(8, "little")
    )
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


class MemoryState:
    """This rank's share of the node's in-memory state: on by default under elasticd, which owns
    the directory (names.MEMORY_DIR); off for good after a refresh that failed."""

    def __init__(
        self, directory: str | os.PathLike | None, every: int | None, budget: float, overlap: bool
    ):
        mem = directory if directory is not None else os.environ.get(names.MEMORY_DIR)
        self.directory = os.fspath(mem) if mem else None
        if every is not None and int(every) < 0:
            raise ValueError(
                f"memory_every must be a number of steps (0: off; None: follow memory_budget), "
                f"got {every}"
            )
        if not 0 < budget < 1:
            raise ValueError(
                f"memory_budget is a share of step time, between 0 and 1 (0.01: 1%), got {budget}"
            )
        self.cadence = cadence.Cadence(
            every=int(every or 1), budget=budget if every is None else None
        )
        self.on = bool(self.directory) and every != 0
        # Whether load() takes part in the resume from memory (a collective): on every rank alike
        # under elasticd or with a directory given, even where this node has no directory (it
        # can still receive the state); never under a launcher that gives none.
        self.wanted = every != 0 and (self.on or names.AGENT in os.environ)
        self.overlap = bool(overlap)
        self.last_stall = 0.0
        self.writer: Writer | None = None  # made at the first refresh, after loading
        self.resumed: tuple[int, int] | None = (
            None  # the (step, lineage) load() resumed from, in this rank's slot
        )
        self.lineage = 0  # stamped on every refresh: agreed at load(), 0 without one
        # 0 keeps the node's state, others their RNG: the real local rank, also under
        # --virtual-local-rank
        self.local_rank = int(os.environ.get(names.LOCAL_RANK) or os.environ.get("LOCAL_RANK", 0))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0))  # 0: unknown
        # sharded, over nodes: a replica of this rank's slot on the next node (memory.replica)
        self.ring = replica.Ring(self.directory, self.local_rank, self.local_world)

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
        figures = heartbeat.writer()
        if figures is not None:
            figures.note("refresh_every", self.every)
        if rank() == 0:
            refresh, step = self.cadence.measured  # this rank's; the agreed N may come from another
            log.info(
                "memory_cadence",
                every=self.every,
                budget=self.cadence.budget,
                refresh_ms=round(1e3 * refresh, 3),
                step_ms=round(1e3 * step, 3),
                **self.ring.figures(),
            )

    def close(self) -> None:
        """Let the exchange in flight land and the slots go (CheckpointManager.close)."""
        if self.writer is not None:
            with contextlib.suppress(OSError):
                self.writer.settle(timeout=10)  # what the exchange in flight waits for
        self.ring.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def load(
        self, disk: str, took: Callable[[Any], dict[str, Any] | None] | None = None
    ) -> tuple[dict[str, Any], Entry] | None:
        """Agree on the step to resume from memory (a collective; rules: choose()), at this
        world size or another, then read it where this rank's node holds it and send it to the
        ranks whose node does not; None when a disk checkpoint in `disk` is newer, no step
        qualifies or any rank cannot read what it needs. Every rank agrees on a new lineage
        here for the steps it will write, whatever is resumed. `took`: what the caller does with
        a disk checkpoint's (state, entry) (CheckpointManager's bookkeeping), for a sharded resume
        that fails in restore() and loads the disk instead (_instead)."""
        views, multi = self._views(disk)
        self.lineage = int(views[0]["next"])
        if any(v["pieces"] for v in views):  # a sharded job's
            return self._load_shards(views, disk, multi, took)
        return self._load_whole(views, multi)

    def _views(self, disk: str) -> tuple[list[dict[str, Any]], bool]:
        """What every rank holds (its node's whole slots, its own, its shards) and the newest disk
        step it sees, gathered from all ranks (a collective); and whether there are several."""
        local = self.local_rank
        node = slots.held(self.directory, 0)
        own = node if local == 0 else slots.held(self.directory, local)
        found = candidates(disk) if looks_at_disk() else []
        view = {
            "whole": [[h.step, h.lineage, h.local_world, h.world] for h in node],
            "own": [[h.step, h.lineage] for h in own],
            "local": local,
            "disk": found[0].step if found else -1,
            "next": int.from_bytes(os.urandom(8), "little") >> 1 or 1,
            "pieces": shards.view(self.directory, local),
        }  # rank 0's is taken
        multi = dist_on() and world() > 1
        if not multi:
            return [view], False
        gathered = all_gather_bytes(json.dumps(view).encode(), cpu_group())
        return [json.loads(b) for b in gathered], True

    def _load_shards(
        self,
        views: list[dict[str, Any]],
        disk: str,
        multi: bool,
        took: Callable[[Any], dict[str, Any] | None] | None,
    ) -> tuple[dict[str, Any], Entry] | None:
        """A sharded job's resume (memory/shards.py), falling back to the disk together if a rank
        fails to restore its pieces (_instead)."""
        got = shards.resume(views, self.directory, self.local_rank, multi, derived_base)
        self.resumed = got[2] if got is not None else None
        if got is None:
            return None
        pieces = got[0].get("model")
        if isinstance(pieces, shards.Pieces):
            on_disk = max(v["disk"] for v in views) >= 0
            pieces.fallback = lambda why: self._instead(why, disk, on_disk, took)
        return got[:2]

    def _load_whole(
        self, views: list[dict[str, Any]], multi: bool
    ) -> tuple[dict[str, Any], Entry] | None:
        """A replicated job's resume: the chosen step read here or received from its holder."""
        world_size, my_rank, local = world(), rank(), self.local_rank
        choice, why = choose(views)
        state, source = None, None
        if choice is not None:
            state, source, why = self._fetch(choice, world_size, my_rank, multi)
            if not all_ok(state is not None, multi):
                choice, state = None, None
        if choice is None or state is None:
            if any(v["whole"] for v in views):
                log.info(
                    "memory_state_skipped",
                    reason=why or "another rank could not read it",
                    action="loading the newest disk checkpoint",
                )
            slots.keep_only(self.directory, local_rank=local, keep=None)
            return None
        self.resumed = (choice.step, choice.lineage) if my_rank in choice.keepers else None
        slots.keep_only(self.directory, local_rank=local, keep=self.resumed)
        received = [r for r in range(world_size) if r not in choice.holders]
        if my_rank == 0 and (received or choice.world != world_size):
            log.info(
                "memory_state_shared",
                step=choice.step,
                world_was=choice.world,
                world=world_size,
                received_by=received,
                rng_derived=[r for r in range(world_size) if r not in choice.keepers],
            )
        return state, Entry(
            file=f"memory:{source}/w{choice.world}-s{choice.step:012d}",
            step=choice.step,
            world_size=choice.world,
        )

    def _instead(
        self,
        why: str,
        disk: str,
        on_disk: bool,
        took: Callable[[Any], dict[str, Any] | None] | None,
    ) -> dict[str, Any]:
        """The newest disk checkpoint's state, which every rank takes together when a sharded
        resume from memory failed in restore() on some rank (`why`); the slots go as at any
        skip. Without a disk checkpoint this attempt ends: the live model and optimizer were
        already touched (the optimizer's state made by get_state_dict or taken from the slot,
        and other ranks may have loaded the memory's), so only a fresh start is a start from
        scratch."""
        action = (
            "loading the newest disk checkpoint"
            if on_disk
            else "no disk checkpoint: ending this attempt, the next starts from scratch"
        )
        if rank() == 0:
            reason = f"resuming from memory failed on {why}"
            log.info("memory_state_skipped", reason=reason, action=action)
        for kind in (slots.OWN, slots.REPLICA):
            slots.keep_only(self.directory, local_rank=self.local_rank, keep=None, kind=kind)
        self.resumed = None
        got = load_latest_entry(disk) if on_disk else None
        state = took(got) if took is not None else got and got[0]
        if state is None:
            raise RuntimeError(
                f"resuming from memory failed on {why}, and there is no disk checkpoint to load "
                "instead: the in-memory state is dropped, so the restart starts from scratch"
            )
        return state

    def _fetch(
        self, choice: Choice, world_size: int, my_rank: int, multi: bool
    ) -> tuple[dict[str, Any] | None, str | None, str | None]:
        """This rank's state at the chosen step: read from its node's slot, or received from the
        holder assigned to it (receivers are dealt out over the holders in turn, so each holder
        sends to a share of them); with its own RNG where its slot holds it, else the seed base
        that restore() derives its RNG from. Returns (state or None, where it came from, why not).
        Every holder assigned a receiver sends to it, bytes or nothing, whatever happened here."""
        step, lineage = choice.step, choice.lineage
        receivers = [r for r in range(world_size) if r not in choice.holders]
        sender = {r: choice.holders[i % len(choice.holders)] for i, r in enumerate(receivers)}
        body, source, why = None, self.directory, None
        if my_rank in sender:
            source = f"rank{sender[my_rank]}"
            data = recv_bytes(sender[my_rank], cpu_group())
            tag = bytes(recv_bytes(sender[my_rank], cpu_group()))  # its MAC (memory.seal)
            try:
                body = reader.decode(data, step, lineage, tag)
            except Exception as e:  # noqa: BLE001 - nothing (the sender failed) or damage: use the disk
                why = (
                    f"not received from rank {sender[my_rank]}: {type(e).__name__}: {e}"
                    if data
                    else f"rank {sender[my_rank]} could not read it"
                )
            del data
        else:
            to = [r for r in receivers if sender[r] == my_rank]
            data = bytearray()
            try:
                if to:
                    data = reader.raw(self.directory, step, lineage)
                    body = reader.decode(data, step, lineage)
                else:
                    body = reader.load(self.directory, 0, step, lineage)
            except Exception as e:  # noqa: BLE001 - any damage means: use the disk
                why, data = f"unreadable: {type(e).__name__}: {e}", bytearray()
            tag = seal.whole(data) if data else b""
            for dst in to:
                send_bytes(data, dst, cpu_group())
                send_bytes(tag, dst, cpu_group())
            del data
        if body is None:
            return None, None, why
        state = dict(body["state"])
        if body.get("rng") is None:  # captured with rng=False: no rank's RNG is touched
            return state, source, None
        mine = None
        if my_rank in choice.keepers:
            try:
                mine = (
                    body["rng"]
                    if self.local_rank == 0
                    else reader.load(self.directory, self.local_rank, step, lineage).get("rng")
                )
            except Exception as e:  # noqa: BLE001
                return None, None, f"own RNG state unreadable: {type(e).__name__}: {e}"
        ranks: list[Any] = [None] * world_size
        ranks[my_rank] = mine
        state["rng"] = {
            "world_size": world_size,
            "ranks": ranks,
            "seed": derived_base(step, world_size),
        }
        return state, source, None

    def refresh(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        auditor: audit.Auditor | None = None,
    ) -> float:
        """Write `state` (or what the callable, around capture(), returns) as `step`; the stall
        in seconds. A callable's state is audited first (`auditor`, a collective; its cost, here or
        on the boundary's all-reduce, counts as the refresh's under the cadence's budget) and
        written only if the replicas agree. A full or
        missing tmpfs, or a state it cannot hold, turns the in-memory state off with one
        warning; disk checkpoints go on."""
        if not self.every:
            return 0.0
        t0 = time.perf_counter()
        state, owned, shard = self._capture(step, state, auditor)
        mapped, writer = self._write(int(step), state, owned, shard, t0)
        self.last_stall = time.perf_counter() - t0
        self._account(step, mapped, writer, auditor)
        return self.last_stall

    def _capture(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        auditor: audit.Auditor | None,
    ) -> tuple[Mapping[str, Any], set[str] | None, bool]:
        """The state to write, the keys this rank owns (overlap) and whether it holds shards; a
        callable runs under this refresh's context and is audited (raises on a disagreement)."""
        if not callable(state):  # captured already, for a disk save at the same step
            return state, None, sharded.holds_shards(state)
        how = Refresh(whole=self.local_rank == 0, owned=set() if self.overlap else None)
        seen = auditor.wanted() if auditor is not None else None
        token, watched = REFRESH.set(how), audit.SEEN.set(seen)
        try:
            captured = state()
        finally:
            audit.SEEN.reset(watched)
            REFRESH.reset(token)
        if auditor is not None:
            auditor.check(step, seen)  # raises on a disagreement: nothing is written
        return captured, how.owned, how.sharded

    def _write(
        self, step: int, state: Mapping[str, Any], owned: set[str] | None, shard: bool, t0: float
    ) -> tuple[bool, Writer | None]:
        """Into this rank's slot (and, sharded, off to the next node's replica); whether the slot
        was mapped in place. A full or missing tmpfs, or a state it cannot hold, turns the
        in-memory state off with one warning."""
        mapped, writer = True, self.writer
        try:
            if shard and writer is not None:
                writer.settle()  # an overlapped slot whole (or dropped) before its exchange ends
            self.ring.wait()  # the last refresh's exchange lands before a slot is reused
            if writer is None:
                writer = self.writer = Writer(
                    self.directory,
                    self.local_rank,
                    keep=self.resumed,
                    overlap=self.overlap,
                    lineage=self.lineage,
                    local_world=self.local_world,
                )
            mapped = writer.write(
                step, state, world=world(), rank=rank(), owned=owned, started=t0, sharded=shard
            )
            if shard and writer.written is not None:
                self.ring.send(*writer.written, writer.landed if writer.queued else None)
            if writer.notice:
                log.warning(
                    "memory_overlap_off",
                    reason=writer.notice,
                    action="copying synchronously from now on",
                )
                writer.notice = None
        except (OSError, TypeError) as e:
            log.warning(
                "memory_state_off",
                directory=self.directory,
                error=f"{type(e).__name__}: {e}",
                action="continuing with disk checkpoints only",
                **({"fix": memdir.full_fix(e)} if isinstance(e, OSError) else {}),
            )
            self.close()
            self.on = False
        return mapped, writer

    def _account(
        self, step: int, mapped: bool, writer: Writer | None, auditor: audit.Auditor | None
    ) -> None:
        """The stall into the heartbeat's figures and the cadence's budget."""
        figures = heartbeat.writer()
        if figures is not None:
            figures.add("refreshes", 1)
            figures.add("refresh_total", self.last_stall)
            figures.note("refresh_last", self.last_stall)
            figures.note("refresh_every", self.every)
        if not self.on or writer is None:
            return
        if not mapped and not writer.queued:
            # the audit's digest of this step, made before the refresh (on the boundary's
            # all-reduce), is the refresh's cost too: both stay under the one budget
            spent = auditor.spent(step) if auditor is not None else 0.0
            self.cadence.costs.append(self.last_stall + spent)
        self.cadence.costs.extend(writer.costs())  # overlapped refreshes, once their events passed
