"""Direct evidence that a silent node is gone: its daemon's address no longer answers.

Missed beats alone cannot tell a cut-off node from a starved one, so they need seconds. A TCP
handshake can: the peer's kernel answers it from the listen queue even while the daemon is
stopped or starved, so a node that answered before and now answers nothing (packets dropped: a
partition, a host down) or refuses (its daemon is gone) is not merely slow.

Each daemon of a multi-node c10d job that does not host the store listens on its own address at
the rendezvous port (`listen`; where that is taken, as on the store's host or a second daemon on
one host, it listens nowhere and its peers judge it by its beats alone). The liveness thread
empties the queue (`drain`) and probes its silent neighbours (`probe`), all at once, bounded.
"""

from __future__ import annotations

import errno
import select
import socket
import time
from collections.abc import Iterable

from elasticd import logs

log = logs.get("elasticd.probe")

PROBE_WAIT = 0.15  # seconds a probe waits for the handshake (a LAN answers in well under 1 ms)
BACKLOG = 1024  # connections queued while the daemon is stopped: four a second per watcher


def bound(addr: str, port: int = 0) -> socket.socket:
    """A non-blocking listener on (addr, port) (0: a port of the kernel's choosing); OSError
    where it cannot bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def listen(addr: str, port: int) -> socket.socket | None:
    """A listener on (addr, port) that only completes handshakes, or None where it cannot bind."""
    try:
        sock = bound(addr, port)
    except OSError as e:
        log.info("probe_not_listening", addr=addr, port=port, why=e.strerror)
        return None
    log.info("probe_listening", addr=addr, port=port)
    return sock


def drain(sock: socket.socket | None) -> None:
    """Accept and close every queued probe (non-blocking)."""
    while sock is not None:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        conn.close()


def probe(targets: Iterable[tuple[str, int]], wait: float = PROBE_WAIT) -> dict:
    """Each (addr, port) probed at once: "answered", "refused" (the host is up, nothing listens:
    the daemon is gone) or "no answer" within `wait` (dropped on the way, or the host is down)."""
    pending: dict[int, tuple[socket.socket, tuple[str, int]]] = {}
    out: dict[tuple[str, int], str] = {}
    for target in targets:
        try:
            s = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET)
        except OSError:
            continue
        s.setblocking(False)
        code = s.connect_ex(target)
        if code in (0, errno.EINPROGRESS):
            pending[s.fileno()] = (s, target)
        else:
            out[target] = _verdict(code)
            s.close()
    deadline = time.monotonic() + wait
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLOUT)
    while pending and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            s, target = pending.pop(fd)
            poller.unregister(fd)
            out[target] = _verdict(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
            s.close()
    for s, target in pending.values():
        out[target] = "no answer"
        s.close()
    return out


def _verdict(code: int) -> str:
    if code == 0:
        return "answered"
    if code == errno.ECONNREFUSED:
        return "refused"
    return "no answer"  # unreachable, timed out: nothing came back from the host
