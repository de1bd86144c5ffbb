"""The control plane's store on a c10d TCPStore (torch.distributed): the one store the daemon
hosts itself (`serve_store`, on the rendezvous endpoint's node and per round for the workers) and
the KV client over it (`TCPStoreKV`, connected with `tcp_connector`). The only module of the
cluster package whose store needs torch: kv.py (the protocol, `LocalKV`) and etcd/ stay
torch-free, so the CLI and an etcd-only caller never load it.

Every call is bounded: a store that does not answer within the timeout raises `kv.Unreachable` (one
line naming the endpoint), never a C++ stack or a hang (`bound_replies`: the client socket's
SO_RCVTIMEO). It connects on a helper thread, reads "absent" through a per-process random marker no
writer can forge, and counts the connections it made (`connections`: one kept is the same store and
host). The server is bound to the one address (`bind_listener`).
"""

from __future__ import annotations

import datetime
import os
import re
import secrets
import socket
import struct
import threading
from collections.abc import Callable

import torch.distributed as dist

from elasticd import logs
from elasticd.cluster.kv import BadCounter, Unreachable, counts

log = logs.get("elasticd.tcpstore")

# compare_set's expected value for "read, do not write": random per process, so that no one
# writing to the store can make a key that exists read as absent (TCPStore answers a compare_set
# of a missing key with the expected value)
_ABSENT = b"\x00elasticd-absent-" + secrets.token_hex(16).encode() + b"\x00"


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(4096)
    except OSError:
        s.close()
        raise
    return s


