"""The control plane's key-value store: the few operations elasticd's rendezvous, liveness,
restart and exit-barrier protocol (rendezvous.py) needs, over a c10d TCPStore (tcpstore.py, the
default for several nodes), an etcd cluster (etcd/) or, for a single-node job, a dict in the
daemon (`LocalKV`: nothing listens, so no other process can touch the job's control plane). This
module imports no torch: only tcpstore.py does.

Every call is bounded: a store that does not answer within the timeout raises `Unreachable`
(one line naming the endpoint), never a C++ stack or a hang. A store connection serves one call
at a time, so a thread that blocks in `wait` uses its own connection (`clone`).

The operations (`KV`): set, get without blocking, multi_get, take / taken of a numbered roll,
compare_set against any raw value, the keys under a prefix, wait, clone. `Unreachable.refused`
says the store is gone for good (its host refused the connection), and `BadCounter` is a counter
someone wrote a non-number over.
"""

from __future__ import annotations

import threading
from typing import Protocol


class Unreachable(Exception):
    """The store did not answer within the call's timeout, or its connection failed. `refused`:
    its host answered that nothing listens there now (a c10d store whose daemon is down: it comes
    back, if at all, as a fresh store without the job's keys), as opposed to silence (a
    partition, a lost quorum)."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class BadCounter(Exception):
    """A counter's key holds something that is not a number (someone else wrote it): the store
    answered, and `raw` is what sits there, for the caller to replace."""

    def __init__(self, key: str, raw: bytes):
        super().__init__(f"counter {key} holds a value that is not a number")
        self.key, self.raw = key, raw


def counts(raw: bytes) -> bool:
    """Whether TCPStore's add can count on from this value: a 64-bit integer (its stoll)."""
    try:
        return -(1 << 63) <= int(raw) < (1 << 62)
    except ValueError:
        return False


class KV(Protocol):
    endpoint: str

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None:
        """The value, or None when the key does not exist (never blocks for it)."""

    def multi_get(self, keys: list[str]) -> list[bytes | None]: ...

    def take(self, key: str) -> int:
        """The next number of the roll at `key` (1, 2, ...), no other call's: at least once (a
        reply lost and the call sent again skips a number). Contention-free on every store: N
        nodes take N numbers with N requests. `BadCounter` when the key holds no number."""

    def taken(self, key: str) -> int:
        """How many numbers of the roll at `key` were taken (0: none), without taking one."""

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Set `desired` if the key holds `expected` (None: the key is absent); True if it did.
        `expected` is the raw value a caller read, whatever it is: b"" (written by someone else)
        is a value like any other (on a TCPStore, absent or empty: both are garbage to replace)."""

    def keys(self, prefix: str) -> list[str]:
        """The keys that begin with `prefix`: for finding records when a counter that numbers
        them cannot be trusted (someone raised it); not for every call (on a TCPStore it lists
        the whole store)."""

    def wait(self, key: str, timeout: float) -> bool:
        """Block until the key exists (True) or `timeout` seconds pass (False)."""

    def clone(self) -> KV:
        """A second connection to the same store, for a thread that blocks in `wait`."""

    def close(self) -> None: ...


class LocalKV:
    """The KV of a single-node job: a dict and a condition variable in the daemon. No socket, so
    no other process (another local user included) can read, fill or steer the control plane;
    a clone shares the dict (the liveness thread and the restart waiter see the loop's writes)."""

    endpoint = "in-process"
    timeout = 1.0

    def __init__(self, _shared: tuple[dict[str, bytes], threading.Condition] | None = None) -> None:
        self._data, self._cond = _shared or ({}, threading.Condition())

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes | None:
        with self._cond:
            return self._data.get(key)

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        with self._cond:
            return [self._data.get(k) for k in keys]

    def _add(self, key: str, amount: int) -> int:
        with self._cond:
            raw = self._data.get(key, b"0")
            if not counts(raw):  # as TCPStore (only the fuzz tests write there)
                raise BadCounter(key, raw)
            value = int(raw) + amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def take(self, key: str) -> int:
        return self._add(key, 1)

    def taken(self, key: str) -> int:
        return self._add(key, 0)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        with self._cond:
            if self._data.get(key) != expected:
                return False
            self._data[key] = bytes(desired)
            self._cond.notify_all()
            return True

    def keys(self, prefix: str) -> list[str]:
        with self._cond:
            return [k for k in self._data if k.startswith(prefix)]

    def wait(self, key: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: key in self._data, timeout=max(timeout, 0.0))

    def clone(self) -> LocalKV:
        return LocalKV((self._data, self._cond))

    def close(self) -> None:
        pass
