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
  else a replica) broadcasts the slot's bytes over the library's gloo group, and every rank places
  the parts of the old shards that overlap its new ones: box intersections of the chunks, as
  torch.distributed.checkpoint's resharding does on disk. Each rank thus reads the whole state
  once in host memory (a later step: send each rank only the chunks it needs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import torch

from elasticd.checkpoint import sharded
from elasticd.checkpoint.collectives import all_ok, broadcast_bytes, cpu_group, rank, world
from elasticd.checkpoint.format import Entry
from elasticd.checkpoint.memory import reader
from elasticd.checkpoint.memory.description import Chunk
from elasticd.checkpoint.memory.slots import OWN, REPLICA, held, keep_only
from elasticd.checkpoint.state import InMemory
from elasticd.checkpoint.walk import where

log = structlog.get_logger()

PARTS = ("model", "optimizer")


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
    Ties: the one more old ranks are held of, then the larger lineage. (None, why) when none."""
    disk = max(v["disk"] for v in views)
    have: dict[tuple[int, int], dict[int, list[tuple[int, str]]]] = {}
    wrote: dict[tuple[int, int], int] = {}
    for r, v in enumerate(views):
        for step, lineage, size, old, kind in v["pieces"]:
            have.setdefault((step, lineage), {}).setdefault(old, []).append((r, kind))
            wrote[(step, lineage)] = size
    if not have:
        return None, "no step held in memory"
    why = ""
    for (step, lineage), by in sorted(
        have.items(), key=lambda kv: (kv[0][0], len(kv[1]), kv[0][1]), reverse=True
    ):
        if step < disk:
            return None, why or f"disk checkpoint at step {disk} is newer"
        was = wrote[(step, lineage)]
        missing = [q for q in range(was) if q not in by]
        if missing:
            why = why or (
                f"no survivor holds rank {missing[0]}'s shards of step {step} in memory (its "
                f"node and the node keeping its replica are both gone)"
            )
            continue
        own = [{(p[0], p[1]) for p in v["pieces"] if p[4] == OWN} for v in views]
        lacking = [
            r
            for r, mine in enumerate(own)
            if (step, lineage) not in mine and any(x == lineage for _, x in mine)
        ]
        if lacking:
            why = why or f"rank {lacking[0]} lacks its own slot at step {step}"
            continue
        source = tuple(
            min(by[q], key=lambda rk, q=q: (rk[1] != OWN, rk[0] != q, rk[0])) for q in range(was)
        )
        keepers = tuple(r for r, mine in enumerate(own) if (step, lineage) in mine)
        direct = was == world_size and all(source[q] == (q, OWN) for q in range(was))
        return Choice(step, lineage, was, source, keepers, direct), ""
    return None, why


def resume(
    views: list[dict[str, Any]],
    directory: str | None,
    local_rank: int,
    multi: bool,
    seed_base: Callable[[int, int], int],
) -> tuple[dict[str, Any], Entry, tuple[int, int] | None] | None:
    """MemoryState.load() for a sharded job (a collective): (state, entry, the (step, lineage)
    this rank's own slot keeps, if any), or None (after one line saying why) for the disk.
    `seed_base(step, world)`: the RNG seed base of ranks without their own slot."""
    world_size, my_rank = world(), rank()
    choice, why = choose(views, world_size)
    body = None
    if choice is not None:
        body, why = fetch(choice, directory, local_rank, my_rank, multi)
        if not all_ok(body is not None, multi):
            choice, body = None, None
    if choice is None or body is None:
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


def fetch(
    choice: Choice, directory: str | None, local_rank: int, my_rank: int, multi: bool
) -> tuple[dict[str, Any] | None, str | None]:
    """(body, why not): this rank's view of the chosen step, {"state": the rest of the state with
    a Pieces where the model and optimizer go, "rng": this rank's own or None}. A collective when
    not `choice.direct`: every rank takes part in every old rank's broadcast, whatever failed."""
    step, lineage = choice.step, choice.lineage
    why, own = None, None
    if my_rank in choice.keepers:
        try:
            own = reader.load(directory, local_rank, step, lineage)
        except Exception as e:  # noqa: BLE001 - any damage means: use the disk
            why = f"own slot unreadable: {type(e).__name__}: {e}"
    if choice.direct:
        pieces = [own["state"]] if own is not None else []
    else:
        pieces = []
        for q, (src, kind) in enumerate(choice.source):
            data: Any = bytearray()
            if src == my_rank:
                try:
                    data = reader.raw(directory, step, lineage, local_rank, kind)
                except Exception as e:  # noqa: BLE001 - sent as nothing: every rank uses the disk
                    why = why or f"rank {q}'s slot unreadable: {type(e).__name__}: {e}"
            data = broadcast_bytes(data, src, cpu_group()) if multi else data
            if not data:
                why = why or f"rank {src} could not read rank {q}'s slot"
                continue
            try:
                pieces.append(reader.decode(bytearray(data), step, lineage)["state"])
            except Exception as e:  # noqa: BLE001
                why = why or f"rank {q}'s slot damaged in transit: {type(e).__name__}: {e}"
            del data
    if why is not None or not pieces:
        return None, why or "nothing read"
    held_parts = Pieces(pieces)
    state = {k: v for k, v in pieces[0].items() if k not in PARTS}
    for part in PARTS:
        if part in pieces[0]:
            state[part] = held_parts
    return {"state": state, "rng": own.get("rng") if own is not None else None}, None


class Pieces(InMemory):
    """The old ranks' slots' model and optimizer parts (DTensors as Chunks), which restore()
    places in the live model's own shards and loads through set_state_dict."""

    def __init__(self, pieces: list[Mapping[str, Any]]) -> None:
        self.pieces = pieces

    def restore(self, state: Mapping[str, Any], model, optimizer, strict: bool) -> None:
        msd, osd = sharded.state_dicts(model, optimizer)
        new_m = _place([p["model"] for p in self.pieces], msd, (None, "model"))
        new_o = None
        if optimizer is not None:
            new_o = _place([p["optimizer"] for p in self.pieces], osd, (None, "optimizer"))
        sharded.apply(model, optimizer, new_m, new_o, strict)


def _place(saved: list[Any], target: Any, at: Any) -> Any:
    """The saved value at one location (the same in every piece but for the Chunks), with each
    Chunk replaced by the live DTensor's shard filled from the pieces' chunks."""
    first = saved[0]
    if isinstance(first, Chunk):
        if not isinstance(target, sharded.dtensor_class() or ()):
            raise ValueError(f"{where(at)}: held as shards in memory, but the live one is not")
        return _assemble(target, saved, at)
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
    chunks that overlap it (each distinct chunk once: replicated dims repeat them)."""
    local = target.to_local()
    (box,) = target.__create_chunk_list__()
    begin, shape = list(box.offsets), list(local.shape)
    out = torch.empty(shape, dtype=local.dtype)
    covered, seen = 0, set()
    for c in chunks:
        if tuple(c.shape) != tuple(target.shape):
            raise ValueError(
                f"{where(at)}: shape {list(c.shape)} in memory, {list(target.shape)} in the model"
            )
        key = (c.offsets, tuple(c.tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        lo = [max(a, b) for a, b in zip(begin, c.offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(begin, shape, c.offsets, c.tensor.shape)]
        if any(h <= low for h, low in zip(hi, lo)):
            continue
        dst, src = out, c.tensor
        for d, (low, h) in enumerate(zip(lo, hi)):
            dst = dst.narrow(d, low - begin[d], h - low)
            src = src.narrow(d, low - c.offsets[d], h - low)
        dst.copy_(src)
        covered += math.prod(h - low for h, low in zip(hi, lo))
    if covered != out.numel():
        raise ValueError(
            f"{where(at)}: the shards in memory cover {covered} of this rank's {out.numel()} values"
        )
    return type(target).from_local(
        out.to(local.device),
        target.device_mesh,
        target.placements,
        shape=target.shape,
        stride=target.stride(),
        run_check=False,
    )