def serve_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A TCPStore server listening on host:port only; the store owns (and closes) the socket."""
    listener = bind_listener(host, port)
    bound = listener.getsockname()[1]
    return dist.TCPStore(
        host,
        bound,
        None,
        True,
        td(timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def tcp_connector(host: str, port: int):
    """How TCPStoreKV connects: a plain connect first, so that a refused one is known at once
    (TCPStore's own client retries a refused connect until its timeout), then the store client."""

    def connect(timeout: float) -> dist.TCPStore:
        socket.create_connection((host, port), timeout=min(timeout, 2.0)).close()
        return dist.TCPStore(host, port, None, False, td(timeout))

    return connect


def bound_replies(store: dist.TCPStore, seconds: float) -> bool:
    """Make every reply the store client waits for time out after `seconds`: TCPStore's own
    timeout bounds `wait` and `get` of a missing key, but a compare_set, add or check sent to a
    store that stopped answering (its host cut off, or its process stopped) waits forever. The
    client's socket gets SO_RCVTIMEO / SO_SNDTIMEO, so such a call raises "Socket Timeout".
    torch exposes the socket only in the client's repr (`SocketImpl(fd=N, ...)`); if that ever
    changes, calls stay unbounded and this says so once (False)."""
    found = re.search(r"SocketImpl\(fd=(\d+)", repr(store))
    if not found:
        if not _warned:
            _warned.append(True)
            log.warning("store_replies_unbounded", why="no socket in the TCPStore client's repr")
        return False
    fd = int(found.group(1))
    with socket.socket(
        fileno=os.dup(fd)
    ) as s:  # the same socket: options apply to it, not to the fd
        timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    return True


_warned: list[bool] = []


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _refused(e: BaseException) -> bool:
    return "refused" in str(e).lower() or isinstance(e, ConnectionRefusedError)


class TCPStoreKV:
    """KV over a c10d TCPStore client connection, made by `connect(timeout)`. A call that fails
    drops the connection (a reply may still be on its way and must never answer the next call);
    the next call makes a new one."""

    def __init__(self, connect: Callable[[float], dist.TCPStore], endpoint: str, timeout: float):
        self._connect = connect
        self.endpoint = endpoint
        self.timeout = timeout
        self.store: dist.TCPStore | None = None
        self._connecting: threading.Thread | None = None
        # connections made: one kept since a node last saw the store's host answer is the same
        # store, in the same host's daemon (cluster/run.py: `followed`)
        self.connections = 0

    def _client(self) -> dist.TCPStore:
        if self.store is None:
            self.store = self._bounded_connect()
            self.connections += 1
        return self.store

    def _bounded_connect(self) -> dist.TCPStore:
        """Connect on a helper thread, waited for `timeout`: TCPStore's own client waits without
        end for the reply to its handshake from a host whose kernel accepts connections while
        the store does not answer (a stopped or wedged process). A connect still stuck there is
        not repeated: at most one helper thread is ever left waiting."""
        if self._connecting is not None and self._connecting.is_alive():
            raise Unreachable(
                f"store {self.endpoint}: the previous connection attempt still waits for a reply"
            )
        box: dict = {}

        def connect() -> None:
            try:
                box["store"] = self._connect(self.timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        helper = threading.Thread(target=connect, name="elasticd-store-connect", daemon=True)
        helper.start()
        helper.join(self.timeout + 1.0)
        if helper.is_alive():
            self._connecting = helper
            raise Unreachable(
                f"store {self.endpoint}: no reply to the connection within {self.timeout:g}s"
            )
        if "error" in box:
            e = box["error"]
            raise Unreachable(f"store {self.endpoint}: {_first_line(e)}", _refused(e)) from None
        store = box["store"]
        bound_replies(store, self.timeout + 1.0)
        return store

    def _call(self, name: str, *args):
        store = self._client()
        try:
            return getattr(store, name)(*args)
        except (dist.DistError, RuntimeError, TimeoutError, OSError) as e:
            self.store = None
            raise Unreachable(f"store {self.endpoint}: {_first_line(e)}", _refused(e)) from None

    def set(self, key: str, value: bytes) -> None:
        """Then one round trip: c10d's set has no reply, so without it a read on another
        connection right after could still miss the value, and a store that stopped answering
        would go unnoticed."""
        self._call("set", key, value)
        self._call("check", [key])

    def get(self, key: str) -> bytes | None:
        found = self._call("compare_set", key, _ABSENT, _ABSENT)
        return None if found == _ABSENT else found

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists: a read that touches no key (a compare_set read of a missing
        key wakes the clients waiting on it: the traps in docs/architecture.md), for a store the
        workers wait on (daemon/inplace.py)."""
        return bool(self._call("check", keys))

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        if keys and self._call("check", keys):
            return list(self._call("multi_get", keys))
        return [self.get(k) for k in keys]

    def take(self, key: str) -> int:
        # read first: an add on a value that is no number sometimes holds its reply ~5 s before
        # the server drops the connection (torch 2.13's libuv store), longer than a join may wait
        self._counting(key)
        return self._add(key, 1)

    def taken(self, key: str) -> int:
        """(A read, not an add of 0: see take.)"""
        return self._counting(key)

    def _counting(self, key: str) -> int:
        raw = self.get(key)
        if raw is None:
            return 0
        if not counts(raw):
            raise BadCounter(key, raw)
        return int(raw)

    def _add(self, key: str, amount: int) -> int:
        """TCPStore's add on a key that holds no number drops the connection (the server's stoll
        fails): told apart from an unreachable store by reading the key, which then answers."""
        try:
            return int(self._call("add", key, amount))
        except Unreachable:
            raw = self.get(key)  # an Unreachable here: the store really does not answer
            if raw is None or counts(raw):
                raise
            raise BadCounter(key, raw) from None

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        # TCPStore's empty expected value means "absent or empty": both are garbage to replace
        return self._call("compare_set", key, expected or b"", desired) == desired

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self._call("list_keys") if k.startswith(prefix)]

    def wait(self, key: str, timeout: float) -> bool:
        """(At most `self.timeout` at a time: the connection's own bound on a reply.)"""
        store = self._client()
        try:
            store.wait([key], td(min(max(timeout, 0.001), self.timeout)))
            return True
        except (dist.DistError, RuntimeError, OSError) as e:
            if isinstance(e, dist.DistStoreError) and "time" in str(e).lower():
                return False  # the key did not come: the connection is fine
            self.store = None
            raise Unreachable(f"store {self.endpoint}: {_first_line(e)}", _refused(e)) from None

    def clone(self) -> TCPStoreKV:
        return TCPStoreKV(self._connect, self.endpoint, self.timeout)

    def close(self) -> None:
        self.store = None  # dropping the last reference closes the connection
