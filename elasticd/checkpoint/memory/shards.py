"""A sharded model's resume from memory: which step (choose), where each old rank's shards come
from (fetch), and how they are placed in the live model's mesh, at the same or another world size
(Pieces.restore).

In a sharded job every rank's own slot holds its own shards (each DTensor's local shard and its
offsets in the global tensor, description.Chunk) and the rest of the state, which is the same on
every rank (sampler, scheduler, user values). A rank of a job spread over nodes also keeps a
replica of one rank of the next node (memory.replica), so after one lost node every old rank's
shards are still in some survivor's memory.

- Same world, every rank holding its own slot at the step: each rank reads its own slot, nothing
  crosses the network, and the shards go back where they were (a bit-exact resume).
- Otherwise (a node lost, nodes joined): for each old rank, one rank that holds its slot (its own,
  else a replica) serves it, and in restore() each rank receives from the servers only the parts
  of the old shards that overlap its new ones (box intersections of the chunks, as
  torch.distributed.checkpoint's resharding does on disk; memory.exchange).
- A failure on any rank after the ranks agreed on the step (a slot unreadable, damage in transit,
  a shape that does not fit, set_state_dict raising) is agreed by all, which load the newest disk
  checkpoint instead (Pieces.fallback), with one line saying what failed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import torch

from elasticd.checkpoint import sharded
from elasticd.checkpoint.collectives import (
    broadcast_bytes,
    cpu_group,
    dist_on,
    from_bytes,
    rank,
    to_bytes,
    world,
)
from elasticd.checkpoint.disk.format import Entry
from elasticd.checkpoint.memory import exchange, reader, seal
from elasticd.checkpoint.memory.choice import newest
from elasticd.checkpoint.memory.description import Chunk
from elasticd.checkpoint.memory.slots import OWN, REPLICA, held, invalidate, keep_only, slot_path
from elasticd.checkpoint.training_state import InMemory
from elasticd.checkpoint.walk import where

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True)
class Choice:
    """The step a sharded resume from memory takes, the same on every rank."""

    step: int
    lineage: int
    world: int  # the world size that wrote it
    source: tuple[tuple[int, str], ...]  # per old rank: (the new rank that holds it, OWN/REPLICA)
    keepers: tuple[int, ...]  # new ranks whose own slot holds their RNG at the step
    direct: bool  # same world, each rank its own slot: nothing crosses the network


def view(directory: str | None, local_rank: int) -> list[list]:
    """This rank's sharded slots as [step, lineage, world, old rank, OWN or REPLICA]."""
    return [
        [h.step, h.lineage, h.world, h.rank, kind]
        for kind in (OWN, REPLICA)
        for h in held(directory, local_rank, kind)
        if h.sharded
    ]


def choose(views: list[dict[str, Any]], world_size: int) -> tuple[Choice | None, str]:
    """The newest (step, lineage) whose every old rank's slot some rank of the new world holds
    (its own or a replica), not older than the newest disk checkpoint ("disk"), and at which every
    rank that took part in the lineage holds its own slot (a torn refresh: the step before).
    Ties: the one more old ranks are held of, then the larger lineage (choice.newest). (None,
    why) when none."""
    have: dict[tuple[int, int], dict[int, list[tuple[int, str]]]] = {}
    wrote: dict[tuple[int, int], int] = {}
    for r, v in enumerate(views):
        for step, lineage, size, old, kind in v["pieces"]:
            have.setdefault((step, lineage), {}).setdefault(old, []).append((r, kind))
            wrote[(step, lineage)] = size
    own = [{(p[0], p[1]) for p in v["pieces"] if p[4] == OWN} for v in views]

    def fits(step: int, lineage: int) -> tuple[Choice | None, str]:
        by, was = have[(step, lineage)], wrote[(step, lineage)]
        missing = [q for q in range(was) if q not in by]
        if missing:
            return None, (
                f"no survivor holds rank {missing[0]}'s shards of step {step} in memory (its "
                f"node and the node keeping its replica are both gone)"
            )
        lacking = [
            r
            for r, mine in enumerate(own)
            if (step, lineage) not in mine and any(x == lineage for _, x in mine)
        ]
        if lacking:
            return None, f"rank {lacking[0]} lacks its own slot at step {step}"
        source = tuple(
            min(by[q], key=lambda rk, q=q: (rk[1] != OWN, rk[0] != q, rk[0])) for q in range(was)
        )
        keepers = tuple(r for r, mine in enumerate(own) if (step, lineage) in mine)
        direct = was == world_size and all(source[q] == (q, OWN) for q in range(was))
        return Choice(step, lineage, was, source, keepers, direct), ""

    disk = max(v["disk"] for v in views)
    return newest({k: len(v) for k, v in have.items()}, disk, fits)


