"""A slot's state read back: in place (load, read), or as the bytes a rank sends to ranks whose
node lacks it (raw) and their decoding on arrival (decode), each checked for the step and lineage
expected, the description's checksum and a layout that stays inside the tensors' bytes. What came
from another rank (a replica slot, bytes received) is decoded only once its MAC verifies
(memory.seal): copied out first, so nothing can change it between the check and the decoding.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from typing import Any

import torch

from elasticd.checkpoint.memory import seal
from elasticd.checkpoint.memory.description import rebuild
from elasticd.checkpoint.memory.slots import (
    FIELDS,
    HEADER,
    MAC_AT,
    OWN,
    REPLICA,
    held,
    parse,
    slot_path,
)


def _find(path: str, local_rank: int, step: int, lineage: int, kind: str = OWN) -> str:
    for h in held(path, local_rank, kind):
        if (h.step, h.lineage) == (step, lineage):
            return slot_path(path, local_rank, h.k, kind)
    raise ValueError(f"in-memory state at step {step} is gone")


def _decode(buf: Any, size: int, name: str, step: int, lineage: int) -> tuple[dict[str, int], Any]:
    """A slot's header and state from its bytes (a mapping of the file, or the bytes received from
    another rank): checked for the step and lineage expected, the description's checksum and a
    layout that stays inside the tensors' bytes. Every tensor is copied out."""
    h = parse(bytes(buf[: FIELDS.size]), size)
    if not h or (h["step"], h["lineage"]) != (step, lineage):
        raise ValueError(f"in-memory slot {name} no longer holds step {step}")
    start = HEADER + h["data_len"]
    meta = bytes(buf[start : start + h["meta_len"]])
    if zlib.crc32(meta) != h["crc"]:
        raise ValueError(f"in-memory slot {name} is damaged (checksum)")
    desc = json.loads(meta)
    tensors = []
    for offset, dtype, shape in desc["tensors"]:
        dt = getattr(torch, dtype)
        n = 1
        for d in shape:
            n *= d
        if (
            not isinstance(dt, torch.dtype)
            or offset < 0
            or offset + n * dt.itemsize > h["data_len"]
        ):
            raise ValueError(f"in-memory slot {name} is damaged (layout)")
        tensors.append(
            torch.frombuffer(buf, dtype=dt, count=n, offset=HEADER + offset).view(shape).clone()
            if n
            else torch.empty(shape, dtype=dt)
        )
    return h, rebuild(desc["tree"], tensors)


def _load_slot(file: str, step: int, lineage: int) -> Any:
    name = os.path.basename(file)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            h, out = _decode(mm, size, name, step, lineage)
            if parse(mm[: FIELDS.size], size) != h:
                raise ValueError(f"in-memory slot {name} changed while being read")
            return out


def load(path: str, local_rank: int, step: int, lineage: int, kind: str = OWN) -> dict[str, Any]:
    """What a local rank's slot holds at (step, lineage): {"rng": ..., "state": {...}} for local
    rank 0 (the node's whole state) and for every rank of a sharded job (its own shards),
    {"rng": ...} for the others. ValueError when it is gone, damaged or changed while read; a
    replica (`kind` REPLICA) whose MAC does not verify: seal.Refused, and it is never decoded."""
    file = _find(path, local_rank, step, lineage, kind)
    if kind != REPLICA:
        return _load_slot(file, step, lineage)
    buf = _copy(file, step, lineage)
    with memoryview(buf) as view:
        mac = seal.slot_mac("replica", view[:HEADER], view[HEADER:])
    if not seal.matches(buf[MAC_AT : MAC_AT + seal.SIZE], mac):
        raise seal.Refused(f"replica slot {os.path.basename(file)}: its MAC does not verify")
    return _decode(buf, len(buf), os.path.basename(file), step, lineage)[1]


def raw(path: str, step: int, lineage: int, local_rank: int = 0, kind: str = OWN) -> bytearray:
    """A slot's state at (step, lineage) as its bytes (header, tensors, description), copied
    out and checked: what a rank sends to ranks whose node lacks it. By default the node's
    whole state (local rank 0's); in a sharded job any local rank's own shards or replica."""
    return _copy(_find(path, local_rank, step, lineage, kind), step, lineage)


def _copy(file: str, step: int, lineage: int) -> bytearray:
    name = os.path.basename(file)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = parse(f.read(FIELDS.size), size)
        if not h or (h["step"], h["lineage"]) != (step, lineage):
            raise ValueError(f"in-memory slot {name} no longer holds step {step}")
        buf = bytearray(HEADER + h["data_len"] + h["meta_len"])
        f.seek(0)
        if f.readinto(buf) != len(buf):
            raise ValueError(f"in-memory slot {name} is truncated")
        f.seek(0)
        if parse(f.read(FIELDS.size), size) != h:
            raise ValueError(f"in-memory slot {name} changed while being read")
    return buf


def decode(buf: bytearray, step: int, lineage: int, tag: bytes | None = None) -> dict[str, Any]:
    """The state in bytes that raw() gave, checked as a slot is read; received from another
    rank, only once `tag`, the MAC its sender made (seal.whole), verifies (else seal.Refused)."""
    if tag is not None and not seal.matches(tag, seal.whole(buf)):
        raise seal.Refused("the state received: its MAC does not verify")
    return _decode(buf, len(buf), "received", step, lineage)[1]


def read(path: str, step: int, *, world: int, rank: int, local_rank: int) -> dict[str, Any]:
    """The state at `step` of an unchanged world with this rank's RNG in place (the other ranks'
    entries are None); see steps()."""
    node = [h for h in held(path, 0) if h.step == step and h.world == world]
    mine = [
        h for h in held(path, local_rank) if h.step == step and h.world == world and h.rank == rank
    ]
    if not node or not mine:
        raise ValueError(f"in-memory state at step {step} is gone")
    body = load(path, 0, step, node[0].lineage)
    own = body if local_rank == 0 else load(path, local_rank, step, mine[0].lineage)
    state = dict(body["state"])
    if own.get("rng") is not None:
        ranks: list[Any] = [None] * world
        ranks[rank] = own["rng"]
        state["rng"] = {"world_size": world, "ranks": ranks}
    return state
