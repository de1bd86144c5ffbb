"""Rank-0 checkpoints that survive a crash at any instant, and an exact resume.

Adopting it in a DDP loop (the same code runs under elasticd, torchrun or as one process):

    mgr = CheckpointManager(every_steps=100)            # dir: arg, else $ELASTICD_CHECKPOINT_DIR
    state = mgr.load_latest()                           # rank 0 reads, every rank receives
    step = restore(state, model=model, optimizer=opt, sampler=sampler)["step"] if state else 0
    while step < total_steps:
        train_one_step(...); sampler.advance(batch_size); step += 1
        mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, sampler=sampler, step=step))
        if mgr.should_stop():                           # SIGTERM (`elasticd stop`): saved above
            break
    mgr.close()                                         # waits for the save in flight

Every rank calls the same methods at the same steps: `capture()` gathers each rank's RNG state and
the save/stop decisions are agreed across ranks, so those calls are collectives.

Directory layout (format 1; a newer elasticd keeps reading it):
    ckpt-<step:012d>-<sha256[:16]>.pt   torch.save({"format", "step", "meta", "state"}); the name
                                        carries the checksum, so files verify without a manifest
    manifest.json                       {"format": 1, "latest": file, "checkpoints": [entry, ...]}
                                        entries oldest first: file, step, epoch, position,
                                        world_size, time, bytes, sha256
    .ckpt-*.tmp / .manifest-*.tmp       writes in progress; removed by the next writer
A checkpoint file appears only by os.replace of a fully written and fsynced temporary file, and
the directory is fsynced after, so a crash leaves the old or the new checkpoint, never a torn one.
"Latest" is the most recently written checkpoint, whatever its step.

Loading uses torch.load(weights_only=True) only: nothing in a checkpoint can run code. Under
torch.distributed the verified file's bytes are broadcast and every rank torch.loads them with
weights_only=True too, so nodes need no shared filesystem and no pickle crosses the network.
"""

from __future__ import annotations

import array
import collections
import ctypes
import dataclasses
import errno
import functools
import hashlib
import io
import json
import numbers
import os
import random
import re
import signal
import socket
import stat
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import structlog
import torch
import torch.distributed as dist

from elasticd import health, memory

__all__ = [
    "FORMAT", "MANIFEST", "CheckpointError", "CheckpointManager", "Entry", "capture", "restore",
    "load_latest", "load_file", "candidates", "read_manifest", "latest_info",
    "install_sigterm_handler", "stop_requested", "request_stop", "unwrap_model",
]

FORMAT = 1  # of the manifest and of the payload inside each checkpoint file
MANIFEST = "manifest.json"
_NAME = re.compile(r"^ckpt-(\d{12,})-([0-9a-f]{16})\.pt$")
_TEMP = re.compile(r"^\.(ckpt|manifest)-.*\.tmp$")
_SHA256 = re.compile(r"^[0-9a-f]{16}(?:[0-9a-f]{48})?$")  # full digest, or the name's 16-digit prefix
MAX_MANIFEST = 4 << 20  # bytes; the manifest of keep=3 is under a kilobyte
MAX_STEP = 2**62  # steps travel between ranks as int64

log = structlog.get_logger()


class CheckpointError(RuntimeError):
    """A save that did not complete (the previous checkpoint is intact and still latest)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint as the manifest records it. `sha256` is the full digest, or the 16-hex-digit
    prefix from the file name for a file found by scanning the directory."""

    file: str
    step: int
    epoch: int | None = None
    position: int | None = None  # samples of the epoch consumed (the sampler's `consumed`)
    world_size: int | None = None
    time: float = 0.0  # wall clock (time.time()) when the state was captured
    bytes: int = 0
    sha256: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Entry:
        """The entry, or ValueError saying what is wrong with it. Strict, as whoever can write the
        directory wrote it: `file` must be a checkpoint name in the directory itself (a crafted
        manifest must not make the writer delete or read files elsewhere) whose step and checksum
        agree with the entry's; numbers must be whole and in range (no 1e999, no negative or
        int64-overflowing step), the time finite."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a checkpoint entry is not an object: {_quote(d)}")
        m = _NAME.match(d["file"]) if isinstance(d.get("file"), str) else None
        if not m:
            raise ValueError(f"not a checkpoint file name: {_quote(d.get('file'))}")
        step = _whole(d, "step", required=True)
        if step != _name_step(m):
            raise ValueError(f"step {step} is not the step in the file name {d['file']}")
        sha = m.group(2) if d.get("sha256") in (None, "") else d["sha256"]
        if not isinstance(sha, str) or not _SHA256.match(sha) or not sha.startswith(m.group(2)):
            raise ValueError(f"sha256 {_quote(sha)} is not the checksum in the file name {d['file']}")
        t = d.get("time") or 0.0
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"time {_quote(t)} is not a finite time")
        return cls(file=d["file"], step=step, epoch=_whole(d, "epoch"), position=_whole(d, "position"),
                   world_size=_whole(d, "world_size"), time=float(t), bytes=_whole(d, "bytes") or 0, sha256=sha)


def _quote(value: Any) -> str:
    """A value from a file, quoted short in a message."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(d: Mapping[str, Any], key: str, required: bool = False) -> int | None:
    """d[key] as a whole number in [0, MAX_STEP]; None where it may be missing (ValueError otherwise)."""
    v = d.get(key)
    if v is None and not required:
        return None
    if type(v) is not int or not 0 <= v <= MAX_STEP:
        raise ValueError(f"{key} {_quote(v)} is not a whole number from 0 to 2**62")
    return v


def _name_step(m: re.Match) -> int:
    """The step a checkpoint file's name carries; ValueError beyond MAX_STEP."""
    digits = m.group(1)
    if len(digits) > 19 or int(digits) > MAX_STEP:
        raise ValueError(f"the step in the file name {m.group(0)} is beyond 2**62")
    return int(digits)


# -- process context ------------------------------------------------------------------------------

def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    """torch.distributed's rank when initialized, else torchrun's RANK, else 0."""
    return dist.get_rank() if _dist_on() else int(os.environ.get("RANK", 0))


