"""The control socket's server (`ControlServer`): one thread of the daemon that serves the
operators.

It only *reads* the immutable snapshot the agent loop publishes and hands commands to the loop
through the `command` callback (which must only enqueue): it never changes daemon state, so the
loop stays the single writer. A command the loop must carry out before it can answer (stacks) gets
a `Deferred`: the connection waits, without holding up the server's thread, until the loop gives the
reply or the Deferred's timeout passes. One thread multiplexes every connection with `selectors`,
each with a hard deadline, so a slow or hostile client neither wedges the server nor delays
another client. Every malformed request gets an error reply (never a dropped connection). Who is
let in and how many connections each may hold: access.py; the socket file: socketfile.py; the
commands: commands.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from elasticd.control import socketfile
from elasticd.control.access import (
    admitted,
    descends_from_us,
    over_limit,
    peer_groups,
    refusal,
    resolve_group,
)
from elasticd.control.commands import COMMANDS, parse_request
from elasticd.control.protocol import MAX_REQUEST, VERSION, error
from elasticd.lifecycle import supervise

log = structlog.get_logger("elasticd.control")

# seconds a connection may take to send its whole request (the CLI sends it at once)
READ_TIMEOUT = 1.0
WRITE_TIMEOUT = 2.0  # seconds it may take to read its reply
ACCEPT_PER_TURN = 8  # connections taken from the backlog before serving those already open
_UCRED = struct.Struct("=iII")  # struct ucred: pid_t pid, uid_t uid, gid_t gid


class Deferred:
    """A reply the agent loop gives later, from its own thread (`give`)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.reply: dict | None = None
        self._wake: Callable[[], None] = lambda: None

    def give(self, reply: dict) -> None:
        self.reply = reply
        self._wake()


@dataclass
class Conn:
    """One client's connection: whose it is, its deadline, what it sent, the reply to write."""

    sock: socket.socket
    uid: int
    deadline: float
    pid: int = 0
    bucket: str = ""  # "workers", or "uid N": whose connection cap it counts against
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytes = b""  # set once the reply is known; the connection then only writes
    waiting: Deferred | None = None  # a reply the loop has yet to give


