"""In-memory training state: the latest step's state in shared memory, so that a crashed worker's
replacement resumes from the step before the crash instead of the last disk checkpoint.

The daemon owns the directory (a private tmpfs directory under /dev/shm, one per daemon run,
passed to workers as ELASTICD_MEMORY_DIR, removed when the daemon exits); workers write into it
through CheckpointManager. It survives worker crashes, not the node: disk checkpoints stay the
source of truth for node loss, a world-size change or a daemon restart.

Layout, per node (W world size, S step, R global rank):
    w<W>-s<S:012d>-full.pt   the state as capture() returns it, written by local rank 0 (DDP
                             state is the same on every rank, as for rank-0 disk checkpoints)
    w<W>-s<S:012d>-r<R>.pt   rank R's own RNG state at S (every rank, local rank 0 included)
    .r<R>-*.tmp              a write in progress; removed by that rank's next write
A file appears by os.replace of a completely written one, so a crash mid-write leaves the
previous step. Each rank keeps its two newest steps: a step S stays readable until S+2 is
written, which needs a collective step that every rank joins only after loading.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

ENV = "ELASTICD_MEMORY_DIR"
ROOT = "/dev/shm"
PREFIX = "elasticd-mem-"
_FILE = re.compile(r"^w(\d+)-s(\d{12})-(full|r(\d+))\.pt$")
KEEP = 2


# -- daemon side ------------------------------------------------------------------------------

def create(run_id: str) -> str | None:
    """A fresh 0700 directory for this daemon run, or None where there is no tmpfs to use.
    Directories of daemons that died without cleaning up are removed first."""
    if not os.path.isdir(ROOT) or not os.access(ROOT, os.W_OK):
        return None
    reap_stale()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64]
    try:
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{safe}-", dir=ROOT)
        with open(os.path.join(path, "owner"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        return None
    return path


def remove(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def reap_stale() -> list[str]:
    """Our user's memory directories whose daemon is gone (SIGKILL, power cut of the process)."""
    gone = []
    try:
        names = os.listdir(ROOT)
    except OSError:
        return gone
    for name in names:
        path = os.path.join(ROOT, name)
        if not name.startswith(PREFIX):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, "owner")) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def newest_step(path: str | None) -> int | None:
    """The newest full state in the directory (for status), whatever its world size."""
    steps = [int(m.group(2)) for m in map(_FILE.match, _listdir(path)) if m and m.group(3) == "full"]
    return max(steps) if steps else None


# -- worker side ------------------------------------------------------------------------------

def _listdir(path: str | None) -> list[str]:
    if not path:
        return []
    try:
        return os.listdir(path)
    except OSError:
        return []


def _name(world: int, step: int, who: str) -> str:
    return f"w{world}-s{step:012d}-{who}.pt"


def _write(path: str, name: str, rank: int, obj: Any) -> None:
    import torch

    fd, tmp = tempfile.mkstemp(prefix=f".r{rank}-", suffix=".tmp", dir=path)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, os.path.join(path, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write(path: str, step: int, state: Mapping[str, Any], *, world: int, rank: int, local_rank: int) -> None:
    """Store `state` (a capture(), whose "rng" holds at least this rank's entry) as `step`."""
    rng = state.get("rng") or {}
    ranks = rng.get("ranks") or []
    mine = ranks[rank] if rank < len(ranks) else (ranks[0] if len(ranks) == 1 else None)
    if local_rank == 0:
        full = dict(state)
        full.pop("rng", None)
        _write(path, _name(world, step, "full"), rank, {"step": step, "state": full})
    _write(path, _name(world, step, f"r{rank}"), rank, {"step": step, "rng": mine})
    prune(path, rank=rank, local_rank=local_rank, keep=KEEP)


def prune(path: str, *, rank: int, local_rank: int, keep: int = KEEP, only: tuple[int, int] | None = None,
          drop_all: bool = False) -> None:
    """Drop this rank's files beyond its `keep` newest steps (with `only` = (world, step): every
    other one; with drop_all: all), and its temporaries. Local rank 0 prunes full states too."""
    mine: dict[tuple[int, int], list[str]] = {}
    for name in _listdir(path):
        if name.startswith(f".r{rank}-") and name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, name))
            continue
        m = _FILE.match(name)
        if m and (m.group(4) == str(rank) or (m.group(3) == "full" and local_rank == 0)):
            mine.setdefault((int(m.group(1)), int(m.group(2))), []).append(name)
    newest_first = sorted(mine, key=lambda k: k[1], reverse=True)
    if drop_all:
        drop = newest_first
    elif only is not None:
        drop = [k for k in newest_first if k != only]
    else:
        drop = newest_first[keep:]
    for k in drop:
        for name in mine[k]:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, name))


def steps(path: str | None, *, world: int, rank: int) -> list[int]:
    """Steps this rank could resume from: the node's full state and its own RNG, same world size."""
    full, own = set(), set()
    for m in map(_FILE.match, _listdir(path)):
        if not m or int(m.group(1)) != world:
            continue
        if m.group(3) == "full":
            full.add(int(m.group(2)))
        elif int(m.group(4)) == rank:
            own.add(int(m.group(2)))
    return sorted(full & own, reverse=True)


def read(path: str, step: int, *, world: int, rank: int) -> dict[str, Any]:
    """The state at `step` with this rank's RNG in place (the other ranks' entries are None).
    weights_only=True, as for disk checkpoints."""
    import torch

    full = torch.load(os.path.join(path, _name(world, step, "full")), map_location="cpu", weights_only=True)
    own = torch.load(os.path.join(path, _name(world, step, f"r{rank}")), map_location="cpu", weights_only=True)
    if full.get("step") != step or own.get("step") != step:
        raise ValueError(f"in-memory state at step {step} is inconsistent")
    state = dict(full["state"])
    if own.get("rng") is not None:
        ranks: list[Any] = [None] * world
        ranks[rank] = own["rng"]
        state["rng"] = {"world_size": world, "ranks": ranks}
    return state
