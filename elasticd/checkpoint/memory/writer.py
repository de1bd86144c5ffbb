"""The refresh: a local rank's two slots, memory-mapped and written in turn, so a refresh is a
memory copy of the tensors into the mapping plus a small JSON description of everything else: no
serializer, no allocation, no file created per step.

A write first marks the slot invalid, copies, writes the description and its CRC, and marks the
slot valid last, so a worker killed mid-write leaves that slot invalid and the other one (the
previous step) intact. Space is reserved with posix_fallocate before the mapping is touched: a
full tmpfs is an OSError, never a SIGBUS.

`Writer` copies device tensors overlapped through overlap.py above OVERLAP_MIN_BYTES (a DDP
node's state or a sharded rank's CUDA shards alike); `landed()` says whether the last write is
whole yet (what the replica waits for).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import marshal
import mmap
import operator
import os
import time
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from elasticd.checkpoint import walk as _walk
from elasticd.checkpoint.memory.description import DICT, Description
from elasticd.checkpoint.memory.slots import (
    FIELDS,
    HEADER,
    MAGIC,
    SHARDED,
    SLOTS,
    aligned,
    header,
    invalidate,
    slot_path,
)

_SMALL = 1 << 20  # bytes below which a tensor is copied with one memmove
# CUDA bytes below which a refresh copies at once instead of overlapping
# (elasticd.checkpoint.overlap). On an H100 node an overlapped refresh of the recovery bench's
# tiny model was charged about 1.2 ms, a synchronous one about 0.5 ms; 0.7 ms is what a
# synchronous copy of 8 MiB into shared memory takes there (~12 GB/s), so below this size queuing
# the copies costs more than it saves.
OVERLAP_MIN_BYTES = 8 << 20
_UNSTEPPED = (
    "no optimizer step ran between two refreshes (a step replayed from a CUDA graph, or "
    "parameters updated by hand)"
)
_LAYOUT = operator.attrgetter("dtype", "shape", "is_cpu")  # what a slot's views and copies are for
_FIRST = operator.itemgetter(0)


class _Slot:
    """One mapped slot file and the tensor views of its current layout."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.mm: mmap.mmap | None = None
        self.size = 0
        self.layout: tuple = ()
        self.views: list = []
        # per view: (address, bytes) for one memmove from a contiguous CPU tensor, or None
        self.direct: list = []
        self.address = 0  # of the mapping
        self.pinned = (
            False  # page-locked for overlapped device copies (elasticd.checkpoint.overlap)
        )

    def reserve(self, size: int) -> bool:
        """Make room for `size` bytes; True when that (re)mapped the slot (a one-off cost)."""
        if size <= self.size:
            return False
        size = max(size + size // 4, 1 << 16)  # room for a description that grows a little
        self.views, self.direct, self.layout = [], [], ()
        if self.mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive somewhere: let it go
                self.mm.close()
        os.posix_fallocate(self.fd, 0, size)  # ENOSPC here, not SIGBUS on a store later
        populate = getattr(
            mmap, "MAP_POPULATE", 0
        )  # page tables filled now, not on each refresh's first touch
        self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | populate)
        self.size = size
        head = ctypes.c_char.from_buffer(self.mm)  # an export of the mapping, let go at once
        self.address = ctypes.addressof(head)
        del head
        return True

    def set_valid(self, valid: int) -> None:
        assert self.mm is not None
        self.mm[8:16] = valid.to_bytes(8, "little")

    def close(self) -> None:
        self.views, self.direct = [], []
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
        os.close(self.fd)