def resume(
    views: list[dict[str, Any]],
    directory: str | None,
    local_rank: int,
    multi: bool,
    seed_base: Callable[[int, int], int],
) -> tuple[dict[str, Any], Entry, tuple[int, int] | None] | None:
    """MemoryState.load() for a sharded job (a collective): (state, entry, the (step, lineage)
    this rank's own slot keeps, if any), or None (after one line saying why) for the disk.
    `seed_base(step, world)`: the RNG seed base of ranks without their own slot. A replica whose
    MAC does not verify is refused by the rank that read it (one line, memory_replica_refused)
    and the ranks choose again without it: another holder, an older step, or the disk."""
    world_size, my_rank = world(), rank()
    refused: set[tuple] = set()  # (holder rank, step, lineage, world, old rank, kind)
    first = ""  # why the first choice failed, when replicas were refused
    while True:
        choice, why = choose(_without(views, refused), world_size)
        why = f"{first}; without it, {why}" if first and choice is None else why
        body = None
        if choice is None:
            break
        body, why, bad = fetch(choice, directory, local_rank, my_rank, multi)
        mine = None if body is not None else f"rank {my_rank}: {why or 'nothing read'}"
        failed, agreed = agree(mine, multi, refused=bad)  # every rank: the first failure's line
        if failed is None:
            break
        choice, body, why = None, None, failed
        new = {tuple(p) for v in agreed for p in v["refused"]} - refused
        if not new:
            break
        refused, first = refused | new, first or failed
    if choice is None or body is None:
        if my_rank == 0:
            log.info(
                "memory_state_skipped",
                reason=why or "another rank could not read it",
                action="loading the newest disk checkpoint",
            )
        for kind in (OWN, REPLICA):
            keep_only(directory, local_rank=local_rank, keep=None, kind=kind)
        return None
    kept = (choice.step, choice.lineage)
    resumed = kept if my_rank in choice.keepers else None
    keep_only(directory, local_rank=local_rank, keep=resumed)
    keep_only(directory, local_rank=local_rank, keep=kept, kind=REPLICA)
    state = body["state"]
    if body["rng"] is not None or my_rank not in choice.keepers:
        ranks: list[Any] = [None] * world_size
        ranks[my_rank] = body["rng"]
        seed = seed_base(choice.step, world_size)
        state["rng"] = {"world_size": world_size, "ranks": ranks, "seed": seed}
    replicas = sorted({q for q, (_, kind) in enumerate(choice.source) if kind != OWN})
    if my_rank == 0:
        log.info(
            "memory_state_sharded",
            step=choice.step,
            world_was=choice.world,
            world=world_size,
            exchanged=not choice.direct,
            from_replicas=replicas,
            rng_derived=[r for r in range(world_size) if r not in choice.keepers],
        )
    where_from = "replicas" if replicas else "own" if choice.direct else "exchanged"
    entry = Entry(
        file=f"memory:{directory}/sharded-{where_from}/w{choice.world}-s{choice.step:012d}",
        step=choice.step,
        world_size=choice.world,
    )
    return state, entry, resumed