class ControlServer:
    """Serves status and forwards commands on a Unix socket, from one daemon thread.

    `snapshot()` returns the latest published status dict (read-only here); `command(request)`
    enqueues the request for the agent loop and returns the immediate reply. Both run on the
    server thread and must be quick: neither may wait for the loop.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        snapshot: Callable[[], dict],
        command: Callable[[dict], dict],
        operators_group: str | None = None,
    ):
        self.path = Path(path)
        self.snapshot = snapshot
        self.command = command
        self.operators_group = operators_group or None
        self._gid: int | None = None
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._identity: socketfile.Identity | None = None  # the socket file we linked

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lifecycle --

    def start(self) -> None:
        """Create the socket (never reachable with looser rights than final) and start serving.

        Raises AlreadyRunning if a live daemon answers at the path, ControlError for anything
        else that needs the operator (unknown group, unusable directory, path too long).
        """
        if self._thread is not None or self._closed:
            raise RuntimeError("a ControlServer starts once; make a new one after close()")
        socketfile.check_length(self.path)
        self._gid = resolve_group(self.operators_group)
        self._listener, self._identity = socketfile.create(
            self.path, self._gid, self.operators_group
        )
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = supervise.thread("control", self._serve)
        self._thread.start()
        log.info(
            "control_socket_listening", path=str(self.path), operators_group=self.operators_group
        )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close every connection, unlink the socket (only if still ours).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._poke()
            self._thread.join(timeout)
            if self._thread.is_alive():  # a callback is stuck; the thread is a daemon thread
                log.warning("control_thread_did_not_stop", timeout=timeout)
        if self._listener is not None and not self.running:
            self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0 and not (self._thread and self._thread.is_alive()):
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self._identity is not None:
            socketfile.remove(self.path, self._identity)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- serving --

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        conns: dict[int, Conn] = {}
        listener = self._listener
        assert listener is not None
        sel.register(listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = min((c.deadline for c in conns.values()), default=now + 1.0) - now
                for key, events in sel.select(max(0.0, timeout)):
                    if key.fileobj is listener:
                        self._accept(sel, conns)
                    elif key.fileobj == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 64)
                    else:
                        conn = conns.get(key.fd)
                        if conn is not None:
                            self._safe_step(sel, conns, conn, events)
                now = time.monotonic()
                for conn in [
                    c for c in conns.values() if c.waiting and c.waiting.reply is not None
                ]:
                    self._respond(sel, conns, conn, {"version": VERSION, **conn.waiting.reply})
                for conn in [c for c in conns.values() if c.deadline <= now]:
                    self._expire(sel, conns, conn)
        finally:  # a crash goes on to supervise.thread, which serves again with the same listener
            for conn in list(conns.values()):
                self._drop(sel, conns, conn)
            sel.close()

    def _expire(self, sel: selectors.BaseSelector, conns: dict[int, Conn], conn: Conn) -> None:
        """A connection past its deadline: read once more (its request may have come in this
        very turn), else drop it (it does not read its reply) or answer why it waited in vain."""
        if not (conn.out or conn.waiting):
            self._safe_step(sel, conns, conn, selectors.EVENT_READ)
            if conn.out or conn.waiting or conn.sock.fileno() not in conns:
                return
        if conn.out:
            self._drop(sel, conns, conn)  # it does not read its reply; give up
        elif conn.waiting:
            timeout = conn.waiting.timeout
            message = f"the daemon did not answer within {timeout:g}s; check its logs"
            self._respond(sel, conns, conn, error(message))
        else:
            message = f"request not received within {READ_TIMEOUT:g}s"
            self._respond(sel, conns, conn, error(message))

    def _poke(self) -> None:
        """Wake the server's select (from another thread); a full pipe already will."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"d")

    def _accept(self, sel: selectors.BaseSelector, conns: dict[int, Conn]) -> None:
        """Take the waiting connections, a few per turn: a peer that keeps connecting must not
        keep the loop from reading the requests of those already in."""
        assert self._listener is not None
        for _ in range(ACCEPT_PER_TURN):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: keep serving the connections we have
                log.warning("control_accept_failed", error=e.strerror)
                return
            sock.setblocking(False)
            pid, uid, gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            conn = Conn(sock, uid, time.monotonic() + READ_TIMEOUT, pid=pid)
            conns[sock.fileno()] = conn
            sel.register(sock, selectors.EVENT_READ)
            if not self._admit(uid, gid):
                log.warning("control_refused", uid=uid, gid=gid, pid=pid)
                self._respond(sel, conns, conn, error(refusal(uid, self.operators_group)))
                continue
            conn.bucket = "workers" if descends_from_us(pid) else f"uid {uid}"
            busy = over_limit(conn, [c for c in conns.values() if c is not conn and c.bucket])
            if busy:
                conn.bucket = ""  # it holds no slot
                self._respond(
                    sel,
                    conns,
                    conn,
                    error(f"busy: too many open control connections {busy}; retry"),
                )

    def _admit(self, uid: int, gid: int) -> bool:
        """Whether the peer's credentials let it in (see `admitted`)."""
        me = os.geteuid()
        if admitted(uid, gid, me, self._gid):
            return True
        return self._gid is not None and admitted(uid, gid, me, self._gid, peer_groups(uid, gid))

    def _safe_step(
        self, sel: selectors.BaseSelector, conns: dict[int, Conn], conn: Conn, events: int
    ) -> None:
        try:
            self._step(sel, conns, conn, events)
        except Exception as e:  # noqa: BLE001 - one client must not end the server
            log.warning("control_connection_failed", error=repr(e))
            self._drop(sel, conns, conn)

    def _step(
        self, sel: selectors.BaseSelector, conns: dict[int, Conn], conn: Conn, events: int
    ) -> None:
        if conn.out:
            if events & selectors.EVENT_WRITE:
                self._flush(sel, conns, conn)
            return
        try:
            chunk = conn.sock.recv(MAX_REQUEST + 1 - len(conn.inbuf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._drop(sel, conns, conn)
        conn.inbuf += chunk
        if len(conn.inbuf) > MAX_REQUEST:
            return self._respond(
                sel, conns, conn, error(f"request larger than {MAX_REQUEST} bytes")
            )
        if chunk and b"\n" not in chunk:
            return  # more to come
        line = bytes(conn.inbuf).split(b"\n", 1)[0]
        if not line.strip():  # nothing at all before EOF: no request to answer
            return (
                self._drop(sel, conns, conn)
                if not conn.inbuf
                else self._respond(sel, conns, conn, error("empty request"))
            )
        try:
            reply = self.handle(line)
        except Exception as e:  # noqa: BLE001 - a bug here must still answer, not drop the client
            log.error("control_request_failed", error=repr(e))
            reply = error(f"internal error handling the request: {type(e).__name__}")
        if isinstance(reply, Deferred):  # not readable meanwhile: a client's EOF must not spin
            conn.waiting, conn.deadline = reply, time.monotonic() + reply.timeout
            sel.unregister(conn.sock)
            reply._wake = self._poke
            if reply.reply is not None:  # given before the wake-up was in place
                reply._wake()
            return
        self._respond(sel, conns, conn, reply)

    def handle(self, raw: bytes) -> dict | Deferred:
        """One request's reply, or the Deferred the loop will give it (the transport-free half of
        the server): its command's entry in COMMANDS says how."""
        req, refused = parse_request(raw)
        if refused:
            return refused
        command = COMMANDS[req["command"]]
        for key, check in command.fields.items():
            problem = check(req.get(key))
            if problem:
                return error(problem)
        return command.serve(self, req) if command.serve else self._forward(req)

    def _forward(self, req: dict) -> dict | Deferred:
        """Hand a request to the agent loop's `command` callback: its reply, or its Deferred."""
        cmd, timeout = req["command"], req.get("timeout")
        try:
            reply = self.command(req)
            if not isinstance(reply, (dict, Deferred)):
                raise TypeError(f"command callback returned {type(reply).__name__}, not dict")
        except Exception as e:  # noqa: BLE001
            log.error("control_command_failed", command=cmd, error=repr(e))
            return error(f"internal error handing {cmd!r} to the daemon: {e!r}")
        if isinstance(reply, Deferred):
            log.info("control_command", command=cmd, timeout=timeout, deferred=True)
            return reply
        log.info("control_command", command=cmd, timeout=timeout, ok=bool(reply.get("ok")))
        return {"version": VERSION, **reply}

    def _respond(
        self, sel: selectors.BaseSelector, conns: dict[int, Conn], conn: Conn, reply: dict
    ) -> None:
        try:
            conn.out = json.dumps(reply, default=str).encode() + b"\n"
        except (TypeError, ValueError) as e:
            conn.out = json.dumps(error(f"internal error encoding the reply: {e}")).encode() + b"\n"
        conn.deadline = time.monotonic() + WRITE_TIMEOUT
        if conn.waiting:
            conn.waiting = None
            sel.register(conn.sock, selectors.EVENT_WRITE)
        else:
            sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._flush(sel, conns, conn)

    def _flush(self, sel: selectors.BaseSelector, conns: dict[int, Conn], conn: Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._drop(sel, conns, conn)
        conn.out = conn.out[sent:]
        if not conn.out:
            self._drop(sel, conns, conn)

    def _drop(self, sel: selectors.BaseSelector, conns: dict[int, Conn], conn: Conn) -> None:
        conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn.sock)
        # Read what the peer already sent: closing with unread data would make its recv() fail
        # with ECONNRESET instead of reading our reply (Linux AF_UNIX semantics).
        with contextlib.suppress(OSError):
            for _ in range(MAX_REQUEST // 4096 + 1):
                if not conn.sock.recv(4096):
                    break
        conn.sock.close()
