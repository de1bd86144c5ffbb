"""The daemon's in-memory state directory: a private tmpfs directory under /dev/shm, one per
daemon run, passed to workers as ELASTICD_MEMORY_DIR, flocked while the daemon lives, removed
when it exits; one that a dead daemon left behind is reaped. Torch-free: the daemon imports it.

A directory whose lock file the live daemon flocks is never reaped, whatever its recorded pid. A
/dev/shm that cannot hold it gives one `memory_state_off` warning with the fix (`full_fix`) and
leaves nothing behind. `newest_step` and `held_bytes` (own and replica slots' allocated bytes)
are for status.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import tempfile

import structlog

from elasticd import names, safeio
from elasticd.checkpoint.memory.slots import OWN, REPLICA, SLOTS, header, slot_kind, slot_path

ENV = names.MEMORY_DIR
ROOT = "/dev/shm"
PREFIX = "elasticd-mem-"

LOCK = "lock"  # flocked by the live daemon for as long as the directory is in use
OWNER = "owner"  # the daemon's pid (for people), written once the lock is held
_locks: dict[str, int] = {}  # directory -> the lock's descriptor, held until remove()

log = structlog.get_logger("elasticd.memory")


def create(run_id: str) -> str | None:
    """A fresh 0700 directory for this daemon run, or None where there is no tmpfs to use (one
    `memory_state_off` warning naming why and the fix, and nothing left behind).
    Directories of daemons that died without cleaning up are removed first.

    The daemon holds an exclusive flock on the directory's lock file for its whole life (close
    on exec: no worker holds it after the daemon is gone): that, not the pid in `owner`, is what
    tells a live directory, since a daemon in another pid namespace sharing /dev/shm (a container)
    has a pid that means nothing here."""
    if not os.path.isdir(ROOT) or not os.access(ROOT, os.W_OK):
        _off(f"{ROOT} is not a directory this user can write", f"give the node a writable {ROOT}")
        return None
    reap_stale()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64]
    path = None
    try:
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{safe}-", dir=ROOT)
        fd = safeio.create(os.path.join(path, LOCK), os.O_RDONLY)
        _locks[path] = fd
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with os.fdopen(safeio.create(os.path.join(path, OWNER)), "w") as f:  # last: see reap_stale
            f.write(str(os.getpid()))
    except OSError as e:
        remove(path)
        _off(f"cannot create its directory in {ROOT} ({e.strerror or e})", full_fix(e))
        return None
    return path


def full_fix(e: OSError) -> str:
    """What the operator does about an error of the in-memory state's tmpfs."""
    if e.errno == errno.ENOSPC:
        return (
            f"free space in {ROOT} (`df {ROOT}`; remove what others left there) or make it larger "
            f"(`mount -o remount,size=... {ROOT}`, a container's --shm-size), or run with "
            "--no-memory-state"
        )
    return f"check {ROOT} (`df -i {ROOT}`, its permissions), or run with --no-memory-state"


def _off(why: str, fix: str) -> None:
    log.warning(
        "memory_state_off",
        reason=f"in-memory state off: {why}; workers resume from disk checkpoints only",
        fix=fix,
    )


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


def held_bytes(path: str | None) -> tuple[int, int]:
    """/dev/shm bytes the directory's slot files hold (allocated blocks, as tmpfs counts them):
    (the ranks' own slots, the replicas of another node's ranks)."""
    held = {OWN: 0, REPLICA: 0}
    try:
        entries = list(os.scandir(path)) if path else []
    except OSError:
        return 0, 0
    for entry in entries:
        kind = slot_kind(entry.name)
        if kind:
            try:
                held[kind] += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue  # removed meanwhile
    return held[OWN], held[REPLICA]