def _without(views: list[dict[str, Any]], refused: set[tuple]) -> list[dict[str, Any]]:
    """The ranks' views less the refused pieces (each (holder rank, *piece))."""
    if not refused:
        return views
    return [
        v | {"pieces": [p for p in v["pieces"] if (r, *p) not in refused]}
        for r, v in enumerate(views)
    ]


def fetch(
    choice: Choice, directory: str | None, local_rank: int, my_rank: int, multi: bool
) -> tuple[dict[str, Any] | None, str | None, list[list]]:
    """(body, why not, the pieces refused here): this rank's view of the chosen step, {"state":
    the rest of the state with a Pieces where the model and optimizer go, "rng": this rank's
    own or None}; a replica whose MAC does not verify is refused (one line, the slot
    invalidated: never loaded) and named among the pieces refused, as [this rank, *piece]. Not
    `choice.direct`: the slots this rank serves are read here, the shards move in restore()
    (memory.exchange), and the rest comes from the holder of old rank 0's slot (a collective:
    every rank takes part in its broadcast, whatever failed)."""
    step, lineage = choice.step, choice.lineage
    why, own = None, None
    if my_rank in choice.keepers:
        try:
            own = reader.load(directory, local_rank, step, lineage)
        except Exception as e:  # noqa: BLE001 - any damage means: use the disk
            why = f"own slot unreadable: {type(e).__name__}: {e}"
    rng = own.get("rng") if own is not None else None
    if choice.direct:
        if why is not None or own is None:
            return None, why or "nothing read", []
        return {"state": _with_pieces(own["state"], Pieces([own["state"]])), "rng": rng}, None, []
    held, refused = {}, []
    for q, (src, kind) in enumerate(choice.source):
        if src != my_rank:
            continue
        try:
            mine = own if kind == OWN and own is not None else None
            held[q] = (mine or reader.load(directory, local_rank, step, lineage, kind))["state"]
        except seal.Refused as e:
            refused.append([my_rank, step, lineage, choice.world, q, kind])
            why = why or f"rank {q}'s replica refused: {e}"
            _refuse(directory, local_rank, choice, q, str(e))
        except Exception as e:  # noqa: BLE001 - sent as nothing: every rank uses the disk
            why = why or f"rank {q}'s slot unreadable: {type(e).__name__}: {e}"
    first = choice.source[0][0]
    context = (step, lineage, first)
    data = b""
    if 0 in held and why is None:
        data = to_bytes(exchange.skeleton(held[0]))
        data += seal.mac("skeleton", context, data)
    data = broadcast_bytes(data, first, cpu_group()) if multi else data
    if not data:
        return None, why or f"rank {first} could not read rank 0's slot", refused
    try:
        tag, data = data[-seal.SIZE :], data[: -seal.SIZE]
        if not seal.matches(tag, seal.mac("skeleton", context, data)):
            raise seal.Refused("its MAC does not verify")
        rest = from_bytes(data)
    except Exception as e:  # noqa: BLE001
        return None, f"rank 0's state damaged in transit: {type(e).__name__}: {e}", refused
    if why is not None:
        return None, why, refused
    serves = [src for src, _ in choice.source]
    parts = {k: rest[k] for k in sharded.PARTS if k in rest}
    pieces = Pieces(exchange=exchange.Exchange(parts, held, serves, (step, lineage)))
    return {"state": _with_pieces(rest, pieces), "rng": rng}, None, refused


def _refuse(directory: str | None, local_rank: int, choice: Choice, old: int, why: str) -> None:
    """A replica whose MAC does not verify: one line, and its slot invalidated."""
    log.warning(
        "memory_replica_refused",
        step=choice.step,
        old_rank=old,
        rank=rank(),
        reason=f"{why}: changed on the way from its node or in this node's /dev/shm",
        action="resuming from another holder, an older step or the disk",
    )
    for h in held(directory, local_rank, REPLICA):
        if (h.step, h.lineage) == (choice.step, choice.lineage):
            invalidate(slot_path(directory, local_rank, h.k, REPLICA))


