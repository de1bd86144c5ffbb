"""The replica: in a sharded job spread over nodes, every rank sends each refreshed slot to the
rank of the same local rank on the next node (ring order: rank r sends to r + local world size,
modulo the world) and keeps the slot it receives from the previous node's rank in its own two
replica slots (`r<L>.0`, `r<L>.1`, the slot format). So node i holds node i+1's shards, and when
any one node is lost every rank's shards are still in a survivor's memory.

Sent over a gloo group of the library's own (made once, at the first refresh; its collectives
never interleave with the training loop's, as the disk writer's own group), on a background
thread, straight from the slot's mapping into the receiver's: the refresh only starts it, and the
next refresh first waits for it (that wait counts as refresh cost, so the cadence keeps the whole
within the budget). A received slot is marked valid only once all of it arrived, so a rank killed
mid-transfer leaves the previous replica whole. Each slot travels with a MAC made with the job's
key (memory.seal: over its header's fields and bytes, computed on the sender's thread while the
bytes travel), kept in the replica's header; a resume that reads the replica verifies it
(reader.load), so bytes changed on the way or in the receiver's /dev/shm are refused, never
loaded. Why gloo rather than the rendezvous store: the
store is one process every node talks to, a slot is the size of a rank's shards, and gloo sends
it point to point at the network's speed.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd.checkpoint.collectives import _tensor_bytes, rank, world
from elasticd.checkpoint.memory import seal
from elasticd.checkpoint.memory.slots import (
    FIELDS,
    HEADER,
    MAC_AT,
    REPLICA,
    SLOTS,
    parse,
    slot_path,
)
from elasticd.checkpoint.memory.writer import _Slot
from elasticd.worker import heartbeat
from elasticd.worker.heartbeat import REPLICA_STATES

log = structlog.get_logger()

TIMEOUT = timedelta(seconds=60)  # a partner that never answers: replication stops, training goes on
Landed = Callable[[float], bool] | None  # Writer.landed: whether the slot to send is whole


def partners(rank: int, world: int, local_world: int) -> tuple[int, int] | None:
    """(the rank this one sends to, the rank it receives from), or None on one node (or an
    uneven or unknown layout): a single node has no other node to hold its shards."""
    if local_world <= 0 or world <= local_world or world % local_world:
        return None
    return (rank + local_world) % world, (rank - local_world) % world


class Replicator:
    """This rank's side of the ring: send(), then wait() before the next refresh."""

    def __init__(self, directory: str, local_rank: int, to: int, source: int) -> None:
        self.to, self.source = to, source
        self.group = dist.new_group(backend="gloo", timeout=TIMEOUT)  # a collective, once
        self.slots = [_Slot(slot_path(directory, local_rank, k, REPLICA)) for k in range(SLOTS)]
        self.next = 0
        self.thread: threading.Thread | None = None
        self.error: str | None = None
        self.sent = 0  # bytes of the last exchange sent (and about as many received)
        self.seconds = 0.0  # how long the last exchange took, in the background

    def send(self, slot: _Slot, size: int, landed: Landed = None) -> None:
        """Start the exchange of the slot just written (`size` bytes of it). `landed(timeout)`:
        whether an overlapped refresh's slot is whole (Writer.landed), waited for on the
        exchange's thread; a slot that never lands is announced as 0 bytes, and both sides
        keep the replica they have."""
        self.thread = threading.Thread(
            target=self._exchange, args=(slot, size, landed), name="elasticd-replica", daemon=True
        )
        self.thread.start()

    def wait(self) -> str | None:
        """Wait for the exchange in flight; why it failed, or None."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        err, self.error = self.error, None
        return err

    def _exchange(self, slot: _Slot, size: int, landed: Landed) -> None:
        t0 = time.perf_counter()
        try:
            if landed is not None and not landed(TIMEOUT.total_seconds()):
                size = 0  # an overlapped refresh dropped: nothing to send this time
            g = self.group
            n = torch.tensor([size], dtype=torch.int64)
            m = torch.zeros(1, dtype=torch.int64)
            req = dist.isend(n, self.to, group=g, tag=1)
            dist.recv(m, self.source, group=g, tag=1)
            req.wait()
            got = int(m.item())
            if got and got < HEADER:
                raise ValueError(f"rank {self.source} announced a slot of {got} bytes")
            incoming = self._post(got) if got else None  # posted first: the MACs overlap the sends
            reqs = self._send(slot, size) if size else []
            if incoming is not None:
                self._land(got, *incoming)
            for r in reqs:
                r.wait()
            self.sent = size
            self.seconds = time.perf_counter() - t0
            _report_sent(size, self.seconds)
        except Exception as e:  # noqa: BLE001 - reported by wait(); training goes on
            self.error = f"{type(e).__name__}: {e}"
            self.seconds = time.perf_counter() - t0

    def _send(self, slot: _Slot, size: int) -> list:
        """The slot's `size` bytes to the next node, straight from its mapping, then their MAC
        (memory.seal), computed while they travel."""
        g = self.group
        assert slot.mm is not None
        out = torch.frombuffer(slot.mm, dtype=torch.uint8, count=size)
        reqs = [
            dist.isend(out[:HEADER], self.to, group=g, tag=2),
            dist.isend(out[HEADER:], self.to, group=g, tag=3),
        ]
        tag = seal.slot_mac(
            "replica", _at(slot.address, HEADER), _at(slot.address + HEADER, size - HEADER)
        )
        reqs.append(
            dist.isend(torch.frombuffer(bytearray(tag), dtype=torch.uint8), self.to, group=g, tag=4)
        )
        return reqs

    def _post(self, got: int) -> tuple:
        """The receives of the previous node's slot, `got` bytes, into the replica slot written
        next (invalid until it landed whole) and of its MAC."""
        g = self.group
        into = self.slots[self.next]
        if into.mm is not None:
            into.set_valid(0)
        into.reserve(got)
        assert into.mm is not None
        head = torch.empty(HEADER, dtype=torch.uint8)
        body = torch.frombuffer(into.mm, dtype=torch.uint8, count=got - HEADER, offset=HEADER)
        tag = torch.empty(seal.SIZE, dtype=torch.uint8)
        works = [
            dist.irecv(t, self.source, group=g, tag=k) for k, t in ((2, head), (3, body), (4, tag))
        ]
        return into, head, tag, works

    def _land(self, got: int, into: _Slot, head, tag, works: list) -> None:
        """The received slot made valid, its MAC kept in its header (verified when a resume reads
        it: reader.load): valid last, so a rank killed before leaves the other replica whole."""
        for w in works:
            w.wait()
        raw = _tensor_bytes(head)
        h = parse(raw[: FIELDS.size], got)
        if h is None or HEADER + h["data_len"] + h["meta_len"] != got:
            raise ValueError(f"rank {self.source} sent a slot whose header does not fit it")
        assert into.mm is not None
        into.mm[16:HEADER] = raw[16:]  # all but magic and the valid flag
        into.mm[MAC_AT : MAC_AT + seal.SIZE] = _tensor_bytes(tag)
        into.mm[:8] = raw[:8]
        into.set_valid(1)
        self.next = (self.next + 1) % SLOTS

    def close(self) -> None:
        self.wait()
        for s in self.slots:
            s.close()


class Ring:
    """This rank's part in the replication, as MemoryState drives it: decided at the first sharded
    refresh (a Replicator when the job spans nodes), wait() before each refresh writes, send()
    after; a failed exchange ends replication on this rank with one warning."""

    def __init__(self, directory: str | None, local_rank: int, local_world: int) -> None:
        self.directory, self.local_rank, self.local_world = directory, local_rank, local_world
        self.replicator: Replicator | None = None
        self.decided = False

    def send(self, slot: _Slot, size: int, landed: Landed = None) -> None:
        if not self.decided:
            self.decided = True
            ring = partners(rank(), world(), self.local_world)
            if ring is not None and self.directory:
                self.replicator = Replicator(self.directory, self.local_rank, *ring)
                if rank() == 0:
                    log.info("memory_replica", sends_to=ring[0], receives_from=ring[1])
            _report_state(off_reason(ring, self.directory, world(), self.local_world))
        if self.replicator is not None:
            self.replicator.send(slot, size, landed)

    def wait(self) -> None:
        if self.replicator is None:
            return
        error = self.replicator.wait()
        if error is not None:
            log.warning(
                "memory_replica_off",
                error=error,
                action="keeping this rank's shards in this node's memory only",
            )
            _report_state("failed")
            self.close()

    def figures(self) -> dict[str, Any]:
        """The last exchange's bytes and background time, for the memory_cadence line."""
        r = self.replicator
        return {"replica_bytes": r.sent, "replica_ms": round(1e3 * r.seconds, 3)} if r else {}

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()
            self.replicator = None


def off_reason(
    ring: tuple[int, int] | None, directory: str | None, world: int, local_world: int
) -> str:
    """The replica_state figure as the ring was decided: "on", or why it is off."""
    if ring is None:
        return "one_node" if 0 < local_world and world <= local_world else "uneven_nodes"
    return "on" if directory else "no_directory"


def _at(address: int, n: int) -> ctypes.Array:
    """`n` bytes of a mapping at `address`, as a buffer hashlib reads without copying (no export
    of the mapping is held, so it can still be remapped)."""
    return (ctypes.c_char * n).from_address(address)


def _report_state(state: str) -> None:
    figures = heartbeat.writer()
    if figures is not None:
        figures.note("replica_state", REPLICA_STATES.index(state))


def _report_sent(size: int, seconds: float) -> None:
    """An exchange landed (on the replica's thread: these figures are written nowhere else)."""
    figures = heartbeat.writer()
    if figures is not None:
        figures.add("replica_sends", 1)
        figures.add("replica_bytes_total", size)
        figures.note("replica_bytes_last", size)
        figures.add("replica_seconds_total", seconds)
        figures.note("replica_seconds_last", seconds)
