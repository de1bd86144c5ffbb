"""Held connections to the watched nodes' daemons: a neighbour whose daemon dies is known at once.

A killed process's kernel closes its sockets, so a connection held to its daemon ends within
milliseconds of a kill -9, where missed beats need two beats (0.25-0.75 s after the kill, since
a silence counts from the read that last saw the counter move) and a probe needs the node's own
address (on one host, or loopback, there is none to probe). Each daemon of a multi-node job
listens (`Links`: the probe's listener where it has one, else a port of its own address, which
its arrival record carries) and holds a connection to each node it watches. A daemon that goes
in order (its end, a stop, a node leaving) writes a word before it closes, and so does one that
turns a connection away (over MAX_HELD): a connection that ends with no word, to a daemon whose
port then refuses a new one (or does not answer it), is a daemon that died; one that answers was
reset on the way (a firewall, a NAT) and is held again. A stopped or starved daemon's kernel
keeps its connections open: never taken for gone.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from elasticd import logs
from elasticd.cluster import probe
from elasticd.lifecycle import supervise

log = logs.get("elasticd.links")

BYE = b"bye\n"  # an orderly end: the daemon stops or turns the connection away
MAX_HELD = 64  # connections of watchers held at once (each node has WATCHED): more get BYE
CONNECT_WAIT = 0.15  # seconds a connect to a neighbour may take (a LAN answers in well under 1 ms)
CONNECT_TRIES = 3  # failed connects to a node before it is left to the beats and the probe
# TCP keepalive on every held connection: a probe after KEEPALIVE_IDLE s of silence keeps a
# firewall's or NAT's state for it (one that forgets an idle connection would leave it silently
# dead), and a host gone without a word (power, cable) ends it after KEEPALIVE_IDLE +
# KEEPALIVE_INTERVAL x KEEPALIVE_PROBES s; the beats and the probe usually tell first.
KEEPALIVE_IDLE = 10
KEEPALIVE_INTERVAL = 2
KEEPALIVE_PROBES = 3
POLL_SLICE = 0.5  # seconds between looks at a stop when nothing happens


def listen(addr: str, port: int = 0) -> socket.socket | None:
    """A non-blocking listener on (addr, port), or None where it cannot bind."""
    try:
        return probe.bound(addr, port)
    except OSError:
        return None


class Links:
    """Our listener's accepted connections, held until they end, and ours to the watched nodes:
    `gone` says which of those ended with no word (node id -> (when, monotonic; why)); `wake` is
    called when one does."""

    def __init__(self, listener: socket.socket | None, wake: Callable[[], None]) -> None:
        self._listener = listener
        self.port = listener.getsockname()[1] if listener is not None else 0
        self._wake = wake
        self._lock = threading.Lock()
        self._want: dict[str, tuple[str, int]] = {}  # node id -> (addr, port) to hold
        self._held: dict[str, socket.socket] = {}  # ours, by node id
        self._tried: dict[str, int] = {}  # failed connects, by node id
        self._accepted: dict[int, socket.socket] = {}  # our watchers', by fd
        self.gone: dict[str, tuple[float, str]] = {}
        self._stop = threading.Event()
        self._poke_r, self._poke_w = socket.socketpair()
        self._poke_r.setblocking(False)
        self._thread = supervise.thread(
            "links", self._run, risk="until it is back, a killed neighbour is found by its beats"
        )
        self._thread.start()

    def watch(self, targets: Mapping[str, tuple[str, int]]) -> None:
        """Hold a connection to each of these nodes' daemons (node id -> (addr, port)), and to
        no other."""
        with self._lock:
            if dict(targets) == self._want:
                return
            self._want = dict(targets)
        self._poke()

    def forgive(self, nodes: Iterable[str]) -> None:
        """Nodes that arrived for a new round are alive, whatever their connection did before
        (a partition longer than the keepalive's 16 s ends it with no word, as a death does):
        their gone mark and failed tries forgotten, a connection held to them again. Kept, a
        node back from a partition was found gone again in every round it joined, at once,
        round after round (a restart storm, 16 rounds in 13 s)."""
        with self._lock:
            for node in nodes:
                self.gone.pop(node, None)
                self._tried.pop(node, None)
        self._poke()

    def close(self) -> None:
        """Say BYE on every connection and close them all (the daemon's end)."""
        self._stop.set()
        self._poke()
        self._thread.join(timeout=2 * POLL_SLICE)
        if self._listener is not None:
            self._accept()  # queued ones too: closing the listener would reset them
        with self._lock:
            socks = [*self._held.values(), *self._accepted.values()]
            self._held, self._accepted = {}, {}
        for s in socks:
            _bye(s)
        if self._listener is not None:
            self._listener.close()
        self._poke_r.close()
        self._poke_w.close()

    def _poke(self) -> None:
        try:
            self._poke_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._connect()
            poller = select.poll()
            poller.register(self._poke_r, select.POLLIN)
            if self._listener is not None:
                poller.register(self._listener, select.POLLIN)
            with self._lock:
                ours = {s.fileno(): n for n, s in self._held.items()}
                theirs = dict(self._accepted)
            for fd in (*ours, *theirs):
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(POLL_SLICE * 1000):
                if fd == self._poke_r.fileno():
                    _empty(self._poke_r)
                elif self._listener is not None and fd == self._listener.fileno():
                    self._accept()
                elif fd in ours:
                    self._ended(ours[fd])
                elif fd in theirs:
                    self._drop(fd)

    def _connect(self) -> None:
        """Connections to the nodes now watched that lack one; those no longer watched closed
        with a word. A node that cannot be reached is tried a few times, then left to the beats
        and the probe."""
        with self._lock:
            want = dict(self._want)
            stale = [n for n in self._held if n not in want]
            for n in stale:
                _bye(self._held.pop(n))
        for node, target in want.items():
            if node in self._held or node in self.gone or self._tried.get(node, 0) >= CONNECT_TRIES:
                continue
            try:
                s = socket.create_connection(target, timeout=CONNECT_WAIT)
            except OSError:
                self._tried[node] = self._tried.get(node, 0) + 1
                continue
            _hold(s)
            with self._lock:
                self._held[node] = s

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            _hold(conn)
            with self._lock:
                if len(self._accepted) >= MAX_HELD:
                    _bye(conn)
                else:
                    self._accepted[conn.fileno()] = conn

    def _drop(self, fd: int) -> None:
        """A watcher's connection readable: it ended (or sent something, which means nothing)."""
        with self._lock:
            conn = self._accepted.get(fd)
        if conn is None or _read(conn) is not None:
            return
        with self._lock:
            self._accepted.pop(fd, None)
        conn.close()

    def _ended(self, node: str) -> None:
        """Our connection to a watched node's daemon readable: a word is an orderly end, an end
        with none (or a reset) its death."""
        with self._lock:
            s = self._held.get(node)
        if s is None:
            return
        got = _read(s)
        if got is not None and not got:
            return  # nothing yet (a spurious wake-up)
        with self._lock:
            self._held.pop(node, None)
            target = self._want.get(node)
        s.close()
        if got is None and target is not None and self._answers(node, target):
            return  # a connection reset between us (a middlebox's): the daemon is alive
        self._tried[node] = CONNECT_TRIES  # not again: it goes, or turned us away
        if got is None:
            self.gone[node] = (time.monotonic(), "its daemon died (our connection to it closed)")
            log.warning("peer_daemon_gone", node=node)
            self._wake()

    def _answers(self, node: str, target: tuple[str, int]) -> bool:
        """Whether the daemon's listener still takes a connection, held from then on: a killed
        daemon's port refuses at once (its host's kernel answers), a lost host gives no answer
        within CONNECT_WAIT; a live daemon whose connection a firewall or NAT reset answers."""
        try:
            s = socket.create_connection(target, timeout=CONNECT_WAIT)
        except OSError:
            return False
        _hold(s)
        with self._lock:
            self._held[node] = s
        log.info("peer_link_reset", node=node)
        return True


def _hold(s: socket.socket) -> None:
    """Ready a connection to be held: non-blocking (one thread polls them all), kept alive."""
    s.setblocking(False)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, opt):  # Linux has all three; elsewhere the system's defaults
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _read(s: socket.socket) -> bytes | None:
    """What is there to read: b"" when nothing is (yet), the bytes, None at its end (or reset)."""
    try:
        data = s.recv(64)
    except BlockingIOError:
        return b""
    except OSError:
        return None
    return data or None


def _empty(s: socket.socket) -> None:
    try:
        while s.recv(64):
            pass
    except OSError:
        pass


def _bye(s: socket.socket) -> None:
    try:
        s.setblocking(True)
        s.settimeout(0.05)
        s.sendall(BYE)
    except OSError:
        pass
    finally:
        s.close()
