"""The control plane's key-value store: the few operations elasticd's rendezvous, liveness,
restart and exit-barrier protocol (rounds.py) needs, over a c10d TCPStore (the default) or an
etcd cluster (etcd.py).

Every call is bounded: a store that does not answer within the timeout raises `Unreachable`
(one line naming the endpoint), never a C++ stack or a hang. A store connection serves one call
at a time, so a thread that blocks in `wait` uses its own connection (`clone`).
"""

from __future__ import annotations

import datetime
from typing import Protocol

import torch.distributed as dist

_ABSENT = b"\x00elasticd-absent\x00"  # compare_set's expected value for "read, do not write"


class Unreachable(Exception):
    """The store did not answer within the call's timeout, or its connection failed."""


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


class TCPStoreKV:
    """KV over a c10d TCPStore client (or the server's own handle on the host node)."""

    def __init__(self, store: dist.TCPStore, endpoint: str, timeout: float):
        self.store = store
        self.endpoint = endpoint
        self.timeout = timeout
        store.set_timeout(_td(timeout))

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except (dist.DistError, RuntimeError, TimeoutError, OSError) as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise Unreachable(f"store {self.endpoint}: {first}") from None

    def set(self, key: str, value: bytes) -> None:
        self._call(self.store.set, key, value)
        # c10d's SET has no reply: without a round trip on this connection (served in order), a read
        # on another connection right after could still miss the value (18% of 5000 tries did).
        self._call(self.store.check, [key])

    def get(self, key: str) -> bytes | None:
        found = self._call(self.store.compare_set, key, _ABSENT, _ABSENT)
        return None if found == _ABSENT else found

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        if keys and self._call(self.store.check, keys):
            return list(self._call(self.store.multi_get, keys))
        return [self.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self.store.add, key, amount))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        if expected is not None and expected in (b"", _ABSENT):
            raise ValueError("expected value may not be empty")
        found = self._call(self.store.compare_set, key, b"" if expected is None else expected, desired)
        return found == desired

    def wait(self, key: str, timeout: float) -> bool:
        try:
            self.store.wait([key], _td(max(timeout, 0.001)))
            return True
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return False
            raise Unreachable(f"store {self.endpoint}: {str(e).strip().splitlines()[0][:200]}") from None
        except (dist.DistError, RuntimeError, OSError) as e:
            raise Unreachable(f"store {self.endpoint}: {str(e).strip().splitlines()[0][:200]}") from None

    def clone(self) -> TCPStoreKV:
        return TCPStoreKV(self._call(self.store.clone), self.endpoint, self.timeout)

    def close(self) -> None:
        self.store = None  # dropping the last reference closes the connection
