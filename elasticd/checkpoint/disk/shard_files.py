"""Sharded checkpoints on disk, in torch.distributed.checkpoint's (DCP's) format: written by every
rank (`ShardedSaver`), and verified and read back (`OnDisk`, which restore() loads with
`dcp.load`, resharded at another world size).

Saving (ShardedSaver; every rank): the training thread copies its own shards to host memory
(sharded.HostCopy) and rank 0 the rest of the state; a background thread then writes them with
dcp.save into a temporary directory, on a gloo group of its own (made once, so its collectives
never interleave with the training loop's). Each rank hashes its own files; rank 0 gathers the
checksums, hashes DCP's `.metadata`, renames the directory to `ckpt-<step>-<sha>.dcp` and writes
the manifest last: a checkpoint counts only when every rank's shards are durable. Retention
removes whole directories after that commit.

Layout: `.metadata` and `__<rank>_0.distcp` (DCP: `dcp.load` and torch's tooling read the
directory as is; it holds {"model": ..., "optimizer": ...}) and `state.pt` (everything else:
RNG, sampler, scheduler, user values; loaded with weights_only=True).

Loading: every rank reads the shared directory. The ranks verify the files' sha256 against the
manifest (each a share of the shards, every rank `.metadata` and `state.pt`) and agree before
choosing, so a corrupt newest checkpoint makes every rank fall back together. DCP unpickles
`.metadata` with plain pickle: it is read only through verified_reader, which checks the bytes
against the manifest's sha256 and then unpickles them with only the classes DCP's metadata uses,
setting only the fields DCP writes (MetadataUnpickler), and the byte items in the shards go
through torch.load(weights_only=True) (SafeLoadPlanner), so a planted file never runs code, even
with a manifest rewritten to match. DCP then reads only the shard files the manifest lists, in
the checkpoint's own directory, each a regular file opened without following a link
(_check_storage, the reader's file system): a path in `.metadata` never reaches a file elsewhere.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import pathlib
import pickle
import stat
import uuid
from collections.abc import Mapping
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd.checkpoint import sharded
from elasticd.checkpoint.collectives import (
    all_gather_bytes,
    all_gather_ints,
    broadcast_bytes,
    dist_on,
    from_bytes,
    rank,
    to_bytes,
)
from elasticd.checkpoint.disk.format import (
    FORMAT,
    SHARDED_NAME,
    Entry,
    atomic_write,
    candidates,
    files_digest,
    read_manifest,
    remove_checkpoint,
    remove_temporaries,
    write_manifest,
)
from elasticd.checkpoint.disk.snapshot import Snapshot

log = structlog.get_logger()

REST = "state.pt"
METADATA = ".metadata"


@dataclasses.dataclass(frozen=True)
class OnDisk:
    """A verified sharded checkpoint's model and optimizer, read by restore() into the live
    model's own shards (dcp.load reshards at another world size)."""

    path: str
    metadata_sha256: str
    parts: tuple[str, ...]
    files: tuple[str, ...] = ()  # the shard files the manifest lists: all that DCP may read


@dataclasses.dataclass
class Job:
    step: int
    meta: dict[str, Any]
    shards: dict[str, Any]  # {"model": ..., "optimizer": ...}: host DTensors of this rank
    rest: dict[str, Any] | None  # rank 0: the rest of the state, host copy


def _open_regular(path: str | os.PathLike) -> io.BufferedReader:
    """A checkpoint file opened for reading: a regular file, never through a symlink and never
    blocking (a FIFO planted in its place is a ValueError, not a reader that waits forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ValueError(f"{os.path.basename(path)} is not a regular file")
    return f


def _sha256(path: str) -> str:
    with _open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _why(e: BaseException) -> tuple[str, BaseException]:
    """A failure in one line, and the exception to raise for it: DCP's CheckpointException
    (a BaseException holding each rank's failure, its text a traceback) becomes the first
    rank's OSError (so a full disk is still told as one) or an OSError with every rank's words."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        # each (exception, its stack) in torch 2.13
        failures = {r: x[0] if isinstance(x, tuple) and x else x for r, x in failures.items()}
        words = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in failures.items())
        words = " ".join(words.split())[:500]
        first = next((x for x in failures.values() if isinstance(x, OSError)), None)
        return words, first or OSError(words)
    words = " ".join(f"{type(e).__name__}: {e}".split())[:500]
    return words, e if isinstance(e, Exception) else OSError(words)