def _world() -> int:
    return dist.get_world_size() if _dist_on() else int(os.environ.get("WORLD_SIZE", 1))


def _resolve_dir(directory: str | os.PathLike | None) -> str:
    directory = directory if directory is not None else os.environ.get("ELASTICD_CHECKPOINT_DIR")
    if not directory:
        raise ValueError("no checkpoint directory: pass one or set ELASTICD_CHECKPOINT_DIR")
    return os.fspath(directory)


_cpu_groups: list[tuple[Any, Any]] = []  # (default group object, gloo group) for non-gloo jobs


def _cpu_group():
    """A group that takes CPU tensors: the default one when it has gloo, else a gloo group made
    once (a collective: every rank gets here at the same point, in load/capture/agreement).
    Keeping our small collectives on CPU avoids CUDA syncs and device placement in NCCL jobs."""
    backend = str(dist.get_backend())
    if backend == "gloo" or "cpu:gloo" in backend:
        return None
    world = dist.group.WORLD
    for owner, group in _cpu_groups:
        if owner is world:
            return group
    group = dist.new_group(backend="gloo")
    _cpu_groups[:] = [(world, group)]
    return group


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Bytes of a contiguous CPU uint8 tensor, without needing numpy."""
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _broadcast_bytes(data: bytes | bytearray | torch.Tensor | None, src: int,
                     group) -> bytes | bytearray | torch.Tensor:
    """Raw bytes (or a uint8 tensor of them) from `src` to every rank, as uint8 tensors (no pickle
    involved). The sender gets its `data` back, the others bytes."""
    mine = dist.get_rank() == src
    n = torch.tensor([len(data) if mine and data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    size = int(n.item())
    if size == 0:
        return b""
    if mine:
        assert data is not None
        if isinstance(data, torch.Tensor):
            buf = data
        else:
            buf = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
        dist.broadcast(buf, src, group=group)
        return data
    buf = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return _tensor_bytes(buf)


def _all_gather_bytes(data: bytes, group) -> list[bytes]:
    world = dist.get_world_size()
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [_tensor_bytes(o[: int(s.item())]) for o, s in zip(out, sizes)]


def _all_gather_ints(value: int, group) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=group)
    return [int(t.item()) for t in out]


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes | bytearray) -> Any:
    """The only way bytes become objects here: weights_only, so no code can run."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# -- host-memory snapshot -------------------------------------------------------------------------

def _safe_globals() -> tuple[type, ...]:
    try:
        return tuple(g for g in torch.serialization.get_safe_globals() if isinstance(g, type))
    except AttributeError:  # older torch
        return ()


class _Snapshot:
    """Copies a state into host memory the training loop cannot change under the background
    writer. Host buffers are reused from the previous save when shapes match (it has finished by
    then: one save in flight), which makes the copy several times faster than fresh allocations
    (no page faults) and lets device tensors go through pinned memory without a sync each."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, state: Any) -> Any:
        self._old, self.buffers, self._device = self.buffers, {}, False
        try:
            out = self._copy(state, "state")
            if self._device and torch.cuda.is_available():
                torch.cuda.synchronize()  # the non_blocking copies have landed
            return out
        finally:
            self._old = {}

    def _tensor(self, t: torch.Tensor, path: str) -> torch.Tensor:
        t = t.detach()
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            return t.to("cpu", copy=True)
        buf = self._old.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        self._device = self._device or t.device.type != "cpu"
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        self.buffers[path] = buf
        return buf

    def _copy(self, obj: Any, path: str) -> Any:
        """Containers are rebuilt as plain dict/list/tuple. Anything torch.load(weights_only=True)
        could not read back is refused here, in the caller's thread and naming the key, so no
        checkpoint is written that cannot be loaded; numpy scalars become Python numbers."""
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if obj is None or type(obj) in (bool, int, float, complex, str, bytes, bytearray):
            return obj
        if isinstance(obj, (torch.Size, torch.dtype, torch.device)):
            return obj
        if isinstance(obj, Mapping):
            items = ((self._copy(k, f"{path} key"), self._copy(v, f"{path}[{k!r}]")) for k, v in obj.items())
            return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if isinstance(obj, (list, tuple, set, frozenset)):
            items = [self._copy(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            return list(items) if isinstance(obj, list) else tuple(items) if isinstance(obj, tuple) else set(items)
        if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
            return self._copy(obj.item(), path)  # a numpy scalar (a metric, a count)
        if isinstance(obj, numbers.Integral):
            return int(obj)
        if isinstance(obj, numbers.Real):
            return float(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if isinstance(obj, _safe_globals()):
            return obj  # the user registered it with torch.serialization.add_safe_globals
        raise TypeError(f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be read back with "
                        "torch.load(weights_only=True); store tensors, numbers, strings, lists and dicts")


def _snapshot(state: Any) -> Any:
    """A one-off host copy (no buffer reuse)."""
    return _Snapshot().take(state)


# -- files ----------------------------------------------------------------------------------------

class _HashingWriter:
    """File object for torch.save that hashes what it writes: one pass, no in-memory copy."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None  # torch's C++ writer hides it behind "unexpected pos"

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(directory: str, name: str | Callable[[Any], str], kind: str,
                  fill: Callable[[Any], Any]) -> tuple[str, Any]:
    """Write via `fill(file)` to a temporary file in `directory`, fsync it, rename it into place
    and fsync the directory; remove the temporary file on any failure. `name` may be a function
    of fill's result (a checksum known only once written)."""
    tmp = os.path.join(directory, f".{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        # new (O_EXCL), never through a symlink, never world-readable: checkpoints hold the weights
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        with os.fdopen(fd, "wb") as f:
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
        final = name if isinstance(name, str) else name(result)
        os.replace(tmp, os.path.join(directory, final))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    return final, result


def _write_checkpoint(directory: str, payload: dict[str, Any], meta: dict[str, Any]) -> Entry:
    """The checkpoint file itself; its name carries the step and the checksum prefix."""
    step = int(payload["step"])

    def fill(f) -> _HashingWriter:
        w = _HashingWriter(f)
        try:
            torch.save(payload, w)
        except Exception as e:
            if w.error is not None:
                raise w.error from e
            raise
        return w

    name, w = _atomic_write(directory, lambda w: f"ckpt-{step:012d}-{w.sha.hexdigest()[:16]}.pt",
                            "ckpt", fill)
    return Entry(file=name, step=step, epoch=meta.get("epoch"), position=meta.get("position"),
                 world_size=meta.get("world_size"), time=float(meta["time"]), bytes=w.size,
                 sha256=w.sha.hexdigest())


def _write_manifest(directory: str, entries: list[Entry]) -> None:
    doc = {
        "format": FORMAT,
        "latest": entries[-1].file if entries else None,
        "checkpoints": [e.to_json() for e in entries],
    }
    data = (json.dumps(doc, indent=1) + "\n").encode()
    _atomic_write(directory, MANIFEST, "manifest", lambda f: f.write(data))


def read_manifest(directory: str | os.PathLike) -> list[Entry] | None:
    """Entries oldest first, or None when there is no usable manifest (then scan the files).

    Each manifest format this elasticd has ever written is parsed here; a newer one is
    reported and ignored rather than misread."""
    path = os.path.join(directory, MANIFEST)
    try:
        doc = json.loads(_read_small(path, MAX_MANIFEST))
        fmt = doc.get("format") if isinstance(doc, dict) else None
        if type(fmt) is int and fmt == 1:
            found = doc.get("checkpoints")
            if not isinstance(found, list):
                raise ValueError(f"\"checkpoints\" is not a list: {_quote(found)}")
            return [Entry.from_json(e) for e in found]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:300]
        log.warning("checkpoint_manifest_unreadable", path=path, error=why,
                    action="scanning checkpoint files instead")
        return None
    log.warning("checkpoint_manifest_unknown_format", path=path, format=_quote(fmt), known=FORMAT,
                action="scanning checkpoint files instead")
    return None


