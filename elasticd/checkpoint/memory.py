"""In-memory training state: the latest step's state in shared memory, so that a crashed worker's
replacement resumes from the step before the crash instead of the last disk checkpoint.

The daemon owns the directory (a private tmpfs directory under /dev/shm, one per daemon run,
passed to workers as ELASTICD_MEMORY_DIR, flocked while the daemon lives, removed when it exits);
workers of every attempt of that run write into it through CheckpointManager. It survives worker
crashes and a change of world size (the node's slots are named by local rank, not global rank),
not the node itself nor its daemon: a lost node's ranks are served by the nodes that still hold
the state (elasticd.checkpoint.memory_state), and disk checkpoints stay the fallback.

Each local rank L owns two preallocated slot files, `l<L>.0` and `l<L>.1`, memory-mapped and
written in turn, so a refresh is a memory copy of the tensors into the mapping plus a small
JSON description of everything else: no serializer, no allocation, no file created per step.
Local rank 0's slot holds the whole state (DDP state is the same on every rank, as for rank-0
disk checkpoints) with its RNG; the other local ranks' slots hold their own RNG state only.

Every slot records the step, the world size, global rank and local world size that wrote it, and
its lineage: a number the ranks agree on at each load (CheckpointManager.load_latest), written
with every later step. Steps of one lineage come from one uninterrupted run, so (step, lineage)
names one state wherever it is held, and a node that missed a resume (cut off, then back) can
never offer a same-numbered step of an abandoned timeline as if it were the current one.

Slot layout: a 4 KiB header, the tensors' bytes (64-byte aligned), then the description.
A write first marks the slot invalid, copies, writes the description and its CRC, and marks
the slot valid last, so a worker killed mid-write leaves that slot invalid and the other one (the
previous step) intact. A step S therefore stays readable until S+2 is written, which needs a
collective step that every rank joins only after loading. Space is reserved with
posix_fallocate before the mapping is touched: a full tmpfs is an OSError, never a SIGBUS.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import itertools
import json
import marshal
import math
import mmap
import operator
import os
import re
import shutil
import statistics
import struct
import tempfile
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any, NamedTuple

from elasticd import names, safeio

ENV = names.MEMORY_DIR
ROOT = "/dev/shm"
PREFIX = "elasticd-mem-"
MAGIC = b"ELDMEM02"
HEADER = 4096
# magic, valid, step, world, rank, data_len, meta_len, crc, local world size (0: unknown), lineage
_FIELDS = struct.Struct("<8sQqqqQQIIq")
_ALIGN = 64
SLOTS = 2
_SMALL = 1 << 20  # bytes below which a tensor is copied with one memmove
# CUDA bytes below which a refresh copies at once instead of overlapping (elasticd.checkpoint.overlap). On an
# H100 node an overlapped refresh of the recovery bench's tiny model was charged about 1.2 ms, a
# synchronous one about 0.5 ms; 0.7 ms is what a synchronous copy of 8 MiB into shared memory
# takes there (~12 GB/s), so below this size queuing the copies costs more than it saves.
OVERLAP_MIN_BYTES = 8 << 20
_LAYOUT = operator.attrgetter(
    "dtype", "shape", "is_cpu"
)  # what a slot's views and copies are made for
_FIRST = operator.itemgetter(0)
torch: Any = None  # imported by the worker-side functions only: the daemon never loads torch
_walk: Any = None  # elasticd.checkpoint.walk, which imports torch: imported with it


def _import_torch() -> None:
    global torch, _walk
    if torch is None:
        import torch as t

        from elasticd.checkpoint import walk

        torch, _walk = t, walk


# -- daemon side ------------------------------------------------------------------------------

LOCK = "lock"  # flocked by the live daemon for as long as the directory is in use
OWNER = "owner"  # the daemon's pid (for people), written once the lock is held
_locks: dict[str, int] = {}  # directory -> the lock's descriptor, held until remove()


def create(run_id: str) -> str | None:
    """A fresh 0700 directory for this daemon run, or None where there is no tmpfs to use.
    Directories of daemons that died without cleaning up are removed first.

    The daemon holds an exclusive flock on the directory's lock file for its whole life (close
    on exec: no worker holds it after the daemon is gone): that, not the pid in `owner`, is what
    tells a live directory, since a daemon in another pid namespace sharing /dev/shm (a container)
    has a pid that means nothing here."""
    if not os.path.isdir(ROOT) or not os.access(ROOT, os.W_OK):
        return None
    reap_stale()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64]
    try:
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{safe}-", dir=ROOT)
        fd = safeio.create(os.path.join(path, LOCK), os.O_RDONLY)
        _locks[path] = fd
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with os.fdopen(safeio.create(os.path.join(path, OWNER)), "w") as f:  # last: see reap_stale
            f.write(str(os.getpid()))
    except OSError:
        return None
    return path


def remove(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
        fd = _locks.pop(path, None)
        if fd is not None:
            os.close(fd)


def reap_stale() -> list[str]:
    """Our user's memory directories whose daemon is gone (SIGKILL, power cut of the process):
    nobody holds their lock. Anything else stays: a directory without an owner file (being
    created) or a lock file (an older elasticd's), another user's, or a symlink (never followed)."""
    gone = []
    try:
        root = os.open(ROOT, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return gone
    try:
        for name in os.listdir(root):
            lock = _take_lock(root, name) if name.startswith(PREFIX) else None
            if lock is not None:
                try:
                    shutil.rmtree(name, dir_fd=root, ignore_errors=True)
                finally:
                    os.close(lock)
                gone.append(os.path.join(ROOT, name))
    finally:
        os.close(root)
    return gone


def _take_lock(root: int, name: str) -> int | None:
    """The locked lock file of ROOT/name if that is a directory of this user that no live daemon
    holds, else None."""
    try:
        d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
    except OSError:
        return None  # a symlink, a file, gone
    try:
        if os.fstat(d).st_uid != os.geteuid():
            return None
        os.stat(OWNER, dir_fd=d, follow_symlinks=False)
        lock = os.open(LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
    except OSError:
        return None
    finally:
        os.close(d)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return None
    return lock


def newest_step(path: str | None) -> int | None:
    """The newest whole state in the directory (for status), whatever its world size."""
    steps = (
        [h["step"] for h in (header(slot_path(path, 0, k)) for k in range(SLOTS)) if h]
        if path
        else []
    )
    return max(steps) if steps else None


# -- slots ------------------------------------------------------------------------------------


def slot_path(path: str, local_rank: int, k: int) -> str:
    return os.path.join(path, f"l{local_rank}.{k}")


def header(file: str) -> dict[str, int] | None:
    """A valid slot's header fields, or None (missing, being written, torn, truncated)."""
    try:
        with open(file, "rb") as f:
            raw = f.read(_FIELDS.size)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    return _parse(raw, size)


def _parse(raw: bytes, size: int) -> dict[str, int] | None:
    if len(raw) < _FIELDS.size:
        return None
    magic, valid, step, world, rank, data_len, meta_len, crc, local_world, lineage = _FIELDS.unpack(
        raw
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
    }


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# The description of a state: JSON where every container other than a list is tagged, so that
# decoding builds only plain data (nothing a file could use to run code) and round-trips exactly
# what torch.load(weights_only=True) would give back.
_T = "\x00"
_DICT = json.dumps(_T + "d").encode()  # the tag of a dict, as the JSON of a description spells it


class _Description:
    """How elasticd.checkpoint.walk encodes a state for a slot: JSON, its tensors appended to
    `tensors` as (tensor, location). Runs every refresh. `last_flat` and `flat` (last refresh's,
    this refresh's): descriptions of dicts of named tensors (a model's state_dict, an
    optimizer's per-parameter state), made once and then the same object for as long as the
    names are, see named_tensors."""

    cannot = "kept in the in-memory state"

    def __init__(self, last_flat: dict) -> None:
        self.tensors: list = []
        self.last_flat, self.flat = last_flat, {}

    def tensor(self, t: Any, at: Any) -> dict:
        self.tensors.append((t, at))
        return {_T + "t": len(self.tensors) - 1}

    def named_tensors(self, obj: dict, at: Any) -> dict:
        """The description of a dict of str -> tensor without a Python step per entry: it
        depends only on the names and where its tensors start in `tensors`, so the object made
        for them last refresh is handed out again, and Writer._json knows it by identity
        (nothing to compare or encode)."""
        cls, tensors = type(obj), self.tensors
        key = (cls, tuple(obj), len(tensors))
        desc = self.last_flat.get(key)
        if desc is None:
            tag = _T + ("d" if cls is dict else "o")
            desc = {tag: [[k, {_T + "t": i}] for i, k in enumerate(key[1], len(tensors))]}
        self.flat[key] = desc
        tensors.extend(zip(obj.values(), zip(itertools.repeat(at), key[1])))
        return desc

    def mapping(self, ordered: bool, pairs: list) -> dict:
        return {_T + ("o" if ordered else "d"): pairs}

    def collection(self, is_tuple: bool, items: list) -> dict:
        return {_T + ("u" if is_tuple else "s"): items}

    def value(self, obj: Any) -> dict:
        if isinstance(obj, torch.Size):
            return {_T + "S": list(obj)}
        if isinstance(obj, torch.dtype):
            return {_T + "D": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {_T + "v": str(obj)}
        if isinstance(obj, complex):
            return {_T + "c": [obj.real, obj.imag]}
        return {_T + "b": base64.b64encode(obj).decode()}

    def keeps(self, obj: Any) -> bool:
        return False


def _rebuild(obj: Any, tensors: list) -> Any:
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    ((tag, v),) = obj.items()
    tag = tag[1:]
    if tag == "t":
        return tensors[v]
    if tag in ("d", "o"):
        pairs = ((_rebuild(k, tensors), _rebuild(x, tensors)) for k, x in v)
        return OrderedDict(pairs) if tag == "o" else dict(pairs)
    if tag == "u":
        return tuple(_rebuild(x, tensors) for x in v)
    if tag == "s":
        return {_rebuild(x, tensors) for x in v}
    if tag == "S":
        return torch.Size(v)
    if tag == "D":
        return getattr(torch, v)
    if tag == "v":
        return torch.device(v)
    if tag == "b":
        return base64.b64decode(v)
    if tag == "c":
        return complex(*v)
    raise ValueError(f"unknown entry {tag!r} in an in-memory state")


# -- worker side ------------------------------------------------------------------------------


@dataclasses.dataclass
class Cadence:
    """How often the in-memory state is refreshed: at every step that is a multiple of `every`.

    With a `budget` (a share of training time), `every` follows what refreshes cost here: the
    smallest N with (refresh time) / (N x step time) <= budget. A small state on long steps is
    refreshed every step; a big one on short steps is refreshed less often instead of slowing
    every step, and a crash then loses about refresh time / budget of work at most. Step time is
    measured between the training loop's calls, so checkpoint work is not counted as training.
    Every rank must refresh at the same steps (a resume needs a step all ranks hold): the caller
    agrees on the largest proposal() over the ranks and hands it to adopt() on all of them."""

    every: int = 1
    budget: float | None = None
    costs: deque = dataclasses.field(
        default_factory=lambda: deque(maxlen=WINDOW)
    )  # refreshes at this `every`
    steps: deque = dataclasses.field(default_factory=lambda: deque(maxlen=15))
    left: float | None = None  # when the caller went back to training
    measured: tuple[float, float] = (
        0.0,
        0.0,
    )  # (refresh, step) seconds that decided the last change

    def step_began(self) -> None:
        now = time.monotonic()
        if self.left is not None:
            self.steps.append(now - self.left)

    def step_ended(self) -> None:
        self.left = time.monotonic()

    def proposal(self) -> int:
        """This rank's N. A refresh that mapped a slot is not counted (the caller leaves it
        out); of the others the lower quartile stands for the cost, since a refresh is only ever
        slowed down by the rest of the machine (a preempted copy, workers warming up after a
        start). Refreshes are compared only at the same N: a refresh after N steps of training
        finds colder caches than one after a single step and costs more (10-15% more at N=3 than
        at N=1 for the recovery bench's model), and a few slow samples must not raise N (nor
        the start-up's, when every step is slow). Hence N is proposed from a full window of
        refreshes at the current N, or as soon as the last five cost four times the budget or
        more (a big state, or one that grew: no reason to wait)."""
        if self.budget is None or len(self.costs) < 5 or len(self.steps) < 5:
            return self.every
        allowed = self.budget * max(self.step_time(), 1e-6)  # refresh seconds per step
        recent = sorted(itertools.islice(reversed(self.costs), 5))[
            1
        ]  # the last five, one fast outlier aside
        if recent >= 4 * self.every * allowed:
            return math.ceil(recent / allowed - 1e-9)
        if len(self.costs) < self.costs.maxlen:
            return self.every
        return max(1, math.ceil(self.cost() / allowed - 1e-9))

    def cost(self) -> float:
        return sorted(self.costs)[len(self.costs) // 4] if self.costs else 0.0

    def step_time(self) -> float:
        return statistics.median(self.steps) if self.steps else 0.0

    def adopt(self, agreed: int) -> bool:
        """Take the agreed N when it is a quarter larger or smaller (no creeping or flapping
        between neighbours), and measure refreshes afresh at it. Returns whether `every`
        changed."""
        if 4 * agreed >= 5 * self.every or 5 * agreed <= 4 * self.every:
            self.measured = (self.cost(), self.step_time())
            self.every = agreed
            self.costs.clear()
            return True
        return False


WINDOW = 25  # refreshes at one cadence that settle it (see Cadence.proposal)


class _Slot:
    """One mapped slot file and the tensor views of its current layout."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.mm: mmap.mmap | None = None
        self.size = 0
        self.layout: tuple = ()
        self.views: list = []
        self.direct: list = []  # per view: (address, bytes) for one memmove from a contiguous CPU tensor, or None
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
        _import_torch()
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
                _invalidate(self.slots[k].file)
        self.next = (kept[0] + 1) % SLOTS if kept else 0
        self._layout: tuple | None = None
        self._offsets: list[int] = []
        self._end = 0
        self._table = b""
        self._encoded: dict[
            Any, tuple[Any, bytes, bytes]
        ] = {}  # entry -> (description, marshal, JSON)
        self._flat: dict = {}  # descriptions of dicts of named tensors, see _Description.named_tensors

    def write(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        world: int,
        rank: int,
        owned: set[int] | None = None,
        started: float | None = None,
    ) -> bool:
        """Store `state` (a capture(), whose "rng" holds at least this rank's entry) as `step`.
        Returns whether a slot had to be mapped first (its cost is not a refresh's).
        When overlapping: `owned` holds the ids of the tensors only the optimizer writes, whose
        copies may run beside the next step; `started` is when the refresh began."""
        started = time.perf_counter() if started is None else started
        rng = state.get("rng") or {}
        ranks = rng.get("ranks") or []
        mine = ranks[rank] if rank < len(ranks) else (ranks[0] if len(ranks) == 1 else None)
        desc = _Description(self._flat)
        walk, tensors = _walk.walk, desc.tensors
        used: dict = {}
        tree = (
            b"{" + _DICT + b':[["rng",' + self._json("rng", walk(mine, desc, (None, "rng")), used)
        )
        if self.local_rank == 0:
            entries = [
                b"["
                + self._json(("k", k), walk(k, desc), used)
                + b","
                + self._json(("v", k), walk(v, desc, (None, k)), used)
                + b"]"
                for k, v in state.items()
                if k != "rng"
            ]
            tree += b'],["state",{' + _DICT + b":[" + b",".join(entries) + b"]}"
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
        ordered: list = []  # other device tensors: copied on the training stream, before what follows
        for view, direct, (t, _) in zip(slot.views, slot.direct, tensors):
            if direct is not None and t.is_contiguous():
                ctypes.memmove(direct[0], t.data_ptr(), direct[1])  # a third of copy_'s overhead
            elif view is None:
                continue
            elif copier is not None and t.is_cuda:
                (side if owned is not None and id(t) in owned else ordered).append((view, t))
            else:
                view.copy_(t.detach())  # device tensors, and big ones: torch's parallel copy
        head = _FIELDS.pack(
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
        )
        commit = functools.partial(_commit, slot, HEADER + end, meta, head)
        self.queued = copier is not None
        if copier is None:
            commit()
        else:
            copier.copy(self.next, side, ordered, commit, started, counted=not mapped)
        self.next = (self.next + 1) % SLOTS
        return mapped

    def _overlapping(self) -> Any:
        """The Copier for this refresh, or None to copy synchronously. First the last refresh
        lands, as a synchronous one would have: a slot is only ever invalidated while the other
        holds a whole step. A refresh that no optimizer step has waited for since may have
        raced a write (see elasticd.checkpoint.overlap): it is dropped, its slot is the one written next,
        and overlapping ends."""
        if self._copier is None:
            if not self._worth_overlapping() or not torch.cuda.is_initialized():
                return None
            from elasticd.checkpoint import overlap

            try:
                self._copier = overlap.Copier(self._device)
            except Exception as e:  # noqa: BLE001 - a CUDA runtime that cannot give a stream: copy as before
                return self._off(f"no side stream: {type(e).__name__}: {e}")
        if self._copier.unfired():
            return self._off(
                "no optimizer step ran between two refreshes (a step replayed from a CUDA "
                "graph, or parameters updated by hand)"
            )
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
        same object (one made once by _Description.named_tensors, a key, a small number), else on marshal's
        bytes, several times cheaper than encoding JSON and exact about types (1, 1.0 and True
        are equal to ==, not here). Descriptions are never changed once made."""
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
            end = _aligned(end + t.numel() * t.element_size())
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
    mm[: _FIELDS.size] = head
    slot.set_valid(1)


def _invalidate(file: str) -> None:
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


def held(path: str | None, local_rank: int) -> list[Held]:
    """A local rank's valid slots, newest step first: of any world size and lineage (headers only;
    local rank 0's hold the node's whole state)."""
    out = []
    for k in range(SLOTS) if path else ():
        h = header(slot_path(path, local_rank, k))
        if h:
            out.append(Held(h["step"], h["lineage"], h["world"], h["rank"], h["local_world"], k))
    return sorted(out, reverse=True)


def _find(path: str, local_rank: int, step: int, lineage: int) -> str:
    for h in held(path, local_rank):
        if (h.step, h.lineage) == (step, lineage):
            return slot_path(path, local_rank, h.k)
    raise ValueError(f"in-memory state at step {step} is gone")


def _decode(buf: Any, size: int, name: str, step: int, lineage: int) -> tuple[dict[str, int], Any]:
    """A slot's header and state from its bytes (a mapping of the file, or the bytes received from
    another rank): checked for the step and lineage expected, the description's checksum and a
    layout that stays inside the tensors' bytes. Every tensor is copied out."""
    h = _parse(bytes(buf[: _FIELDS.size]), size)
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
    return h, _rebuild(desc["tree"], tensors)


def _load_slot(file: str, step: int, lineage: int) -> Any:
    _import_torch()
    name = os.path.basename(file)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            h, out = _decode(mm, size, name, step, lineage)
            if _parse(mm[: _FIELDS.size], size) != h:
                raise ValueError(f"in-memory slot {name} changed while being read")
            return out


def load(path: str, local_rank: int, step: int, lineage: int) -> dict[str, Any]:
    """What a local rank's slot holds at (step, lineage): {"rng": ..., "state": {...}} for local
    rank 0 (the node's whole state), {"rng": ...} for the others. ValueError when it is gone,
    damaged or changed while being read."""
    return _load_slot(_find(path, local_rank, step, lineage), step, lineage)


def raw(path: str, step: int, lineage: int) -> bytearray:
    """The node's whole state at (step, lineage) as its slot's bytes (header, tensors,
    description), copied out and checked: what a rank sends to ranks whose node lacks it."""
    file = _find(path, 0, step, lineage)
    name = os.path.basename(file)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = _parse(f.read(_FIELDS.size), size)
        if not h or (h["step"], h["lineage"]) != (step, lineage):
            raise ValueError(f"in-memory slot {name} no longer holds step {step}")
        buf = bytearray(HEADER + h["data_len"] + h["meta_len"])
        f.seek(0)
        if f.readinto(buf) != len(buf):
            raise ValueError(f"in-memory slot {name} is truncated")
        f.seek(0)
        if _parse(f.read(_FIELDS.size), size) != h:
            raise ValueError(f"in-memory slot {name} changed while being read")
    return buf


def decode(buf: bytearray, step: int, lineage: int) -> dict[str, Any]:
    """The state in bytes that raw() gave on another node, checked as a slot is read."""
    _import_torch()
    return _decode(buf, len(buf), "received", step, lineage)[1]


def steps(path: str | None, *, world: int, rank: int, local_rank: int) -> list[int]:
    """Steps this rank could resume from at an unchanged world (tools and tests; a resume goes
    through held()): the node's whole state and this rank's own RNG, written at this world size."""
    node = {h.step for h in held(path, 0) if h.world == world}
    return sorted(
        node & {h.step for h in held(path, local_rank) if h.world == world and h.rank == rank},
        reverse=True,
    )


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


def keep_only(path: str | None, *, local_rank: int, keep: tuple[int, int] | None) -> None:
    """Invalidate this local rank's slots except the one holding `keep`, a (step, lineage) (None:
    all of them), so that no state of an abandoned timeline can be mixed with the one resumed from."""
    if not path:
        return
    kept = [
        h.k
        for h in held(path, local_rank)
        if keep is not None and (h.step, h.lineage) == tuple(keep)
    ][:1]
    for k in range(SLOTS):
        if k not in kept:
            _invalidate(slot_path(path, local_rank, k))
