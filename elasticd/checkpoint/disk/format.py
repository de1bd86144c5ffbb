"""The checkpoint directory's layout, torch-free: what the daemon reads for `elasticd status` and
what the worker-side library writes and scans.

Directory layout (format 1; a newer elasticd keeps reading it):
    ckpt-<step:012d>-<sha256[:16]>.pt   torch.save({"format", "step", "meta", "state"}); the name
                                        carries the checksum, so files verify without a manifest
    manifest.json                       {"format": 1, "latest": file, "checkpoints": [entry, ...]}
                                        entries oldest first: file, step, epoch, position,
                                        world_size, time, bytes, sha256
    ckpt-<step:012d>-<sha256[:16]>.dcp/ a sharded checkpoint (elasticd.checkpoint.disk.shard_files):
                                        torch.distributed.checkpoint's `.metadata` and
                                        `__<rank>_<n>.distcp`, plus `state.pt` (the rest of the
                                        state); its entry lists every file's sha256 (`files`), the
                                        name carries the sha256 of that list; it counts only once
                                        the manifest names it (the manifest is written last)
    .ckpt-*.tmp / .manifest-*.tmp       writes in progress; removed by the next writer
A checkpoint file appears only by os.replace of a fully written and fsynced temporary file, and
the directory is fsynced after, so a crash leaves the old or the new checkpoint, never a torn one.
"Latest" is the most recently written checkpoint, whatever its step.

Whoever can write the directory may have written the manifest: each entry is parsed strictly
(`Entry.from_json`: a checkpoint name in the directory itself, whole numbers in range), and a
sharded one lists each file's sha256. `atomic_write` is the one way a file appears; `candidates`
lists the checkpoints newest first.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from elasticd import names

FORMAT = 1  # of the manifest and of the payload inside each checkpoint file
MANIFEST = "manifest.json"
NAME = re.compile(r"^ckpt-(\d{12,})-([0-9a-f]{16})\.pt$")
SHARDED_NAME = re.compile(r"^ckpt-(\d{12,})-([0-9a-f]{16})\.dcp$")
SHARD_FILE = re.compile(r"^(?:\.metadata|state\.pt|__\d{1,9}_\d{1,9}\.distcp)$")
_FULL_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TEMP = re.compile(r"^\.(ckpt|manifest)-.*\.tmp$")
_SHA256 = re.compile(
    r"^[0-9a-f]{16}(?:[0-9a-f]{48})?$"
)  # full digest, or the name's 16-digit prefix
MAX_MANIFEST = 4 << 20  # bytes; the manifest of keep=3 is under a kilobyte
MAX_STEP = 2**62  # steps travel between ranks as int64

log = structlog.get_logger()


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
    # a sharded checkpoint's files and their sha256, sorted by name; None for a .pt file
    files: tuple[tuple[str, str], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.files is None:
            del d["files"]
        else:
            d["files"] = dict(self.files)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Entry:
        """The entry, or ValueError saying what is wrong with it. Strict, as whoever can write the
        directory wrote it: `file` must be a checkpoint name in the directory itself (a crafted
        manifest must not make the writer delete or read files elsewhere) whose step and checksum
        agree with the entry's; numbers must be whole and in range (no 1e999, no negative or
        int64-overflowing step), the time finite."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a checkpoint entry is not an object: {_quote(d)}")
        m = NAME.match(d["file"]) if isinstance(d.get("file"), str) else None
        m = m or (SHARDED_NAME.match(d["file"]) if isinstance(d.get("file"), str) else None)
        if not m:
            raise ValueError(f"not a checkpoint file name: {_quote(d.get('file'))}")
        step = _whole(d, "step", required=True)
        if step != _name_step(m):
            raise ValueError(f"step {step} is not the step in the file name {d['file']}")
        sha = m.group(2) if d.get("sha256") in (None, "") else d["sha256"]
        if not isinstance(sha, str) or not _SHA256.match(sha) or not sha.startswith(m.group(2)):
            raise ValueError(
                f"sha256 {_quote(sha)} is not the checksum in the file name {d['file']}"
            )
        t = d.get("time") or 0.0
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"time {_quote(t)} is not a finite time")
        return cls(
            file=d["file"],
            step=step,
            epoch=_whole(d, "epoch"),
            position=_whole(d, "position"),
            world_size=_whole(d, "world_size"),
            time=float(t),
            bytes=_whole(d, "bytes") or 0,
            sha256=sha,
            files=_files(d, sha) if SHARDED_NAME.match(d["file"]) else None,
        )