def _read_small(path: str, limit: int) -> bytes:
    """A regular file's bytes; OSError for anything else (a FIFO would block the reader, the daemon's
    status included), ValueError beyond `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def candidates(directory: str | os.PathLike) -> list[Entry]:
    """Every checkpoint in `directory`, newest first: the manifest's entries plus any file the
    manifest does not list (a crash between writing a file and updating the manifest, or a lost
    manifest). Files are not read here."""
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    entries = read_manifest(directory) or []
    known = {e.file for e in entries}
    for name in names:
        m = _NAME.match(name)
        if m and name not in known:
            try:
                step = _name_step(m)
                st = os.stat(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            except ValueError as e:
                log.warning("checkpoint_skipped", path=os.path.join(directory, name), reason=str(e),
                            action="trying the previous checkpoint")
                continue
            entries.append(Entry(file=name, step=step, time=st.st_mtime, bytes=st.st_size, sha256=m.group(2)))
    order = {id(e): i for i, e in enumerate(entries)}
    return sorted(entries, key=lambda e: (e.time, e.step, order[id(e)]), reverse=True)


def latest_info(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The newest checkpoint's manifest entry plus its path, reading no checkpoint (for status)."""
    found = candidates(directory)
    if not found:
        return None
    return {**found[0].to_json(), "path": os.path.join(os.fspath(directory), found[0].file)}


def _read_verified(path: str, sha256: str | None, *,
                   for_broadcast: bool = False) -> tuple[torch.Tensor | None, Any]:
    """The file's payload (and, for_broadcast, its bytes as a uint8 tensor), or ValueError/OSError
    saying why it cannot be used. The checksum is streamed and torch.load reads the very file
    that was hashed (through its open descriptor), so a load costs about what a plain torch.load
    does instead of copying the bytes through Python three times."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = None
        if for_broadcast:
            data = torch.empty(size, dtype=torch.uint8)
            view = (ctypes.c_char * size).from_address(data.data_ptr()) if size else bytearray()
            if f.readinto(view) != size:
                raise ValueError("file changed while being read")
            digest = hashlib.sha256(view).hexdigest()
            del view
        else:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if sha256 and not digest.startswith(sha256):
            raise ValueError(f"checksum mismatch (sha256 {digest[:16]}..., expected {sha256[:16]}...; "
                             f"{size} bytes): truncated or corrupt")
        same = f"/proc/self/fd/{f.fileno()}"
        f.seek(0)
        try:
            payload = torch.load(same if os.path.exists(same) else f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises several types for bad or unsafe files
            raise ValueError(f"not loadable with weights_only=True: {_why(e)}") from e
    _check_payload(payload)
    return data, payload


def _why(e: BaseException) -> str:
    why = str(e)
    why = why[why.find("WeightsUnpickler error:"):] if "WeightsUnpickler error:" in why else why
    why = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", why).split())  # one event, one line
    return f"{type(e).__name__}: {why[:300]}"


def _check_payload(payload: Any) -> None:
    if not isinstance(payload, dict) or "state" not in payload or not isinstance(payload.get("format"), int):
        raise ValueError("not an elasticd checkpoint")
    if payload["format"] > FORMAT:
        raise ValueError(f"written by a newer elasticd (format {payload['format']}, this one reads {FORMAT})")


def load_file(path: str | os.PathLike, sha256: str | None = None) -> dict[str, Any]:
    """One checkpoint file's state (what was passed to save), verified when `sha256` is given or
    the name carries a checksum. Raises ValueError for a corrupt, foreign or unsafe file."""
    path = os.fspath(path)
    m = _NAME.match(os.path.basename(path))
    return _read_verified(path, sha256 or (m.group(2) if m else None))[1]["state"]


def _first_good(directory: str, found: list[Entry], *,
                for_broadcast: bool = False) -> tuple[torch.Tensor | None, dict, Entry] | None:
    """Pop candidates newest first until one verifies; report each one skipped."""
    while found:
        entry = found.pop(0)
        path = os.path.join(directory, entry.file)
        try:
            data, payload = _read_verified(path, entry.sha256, for_broadcast=for_broadcast)
        except (OSError, ValueError) as e:
            log.warning("checkpoint_skipped", path=path, step=entry.step, reason=str(e),
                        action="trying the previous checkpoint")
            continue
        return data, payload, entry
    return None


def _looks_at_disk() -> bool:
    """One process per node reads the local directory (LOCAL_RANK 0, or unknown)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _load_latest(directory: str | os.PathLike | None, group=None) -> tuple[dict[str, Any], Entry] | None:
    directory = _resolve_dir(directory)
    if not _dist_on() or dist.get_world_size() == 1:
        got = _first_good(directory, candidates(directory))
        return None if got is None else (got[1]["state"], got[2])
    # Each node looks at its own directory; the rank holding the newest step sends it. Group rank
    # 0 (and so the node that saves) can move between rendezvous rounds, so "rank 0 reads" is
    # generalized to "whoever has the newest reads"; with one shared directory that is rank 0.
    group = group if group is not None else _cpu_group()
    mine = candidates(directory) if _looks_at_disk() else []
    while True:
        steps = _all_gather_ints(mine[0].step if mine else -1, group)
        best = max(steps)
        if best < 0:
            return None
        src = steps.index(best)
        header, data, state = b"", b"", None
        if dist.get_rank() == src:
            entry = mine[0]
            got = _first_good(directory, mine[:1], for_broadcast=True)
            mine.pop(0)
            if got is not None:
                data, payload, entry = got
                state = payload["state"]
                header = json.dumps(entry.to_json()).encode()
        header = _broadcast_bytes(header, src, group)
        if not header:
            continue  # the sender's newest did not verify: every rank asks again
        data = _broadcast_bytes(data, src, group)
        entry = Entry.from_json(json.loads(bytes(header)))
        if state is None:
            payload = _from_bytes(data)
            _check_payload(payload)
            state = payload["state"]
        return state, entry