def _fsync(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardedSaver:
    """One CheckpointManager's sharded saves: stage() in the training thread, commit() in its
    background thread, on every rank."""

    def __init__(self, directory: str, keep: int) -> None:
        self.directory, self.keep = directory, keep
        self.entries: list[Entry] | None = None  # rank 0's view of the manifest, oldest first
        self._host = sharded.HostCopy()
        self._snap = Snapshot()
        self._group: Any = None
        self._grouped = False

    def stage(self, step: int, state: Mapping[str, Any], meta: dict[str, Any]) -> Job:
        """The host copy (the save's stall); a collective the first time (the writer's group)."""
        if not self._grouped and dist_on() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        self._grouped = True
        shards = self._host.take({k: state[k] for k in sharded.PARTS if k in state})
        # taken on every rank, though rank 0 alone writes it: a state the copy refuses raises on
        # every rank, never leaving the others waiting for rank 0 in the writer's collectives
        others = self._snap.take({k: v for k, v in state.items() if k not in sharded.PARTS})
        rest = {"format": FORMAT, "step": step, "meta": meta, "parts": list(shards)}
        rest["state"] = others
        return Job(step, meta, shards, rest if rank() == 0 else None)

    def _agree(self, mine: str) -> list[str]:
        """Every rank's word (JSON, or "!" and an error), in rank order."""
        if self._group is None:
            return [mine]
        return [bytes(b).decode() for b in all_gather_bytes(mine.encode(), self._group)]

    def commit(self, job: Job) -> Entry:
        """Write, verify and commit one save; raises on every rank when any rank failed."""
        lead = rank() == 0
        tmp, err, mine = "", "", None  # mine: this rank's own failure, raised as it is
        if lead:
            try:
                tmp = self._prepare(job)
            except BaseException as e:  # noqa: BLE001 - reported to every rank below
                err, mine = _why(e)
        if self._group is not None:
            got = broadcast_bytes((tmp or "").encode(), 0, self._group)
            tmp = bytes(got).decode() if not lead else tmp
        if not tmp:
            raise mine or OSError("rank 0 could not prepare the checkpoint's directory")
        path = os.path.join(self.directory, tmp)
        try:
            files = self._write(path, job)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one
            files, (err, mine) = {}, _why(e)
        words = self._agree(json.dumps(files) if not err else "!" + err)
        failed = [w[1:] for w in words if w.startswith("!")]
        if failed:
            if lead:
                remove_checkpoint(self.directory, tmp)
            raise mine or OSError("; ".join(failed))
        entry = None
        if lead:
            try:
                entry = self._publish(path, job, words)
            except BaseException as e:  # noqa: BLE001 - every rank learns of it below
                remove_checkpoint(self.directory, tmp)
                err, mine = _why(e)
        word = self._agree(json.dumps(entry.to_json()) if entry else "!" + err)[0]
        if word.startswith("!"):
            raise mine or OSError(word[1:])
        return Entry.from_json(json.loads(word))

    def _prepare(self, job: Job) -> str:
        d = self.directory
        if self.entries is None:
            os.makedirs(d, 0o750, exist_ok=True)
            remove_temporaries(d)
            self.entries = list(reversed(candidates(d)))
            _remove_unlisted(d)
        tmp = f".ckpt-{job.step:012d}-{uuid.uuid4().hex[:12]}.tmp"
        os.mkdir(os.path.join(d, tmp), 0o750)
        assert job.rest is not None
        data = to_bytes(job.rest)
        atomic_write(os.path.join(d, tmp), REST, "ckpt", lambda f: f.write(data))
        return tmp

    def _write(self, path: str, job: Job) -> dict[str, str]:
        """dcp.save of this rank's shards; this rank's files and their sha256."""
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=1)
        dcp.save(job.shards, storage_writer=writer, process_group=self._group)
        mine = f"__{rank()}_"
        names = [n for n in os.listdir(path) if n.startswith(mine) and n.endswith(".distcp")]
        for n in names:
            os.chmod(os.path.join(path, n), 0o640)  # checkpoints hold the weights (safeio's rule)
        return {n: _sha256(os.path.join(path, n)) for n in names}

    def _publish(self, path: str, job: Job, words: list[str]) -> Entry:
        """Rank 0, once every rank's shards are durable: the directory in place, the manifest."""
        files: dict[str, str] = {}
        for w in words:
            files.update(json.loads(w))
        os.chmod(os.path.join(path, METADATA), 0o640)
        for name in (METADATA, REST):
            _fsync(os.path.join(path, name))
            files[name] = _sha256(os.path.join(path, name))
        _fsync(path, os.O_RDONLY | os.O_DIRECTORY)
        digest = files_digest(files)
        name = f"ckpt-{job.step:012d}-{digest[:16]}.dcp"
        d = self.directory
        if _verify(d, _named(name, files), 0, 1):  # else the same files are there already
            remove_checkpoint(d, name)  # a torn or damaged copy under the same name
            os.rename(path, os.path.join(d, name))
        else:
            remove_checkpoint(d, os.path.basename(path))
        _fsync(d, os.O_RDONLY | os.O_DIRECTORY)
        size = sum(os.path.getsize(os.path.join(d, name, f)) for f in files)
        entry = Entry(
            file=name,
            step=job.step,
            epoch=job.meta.get("epoch"),
            position=job.meta.get("position"),
            world_size=job.meta.get("world_size"),
            time=float(job.meta["time"]),
            bytes=size,
            sha256=digest,
            files=tuple(sorted(files.items())),
        )
        before = self.entries or []
        entries = [e for e in before if e.step != entry.step and e.file != entry.file] + [entry]
        kept = entries[-self.keep :]
        try:
            write_manifest(d, kept)  # commit first, delete after: the manifest never dangles
        except BaseException:
            self.entries = None  # re-read the directory next time
            raise
        self.entries = kept
        for old in {e.file for e in before} - {e.file for e in kept}:
            remove_checkpoint(d, old)
        return entry


