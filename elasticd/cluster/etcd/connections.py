"""The kept-alive connections to the members (`Connections`), one per endpoint: made under a
deadline (and the TLS handshake with them), replaced when a member closed one while it was idle, and
shut down at once by `shut_all` (a call in progress on another thread then fails at once).
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading

from elasticd.cluster.etcd import reply
from elasticd.cluster.etcd.endpoints import Endpoint, resolve
from elasticd.cluster.etcd.errors import Failed, cause_of, one_line


class Connections:
    """One kept-alive connection per endpoint index (a call uses one at a time: the client's lock
    keeps it so); `closing` set by shut_all, after which no new one is made."""

    def __init__(self, endpoints: list[Endpoint], tls: ssl.SSLContext | None) -> None:
        self.endpoints = endpoints
        self.tls = tls
        self._conns: dict[int, http.client.HTTPConnection] = {}  # changed under _lock
        self._lock = threading.Lock()
        self.closing = threading.Event()

    def shut_all(self) -> None:
        """No new connection from now on, and every kept one shut down: a call in progress on
        another thread fails at once (its thread closes the connection)."""
        with self._lock:
            self.closing.set()
            conns = list(self._conns.values())
        for conn in conns:
            shut(conn.sock)

    def get(self, i: int, end: float) -> http.client.HTTPConnection:
        """The kept-alive connection to endpoint i, or a new one (connected by `end`); one the
        member closed while idle (it died, or timed the connection out) is replaced before use, so
        a request is never sent into a dead connection."""
        conn = self._conns.get(i)
        if conn is not None and (conn.sock is None or dropped(conn.sock)):
            self.drop(i)
            conn = None
        return conn if conn is not None else self.new(self.endpoints[i], end, slot=i)

    def new(self, ep: Endpoint, end: float, slot: int | None = None) -> http.client.HTTPConnection:
        """A connection to `ep`, connected (and its TLS handshake done) by `end`; `slot`: the
        endpoint index it is kept under, from before it connects (shut_all shuts it down there)."""
        conn = http.client.HTTPConnection(ep.host, ep.port)
        conn.auto_open = 0  # http.client never connects by itself (it would not speak TLS)
        with self._lock:
            if self.closing.is_set():
                raise Failed("this connection was closed", applied_maybe=False, cause="closed")
            if slot is not None:
                self._conns[slot] = conn
        failure: Exception = OSError(f"no address for {ep.host}")
        for family, kind, proto, _, address in resolve(ep):
            try:
                conn.sock = socket.socket(family, kind, proto)
                if self.closing.is_set():
                    raise Failed("this connection was closed", applied_maybe=False, cause="closed")
                conn.sock.settimeout(reply.left(end))
                conn.sock.connect(address)
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if ep.scheme == "https":
                    self._handshake(conn, ep, end)
                return conn
            except Failed:
                conn.close()
                raise
            except Exception as e:  # noqa: BLE001 - the next address, else a failed attempt
                failure = e
                conn.close()
        # a TLS handshake that failed did reach the member, but no request was sent yet
        raise Failed(one_line(failure), applied_maybe=False, cause=cause_of(failure))

    def _handshake(self, conn: http.client.HTTPConnection, ep: Endpoint, end: float) -> None:
        """TLS on conn's connected socket, the member's certificate verified (a failure to verify
        does not heal by waiting: the CA or the name is wrong)."""
        conn.sock = self.tls.wrap_socket(
            conn.sock, server_hostname=ep.host, do_handshake_on_connect=False
        )
        conn.sock.settimeout(reply.left(end))
        try:
            conn.sock.do_handshake()
        except ssl.SSLCertVerificationError as e:
            raise Failed(
                f"TLS: {one_line(e)}", applied_maybe=False, cause="tls", lasting=True
            ) from None

    def drop(self, i: int) -> None:
        with self._lock:
            conn = self._conns.pop(i, None)
        if conn is not None:
            conn.close()

    def drop_all(self) -> None:
        for i in list(self._conns):
            self.drop(i)


def shut(sock: socket.socket | None) -> None:
    """Shut a socket down both ways: a thread blocked reading it wakes at once (its owner
    closes it). The base class's shutdown, as TLS's would unwrap under the reader."""
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass


def dropped(sock: socket.socket) -> bool:
    """Whether an idle kept-alive connection was closed by its member: it is readable (EOF, or data
    nobody asked for) while no request is outstanding."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    if not readable:
        return False
    if isinstance(sock, ssl.SSLSocket):
        return _tls_closed(sock)
    return True


def _tls_closed(sock: ssl.SSLSocket) -> bool:
    """A TLS socket turns readable also for records that carry no data (TLS 1.3 session tickets):
    read without blocking and see whether the connection ended."""
    blocking = sock.gettimeout()
    try:
        sock.setblocking(False)
        try:
            sock.recv(1)  # EOF, or a byte nobody asked for: either way the connection is done
            return True
        except ssl.SSLWantReadError:
            return False  # a record without data (a session ticket): still open
        except (OSError, ssl.SSLError):
            return True
    finally:
        try:
            sock.settimeout(blocking)
        except OSError:
            pass