def load_latest(directory: str | os.PathLike | None = None, *, group=None) -> dict[str, Any] | None:
    """The newest checkpoint that verifies (checksum, then torch.load with weights_only=True), or
    None. Corrupt or truncated ones are reported (structlog warning with the path) and skipped.
    Under torch.distributed every rank must call it; all get the same state."""
    got = _load_latest(directory, group)
    return None if got is None else got[0]


# -- capture / restore ----------------------------------------------------------------------------

def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state_dict has no DDP `module.` or torch.compile `_orig_mod.` prefix.
    (torch.compile's wrapper holds the model as its submodule `_orig_mod`; looked up in
    `_modules`, as a missing attribute costs nn.Module an exception with a formatted message.)"""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(inner := model._modules.get("_orig_mod"), torch.nn.Module):
            model = inner
        else:
            return model


@functools.cache
def _numpy():
    """numpy, or None where it is not installed (looked up once: a failed import searches the
    whole path again each time)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, ints and floats (weights_only-loadable). CUDA's only
    where this process has initialised CUDA: reading it would otherwise create a CUDA context on
    every GPU (and fail in a process forked from one that has), and a process that never used
    CUDA has drawn nothing from it that a resume would need."""
    state: dict[str, Any] = {"python": _python_rng.state(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy"] = _numpy_rng.state(np)
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@dataclasses.dataclass
class _PythonRng:
    """Python's global RNG state, read again only when it may have changed.

    random.getstate() builds 625 ints, and turning them into a tensor takes as long again:
    together a good part of a small training step's in-memory refresh. In CPython the
    generator's index and 624-word key sit in the object right after its header; those bytes are
    compared instead, and the last state stands while they and gauss_next are unchanged
    (anything that draws, seeds or sets the state rewrites them). The layout is checked against
    getstate() once per generator; where it differs (another interpreter or build), every call
    reads getstate()."""

    inst: Any = None
    raw: bytes | None = None
    value: dict[str, Any] | None = None
    usable: bool = False
    key: Any = None  # the generator's index and key in place (ctypes array); read while `inst` lives
    _AT: ClassVar[int] = 16  # after ob_refcnt and ob_type: int index; uint32_t state[624]
    _SIZE: ClassVar[int] = 4 + 624 * 4

    def _raw(self) -> bytes:
        return self.key.raw

    def state(self) -> dict[str, Any]:
        inst = getattr(random.getstate, "__self__", random)  # the generator behind random's functions
        if (inst is self.inst and self.usable and self.value is not None
                and getattr(inst, "gauss_next", None) == self.value["gauss_next"] and self._raw() == self.raw):
            return self.value
        version, internal, gauss = inst.getstate()
        self.value = {"version": version, "state": torch.frombuffer(array.array("q", internal), dtype=torch.int64),
                      "gauss_next": gauss}
        if inst is not self.inst:
            self.inst = inst
            base = type(inst).__mro__[-2]  # the C type that holds the key
            self.usable = sys.implementation.name == "cpython" and base.__basicsize__ >= self._AT + self._SIZE
            if self.usable:
                self.key = (ctypes.c_char * self._SIZE).from_address(id(inst) + self._AT)
                self.usable = self._raw() == (array.array("i", internal[-1:]).tobytes()
                                              + array.array("I", internal[:-1]).tobytes())
        self.raw = self._raw() if self.usable else None
        return self.value


_python_rng = _PythonRng()


@dataclasses.dataclass
class _NumpyRng:
    """numpy's global RNG state, read again only when it may have changed.

    np.random.get_state() copies the 624-word key element by element (about 0.1 ms, more than a
    small training step's whole in-memory refresh). The generator's state struct, reachable
    through numpy's public ctypes interface, is compared instead: if its bytes are unchanged and
    no Gaussian was cached (drawing the cached one leaves the struct alone), the last state
    stands. The struct's layout is checked against get_state() once per generator; where it
    differs this shortcut is off."""

    gen: Any = None
    raw: bytes | None = None
    value: dict[str, Any] | None = None
    usable: bool = False
    key: Any = None  # the state struct in place (ctypes array); read while `gen` lives

    def _raw(self) -> bytes:
        return self.key.raw

    def state(self, np) -> dict[str, Any]:
        get_gen = getattr(np.random, "get_bit_generator", None)
        gen = get_gen() if get_gen else None
        if (gen is not None and gen is self.gen and self.usable and self.value is not None
                and not self.value["has_gauss"] and self._raw() == self.raw):
            return self.value
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        self.value = {"bit_generator": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        if gen is not self.gen:
            self.gen = gen
            self.usable = False
            try:
                if type(gen).__name__ == "MT19937":
                    self.key = (ctypes.c_char * (624 * 4 + 4)).from_address(gen.ctypes.state_address)
                    self.usable = self._raw() == keys.astype("<u4").tobytes() + int(pos).to_bytes(4, "little", signed=True)
            except (AttributeError, TypeError, ValueError):
                pass
        self.raw = self._raw() if self.usable else None
        return self.value


_numpy_rng = _NumpyRng()


def _set_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    key = py["state"]  # an int64 tensor; a list of ints in older checkpoints
    random.setstate((py["version"], tuple(key.tolist() if isinstance(key, torch.Tensor) else key), py["gauss_next"]))
    torch.set_rng_state(state["torch"])
    np = _numpy()
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["bit_generator"], s["keys"].numpy().astype(np.uint32), s["pos"],
                             s["has_gauss"], s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _derived_seed(rng: Mapping[str, Any], rank: int) -> int:
    """For a rank the checkpoint has no RNG state for (the world grew): reproducible, distinct."""
    known = [r for r in rng.get("ranks") or [] if r is not None]
    base = bytes(known[0]["torch"].tolist()) if known else b""
    return int.from_bytes(hashlib.sha256(base + rank.to_bytes(8, "little")).digest()[:8], "little") >> 1


# While CheckpointManager refreshes the in-memory state through a capture() callable: "node" on
# local rank 0, which keeps the node's whole state, "rng" on the other local ranks, which keep only
# their own RNG; None otherwise (a checkpoint).
_local_capture: list[str | None] = [None]
# While a refresh overlaps its device copies with the next step: capture() adds the ids of the
# tensors only the optimizer writes (its parameters and state) to this set (elasticd.overlap).
_owned: list[set[int] | None] = [None]


def capture(model: torch.nn.Module | None = None, optimizer=None, scheduler=None, scaler=None,
            sampler=None, *, rng: bool = True, **user_state: Any) -> dict[str, Any]:
    """Everything an exact resume needs, as one weights_only-loadable dict.

    A collective under torch.distributed (every rank's RNG state is gathered, so that each rank
    gets its own back). Tensors are live views: CheckpointManager.save copies them at the call;
    copy them yourself if you keep the dict while training goes on. `user_state` is anything
    else (step, best metric, ...) and comes back from restore()."""
    state: dict[str, Any] = {"format": FORMAT}
    refresh = _local_capture[0]
    if model is not None and refresh != "rng":
        # an in-memory refresh copies the parameters at once: no detached alias of each is needed
        state["model"] = unwrap_model(model).state_dict(keep_vars=refresh is not None)
    for key, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler),
                     ("sampler", sampler)):
        if obj is None or refresh == "rng":
            continue
        if not callable(getattr(obj, "state_dict", None)):
            hint = "; use elasticd.sampler.ResumableDistributedSampler" if key == "sampler" else ""
            raise TypeError(f"{key}: a {type(obj).__qualname__} has no state_dict(){hint}")
        state[key] = obj.state_dict()
        if key == "optimizer" and _owned[0] is not None and isinstance(obj, torch.optim.Optimizer):
            _owned[0].update(id(p) for g in obj.param_groups for p in g["params"])
            _owned[0].update(id(t) for s in obj.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    if rng:
        mine = _rng_state()
        world = dist.get_world_size() if _dist_on() else 1
        if world > 1 and refresh:
            ranks = [None] * world  # an in-memory snapshot: each rank keeps its own
            ranks[dist.get_rank()] = mine
        elif world > 1:
            ranks = [_from_bytes(b) for b in _all_gather_bytes(_to_bytes(mine), _cpu_group())]
        else:
            ranks = [mine]
        state["rng"] = {"world_size": len(ranks), "ranks": ranks}
    state["user"] = dict(user_state)
    return state


def restore(state: Mapping[str, Any], model: torch.nn.Module | None = None, optimizer=None,
            scheduler=None, scaler=None, sampler=None, *, strict: bool = True,
            rng: bool = True) -> dict[str, Any]:
    """Apply a capture()d state to the given objects; return its user state (step, ...).

    Each rank takes its own RNG state; a rank beyond the saved world size is seeded from a value
    derived from the checkpoint and its rank. RNG comes last, after everything that is loaded."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    for key, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                     ("scaler", scaler), ("sampler", sampler)):
        if obj is None:
            continue
        if key not in state:
            raise KeyError(f"the checkpoint has no {key!r} state (it has: {', '.join(sorted(state))})")
        if key == "model":
            sd = OrderedDict(state["model"])
            consume_prefix_in_state_dict_if_present(sd, "module.")  # a checkpoint saved from DDP
            unwrap_model(model).load_state_dict(sd, strict=strict)
        else:
            obj.load_state_dict(state[key])
    if rng and "rng" in state:
        saved, rank = state["rng"], _rank()
        if rank < len(saved["ranks"]) and saved["ranks"][rank] is not None:
            _set_rng_state(saved["ranks"][rank])
        else:
            seed = _derived_seed(saved, rank)
            random.seed(seed)
            torch.manual_seed(seed)
            np = _numpy()
            if np is not None:
                np.random.seed(seed % 2**32)
    return dict(state.get("user", {}))


# -- graceful stop --------------------------------------------------------------------------------

_stop = threading.Event()
_boundary = [0.0]  # monotonic time of the latest step boundary
_gaps: collections.deque[float] = collections.deque(maxlen=20)  # the latest times between two
_handler_installed = [0]  # pid of the process that installed it (a fork child installs anew)


def request_stop() -> None:
    """What SIGTERM does: ask the loop to save at its next step boundary and stop."""
    _stop.set()


def stop_requested() -> bool:
    """This process's own flag (not agreed across ranks; CheckpointManager.should_stop is)."""
    return _stop.is_set()


def _mark_state_loaded() -> None:
    """For the daemon's recovery timeline ("state loaded"), when running under elasticd."""
    path = os.environ.get("ELASTICD_HEARTBEAT_FILE")
    if path:
        health.mark(path, "state_loaded")


def _at_boundary() -> None:
    now = time.monotonic()
    if _boundary[0]:
        _gaps.append(now - _boundary[0])
    _boundary[0] = now


def _forget_boundaries() -> None:  # a forked child has not reached any boundary of its own yet
    _boundary[0] = 0.0
    _gaps.clear()


os.register_at_fork(after_in_child=_forget_boundaries)


def _abandoned() -> bool:
    """elasticd is restarting the group after a failure (a peer is dead or hung): the step in
    progress can never finish and the state since the last step is already in memory, so
    SIGTERM keeps its default meaning instead of waiting for a boundary that will not come."""
    return health.marked(os.environ.get("ELASTICD_HEARTBEAT_FILE"), "abandon")


def install_sigterm_handler(stop_timeout: float = 10.0) -> bool:
    """Turn SIGTERM into a stop request the loop honours at its next step boundary (save, exit 0).
    Not when elasticd marked the group abandoned (a restart after a failure): then it ends the
    process at once, as SIGTERM's default would.

    A rank that cannot reach a boundary (stuck in a collective with a dead peer) must still die
    promptly, as SIGTERM's default would: a watchdog thread woken by the signal itself
    (signal.set_wakeup_fd, which works while the main thread is blocked in C++) ends the process
    with status 143 when no step boundary follows within max(stop_timeout, 3 x the longest of
    the last 20 steps). A second SIGTERM ends it at once. Main thread only; returns False elsewhere or when
    something else (an asyncio loop) owns the wakeup fd, in which case only the flag is set."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _handler_installed[0] == os.getpid():
        return True
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if _stop.is_set() or _abandoned():  # second SIGTERM, or a restart: the default action
            signal.signal(signal.SIGTERM, previous if callable(previous) else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            return
        _stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    _handler_installed[0] = os.getpid()
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        old = -2
    if old != -1:  # someone else's; put it back and go without the watchdog
        if old >= 0:
            signal.set_wakeup_fd(old)
        reader.close()
        writer.close()
        return True
    pid = os.getpid()

    def watchdog():
        while True:
            try:
                got = reader.recv(64)
            except OSError:
                return
            if os.getpid() != pid or not got:
                return
            if signal.SIGTERM not in got:
                continue
            if _abandoned():  # the main thread may be blocked in C++ and never run the handler
                os._exit(128 + signal.SIGTERM)
            signalled = time.monotonic()
            while True:
                limit = max(stop_timeout, 3 * max(_gaps, default=0.0))
                if _boundary[0] > signalled:
                    return  # the loop is alive and will save and stop by itself
                if time.monotonic() - signalled > limit:
                    os.write(2, f"elasticd.checkpoint: SIGTERM and no step boundary within {limit:.0f}s; "
                                "exiting\n".encode())
                    os._exit(128 + signal.SIGTERM)
                time.sleep(0.05)

    def after_fork_in_child():  # a forked DataLoader worker must not wake our watchdog
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass

    os.register_at_fork(after_in_child=after_fork_in_child)
    threading.Thread(target=watchdog, name="elasticd-sigterm-watchdog", daemon=True).start()
    _watchdog_fds.extend([reader, writer])
    return True


_watchdog_fds: list[socket.socket] = []


def _describe(directory: str, err: BaseException) -> str:
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return (f"saving a checkpoint in {directory} failed: {type(err).__name__}: {err}"
            + (" (the disk, a quota or a file size limit is full)" if full else "")
            + "; the previous checkpoint is intact")


# -- the manager ----------------------------------------------------------------------------------

class CheckpointManager:
    """Periodic, atomic, asynchronous checkpoints written by global rank 0 only.

    save() blocks only to copy the state into host memory (and to wait for the previous save,
    at most one is in flight); a background thread serializes, writes, fsyncs and commits it.
    `last_stall` is that blocking time in seconds, `last_write` the background time.
    A failed save (disk full, unwritable directory) leaves the previous checkpoint intact and
    latest, removes its temporary file, is logged at once and raised as CheckpointError from the
    next save()/wait()/close() (errors="raise") or only logged (errors="log").

    Under elasticd, maybe_save() also refreshes the in-memory state (elasticd.memory): every
    `memory_every` steps, or by default as often as keeps its cost under `memory_budget` of the
    step time (every step unless the state is big for the step: memory.Cadence). The default
    budget, 0.75%, leaves a quarter of the 1% that elasticd may cost a job in steady state to
    what the charge misses (it is the lower quartile of refresh costs; their mean runs 10-20%
    above it). A state with 8 MiB or more on the GPU is copied beside the next step
    (`memory_overlap`, elasticd.overlap: on an H100 a 200 MB state's refresh costs the step
    about 1 ms instead of 17 ms, so the same budget refreshes it about fifteen times as often);
    memory_overlap=False copies it at once, for a script that writes its parameters by hand
    between a refresh and its next optimizer step."""

    def __init__(self, directory: str | os.PathLike | None = None, keep: int = 3,
                 every_steps: int | None = None, every_seconds: float | None = None, *,
                 handle_sigterm: bool = True, stop_timeout: float = 10.0, errors: str = "raise",
                 sync_every: int = 1, memory_every: int | None = None, memory_budget: float = 0.0075,
                 memory_dir: str | os.PathLike | None = None, memory_overlap: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if errors not in ("raise", "log"):
            raise ValueError(f"errors must be 'raise' or 'log', got {errors!r}")
        self.directory = _resolve_dir(directory)
        self.keep, self.every_steps, self.every_seconds = keep, every_steps, every_seconds
        self.errors, self.sync_every = errors, max(1, int(sync_every))
        self.last_stall = 0.0
        self.last_write = 0.0
        self.last_error: BaseException | None = None
        self.last_saved: Entry | None = None  # the latest committed save of this manager
        self.loaded: Entry | None = None  # what load_latest() returned
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._entries: list[Entry] | None = None  # writer's view of the manifest, oldest first
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._stopping = False
        self._stop_saved = False
        self._agreed = False  # a maybe_save agreed on the stop flag since should_stop last asked
        self._calls = 0
        self._snap = _Snapshot()
        self._signals = install_sigterm_handler(stop_timeout) if handle_sigterm else False
        # In-memory state (elasticd.memory): on by default under elasticd, which owns the directory.
        mem = memory_dir if memory_dir is not None else os.environ.get(memory.ENV)
        self.memory_dir = os.fspath(mem) if mem else None
        if memory_every is not None and int(memory_every) < 0:
            raise ValueError(f"memory_every must be a number of steps (0: off; None: follow memory_budget), "
                             f"got {memory_every}")
        if not 0 < memory_budget < 1:
            raise ValueError(f"memory_budget is a share of step time, between 0 and 1 (0.01: 1%), "
                             f"got {memory_budget}")
        self._cadence = memory.Cadence(every=int(memory_every or 1),
                                       budget=memory_budget if memory_every is None else None)
        self._memory_on = bool(self.memory_dir) and memory_every != 0  # off for good after a failed refresh
        self._memory_overlap = bool(memory_overlap)
        self.last_memory_stall = 0.0
        self._memory_writer: memory.Writer | None = None  # made at the first refresh, after loading
        self._memory_resumed: int | None = None  # the in-memory step load_latest() resumed from
        self._local_rank = int(os.environ.get("LOCAL_RANK", 0))  # 0 keeps the node's state, others their RNG

    @property
    def memory_every(self) -> int:
        """Steps between in-memory refreshes as of now; 0 when the in-memory state is off."""
        return self._cadence.every if self._memory_on else 0

    # -- loading ---------------------------------------------------------------------------------
    def load_latest(self) -> dict[str, Any] | None:
        """The newest state: this node's in-memory state when every rank has it at a step at
        least as new as the newest disk checkpoint, else the module function's disk checkpoint.
        Records the entry in `self.loaded` (its file is "memory:..." for in-memory state)."""
        got = self._load_memory() if self.memory_every else None
        if got is None:
            got = _load_latest(self.directory)
        _mark_state_loaded()
        if got is None:
            self.loaded = None
            return None
        state, self.loaded = got
        self._last_step = self.loaded.step
        if self.loaded.step is not None:
            path = self.loaded.file if self.loaded.file.startswith("memory:") else \
                os.path.join(self.directory, self.loaded.file)
            log.info("checkpoint_loaded", path=path, step=self.loaded.step,
                     source="memory" if path.startswith("memory:") else "disk")
        return state

    def _load_memory(self) -> tuple[dict[str, Any], Entry] | None:
        """Agree on the newest step every rank holds in memory (a collective), then read it."""
        world, rank, local = _world(), _rank(), self._local_rank
        mine = memory.steps(self.memory_dir, world=world, rank=rank, local_rank=local)
        found = candidates(self.directory) if _looks_at_disk() else []
        view = {"mem": mine, "disk": found[0].step if found else -1}
        multi = _dist_on() and world > 1
        views = ([json.loads(b) for b in _all_gather_bytes(json.dumps(view).encode(), _cpu_group())]
                 if multi else [view])
        common = set.intersection(*(set(v["mem"]) for v in views))
        disk = max(v["disk"] for v in views)
        step = max(common) if common else None
        state, why = None, None
        if step is None or step < disk:
            why = "no step held by every rank" if step is None else f"disk checkpoint at step {disk} is newer"
        else:
            try:
                state = memory.read(self.memory_dir, step, world=world, rank=rank, local_rank=local)
            except Exception as e:  # noqa: BLE001 - any damage means: use the disk
                why = f"unreadable: {type(e).__name__}: {e}"
        ok = state is not None
        if multi:
            t = torch.tensor([int(ok)], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group())
            ok = bool(t.item())
        if not ok:
            if any(v["mem"] for v in views):
                log.info("memory_state_skipped", reason=why or "another rank could not read it",
                         action="loading the newest disk checkpoint")
            memory.keep_only(self.memory_dir, local_rank=local, world=world, rank=rank, step=None)
            return None
        memory.keep_only(self.memory_dir, local_rank=local, world=world, rank=rank, step=step)
        self._memory_resumed = step
        assert state is not None
        return state, Entry(file=f"memory:{self.memory_dir}/w{world}-s{step:012d}", step=step, world_size=world)

    def save_memory(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> float:
        """Refresh the in-memory state (every rank calls it at the same steps; no collective when
        `state` is a callable around capture()). Returns the stall in seconds. A full or missing
        tmpfs, or a state it cannot hold, turns in-memory state off with one warning; disk
        checkpoints go on."""
        if not self.memory_every:
            return 0.0
        t0 = time.perf_counter()
        owned = None
        if callable(state):
            _local_capture[0] = "rng" if self._local_rank else "node"
            _owned[0] = set() if self._memory_overlap else None
            try:
                state = state()
            finally:
                _local_capture[0], owned, _owned[0] = None, _owned[0], None
        mapped = True
        writer = self._memory_writer
        try:
            if writer is None:
                writer = self._memory_writer = memory.Writer(self.memory_dir, self._local_rank,
                                                             keep_step=self._memory_resumed,
                                                             overlap=self._memory_overlap)
            mapped = writer.write(int(step), state, world=_world(), rank=_rank(), owned=owned, started=t0)
            if writer.notice:
                log.warning("memory_overlap_off", reason=writer.notice, action="copying synchronously from now on")
                writer.notice = None
        except (OSError, TypeError) as e:
            log.warning("memory_state_off", directory=self.memory_dir, error=f"{type(e).__name__}: {e}",
                        action="continuing with disk checkpoints only")
            self._memory_on = False
            if self._memory_writer is not None:
                self._memory_writer.close()
                self._memory_writer = None
        self.last_memory_stall = time.perf_counter() - t0
        if self._memory_on:
            if not mapped and not writer.queued:
                self._cadence.costs.append(self.last_memory_stall)
            self._cadence.costs.extend(writer.costs())  # overlapped refreshes, once their events passed
        return self.last_memory_stall

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], *,
             epoch: int | None = None, position: int | None = None) -> float:
        """Checkpoint `state` (or what the callable returns: it is called on every rank, so
        capture() may be passed) as `step`. Returns the stall in seconds. epoch/position default
        to the sampler's state inside `state`."""
        t0 = time.perf_counter()
        self._join()
        state = state() if callable(state) else state
        self._last_step, self._last_time = int(step), time.monotonic()
        if _rank() != 0:
            self.last_stall = time.perf_counter() - t0
            return self.last_stall
        sampler = state.get("sampler") if isinstance(state, Mapping) else None
        if isinstance(sampler, Mapping):
            epoch = sampler.get("epoch") if epoch is None else epoch
            position = sampler.get("consumed") if position is None else position
        meta = {"step": int(step), "epoch": epoch, "position": position, "world_size": _world(),
                "time": time.time()}
        payload = {"format": FORMAT, "step": int(step), "meta": meta, "state": self._snap.take(state)}
        self._thread = threading.Thread(target=self._persist, args=(payload, meta),
                                        name="elasticd-checkpoint-writer")
        self._thread.start()
        self.last_stall = time.perf_counter() - t0
        return self.last_stall

    def _persist(self, payload: dict[str, Any], meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        d = self.directory
        try:
            if self._entries is None:
                os.makedirs(d, 0o750, exist_ok=True)
                for name in os.listdir(d):  # temporaries of a writer that died
                    if _TEMP.match(name):
                        try:
                            os.unlink(os.path.join(d, name))
                        except OSError:
                            pass
                self._entries = list(reversed(candidates(d)))
            entry = _write_checkpoint(d, payload, meta)
            # A save at a step already present replaces it; the oldest beyond `keep` go.
            before = self._entries
            entries = [e for e in before if e.step != entry.step and e.file != entry.file] + [entry]
            kept = entries[-self.keep:]
            _write_manifest(d, kept)  # commit first, delete after: the manifest never dangles
            self._entries = kept
            live = {e.file for e in kept}
            for name in {e.file for e in before} - live:
                try:
                    os.unlink(os.path.join(d, name))
                except FileNotFoundError:
                    pass
            self.last_saved = entry
            self.last_write = time.perf_counter() - t0
            log.info("checkpoint_saved", path=os.path.join(d, entry.file), step=entry.step,
                      bytes=entry.bytes, seconds=round(self.last_write, 3))
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            self._error = e
            self._entries = None  # re-read the directory next time
            log.error("checkpoint_save_failed", directory=d, step=payload["step"], error=_describe(d, e),
                      latest=self.last_saved and self.last_saved.file)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            self.last_error = err
            if self.errors == "raise":
                raise CheckpointError(_describe(self.directory, err)) from err

    def wait(self) -> Entry | None:
        """Block until the save in flight is on disk; raise CheckpointError if it failed."""
        self._join()
        return self.last_saved

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self._thread is not None:
            self._thread.join()

    # -- cadence and stop ------------------------------------------------------------------------
    def _agree(self) -> tuple[bool, bool]:
        """(stop, time due), the same on every rank: any rank's SIGTERM or timer counts. The
        in-memory cadence is agreed in the same call (the largest rank's proposal).

        Under torch.distributed this is one small all_reduce on CPU every `sync_every`-th call
        (on other calls both are False), so every rank must call in the same pattern."""
        self._calls += 1
        local = [_stop.is_set() or self._stopping,
                 self.every_seconds is not None and time.monotonic() - self._last_time >= self.every_seconds]
        if _dist_on() and dist.get_world_size() > 1:
            if self._stopping:
                flags = [True, False, 0]  # agreed everywhere already; timers no longer matter
            elif self._calls % self.sync_every:
                flags = [False, False, 0]
            else:
                t = torch.tensor([*map(int, local), self._proposal()], dtype=torch.int64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
                flags = t.tolist()
        else:
            flags = [*local, self._proposal()]
        if flags[2] and self._memory_on and self._cadence.adopt(int(flags[2])):
            if _rank() == 0:  # this rank's measurements; the agreed N may come from another
                refresh, step = self._cadence.measured
                log.info("memory_cadence", every=self.memory_every, budget=self._cadence.budget,
                         refresh_ms=round(1e3 * refresh, 3), step_ms=round(1e3 * step, 3))
        if flags[0] and not self._stopping:
            self._stopping = True
            log.info("checkpoint_stop_requested", action="saving and stopping at this step")
        return bool(flags[0]), bool(flags[1])

    def _proposal(self) -> int:
        """This rank's in-memory cadence (medians of recent timings: only on calls that agree)."""
        return self._cadence.proposal() if self._memory_on else 0

    def maybe_save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], *,
                   epoch: int | None = None, position: int | None = None) -> bool:
        """Save if `step` is a multiple of every_steps, every_seconds have passed, or a stop was
        requested (then once: the final save). Call it on every rank at every step boundary.
        The in-memory state is refreshed every `memory_every` steps (see memory.Cadence)."""
        self._cadence.step_began()
        try:
            return self._maybe_save(step, state, epoch, position)
        finally:
            self._cadence.step_ended()

    def _maybe_save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
                    epoch: int | None, position: int | None) -> bool:
        _at_boundary()
        stop, time_due = self._agree()
        self._agreed = True
        step_due = bool(self.every_steps) and step % self.every_steps == 0 and step != self._last_step
        final = stop and not self._stop_saved
        memory_due = bool(self.memory_every) and step % self.memory_every == 0
        if not (step_due or time_due or final):
            if memory_due:
                self.save_memory(step, state)
            return False
        state = state() if callable(state) else state
        self.save(step, state, epoch=epoch, position=position)
        if memory_due:
            self.save_memory(step, state)
        self._stop_saved = self._stop_saved or stop
        return True

    def should_stop(self) -> bool:
        """True on every rank once any rank was asked to stop. After maybe_save() at the same
        boundary it costs nothing; alone, it is a small collective."""
        _at_boundary()
        if self._stopping:
            return True
        if not self._agreed:
            self._agree()
        self._agreed = False
        return self._stopping
