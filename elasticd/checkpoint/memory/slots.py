"""The slot files' format: each local rank L owns two preallocated files, `l<L>.0` and `l<L>.1`,
written in turn, and, in a sharded job spread over nodes, two more, `r<L>.0` and `r<L>.1`: the
replica of another node's rank's slot (elasticd.checkpoint.memory.replica). A 4 KiB header (step,
world size, global rank, local world size, lineage, lengths, the description's CRC, whether it
holds a sharded rank's own shards, and a valid flag written last; a replica's also the MAC its
sender made, memory.seal), the tensors' bytes (64-byte aligned), then the description. Headers
are read here without torch, for the daemon's status and for choosing what to resume from.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from typing import NamedTuple

MAGIC = b"ELDMEM04"
HEADER = 4096
# where a replica slot keeps the MAC its sender made (memory.seal), past the header's fields
MAC_AT = 1024
# magic, valid, step, world, rank, data_len, meta_len, crc, local world size (0: unknown), lineage,
# flags (SHARDED)
FIELDS = struct.Struct("<8sQqqqQQIIqQ")
SHARDED = 1  # the slot holds its rank's own shards (and the rest), not a node's whole state
OWN, REPLICA = "l", "r"  # slot files: a local rank's own, and the replica it keeps of another's
_ALIGN = 64
SLOTS = 2


def slot_path(path: str, local_rank: int, k: int, kind: str = OWN) -> str:
    return os.path.join(path, f"{kind}{local_rank}.{k}")


_SLOT_NAME = re.compile(rf"({OWN}|{REPLICA})[0-9]+\.[0-9]+")


def slot_kind(name: str) -> str | None:
    """OWN or REPLICA for a slot file's name (as slot_path makes it), else None."""
    match = _SLOT_NAME.fullmatch(name)
    return match.group(1) if match else None


def header(file: str) -> dict[str, int] | None:
    """A valid slot's header fields, or None (missing, being written, torn, truncated)."""
    try:
        with open(file, "rb") as f:
            raw = f.read(FIELDS.size)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    return parse(raw, size)


def parse(raw: bytes, size: int) -> dict[str, int] | None:
    if len(raw) < FIELDS.size:
        return None
    magic, valid, step, world, rank, data_len, meta_len, crc, local_world, lineage, flags = (
        FIELDS.unpack(raw)
    )
    if magic != MAGIC or valid != 1 or HEADER + data_len + meta_len > size:
        return None
    return {
        "step": step,
        "world": world,
        "rank": rank,
        "data_len": data_len,
        "meta_len": meta_len,
        "crc": crc,
        "local_world": local_world,
        "lineage": lineage,
        "sharded": bool(flags & SHARDED),
    }


def aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def invalidate(file: str) -> None:
    with contextlib.suppress(OSError), open(file, "r+b") as f:
        f.seek(8)
        f.write(bytes(8))


class Held(NamedTuple):
    """A valid slot, as its header describes it."""

    step: int
    lineage: int
    world: int  # the world size that wrote it
    rank: int  # the global rank that wrote it
    local_world: int  # its node's local world size then (0: unknown)
    k: int  # which of the local rank's two slots
    sharded: bool = False  # its rank's own shards (any local rank), not a node's whole state


def held(path: str | None, local_rank: int, kind: str = OWN) -> list[Held]:
    """A local rank's valid slots (or replicas), newest step first: of any world size and lineage
    (headers only; in DDP local rank 0's hold the node's whole state)."""
    out = []
    for k in range(SLOTS) if path else ():
        h = header(slot_path(path, local_rank, k, kind))
        if h:
            out.append(
                Held(
                    h["step"],
                    h["lineage"],
                    h["world"],
                    h["rank"],
                    h["local_world"],
                    k,
                    h["sharded"],
                )
            )
    return sorted(out, reverse=True)


def steps(path: str | None, *, world: int, rank: int, local_rank: int) -> list[int]:
    """Steps this rank could resume from at an unchanged world (tools and tests; a resume goes
    through held()): the node's whole state and this rank's own RNG, written at this world size."""
    node = {h.step for h in held(path, 0) if h.world == world}
    return sorted(
        node & {h.step for h in held(path, local_rank) if h.world == world and h.rank == rank},
        reverse=True,
    )


def keep_only(
    path: str | None, *, local_rank: int, keep: tuple[int, int] | None, kind: str = OWN
) -> None:
    """Invalidate this local rank's slots except the one holding `keep`, a (step, lineage) (None:
    all of them), so that no state of an abandoned timeline can be mixed with the one resumed
    from."""
    if not path:
        return
    kept = [
        h.k
        for h in held(path, local_rank, kind)
        if keep is not None and (h.step, h.lineage) == tuple(keep)
    ][:1]
    for k in range(SLOTS):
        if k not in kept:
            invalidate(slot_path(path, local_rank, k, kind))