def _with_pieces(state: Mapping[str, Any], pieces: Pieces) -> dict[str, Any]:
    """The rest of the state, with `pieces` where the model and optimizer go."""
    out = {k: v for k, v in state.items() if k not in sharded.PARTS}
    for part in sharded.PARTS:
        if part in state:
            out[part] = pieces
    return out


class Pieces(InMemory):
    """The model and optimizer parts of a sharded resume from memory, which restore() places in
    the live model's own shards and loads through set_state_dict: at the same world each rank's
    own slot (`pieces`, its Chunks), at another the shards received from their holders
    (`exchange`). A failure on any rank, in the exchange, the placing or set_state_dict, is agreed
    by every rank, which then all load the newest disk checkpoint instead (`fallback`, set by
    MemoryState.load: the state restore() goes on with)."""

    def __init__(self, pieces: list[Mapping[str, Any]] | None = None, exchange: Any = None) -> None:
        self.pieces, self.exchange = pieces, exchange
        self.fallback: Callable[[str], Mapping[str, Any]] | None = None

    def restore(
        self, state: Mapping[str, Any], model, optimizer, strict: bool
    ) -> Mapping[str, Any] | None:
        multi = dist_on() and world() > 1
        new_m = new_o = why = None
        if self.exchange is not None:
            new_m, new_o, why = self.exchange.place(model, optimizer, multi)
            if why is None and optimizer is not None:
                seed(optimizer, model, new_o)
        else:
            try:
                new_m, new_o = self._own(model, optimizer)
            except Exception as e:  # noqa: BLE001 - agreed below: every rank uses the disk
                why = f"rank {rank()}: {type(e).__name__}: {e}"
        why, _ = agree(why, multi)
        if why is None:
            try:
                sharded.apply(model, optimizer, new_m, new_o, strict)
            except Exception as e:  # noqa: BLE001
                why = f"rank {rank()}: set_state_dict: {type(e).__name__}: {e}"
            got = self.exchange.received if self.exchange is not None else 0
            why, views = agree(why, multi, received=got)
            if why is None and self.exchange is not None and rank() == 0:
                log.info(
                    "memory_state_exchanged",
                    received_bytes=[v["received"] for v in views],
                    seconds=round(self.exchange.seconds, 3),
                )
        if why is None:
            return None
        if self.fallback is None:
            raise RuntimeError(f"the in-memory resume failed: {why}")
        return self.fallback(why)

    def _own(self, model, optimizer) -> tuple[Any, Any]:
        assert self.pieces is not None
        if optimizer is not None and len(self.pieces) == 1:
            seed(optimizer, model, self.pieces[0].get("optimizer"))
        msd, osd = sharded.state_dicts(model, optimizer)
        new_m = _place([p["model"] for p in self.pieces], msd, (None, "model"))
        new_o = None
        if optimizer is not None:
            new_o = _place([p["optimizer"] for p in self.pieces], osd, (None, "optimizer"))
        return new_m, new_o


def seed(optimizer, model, saved: Any) -> None:
    """A fresh optimizer's state made from a sharded resume's (`saved`: the optimizer part, its
    tensors read from the own slot as Chunks, or placed by the exchange as DTensors), where each
    is exactly this rank's shard of its parameter (sharded.fresh_by_name says which optimizer
    and names qualify). set_state_dict loads the same values after; without this it would first
    make a state by a step of zero gradients (0.44 s of a 1 GB Adam job's load), only to replace
    it. Anything else leaves the optimizer to torch."""
    state = saved.get("state") if isinstance(saved, Mapping) else None
    named = sharded.fresh_by_name(model, optimizer, state)
    if named is None:
        return
    seeds = {}
    for name, values in state.items():
        if not isinstance(values, Mapping):
            return
        entry = {}
        for k, v in values.items():
            if isinstance(v, (Chunk, torch.Tensor)) and getattr(v, "ndim", 1):
                v = _shard_of(named[name], v)
                if v is None:
                    return
            entry[k] = v
        seeds[named[name]] = entry
    optimizer.state.update(seeds)


