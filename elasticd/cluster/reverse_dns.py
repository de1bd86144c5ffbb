"""The name lookup torch's TCPStore makes on every connection, timed once per store address and
said in one line where it is slow.

Why: c10d names the address at the other end of each connection it makes or accepts (its
`formatSockAddr`: getnameinfo without NI_NUMERICHOST), the client on its connecting thread and
the store in its one event loop, until a lookup fails in that process. A resolver that answers
slowly (a DNS server that drops queries, or one cut off by a partition) stalls each connection
that long (5 s per try by default), and every client of the store with it: a rank's
init_process_group, a daemon's store calls (bounded at 2 s: daemon/inplace.py), a spare's
handle. The client looks up the store's address as it connected to it, an IPv4 one mapped into
IPv6 (torch's client prefers IPv6: ::ffff:a.b.c.d, which /etc/hosts seldom lists); the store
looks up its peer's.

elasticd cannot make torch skip it; it measures the same lookups for the stores a node uses (the
rendezvous endpoint's, the workers' of each round, this node's own address, which the store's
host looks up), on a thread, and names the slow one with the fix (docs/running.md#name-lookups).
"""

from __future__ import annotations

import socket
import threading
import time

from elasticd import logs

log = logs.get("elasticd.agent")

SLOW = 0.2  # seconds: a lookup this slow, on every store connection, is worth a line

_watched: set[str] = set()
_lock = threading.Lock()


def forms(host: str) -> list[tuple]:
    """The socket addresses torch's TCPStore looks up for a connection to or from `host`: its
    client's (IPv6 first, an IPv4 address mapped) and the store's view of the peer."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []  # the connection fails before any lookup: the store's own error says so
    out: list[tuple] = []
    for family, _, _, _, sa in infos:
        if family == socket.AF_INET:
            found = [(f"::ffff:{sa[0]}", 0, 0, 0), (sa[0], 0)]
        elif family == socket.AF_INET6:
            found = [(sa[0], 0, sa[2], sa[3])]
        else:
            continue
        out += [f for f in found if f not in out]
    return out


def check(host: str) -> list[tuple[str, float]]:
    """Each of `host`'s lookups as torch makes them (NI_NUMERICSERV), with its seconds; one that
    fails counts as long as it took (torch's first failure costs that, then it stops looking)."""
    timed = []
    for sa in forms(host):
        began = time.monotonic()
        try:
            socket.getnameinfo(sa, socket.NI_NUMERICSERV)
        except OSError:
            pass
        timed.append((sa[0], time.monotonic() - began))
    return timed


def watch(host: str) -> threading.Thread | None:
    """`check(host)` on a thread of its own, once per host in this process; a lookup slower than
    SLOW is one warning line. The thread, or None where `host` was watched already."""
    with _lock:
        if not host or host in _watched:
            return None
        _watched.add(host)
    t = threading.Thread(target=_look, args=(host,), name="elasticd-reverse-dns", daemon=True)
    t.start()
    return t


def _look(host: str) -> None:
    slow = [(address, s) for address, s in check(host) if s >= SLOW]
    if not slow:
        return
    address, seconds = max(slow, key=lambda found: found[1])
    log.warning(
        "store_address_lookup_slow",
        host=host,
        address=address,
        seconds=round(seconds, 2),
        consequence="torch's TCPStore looks up this address's name on every connection to or "
        "from it, its store's event loop blocked meanwhile: each connection stalls this long, "
        "and a store call bounded tighter fails",
        fix="answer reverse lookups of the nodes' addresses locally (/etc/hosts, nscd or "
        "systemd-resolved), or mend the resolver (/etc/resolv.conf)",
    )
