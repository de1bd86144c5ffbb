"""The metrics' HTTP server: prometheus-client's exposition handler on a `socketserver` of ours
(`BoundedServer`, on one address)
that bounds what whoever reaches the port can cost the daemon (metrics.Exporter serves it).

At most MAX_CONNECTIONS connections are served at once, each for at most REQUEST_TIMEOUT for its
whole exchange; at the cap the connection that has waited longest without sending its request is
evicted, else the new one is closed at once. prometheus-client's own server starts a thread per
connection and waits on each without end (400 idle connections were 400 threads, and the file
descriptors the daemon needed to restart its workers).
"""

from __future__ import annotations

import contextlib
import errno
import io
import socket
import socketserver
import threading
import time
from typing import Any

from prometheus_client.exposition import MetricsHandler

from elasticd import logs

log = logs.get("elasticd.metrics")

MAX_CONNECTIONS = 16  # connections served at once (Prometheus scrapes a target one at a time)
REQUEST_TIMEOUT = 5.0  # seconds a connection has for its whole request and reply (a scrape: ms)
EVICT_WAIT = 1.0  # seconds a new connection waits for the slot of an idle one it evicted


def serve(address: tuple[str, int], handler: type) -> BoundedServer:
    """A BoundedServer on `address`, serving on a thread of its own (an OSError, e.g. the port
    in use, is the caller's)."""
    server = BoundedServer(address, handler)
    threading.Thread(target=server.serve_forever, name="elasticd-metrics", daemon=True).start()
    log.info(
        "metrics_serving",
        address=f"{address[0]}:{address[1]}",
        path="/metrics",
        max_connections=MAX_CONNECTIONS,
        request_timeout=REQUEST_TIMEOUT,
    )
    return server


class _Deadline(io.RawIOBase):
    """A connection's reads, each allowed only what is left of its request's time: a client that
    trickles bytes (slowloris) is dropped at the deadline, not kept for as long as it trickles."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's time is up")
        self._sock.settimeout(
            left
        )  # a reply's sendall is bounded by what is left after the last read
        return self._sock.recv_into(buffer)


class Handler(MetricsHandler):
    """prometheus-client's exposition (content negotiation, gzip, name[] filters), with the
    whole exchange bounded by REQUEST_TIMEOUT; one request per connection (HTTP/1.0)."""

    server: BoundedServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain reader is replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(
            _Deadline(self.connection, time.monotonic() + REQUEST_TIMEOUT)
        )

    def parse_request(self) -> bool:
        """Its line and headers are in: from now on the connection is served, no longer
        evictable."""
        ok = super().parse_request()
        self.server.requested(self.connection)
        return ok


class BoundedServer(socketserver.ThreadingTCPServer):
    """A thread per connection, at most MAX_CONNECTIONS of them. At the cap a new connection
    takes the slot of the one that has waited longest without sending its request (an idle or
    slowloris client), so a scraper is served while the slots are held by idle connections; if
    every slot is serving a request, it is closed at once. Nothing a client does prints a
    traceback: errors are one throttled event."""

    daemon_threads = True
    block_on_close = False  # closing never waits on a client
    allow_reuse_address = True  # as prometheus-client's server: a restarted daemon binds at once
    request_queue_size = (
        128  # a burst of connections waits in the kernel's queue, not as SYNs resent a second later
    )

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        self.address_family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[
            0
        ][0]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._waiting: dict[socket.socket, None] = {}  # accepted, request not yet in: oldest first
        self._lock = threading.Lock()
        self._throttle = logs.Throttle()
        self.refused = self.evicted = 0
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._say("metrics_accept_failed", error=str(e))
                time.sleep(
                    0.1
                )  # the connection waits in the kernel's queue: not a busy loop meanwhile
            raise

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not (self._slots.acquire(blocking=False) or self._evict()):
            self.refused += 1
            self._say(
                "metrics_connection_refused",
                reason=f"{MAX_CONNECTIONS} connections are being served",
            )
            self.shutdown_request(request)
            return
        with self._lock:
            self._waiting[request] = None
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def requested(self, request: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(request, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-reply, or anything else one connection raised."""
        import sys

        self._say("metrics_request_failed", error=repr(sys.exc_info()[1]))

    def _evict(self) -> bool:
        """Drop the connection that has waited longest for its request, and take its slot once
        its thread has let it go; False when every connection is being served."""
        with self._lock:
            if not self._waiting:
                return False
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its thread's read ends now
        self.evicted += 1
        self._say("metrics_connection_evicted", reason="no request yet, and every slot taken")
        return self._slots.acquire(timeout=EVICT_WAIT)

    def _release(self, request: socket.socket) -> None:
        self.requested(request)
        self._slots.release()

    def _say(self, event: str, **fields: Any) -> None:
        held = self._throttle(event)
        if held is not None:
            log.warning(event, **fields, held_back=held)