def _shard_of(param: Any, v: Any) -> Any:
    """`v` as a DTensor of the parameter's spec, where it is exactly the parameter's local shard
    (a Chunk read from the slot, or a DTensor the exchange placed); else None."""
    if isinstance(v, Chunk):
        return _as_read(param, v)
    if not isinstance(v, type(param)) or v.shape != param.shape or v.dtype != param.dtype:
        return None
    same = exchange.local_box(v) == exchange.local_box(param)
    return v if same and v.placements == param.placements else None


def _as_read(target: Any, c: Chunk) -> Any:
    """A DTensor of the live `target`'s spec around the chunk's tensor as it was read, where the
    chunk is exactly the target's local shard (the same world); else None. It was read from the
    slot for this load alone: a second copy of each shard was a third of a 1 GB load's time."""
    t = c.tensor
    exact = tuple(c.shape) == tuple(target.shape) and t.dtype == target.to_local().dtype
    if exact and [list(c.offsets), list(t.shape)] == exchange.local_box(target):
        return exchange.like(target, t.contiguous())
    return None


def agree(why: str | None, multi: bool, **extra: Any) -> tuple[str | None, list[dict]]:
    """(the first rank's reason, every rank's view) of a step of the resume that may have failed
    on some rank: every rank learns it, and all take the disk together."""
    views = exchange.gather_json({"why": why, **extra}, multi)
    return next((v["why"] for v in views if v["why"]), None), views


def _place(saved: list[Any], target: Any, at: Any) -> Any:
    """The saved value at one location (the same in every piece but for the Chunks), with each
    Chunk replaced by the live DTensor's shard filled from the pieces' chunks."""
    first = saved[0]
    if isinstance(first, Chunk):
        return _assemble(exchange.live_dtensor(target, at), saved, at)
    if isinstance(first, Mapping):
        live = target if isinstance(target, Mapping) else {}
        return type(first)((k, _place([s[k] for s in saved], live.get(k), (at, k))) for k in first)
    if isinstance(first, list):
        live = target if isinstance(target, list) else []
        return [
            _place([s[i] for s in saved], live[i] if i < len(live) else None, (at, i))
            for i in range(len(first))
        ]
    return first


def _assemble(target: Any, chunks: list[Chunk], at: Any) -> Any:
    """A DTensor of the live one's spec whose local shard is copied from the parts of the saved
    chunks that overlap it (each distinct chunk once: replicated dims repeat them); a chunk that
    is exactly this rank's shard is taken as read (_as_read)."""
    local = target.to_local()
    need = exchange.local_box(target)
    for c in chunks:
        if tuple(c.shape) != tuple(target.shape):
            raise ValueError(
                f"{where(at)}: shape {list(c.shape)} in memory, {list(target.shape)} in the model"
            )
    for c in chunks:
        if (as_read := _as_read(target, c)) is not None:
            return as_read
    out = torch.empty(need[1], dtype=local.dtype)
    covered, seen = 0, set()
    for c in chunks:
        key = (c.offsets, tuple(c.tensor.shape))
        hit = None if key in seen else exchange.meet(need, [list(key[0]), list(key[1])])
        seen.add(key)
        if hit is not None:
            lo, hi = hit
            exchange.window(out, lo, hi, need[0]).copy_(exchange.window(c.tensor, lo, hi, key[0]))
            covered += math.prod(h - low for h, low in zip(hi, lo))
    if covered != out.numel():
        raise ValueError(
            f"{where(at)}: the shards in memory cover {covered} of this rank's {out.numel()} values"
        )
    return exchange.like(target, out)