def files_digest(files: Mapping[str, str]) -> str:
    """A sharded checkpoint's checksum: the sha256 of its files' names and sha256s."""
    lines = "".join(f"{name} {files[name]}\n" for name in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def _files(d: Mapping[str, Any], sha: str) -> tuple[tuple[str, str], ...]:
    """A sharded entry's `files`: names DCP and elasticd write, in the directory itself, each
    with a full sha256, whose digest is the entry's."""
    files = d.get("files")
    if not isinstance(files, Mapping) or not {".metadata", "state.pt"} <= set(files):
        raise ValueError(f"{d['file']}: no list of files with .metadata and state.pt")
    for name, digest in files.items():
        if not isinstance(name, str) or not SHARD_FILE.match(name):
            raise ValueError(f"{d['file']}: not a sharded checkpoint's file: {_quote(name)}")
        if not isinstance(digest, str) or not _FULL_SHA256.match(digest):
            raise ValueError(f"{d['file']}: {name}'s sha256 {_quote(digest)} is not one")
    if not files_digest(files).startswith(sha):
        raise ValueError(f"{d['file']}: its files' checksums do not give its sha256")
    return tuple(sorted(files.items()))


def file_name(step: int, sha256: str) -> str:
    """A checkpoint file's name: its step and the prefix of its checksum."""
    return f"ckpt-{step:012d}-{sha256[:16]}.pt"


def _quote(value: Any) -> str:
    """A value from a file, quoted short in a message."""
    text = (
        repr(value)
        if isinstance(value, (str, int, float, bool, type(None)))
        else f"a {type(value).__name__}"
    )
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(d: Mapping[str, Any], key: str, required: bool = False) -> int | None:
    """d[key] as a whole number in [0, MAX_STEP]; None where it may be missing (ValueError
    otherwise)."""
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


def resolve_dir(directory: str | os.PathLike | None) -> str:
    """The directory given, else $ELASTICD_CHECKPOINT_DIR (ValueError when neither is set)."""
    directory = directory if directory is not None else os.environ.get(names.CHECKPOINT_DIR)
    if not directory:
        raise ValueError("no checkpoint directory: pass one or set ELASTICD_CHECKPOINT_DIR")
    return os.fspath(directory)


# -- writing ------------------------------------------------------------------------------------


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    directory: str, name: str | Callable[[Any], str], kind: str, fill: Callable[[Any], Any]
) -> tuple[str, Any]:
    """Write via `fill(file)` to a temporary file in `directory`, fsync it, rename it into place
    and fsync the directory; remove the temporary file on any failure. `name` may be a function
    of fill's result (a checksum known only once written)."""
    tmp = os.path.join(directory, f".{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        # new (O_EXCL), never through a symlink, never world-readable: checkpoints hold the weights
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640
        )
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


def remove_temporaries(directory: str) -> None:
    """Temporary files (and a sharded save's temporary directories) of a writer that died."""
    for name in os.listdir(directory):
        if _TEMP.match(name):
            remove_checkpoint(directory, name)


def remove_checkpoint(directory: str, name: str) -> None:
    """A checkpoint file, or a sharded checkpoint's directory (never through a symlink)."""
    path = os.path.join(directory, name)
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def write_manifest(directory: str, entries: list[Entry]) -> None:
    doc = {
        "format": FORMAT,
        "latest": entries[-1].file if entries else None,
        "checkpoints": [e.to_json() for e in entries],
    }
    data = (json.dumps(doc, indent=1) + "\n").encode()
    atomic_write(directory, MANIFEST, "manifest", lambda f: f.write(data))


# -- reading ------------------------------------------------------------------------------------


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
                raise ValueError(f'"checkpoints" is not a list: {_quote(found)}')
            return [Entry.from_json(e) for e in found]
    except FileNotFoundError:
        return None
    except (
        OSError,
        ValueError,
        RecursionError,
    ) as e:  # RecursionError: nested past the parser's depth
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:300]
        log.warning(
            "checkpoint_manifest_unreadable",
            path=path,
            error=why,
            action="scanning checkpoint files instead",
        )
        return None
    log.warning(
        "checkpoint_manifest_unknown_format",
        path=path,
        format=_quote(fmt),
        known=FORMAT,
        action="scanning checkpoint files instead",
    )
    return None


def _read_small(path: str, limit: int) -> bytes:
    """A regular file's bytes; OSError for anything else (a FIFO would block the reader, the
    daemon's status included), ValueError beyond `limit` bytes."""
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
        m = NAME.match(name)
        if m and name not in known:
            try:
                step = _name_step(m)
                st = os.stat(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            except ValueError as e:
                log.warning(
                    "checkpoint_skipped",
                    path=os.path.join(directory, name),
                    reason=str(e),
                    action="trying the previous checkpoint",
                )
                continue
            entries.append(
                Entry(file=name, step=step, time=st.st_mtime, bytes=st.st_size, sha256=m.group(2))
            )
    order = {id(e): i for i, e in enumerate(entries)}
    return sorted(entries, key=lambda e: (e.time, e.step, order[id(e)]), reverse=True)


def latest_info(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The newest checkpoint's manifest entry plus its path, reading no checkpoint (for status)."""
    found = candidates(directory)
    if not found:
        return None
    info = found[0].to_json()
    info.pop("files", None)  # a sharded checkpoint's list: one row per rank's file, not for status
    return {**info, "path": os.path.join(os.fspath(directory), found[0].file)}