def _remove_unlisted(directory: str) -> None:
    """Sharded directories a readable manifest does not name: a writer killed between renaming
    one into place and writing the manifest. (With no readable manifest, nothing is removed.)"""
    listed = read_manifest(directory)
    if listed is None:
        return
    known = {e.file for e in listed}
    for name in os.listdir(directory):
        if SHARDED_NAME.match(name) and name not in known:
            remove_checkpoint(directory, name)


def _named(name: str, files: dict[str, str]) -> Entry:
    return Entry(file=name, step=0, files=tuple(sorted(files.items())))


# -- loading ------------------------------------------------------------------------------------


def _verify(directory: str, entry: Entry, me: int, world: int) -> str:
    """ "" when this rank's share of the entry's files match the manifest, else why not."""
    path = os.path.join(directory, entry.file)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return "not a directory"
        for i, (name, digest) in enumerate(entry.files or ()):
            if name in (METADATA, REST) or i % world == me:
                got = _sha256(os.path.join(path, name))
                if got != digest:
                    return (
                        f"{name}: checksum mismatch (sha256 {got[:16]}..., expected "
                        f"{digest[:16]}...): truncated or corrupt"
                    )
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _open(directory: str, entry: Entry) -> dict[str, Any]:
    """The state: state.pt's part loaded (bytes hashed, then loaded with weights_only=True), the
    model and optimizer as an OnDisk record for restore()."""
    path = os.path.join(directory, entry.file)
    files = dict(entry.files or ())
    with _open_regular(os.path.join(path, REST)) as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != files[REST]:
        raise ValueError(f"{REST}: checksum mismatch: truncated or corrupt")
    payload = from_bytes(data)
    if not isinstance(payload, dict) or not isinstance(payload.get("state"), dict):
        raise ValueError("not an elasticd checkpoint")
    if not isinstance(payload.get("format"), int) or payload["format"] > FORMAT:
        raise ValueError(f"written by a newer elasticd (format {payload.get('format')!r})")
    parts = tuple(p for p in sharded.PARTS if p in payload.get("parts", ()))
    state = dict(payload["state"])
    shards = tuple(n for n in files if n not in (METADATA, REST))
    on_disk = OnDisk(path, files[METADATA], parts, shards)
    for p in parts:
        state[p] = on_disk
    return state


