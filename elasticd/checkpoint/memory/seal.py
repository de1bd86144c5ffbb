"""Keyed MACs on the in-memory state's bytes that cross the network: a replica slot sent to the
next node (memory.replica, verified when a resume reads it), the node's whole state sent to a rank
whose node lacks it (reader.raw / decode), a sharded resume's skeleton and shard slices
(memory.exchange). Anyone who reaches the workers' ports or a node's /dev/shm could otherwise
change the state a resume loads; now what does not verify is refused, and the resume takes the
next source (another replica, the disk).

HMAC-SHA256 (hashlib's, OpenSSL's: about 1.8 GB/s on one core with the SHA extensions that x86
server CPUs have had since 2017, against 0.7 GB/s for keyed BLAKE2b), bound to what the bytes are
(`part`, and the step, lineage, ranks the caller names) so that bytes of another step, lineage or
rank do not verify in their place. It runs on the replica's background thread beside the send,
a large slot in pieces on a few threads (slot_mac).

The key is the daemon's (names.STATE_KEY, hex): derived from the job secret and the job id
(cluster/signing.state_key), the same on every node of the job, never the secret itself. Without
one (a launcher other than elasticd) the MAC is an unkeyed checksum: it tells damage, not forgery.
Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Iterable

from elasticd import names
from elasticd.checkpoint.memory.slots import FIELDS, HEADER

SIZE = 32  # bytes of a MAC
PIECE = 64 << 20  # bytes of a slot MAC'd as one piece (slot_mac)
# threads a slot's MAC runs on: a share of the CPUs this process may use (8 ranks a node), at most 4
THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 8))
_cached: list[bytes] = []  # the key, read once per process


def key() -> bytes:
    """This job's state key (names.STATE_KEY), b"" when none was given."""
    if not _cached:
        try:
            _cached.append(bytes.fromhex(os.environ.get(names.STATE_KEY, "")))
        except ValueError:
            _cached.append(b"")
    return _cached[0]


def mac(part: str, context: Iterable[int], *data) -> bytes:
    """The MAC of `data` (buffers, in order) as `part` (what they are) at `context` (the step,
    lineage, ranks they belong to)."""
    where = ",".join(str(int(c)) for c in context)
    h = hmac.new(key(), f"elasticd/state/1\0{part}\0{where}\0".encode(), hashlib.sha256)
    for d in data:
        h.update(d)
    return h.digest()


def matches(tag: bytes | bytearray, expected: bytes) -> bool:
    """Whether `tag`, as received or kept, is the MAC `expected` (in constant time)."""
    return len(tag) == SIZE and hmac.compare_digest(bytes(tag), expected)


def slot_mac(part: str, head, body) -> bytes:
    """A slot's MAC as `part`: its header's fields but the valid flag (magic, step, world, rank,
    lengths, the description's CRC, local world, lineage, flags), then the MACs of its bytes past
    the header (`head`: at least its fields, `body`: the rest), PIECE bytes each, on up to
    THREADS threads: one core's 1.8 GB/s would be slower than the network a large slot goes
    over."""
    return mac(part, (), head[:8], head[16 : FIELDS.size], *_pieces(part, body))


def _pieces(part: str, body) -> list[bytes]:
    """The MAC of each PIECE bytes of `body`, bound to its index and the body's length."""
    with memoryview(body) as view:
        size = len(view)
        starts = range(0, size, PIECE) or range(1)
        out = [b""] * len(starts)

        def work(first: int) -> None:  # every THREADS-th piece from `first`
            for i in range(first, len(starts), THREADS):
                at = starts[i]
                out[i] = mac(f"{part}/piece", (i, size), view[at : at + PIECE])

        helpers = [
            threading.Thread(target=work, args=(k,), name="elasticd-mac", daemon=True)
            for k in range(1, min(THREADS, len(starts)))
        ]
        for t in helpers:
            t.start()
        work(0)
        for t in helpers:
            t.join()
    return out


def whole(buf: bytes | bytearray) -> bytes:
    """The MAC of a slot's bytes (reader.raw) sent whole to another rank."""
    with memoryview(buf) as view:
        return slot_mac("whole", view[:HEADER], view[HEADER:])


class Refused(ValueError):
    """Bytes whose MAC does not verify: damaged or changed since their sender made it."""