class Writer:
    """Refreshes this local rank's slots, alternating between the two.

    `keep`: the (step, lineage) this process just resumed from memory, held in its own slot; that
    slot is left alone and the other is written first. Every other slot is invalidated at once: a
    state of an abandoned timeline must never outlive the first write of the new one. Every write
    is stamped with `lineage` (agreed at the load) and `local_world` (LOCAL_WORLD_SIZE; 0 when
    unknown), which tells a later resume which local ranks of this node existed."""

    def __init__(
        self,
        path: str,
        local_rank: int,
        keep: tuple[int, int] | None = None,
        overlap: bool = False,
        *,
        lineage: int = 0,
        local_world: int = 0,
    ) -> None:
        self.local_rank = local_rank
        self.lineage, self.local_world = int(lineage), int(local_world)
        self.overlap = (
            overlap  # queue device copies to overlap the next step (elasticd.checkpoint.overlap)
        )
        self.queued = False  # the last write's copies were queued, its cost is measured later
        self.notice: str | None = (
            None  # why overlapping was turned off, for the caller to report once
        )
        self._copier: Any = (
            None  # an elasticd.checkpoint.overlap.Copier, made at the first overlapped refresh
        )
        self._device: Any = None  # the one CUDA device of the layout's tensors, if they have one
        self._device_bytes = 0  # of the layout's CUDA tensors
        self.slots = [_Slot(slot_path(path, local_rank, k)) for k in range(SLOTS)]
        kept = [
            k
            for k in range(SLOTS)
            if keep is not None
            and (h := header(self.slots[k].file))
            and (h["step"], h["lineage"]) == tuple(keep)
        ][:1]
        for k in range(SLOTS):
            if k not in kept:
                invalidate(self.slots[k].file)
        self.next = (kept[0] + 1) % SLOTS if kept else 0
        self._layout: tuple | None = None
        self._offsets: list[int] = []
        self._end = 0
        self._table = b""
        self._encoded: dict[
            Any, tuple[Any, bytes, bytes]
        ] = {}  # entry -> (description, marshal, JSON)
        # descriptions of dicts of named tensors, see Description.named_tensors
        self._flat: dict = {}
        self.written: tuple[_Slot, int] | None = None  # the last slot written and its bytes used
        self._last: Any = None  # its overlap.Pending while queued (see landed())

    def write(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        world: int,
        rank: int,
        owned: set[int] | None = None,
        started: float | None = None,
        sharded: bool = False,
    ) -> bool:
        """Store `state` (a capture(), whose "rng" holds at least this rank's entry) as `step`.
        Returns whether a slot had to be mapped first (its cost is not a refresh's).
        When overlapping: `owned` holds the ids of the tensors only the optimizer writes, whose
        copies may run beside the next step; `started` is when the refresh began. `sharded`:
        every local rank keeps its own shards (and the rest), not local rank 0 the node's state
        (CUDA shards overlapped as any device tensor); `written` then says where, and `landed()`
        when it is whole (for the replica)."""
        started = time.perf_counter() if started is None else started
        rng = state.get("rng") or {}
        ranks = rng.get("ranks") or []
        mine = ranks[rank] if rank < len(ranks) else (ranks[0] if len(ranks) == 1 else None)
        desc = Description(self._flat)
        walk, tensors = _walk.walk, desc.tensors
        used: dict = {}
        tree = b"{" + DICT + b':[["rng",' + self._json("rng", walk(mine, desc, (None, "rng")), used)
        if self.local_rank == 0 or sharded:
            entries = [
                b"["
                + self._json(("k", k), walk(k, desc), used)
                + b","
                + self._json(("v", k), walk(v, desc, (None, k)), used)
                + b"]"
                for k, v in state.items()
                if k != "rng"
            ]
            tree += b'],["state",{' + DICT + b":[" + b",".join(entries) + b"]}"
        tree += b"]]}"
        self._encoded, self._flat = (
            used,
            desc.flat,
        )  # only this step's: names that come and go are not kept
        key = tuple(map(_LAYOUT, map(_FIRST, tensors)))
        if key != self._layout:
            self._plan(key, tensors)
        offsets, end = self._offsets, self._end
        meta = self._table + tree + b"}"
        copier = self._overlapping()
        slot = self.slots[self.next]
        need = HEADER + end + len(meta)
        if slot.pinned and need > slot.size:  # about to be mapped anew: let the old pages go first
            self._copier.unpin(slot.address)
            slot.pinned = False
        mapped = slot.reserve(need)
        if copier is not None and not slot.pinned:
            slot.pinned = copier.pin(slot.address, slot.size)
            if not slot.pinned:
                copier = self._off(
                    "the GPU driver refused to page-lock the slot (cudaHostRegister)"
                )
        mm = slot.mm
        assert mm is not None
        slot.set_valid(0)
        if slot.layout != key:  # views into the mapping, made once per layout
            slot.views = [
                torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=HEADER + o).view(
                    t.shape
                )
                if t.numel()
                else None
                for o, (t, _) in zip(offsets, tensors)
            ]
            slot.direct = [
                (v.data_ptr(), t.nbytes)
                if v is not None and t.is_cpu and t.nbytes < _SMALL
                else None
                for v, (t, _) in zip(slot.views, tensors)
            ]
            slot.layout = key
        side: list = []  # device tensors only the optimizer writes: copied beside the next step
        # other device tensors: copied on the training stream, before what follows
        ordered: list = []
        for view, direct, (t, _) in zip(slot.views, slot.direct, tensors):
            if direct is not None and t.is_contiguous():
                ctypes.memmove(direct[0], t.data_ptr(), direct[1])  # a third of copy_'s overhead
            elif view is None:
                continue
            elif copier is not None and t.is_cuda:
                (side if owned is not None and id(t) in owned else ordered).append((view, t))
            else:
                view.copy_(t.detach())  # device tensors, and big ones: torch's parallel copy
        head = FIELDS.pack(
            MAGIC,
            0,
            step,
            world,
            rank,
            end,
            len(meta),
            zlib.crc32(meta),
            self.local_world,
            self.lineage,
            SHARDED if sharded else 0,
        )
        commit = functools.partial(_commit, slot, HEADER + end, meta, head)
        self.written = (slot, HEADER + end + len(meta))
        self.queued = copier is not None
        self._last = None  # the overlap.Pending of this write, when queued
        if copier is None:
            commit()
        else:
            copier.copy(self.next, side, ordered, commit, started, counted=not mapped)
            self._last = copier.pending[self.next]
        self.next = (self.next + 1) % SLOTS
        return mapped

    def landed(self, timeout: float | None = None) -> bool:
        """Wait until the last write is whole in its slot; False if it never will be (an
        overlapped refresh dropped, see settle()) or `timeout` passed first. The replica sends a
        slot only once this says so."""
        p = self._last
        return p is None or (p.done.wait(timeout) and p.committed)

    def settle(self, timeout: float | None = None) -> None:
        """Drop an overlapped refresh no optimizer step has waited for (with one notice) and let
        the others land; what waits on landed() then returns."""
        if self._copier is not None and self._copier.unfired():
            self._off(_UNSTEPPED)
        elif self._copier is not None:
            self._copier.settle(timeout)

    def _overlapping(self) -> Any:
        """The Copier for this refresh, or None to copy synchronously. First the last refresh
        lands, as a synchronous one would have: a slot is only ever invalidated while the other
        holds a whole step. A refresh that no optimizer step has waited for since may have
        raced a write (see elasticd.checkpoint.overlap): it is dropped, its slot is the one written
        next, and overlapping ends."""
        if self._copier is None:
            if not self._worth_overlapping() or not torch.cuda.is_initialized():
                return None
            from elasticd.checkpoint import overlap

            try:
                self._copier = overlap.Copier(self._device)
            except Exception as e:  # noqa: BLE001 - a CUDA runtime that cannot give a stream: copy as before
                return self._off(f"no side stream: {type(e).__name__}: {e}")
        if self._copier.unfired():
            return self._off(_UNSTEPPED)
        self._copier.settle()
        if not self._worth_overlapping():
            return None
        if self._copier.device != self._device:
            return self._off("the state's tensors moved to another GPU")
        return self._copier

    def _worth_overlapping(self) -> bool:
        return self.overlap and self._device is not None and self._device_bytes >= OVERLAP_MIN_BYTES

    def costs(self) -> list[float]:
        """Seconds that overlapped refreshes cost the step, once measured (see Copier.costs)."""
        return self._copier.costs() if self._copier is not None else []

    def _off(self, reason: str) -> None:
        """Copy synchronously from now on; refreshes in flight land or are dropped first (the
        slot of a dropped one is written next)."""
        self.overlap, self.notice = False, reason
        for key in self._copier.settle() if self._copier is not None else ():
            self.next = key
        return None

    def _json(self, name: Any, desc: Any, used: dict) -> bytes:
        """`desc` as JSON bytes, reused while the entry `name` describes the same as last time:
        most of a state (model and optimizer layout, hyperparameters, RNG left untouched) is the
        same from step to step. Sameness is judged on identity where the description is the
        same object (one made once by Description.named_tensors, a key, a small number), else on
        marshal's bytes, several times cheaper than encoding JSON and exact about types (1, 1.0
        and True are equal to ==, not here). Descriptions are never changed once made."""
        last = self._encoded.get(name)
        if last is not None and last[0] is desc:
            used[name] = last
            return last[2]
        exact = marshal.dumps(
            desc, 2
        )  # version 2: no back-references, so equal values give equal bytes
        out = (
            last[2]
            if last is not None and last[1] == exact
            else json.dumps(desc, separators=(",", ":")).encode()
        )
        used[name] = (desc, exact, out)
        return out

    def _plan(self, key: tuple, tensors: list) -> None:
        """Offsets of a new layout of tensors and the fixed head of the description."""
        offsets, table, end = [], [], 0
        for t, at in tensors:
            if t.layout != torch.strided or t.is_quantized or t.is_nested:
                raise TypeError(
                    f"{_walk.where(at)}: a {t.layout} tensor cannot be kept in the in-memory state"
                )
            offsets.append(end)
            table.append([end, str(t.dtype).removeprefix("torch."), list(t.shape)])
            end = aligned(end + t.numel() * t.element_size())
        self._layout, self._offsets, self._end = key, offsets, end
        devices = {t.device for t, _ in tensors if t.is_cuda}
        self._device = devices.pop() if len(devices) == 1 else None
        self._device_bytes = sum(t.nbytes for t, _ in tensors if t.is_cuda)
        self._table = (
            b'{"tensors":' + json.dumps(table, separators=(",", ":")).encode() + b',"tree":'
        )

    def close(self) -> None:
        if self._copier is not None:
            self._copier.settle(timeout=10)
            for s in self.slots:
                if s.pinned:
                    self._copier.unpin(s.address)
                    s.pinned = False
            self._copier.close()
        for s in self.slots:
            s.close()


def _commit(slot: _Slot, at: int, meta: bytes, head: bytes) -> None:
    """Write a slot's description and header after its tensors, and mark it whole: last."""
    mm = slot.mm
    assert mm is not None
    mm[at : at + len(meta)] = meta
    mm[: FIELDS.size] = head
    slot.set_valid(1)
