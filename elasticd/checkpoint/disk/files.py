"""Checkpoint files: write one while hashing it (the checksum goes into its name), verify and
load one, and the newest that verifies, read by one rank and broadcast to every other.

Loading uses torch.load(weights_only=True) only: nothing in a checkpoint can run code. Under
torch.distributed the verified file's bytes are broadcast and every rank torch.loads them with
weights_only=True too, so nodes need no shared filesystem and no pickle crosses the network.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd.checkpoint.collectives import (
    all_gather_ints,
    broadcast_bytes,
    cpu_group,
    dist_on,
    from_bytes,
)
from elasticd.checkpoint.disk import shard_files
from elasticd.checkpoint.disk.format import (
    FORMAT,
    NAME,
    Entry,
    atomic_write,
    candidates,
    file_name,
    resolve_dir,
)

log = structlog.get_logger()


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


def write_checkpoint(directory: str, payload: dict[str, Any], meta: dict[str, Any]) -> Entry:
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

    name, w = atomic_write(directory, lambda w: file_name(step, w.sha.hexdigest()), "ckpt", fill)
    return Entry(
        file=name,
        step=step,
        epoch=meta.get("epoch"),
        position=meta.get("position"),
        world_size=meta.get("world_size"),
        time=float(meta["time"]),
        bytes=w.size,
        sha256=w.sha.hexdigest(),
    )


def _read_verified(
    path: str, sha256: str | None, *, for_broadcast: bool = False
) -> tuple[torch.Tensor | None, Any]:
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
            raise ValueError(
                f"checksum mismatch (sha256 {digest[:16]}..., expected {sha256[:16]}...; "
                f"{size} bytes): truncated or corrupt"
            )
        same = f"/proc/self/fd/{f.fileno()}"
        f.seek(0)
        try:
            payload = torch.load(
                same if os.path.exists(same) else f, map_location="cpu", weights_only=True
            )
        except Exception as e:
            raise ValueError(f"not loadable with weights_only=True: {_why(e)}") from e
    check_payload(payload)
    return data, payload


def _why(e: BaseException) -> str:
    why = str(e)
    why = why[why.find("WeightsUnpickler error:") :] if "WeightsUnpickler error:" in why else why
    why = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", why).split())  # one event, one line
    return f"{type(e).__name__}: {why[:300]}"


def check_payload(payload: Any) -> None:
    if (
        not isinstance(payload, dict)
        or "state" not in payload
        or not isinstance(payload.get("format"), int)
    ):
        raise ValueError("not an elasticd checkpoint")
    if payload["format"] > FORMAT:
        raise ValueError(
            f"written by a newer elasticd (format {payload['format']}, this one reads {FORMAT})"
        )


def load_file(path: str | os.PathLike, sha256: str | None = None) -> dict[str, Any]:
    """One checkpoint file's state (what was passed to save), verified when `sha256` is given or
    the name carries a checksum. Raises ValueError for a corrupt, foreign or unsafe file."""
    path = os.fspath(path)
    m = NAME.match(os.path.basename(path))
    return _read_verified(path, sha256 or (m.group(2) if m else None))[1]["state"]


def _first_good(
    directory: str, found: list[Entry], *, for_broadcast: bool = False
) -> tuple[torch.Tensor | None, dict, Entry] | None:
    """Pop candidates newest first until one verifies; report each one skipped."""
    while found:
        entry = found.pop(0)
        path = os.path.join(directory, entry.file)
        if entry.files is not None:  # sharded: this process reads every file
            state = shard_files.open_agreed(directory, entry, None)
            if state is not None:
                return None, {"state": state}, entry
            continue
        try:
            data, payload = _read_verified(path, entry.sha256, for_broadcast=for_broadcast)
        except (OSError, ValueError) as e:
            log.warning(
                "checkpoint_skipped",
                path=path,
                step=entry.step,
                reason=str(e),
                action="trying the previous checkpoint",
            )
            continue
        return data, payload, entry
    return None


def looks_at_disk() -> bool:
    """One process per node reads the local directory (LOCAL_RANK 0, or unknown)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def load_latest_entry(
    directory: str | os.PathLike | None, group=None
) -> tuple[dict[str, Any], Entry] | None:
    directory = resolve_dir(directory)
    if not dist_on() or dist.get_world_size() == 1:
        got = _first_good(directory, candidates(directory))
        return None if got is None else (got[1]["state"], got[2])
    # Each node looks at its own directory; the rank holding the newest step sends it. Group rank
    # 0 (and so the node that saves) can move between rendezvous rounds, so "rank 0 reads" is
    # generalized to "whoever has the newest reads"; with one shared directory that is rank 0.
    group = group if group is not None else cpu_group()
    mine = candidates(directory) if looks_at_disk() else []
    while True:
        steps = all_gather_ints(mine[0].step if mine else -1, group)
        best = max(steps)
        if best < 0:
            return None
        src = steps.index(best)
        header, data, state = b"", b"", None
        if dist.get_rank() == src and mine[0].files is not None:
            header = json.dumps(mine[0].to_json()).encode()  # sharded: every rank reads it
        elif dist.get_rank() == src:
            entry = mine[0]
            got = _first_good(directory, mine[:1], for_broadcast=True)
            mine.pop(0)
            if got is not None:
                data, payload, entry = got
                state = payload["state"]
                header = json.dumps(entry.to_json()).encode()
        header = broadcast_bytes(header, src, group)
        if not header:
            continue  # the sender's newest did not verify: every rank asks again
        entry = Entry.from_json(json.loads(bytes(header)))
        if entry.files is not None:
            mine = [e for e in mine if e.file != entry.file]
            state = shard_files.open_agreed(directory, entry, group)
            if state is None:
                continue  # some rank could not verify it: every rank asks again
            return state, entry
        data = broadcast_bytes(data, src, group)
        if state is None:
            payload = from_bytes(data)
            check_payload(payload)
            state = payload["state"]
        return state, entry


def load_latest(directory: str | os.PathLike | None = None, *, group=None) -> dict[str, Any] | None:
    """The newest checkpoint that verifies (checksum, then torch.load with weights_only=True), or
    None. Corrupt or truncated ones are reported (structlog warning with the path) and skipped.
    Under torch.distributed every rank must call it; all get the same state."""
    got = load_latest_entry(directory, group)
    return None if got is None else got[0]
