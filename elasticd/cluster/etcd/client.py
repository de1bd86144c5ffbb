"""`EtcdKV`: the control plane's key-value operations (kv.KV) on an etcd cluster, each one POST
to the member in use, failing over across the endpoints until the call's deadline (see the
package's description).

`take` is one put returning the key's previous version (no retries under contention),
`compare_set` a transaction, `wait` a read then a watch from its revision. When the deadline
passes, `Unreachable` names every endpoint; a member that answers no (auth, permission) is
`Refused`. It logs in per member. A reply that cannot be read is that member's failed attempt
(failover; logged once a minute per member), never another exception; `close()` shuts a call in
progress down at once.
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import ssl
import threading
import time
from collections.abc import Sequence

from elasticd import logs
from elasticd.cluster import kv
from elasticd.cluster.etcd import reply, watch, wire
from elasticd.cluster.etcd.connections import Connections
from elasticd.cluster.etcd.endpoints import parse_endpoints, tls_context
from elasticd.cluster.etcd.errors import (
    Failed,
    Misconfigured,
    NoAnswer,
    Refused,
    cause_of,
    one_line,
)

log = logs.get("elasticd.etcd")

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
MAX_KEYS = (
    100_000  # keys one listing returns at most (a round has one per node; more is a forger's)
)
# Seconds one member gets to answer one request before the call tries the next endpoint (a share
# of the call's timeout when that is shorter, so every member gets a turn). A healthy member
# answers in milliseconds. Well under the liveness rule's 1.25 s of silence (LOST_SILENCE): a
# member cut off mid-request costs a node's beats half a second, so its peers never take it for
# lost (at 2 s they did, with a partitioned member). A follower whose leader just died holds a
# request until a new leader is elected (about a second): the call goes round the members until
# one answers, within its deadline, the time doubling with each round of attempts that timed out
# (an overloaded cluster). Quick refusals ("no leader", a refused connection) double nothing: an
# election gives dozens of them, and a doubled time then let one member still catching up hold
# a request for the call's whole deadline (a node's beats stalled that long, it was taken for
# lost).
ATTEMPT_TIMEOUT = 0.5
_BACKOFF = (0.05, 0.5)  # after every endpoint failed once: first pause, longest pause
REJECTED_EVERY = 60.0  # seconds between two log lines about one member's unreadable replies
_HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-Hasleader": "true"}
# Answers that mean the member did not take the request in (safe to send again anywhere).
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: too many requests", "etcdserver: not capable")


_REJECTIONS = logs.Throttle(REJECTED_EVERY)


class EtcdKV:
    """kv.KV on an etcd cluster (see the package's description). The constructor does no I/O."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout: float,
        *,
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        _tls: ssl.SSLContext | None = None,
    ):
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"etcd timeout must be a positive number of seconds, not {timeout!r}")
        if (user is None) != (password is None):
            raise ValueError("etcd: a user needs a password and a password a user")
        want_tls = bool(cacert or cert or key) or _tls is not None
        self.endpoints = parse_endpoints(endpoints, tls=want_tls)
        self.endpoint = ",".join(str(e) for e in self.endpoints)
        self.timeout = float(timeout)
        self._tls = _tls
        if self._tls is None and (want_tls or any(e.scheme == "https" for e in self.endpoints)):
            self._tls = tls_context(cacert, cert, key)
        self._user, self._password = user, password
        # endpoint index -> auth token (simple tokens are per member)
        self._tokens: dict[int, str] = {}
        self._pool = Connections(self.endpoints, self._tls)  # a kept-alive one per endpoint
        self._current = 0
        self._streams = watch.Streams()  # wait's open watch per thread, between slices
        self._lock = threading.Lock()  # one call at a time
        # A member gets this long to answer before the call moves on (when there are others): a
        # stalled member, or a follower holding a request for a leader that just died, must not
        # eat the time a healthy one needs.
        n = len(self.endpoints)
        self._attempt_cap = (
            self.timeout if n == 1 else min(ATTEMPT_TIMEOUT, max(self.timeout / n, 0.25))
        )

    # --- the KV operations -------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": wire.b64(key), "value": wire.b64(value)}, wire.header)

    def get(self, key: str) -> bytes | None:
        return self._range(key)[0]

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i : i + MAX_TXN_OPS]
            values, _ = self._call(
                "/v3/kv/txn",
                {"success": [{"request_range": {"key": wire.b64(k)}} for k in chunk]},
                functools.partial(wire.reads, len(chunk)),
            )
            out.extend(values)
        return out

    def take(self, key: str) -> int:
        # The roll is the key's version, which etcd raises by one at every put: one put that
        # returns the version before it is an atomic fetch-and-add with nothing to retry (a
        # compare-and-swap of a value made N nodes arriving together cost O(N^2) requests).
        version, _ = self._call(
            "/v3/kv/put", {"key": wire.b64(key), "value": "", "prev_kv": True}, wire.prev_version
        )
        return version + 1

    def taken(self, key: str) -> int:
        return self._call("/v3/kv/range", {"key": wire.b64(key)}, wire.version)[0]

    def keys(self, prefix: str) -> list[str]:
        end = prefix.encode()[:-1] + bytes(
            [prefix.encode()[-1] + 1]
        )  # every key with the prefix: etcd's range end
        return self._call(
            "/v3/kv/range",
            {
                "key": wire.b64(prefix),
                "range_end": wire.b64(end),
                "keys_only": True,
                "limit": MAX_KEYS,
            },
            wire.keys,
        )[0]

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        # b"" (someone's empty value) is compared as the value it is: absent is None
        k = wire.b64(key)
        compare = (
            {"target": "CREATE", "key": k, "create_revision": "0", "result": "EQUAL"}
            if expected is None
            else {"target": "VALUE", "key": k, "value": wire.b64(expected), "result": "EQUAL"}
        )
        (succeeded, value), lost_reply = self._call(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": {"key": k, "value": wire.b64(desired)}}],
                "failure": [{"request_range": {"key": k}}],
            },
            wire.txn_outcome,
        )
        # an earlier attempt may have set it: then the key holding `desired` says it did
        return succeeded or (lost_reply and value == desired)

    def wait(self, key: str, timeout: float) -> bool:
        # A caller waits on one key in slices (stop flags are looked at between them): the watch
        # stays open from one slice to the next until it is due for renewal, so a waiter costs
        # the cluster one read and one watch per WATCH_RENEW, not per slice. Each thread has its own
        # (a waiter of the next round may start before the last one has left).
        deadline = time.monotonic() + max(float(timeout), 0.0)
        while True:
            st = self._streams.mine()
            if st is not None and (st.key != key or time.monotonic() >= st.renew_at):
                self._streams.end(st)
                st = None
            if st is None:
                value, _, revision = self._range(key)
                if value is not None:
                    return True
                if deadline - time.monotonic() <= 0:
                    return False
            try:
                if st is None:
                    st = self._watch(key, revision + 1, deadline)
                    if st is None:
                        return False
                    self._streams.keep(st)
                if watch.next_put(st, min(deadline, st.renew_at), self._attempt_cap):
                    self._streams.end(st)
                    return True
            except Failed as f:
                if st is not None:
                    self._streams.end(st)
                with self._lock:
                    if f.cause == "reply":
                        self._rejected(self._current, f.reason)
                    self._pool.drop(self._current)
                    self._current = (self._current + 1) % len(self.endpoints)
                self._pool.closing.wait(min(_BACKOFF[0], max(deadline - time.monotonic(), 0)))
                continue
            if time.monotonic() >= deadline:
                return False  # the stream stays open for this thread's next slice

    def clone(self) -> EtcdKV:
        c = EtcdKV(
            [e.url for e in self.endpoints],
            self.timeout,
            user=self._user,
            password=self._password,
            _tls=self._tls,
        )
        c._tokens = dict(self._tokens)
        c._current = self._current
        return c

    def close(self) -> None:
        """End every connection now, without waiting for a call in progress on another thread:
        its socket is shut down, so that call fails at once ("closed") instead of waiting for a
        member that trickles or stalls (a daemon told to stop exits promptly). The thread that
        owns a socket closes it (closing it under a reader could hand its number to a new file)."""
        self._pool.shut_all()
        self._streams.close_all()
        if self._lock.acquire(blocking=False):  # no call in progress: nobody else will close them
            try:
                self._pool.drop_all()
            finally:
                self._lock.release()

    def status(self, timeout: float | None = None, fail_fast: bool = False) -> dict:
        """The member in use's status (version, leader, revision): a cheap check that the cluster
        answers with a leader, and that the user authenticates (`timeout`: the call's, when not
        the store's; `fail_fast`: Misconfigured once every endpoint failed for good)."""
        return self._call(
            "/v3/maintenance/status", {}, wire.status, timeout=timeout, fail_fast=fail_fast
        )[0]

    # --- requests, failover -------------------------------------------------------------------

    def _range(self, key: str) -> tuple[bytes | None, int, int]:
        """(value or None, the key's mod_revision (0 when absent), the store's revision)."""
        return self._call("/v3/kv/range", {"key": wire.b64(key)}, wire.range_reply)[0]

    def _call(
        self,
        path: str,
        body: dict,
        decode,
        *,
        timeout: float | None = None,
        fail_fast: bool = False,
    ):
        """POST to the member in use, failing over until the deadline. Returns `decode(reply)` and
        whether an earlier attempt failed after the request may have reached etcd. A reply that
        `decode` cannot read (any exception) is that member's failed attempt."""
        data = json.dumps(body).encode()
        with self._lock:
            timeout = self.timeout if timeout is None else timeout
            deadline = time.monotonic() + timeout
            errors: dict[int, Failed] = {}  # endpoint index -> its last failure
            lost_reply = False
            failures = 0
            slow = 0  # attempts that timed out
            reauthed: set[int] = set()
            while True:
                if self._pool.closing.is_set():
                    self._pool.drop_all()
                    raise kv.Unreachable(f"etcd {self.endpoint}: this connection was closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoAnswer(
                        f"etcd {self.endpoint}: no answer within {timeout:g} s "
                        f"({self._summary(errors)})",
                        frozenset(f.cause for f in errors.values()),
                    )
                i = self._current
                # each round of timed-out attempts doubles a member's time: a member cut off
                # costs half a second, while a cluster that is only slow (overloaded) is not sent
                # every request again and again at half-second intervals
                cap = self._attempt_cap * 2 ** (slow // len(self.endpoints))
                try:
                    reply = self._attempt(i, path, data, time.monotonic() + min(left, cap))
                    return wire.decoded(decode, reply), lost_reply
                except Failed as f:
                    errors[i] = f
                    lost_reply |= f.applied_maybe
                    slow += f.cause == "timeout"
                    self._pool.drop(i)
                    if f.cause == "reply":
                        self._rejected(i, f.reason)
                    if f.reauth:
                        self._tokens.pop(i, None)
                        if (
                            i not in reauthed
                        ):  # a token the member no longer knows: log in again, same member
                            reauthed.add(i)
                            continue
                        raise Refused(f"etcd {self.endpoints[i]}: {f.reason}") from None
                    if (
                        fail_fast
                        and len(errors) == len(self.endpoints)
                        and all(e.lasting for e in errors.values())
                    ):
                        causes = frozenset(e.cause for e in errors.values())
                        raise Misconfigured(self._summary(errors), causes) from None
                    self._current = (i + 1) % len(self.endpoints)
                    failures += 1
                    if (
                        failures % len(self.endpoints) == 0
                    ):  # every endpoint failed once more: pause
                        pause = min(
                            _BACKOFF[0] * 2 ** (failures // len(self.endpoints) - 1), _BACKOFF[1]
                        )
                        self._pool.closing.wait(max(min(pause, deadline - time.monotonic()), 0))

    def _attempt(self, i: int, path: str, data: bytes, end: float) -> dict:
        """One request to endpoint i (logging in first where needed), answered by `end`."""
        headers = dict(_HEADERS)
        if self._user is not None:
            if i not in self._tokens:
                reply = self._post(
                    i,
                    "/v3/auth/authenticate",
                    json.dumps({"name": self._user, "password": self._password}).encode(),
                    end,
                    headers,
                    authenticating=True,
                )
                self._tokens[i] = wire.decoded(wire.token, reply)
            headers["Authorization"] = self._tokens[i]
        return self._post(i, path, data, end, headers)

    def _post(
        self,
        i: int,
        path: str,
        data: bytes,
        end: float,
        headers: dict,
        authenticating: bool = False,
    ) -> dict:
        if end <= time.monotonic():
            raise Failed("timed out", applied_maybe=False, cause="timeout")
        conn = self._pool.get(i, end)
        try:
            conn.sock.settimeout(reply.left(end))  # sending: sendall's timeout bounds it in total
            conn.response_class = functools.partial(reply.response, deadline=end)
            conn.request("POST", path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = reply.body(resp)
        except Exception as e:  # noqa: BLE001 - whatever the member sends or does: a failed attempt
            raise Failed(one_line(e), applied_maybe=True, cause=cause_of(e)) from None
        if resp.will_close:
            self._pool.drop(i)
        return self._judge(i, resp, raw, authenticating)

    def _judge(
        self, i: int, resp: http.client.HTTPResponse, raw: bytes, authenticating: bool
    ) -> dict:
        """The reply of a 200 that is a JSON object; else the failure its status and error say."""
        try:
            reply = wire.parse(raw) if raw else {}
        except Exception:  # noqa: BLE001 - not JSON (or too much of it): judged by its status below
            reply = None
        if resp.status == 200:
            if isinstance(reply, dict):
                return reply
            raise Failed("a reply that is not a JSON object", applied_maybe=True, cause="reply")
        message = wire.error_text(reply) or f"HTTP {resp.status} {one_line(resp.reason)}"
        code = reply.get("code") if isinstance(reply, dict) else None
        if (
            resp.status == 401 or code == 16
        ):  # Unauthenticated: the token expired or the member restarted
            if authenticating or self._user is None:
                raise Refused(f"etcd {self.endpoints[i]}: {message}")
            raise Failed(message, applied_maybe=False, reauth=True)
        if any(m in message for m in _NOT_APPLIED):
            raise Failed(
                message, applied_maybe=False, cause="leader" if "leader" in message else "other"
            )
        if resp.status >= 500 or resp.status in (408, 429) or code in (4, 8, 10, 13, 14):
            raise Failed(message, applied_maybe=True)
        raise Refused(f"etcd {self.endpoints[i]}: {message}")

    def _summary(self, errors: dict[int, Failed]) -> str:
        """Every endpoint's last error, on one line."""
        return (
            "; ".join(f"{self.endpoints[i]}: {f.reason}" for i, f in errors.items())
            or "no attempt finished"
        )

    def _rejected(self, i: int, why: str) -> None:
        """Log a member's reply that could not be read: once a minute per member at most (one
        that sends garbage to every request must not write a line per request)."""
        held = _REJECTIONS(str(self.endpoints[i]))
        if held is not None:
            log.warning(
                "etcd_reply_rejected", endpoint=str(self.endpoints[i]), why=why, held_back=held
            )

    # --- wait ------------------------------------------------------------------------------

    def _watch(self, key: str, start_revision: int, deadline: float) -> watch.Stream | None:
        """A watch of `key` from `start_revision` on the member in use, on a connection of its
        own (watch.start); None when `deadline` passed before the member took it."""
        with self._lock:
            i = self._current
            ep = self.endpoints[i]
            headers = dict(_HEADERS)
            if self._user is not None and i in self._tokens:
                headers["Authorization"] = self._tokens[i]
        # the member gets one attempt's time to take the watch (a cut-off one is left as a call
        # would leave it); the stream then runs until it is due for renewal
        patience = max(min(deadline - time.monotonic(), self._attempt_cap), 0.001)
        taken_by = time.monotonic() + patience
        conn = self._pool.new(ep, taken_by)
        return watch.start(conn, key, start_revision, headers, taken_by, patience, deadline)