def open_agreed(directory: str, entry: Entry, group) -> dict[str, Any] | None:
    """Every rank verifies its share of the entry's files; the state when all verify, else None
    on every rank (after one warning naming the reason)."""
    if group is None and not (dist_on() and dist.get_world_size() > 1):
        me, world = 0, 1
    else:
        me, world = dist.get_rank(), dist.get_world_size()
    why = _verify(directory, entry, me, world)
    state = None
    if not why:
        try:
            state = _open(directory, entry)
        except (OSError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
    oks = [0 if why else 1] if world == 1 else all_gather_ints(0 if why else 1, group)
    if min(oks) == 1:
        return state
    if why:
        log.warning(
            "checkpoint_skipped",
            path=os.path.join(directory, entry.file),
            step=entry.step,
            reason=why,
            action="trying the previous checkpoint",
        )
    return None


def restore(state: Mapping[str, Any], model: torch.nn.Module, optimizer, strict: bool) -> None:
    """The model's (and optimizer's) part of `state` into the live objects through
    set_state_dict, read from disk first when it is a sharded checkpoint's (dcp.load into the
    live model's own shards: resharded when the world size changed); a full one (a DDP job's)
    is cut down to this rank's shards."""
    msd = state["model"]
    osd = state.get("optimizer") if optimizer is not None else None
    if isinstance(msd, OnDisk):
        import torch.distributed.checkpoint as dcp

        reader = verified_reader(msd)
        msd, osd = sharded.state_dicts(model, optimizer)
        target = {"model": msd} | ({"optimizer": osd} if osd is not None else {})
        dcp.load(target, storage_reader=reader, planner=_planner())
        msd, osd = target["model"], target.get("optimizer")
    elif sharded.is_sharded(model) and not sharded.holds_shards(state):
        sharded.apply_full(model, optimizer, msd, osd, strict)  # a DDP job's full checkpoint
        return
    sharded.apply(model, optimizer, msd, osd, strict)


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, but its byte items are loaded with weights_only=True."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


# What DCP's `.metadata` pickle holds (torch 2.13), and nothing else: a manifest someone rewrote
# to match a planted file still cannot make it run code (the weights_only rule, for DCP's file).
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


@functools.cache
def _built() -> dict[type, frozenset[str]]:
    """The classes whose state a pickle may set (BUILD), each with the fields it may set: the
    dataclasses of DCP's metadata but TensorProperties (its own __setstate__, checked apart)."""
    import importlib

    out = {}
    for module, names in _METADATA_CLASSES.items():
        for name in names:
            cls = getattr(importlib.import_module(module), name)
            if dataclasses.is_dataclass(cls) and name != "TensorProperties":
                out[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return out


def _leaf_types() -> tuple[type, ...]:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, TensorProperties

    plain = (type(None), bool, int, float, str, bytes, torch.dtype, torch.layout, torch.Size)
    return (*plain, pathlib.PurePath, _MEM_FORMAT_ENCODING, TensorProperties, *_built())


def _plain(value: Any) -> bool:
    """Whether `value` holds only what DCP's metadata holds: numbers, strings, dtypes, sizes,
    paths, its own records, in lists, tuples and dicts (walked without recursion)."""
    leaves, todo, seen = _leaf_types(), [value], set()
    while todo:
        v = todo.pop()
        if id(v) in seen or isinstance(v, leaves) and not isinstance(v, (tuple, list, dict)):
            continue
        seen.add(id(v))
        if type(v) in (list, tuple):
            todo.extend(v)
        elif isinstance(v, dict) and type(v) in (dict, collections.OrderedDict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif not isinstance(v, leaves):
            return False
    return True


def _properties(state: Any) -> bool:
    """TensorProperties' own state: (dtype, layout, requires_grad, memory format, pin_memory)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    kinds = (torch.dtype, torch.layout, bool, _MEM_FORMAT_ENCODING, bool)
    return (
        type(state) is tuple
        and len(state) == len(kinds)
        and all(isinstance(v, k) for v, k in zip(state, kinds))
    )


class MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """DCP's `.metadata`, unpickled with only the classes its format uses (and torch's dtypes),
    whose state a pickle may set only as DCP writes it: a metadata record's own fields, holding
    values of those kinds (`_plain`), and TensorProperties' five values. Python's unpickler,
    whose BUILD this replaces (the C one cannot be told), never sets another attribute, a
    `__class__` or a slot."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a checkpoint's metadata: refused, not loaded"
        )

    def load_build(self) -> None:
        from torch.distributed.checkpoint.metadata import TensorProperties

        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls is TensorProperties and _properties(state):
            inst.__setstate__(state)
            return
        fields = _built().get(cls)
        if (
            fields is None
            or type(state) is not dict
            or not state.keys() <= fields
            or not _plain(list(state.values()))
        ):
            what = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise pickle.UnpicklingError(
                f"a pickle setting {what} on {cls.__name__}: not how DCP writes its metadata; "
                "refused, not loaded"
            )
        inst.__dict__.update(state)

    dispatch[pickle.BUILD[0]] = load_build


def _check_storage(on_disk: OnDisk, storage_data: Mapping[Any, Any]) -> None:
    """Every place `.metadata` says DCP reads an item from: a shard file of the checkpoint's own
    directory that the manifest lists with its sha256 (verified by the ranks before the load),
    at an offset and a length; never a path elsewhere (`../`, absolute), nor a file left out."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    listed = set(on_disk.files)
    for index, info in storage_data.items():
        where = getattr(info, "relative_path", None)
        ok = (
            type(info) is _StorageInfo
            and type(where) is str
            and where in listed
            and all(type(n) is int and n >= 0 for n in (info.offset, info.length))
        )
        if not ok:
            fqn = getattr(index, "fqn", index)
            raise ValueError(
                f"{METADATA} reads {fqn!r} from {where!r}, not a shard file of the checkpoint "
                "that its manifest lists: refused"
            )


def verified_reader(on_disk: OnDisk):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    home = pathlib.Path(on_disk.path)

    class _Files(FileSystem):
        """DCP's file access, reading only the checkpoint's listed files, each a regular file
        opened without following a link."""

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str):
            path = pathlib.Path(path)
            if mode != "rb" or path.parent != home or path.name not in on_disk.files:
                raise ValueError(f"{path}: not a shard file of the checkpoint; not read")
            with _open_regular(path) as f:
                yield f

    class _Reader(FileSystemReader):
        """DCP's reader, but `.metadata` is unpickled only once its bytes match the manifest,
        and the data only from the shard files the manifest lists."""

        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.fs = _Files()

        def read_metadata(self, *args: Any, **kwargs: Any):
            name = os.path.join(on_disk.path, METADATA)
            with _open_regular(name) as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != on_disk.metadata_sha256:
                raise ValueError(f"{name}: checksum mismatch; not unpickled")
            metadata = MetadataUnpickler(io.BytesIO(data)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            _check_storage(on_disk, self.storage_data)

    return _Reader(on_disk.path)
