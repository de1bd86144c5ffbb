"""A survivor's pending collective ended from outside its process, when the next generation is
announced: the daemon takes a duplicate of each socket the survivor's latest forming made
(pidfd_getfd, Linux 5.6: the same socket, not a copy) and shuts it down, so that the survivor's
receive fails as if its peer had closed the connection, and its script unwinds to re-form.

Why from outside: a survivor learns of a failure only from its collective. A peer that died
closes its connections, but a peer cut off by a partition closes nothing, and the survivor
waits on it until gloo's timeout (30 min by default); before this, the daemon killed such a
survivor as stuck after about a step and started its rank again (`inplace.unstick`), losing
its process. The survivor's own shutdown of these sockets as it unwinds (worker/reconfigure.py
`Member.abort`) needs it to unwind first.

Only the sockets the worker named (names.pairs_file: its generation, then fd:inode pairs) and
only those of a generation older than the one announced; a socket is shut only if the fd still
holds the same inode (a closed fd reused since is left alone). Needs the right to ptrace the
worker (the daemon is its parent, or root; a seccomp filter or Yama's ptrace_scope 2-3 may deny
it): where denied, said once, and the stuck survivor is killed and replaced as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
from pathlib import Path

from elasticd import logs, names

log = logs.get("elasticd.agent")

SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)
_libc = ctypes.CDLL(None, use_errno=True)
_denied: list[str] = []  # why the kernel refused, once: said once, not tried again


def pairs(heartbeat: Path) -> tuple[int, dict[int, int]] | None:
    """The generation and the fd -> inode pairs a worker last wrote; None if none or garbled."""
    try:
        fields = Path(names.pairs_file(str(heartbeat))).read_text().split()
        found = {int(fd): int(ino) for fd, ino in (f.split(":") for f in fields[1:])}
        return int(fields[0]), found
    except (OSError, ValueError, IndexError):
        return None


def _getfd(pidfd: int, fd: int) -> int:
    got = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return got


def _shut_one(dup: int, inode: int) -> int:
    """Shut down the socket `dup` (a duplicate, closed here) if it is still `inode`: 1 if shut."""
    try:
        st = os.fstat(dup)
    except OSError:
        st = None
    if st is None or not stat.S_ISSOCK(st.st_mode) or st.st_ino != inode:
        os.close(dup)
        return 0
    with socket.socket(fileno=dup) as s:  # closes the duplicate only
        try:
            s.getpeername()  # a listening socket has no peer: kept
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return 0
    return 1


def shut(pid: int, heartbeat: Path, generation: int) -> int:
    """Shut down worker `pid`'s sockets of a generation before `generation`: how many."""
    found = pairs(heartbeat)
    if _denied or found is None or found[0] >= generation or not found[1]:
        return 0
    count = 0
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return 0  # gone: nothing of it waits
    try:
        for fd, inode in found[1].items():
            try:
                dup = _getfd(pidfd, fd)
            except OSError as e:
                if e.errno in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                    _denied.append(str(e))
                    log.warning(
                        "in_place_outside_abort_denied", why=str(e),
                        consequence="a survivor blocked on a silent peer is killed as stuck",
                    )  # fmt: skip
                    return count
                continue  # that fd is closed now
            count += _shut_one(dup, inode)
    finally:
        os.close(pidfd)
    return count
