"""The control plane's key-value store: the few operations elasticd's rendezvous, liveness,
restart and exit-barrier protocol (rounds.py) needs, over a c10d TCPStore (the default) or an
etcd cluster (etcd.py).

Every call is bounded: a store that does not answer within the timeout raises `Unreachable`
(one line naming the endpoint), never a C++ stack or a hang. A store connection serves one call
at a time, so a thread that blocks in `wait` uses its own connection (`clone`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

_ABSENT = b"\x00elasticd-absent\x00"  # compare_set's expected value for "read, do not write"


class Unreachable(Exception):
    """The store did not answer within the call's timeout, or its connection failed. `refused`:
    its host answered that nothing listens there any more (a c10d store whose daemon is gone: it
    will never come back with the job's state), as opposed to silence (a partition, a lost quorum)."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class KV(Protocol):
    endpoint: str

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None:
        """The value, or None when the key does not exist (never blocks for it)."""

    def multi_get(self, keys: list[str]) -> list[bytes | None]: ...

    def add(self, key: str, amount: int) -> int:
        """Atomically add to an integer counter (created at 0) and return the new value."""

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Set `desired` if the key holds `expected` (None: the key is absent); True if it did."""

    def wait(self, key: str, timeout: float) -> bool:
        """Block until the key exists (True) or `timeout` seconds pass (False)."""

    def clone(self) -> KV:
        """A second connection to the same store, for a thread that blocks in `wait`."""

    def close(self) -> None: ...


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


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

    def _client(self) -> dist.TCPStore:
        if self.store is None:
            try:
                self.store = self._connect(self.timeout)
            except (dist.DistError, RuntimeError, TimeoutError, OSError) as e:
                raise Unreachable(f"store {self.endpoint}: {_first_line(e)}", _refused(e)) from None
        return self.store

    def _call(self, name: str, *args):
        store = self._client()
        try:
            return getattr(store, name)(*args)
        except (dist.DistError, RuntimeError, TimeoutError, OSError) as e:
            self.store = None
            raise Unreachable(f"store {self.endpoint}: {_first_line(e)}", _refused(e)) from None

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes | None:
        found = self._call("compare_set", key, _ABSENT, _ABSENT)
        return None if found == _ABSENT else found

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        if keys and self._call("check", keys):
            return list(self._call("multi_get", keys))
        return [self.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        if expected is not None and expected in (b"", _ABSENT):
            raise ValueError("expected value may not be empty")
        return self._call("compare_set", key, b"" if expected is None else expected, desired) == desired

    def wait(self, key: str, timeout: float) -> bool:
        store = self._client()
        try:
            store.wait([key], _td(max(timeout, 0.001)))
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
