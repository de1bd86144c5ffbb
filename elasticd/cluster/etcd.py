"""The control plane's key-value store (kv.KV) on an etcd cluster, through etcd's v3 API.

etcd answers its v3 gRPC API also as JSON over HTTP/1.1 (the gRPC-JSON gateway every member
serves on its client port, etcd 3.4 to 3.6): POST /v3/kv/range, /v3/kv/put, /v3/kv/txn,
/v3/watch (a stream of JSON lines), /v3/auth/authenticate; keys and values in base64. That is all
this module speaks, with the standard library's http.client: no new dependency, and none of the
v2 API that etcd 3.6 removed (docs/multinode.md, "Rendezvous on etcd", says why not python-etcd or etcd3).

Failover. A call has one deadline (the connection's timeout). It goes to the member in use (at
first this node's own member when etcd runs beside it, else one picked at random, so that the
nodes spread over the members and one member's loss touches a share of them); when that
member cannot answer (connection refused, a dropped connection, no reply within its share of
the deadline, a 5xx, "etcdserver: no leader") the call moves to the next endpoint, round and
round with a short backoff, until the deadline passes: then `kv.Unreachable`, one line naming
every endpoint and the last error each gave. Every request carries gRPC's "hasleader" metadata,
so a member cut off from its cluster's leader (quorum lost, or partitioned away) says "no leader"
at once instead of holding the request until its own timeout. A member that answers but refuses
(bad password, no permission, a request too large) raises `Refused` (an Unreachable) at once.
Where every endpoint fails in a way that waiting cannot heal (a host name that does not resolve,
a certificate that does not verify), `connect()` raises `Misconfigured` at once instead.

A member is not trusted to be well-behaved. Its reply is read under the attempt's deadline as a
whole (status line, headers and body: a member trickling a byte at a time cannot stretch it, as
a timeout per recv would let it), at most MAX_REPLY bytes of it (a Content-Length of 10^13 or a
chunk size of -1 is refused, not read into memory), and decoded strictly (each field of the form
etcd gives it: an object, a list, digits, base64): whatever cannot be read, too deep, too large,
or not of its form, is a failed attempt on that member like a dropped connection (the call
moves on; logged at most once a minute per member), never an exception of another kind.
`close()` shuts the sockets of a call in progress on another thread down, so the call fails at
once instead of holding its thread (and a daemon told to stop) until its member lets go.

Retries and ambiguity. A request that never reached etcd (refused connection, a kept-alive
connection found closed before sending, "no leader") is simply sent again elsewhere. One whose
reply was lost after etcd may have applied it (the member died or stalled mid-request) is also
sent again: harmless for set, get, multi_get, taken and wait; `take` is then at-least-once (a
lost reply can skip a number; every number it returns is still one no other take returned), and
`compare_set` answers True if the key then holds `desired`. The c10d TCPStore's timeouts are no
better.

`take` is one put that asks for the key's previous version: the roll is the key's version,
which every put raises by one, so N nodes arriving together cost N requests, none retried.
`compare_set` is one transaction comparing the value
(or create_revision 0: absent). `wait` reads the key and, when it is absent, watches it from the
read's revision + 1, so a write between the two is not missed; the watch is renewed (read again,
watch again) every few seconds, so a member that lost its cluster silently cannot hide the key
until the deadline.

One EtcdKV serves one call at a time (a lock keeps it so); a thread that blocks in `wait` uses a
`clone()`. Keys are used exactly as given (the caller scopes them per job).
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import ipaddress
import json
import math
import random
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

from elasticd import logs
from elasticd.cluster import kv, signing

log = logs.get("elasticd.etcd")

DEFAULT_PORT = 2379
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
# one answers, within its deadline, the time doubling with each round (an overloaded cluster).
ATTEMPT_TIMEOUT = 0.5
# Seconds a watch runs before the key is read again and the watch renewed: how long a member
# that lost its cluster (or was cut off from us) without closing the stream can hide a put.
WATCH_RENEW = 2.0
_BACKOFF = (0.05, 0.5)  # after every endpoint failed once: first pause, longest pause
# Bytes of a reply a member may send: one value as large as a sealed signing.MAX_VALUE, in base64,
# and a mebibyte for the rest (JSON, header). A larger one is a failed attempt, never read whole.
MAX_REPLY = (signing.MAX_VALUE + signing.MAC_HEX + 1) * 4 // 3 + 1024 * 1024
_FRAMING = 1024 * 1024  # bytes of status line, headers and chunk sizes a reply may add
# JSON items (',' '[' '{') a reply may hold: the largest of ours, a transaction of MAX_TXN_OPS reads,
# has about 2,000; millions of tiny ones would cost gigabytes once parsed.
MAX_ITEMS = 100_000
REJECTED_EVERY = 60.0  # seconds between two log lines about one member's unreadable replies
_HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-Hasleader": "true"}
# Answers that mean the member did not take the request in (safe to send again anywhere).
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: too many requests", "etcdserver: not capable")


class Refused(kv.Unreachable):
    """The cluster answered and refused (authentication, permission, a malformed or too large
    request): sending it again, to this member or another, would not help."""

    def __init__(self, message: str):
        super().__init__(message, refused=True)


class NoAnswer(kv.Unreachable):
    """No member answered within the call's deadline. `causes`: what the endpoints' last attempts
    failed of (refused, timeout, dns, tls, leader, reply, dropped, other), for the operator's hint."""

    def __init__(self, message: str, causes: frozenset[str] = frozenset()):
        super().__init__(message)
        self.causes = causes


class Misconfigured(NoAnswer):
    """Every endpoint failed in a way that retrying cannot heal (a host name that does not
    resolve, a certificate that does not verify): connect() says so at once."""


class _Failed(Exception):
    """One attempt on one endpoint failed. `applied_maybe`: the request may have reached etcd;
    `cause`: what kind of failure (see NoAnswer); `lasting`: waiting will not heal it."""

    def __init__(
        self,
        reason: str,
        applied_maybe: bool,
        reauth: bool = False,
        cause: str = "other",
        lasting: bool = False,
    ):
        super().__init__(reason)
        self.reason = reason
        self.applied_maybe = applied_maybe
        self.reauth = reauth
        self.cause = cause
        self.lasting = lasting


@dataclass(frozen=True)
class Endpoint:
    scheme: str  # "http" or "https"
    host: str
    port: int

    def __str__(self) -> str:
        return self.url if self.scheme == "https" else self.url.removeprefix("http://")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_endpoints(text: str | Sequence[str], tls: bool = False) -> list[Endpoint]:
    """Endpoints from "h1:2379,h2:2379" (or a list), each `[scheme://]host[:port]`; the scheme is https when TLS
    options are given, http otherwise; the port 2379 when left out. ValueError when malformed."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[Endpoint] = []
    for raw in items:
        item = raw.strip()
        if not item:
            raise ValueError(f"etcd endpoints {text!r}: an empty endpoint")
        scheme = "https" if tls else "http"
        if "://" in item:
            scheme, item = item.split("://", 1)
            if scheme not in ("http", "https"):
                raise ValueError(f"etcd endpoint {raw.strip()!r}: the scheme must be http or https")
        item = item.rstrip("/")
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ("" if not rest else None)
        elif item.count(":") == 1:
            host, port_text = item.split(":")
        elif ":" in item:
            host, port_text = item, ""  # a bare IPv6 address
        else:
            host, port_text = item, ""
        if port_text is None or not host or any(c in host for c in "/?#@ "):
            raise ValueError(f"etcd endpoint {raw.strip()!r}: expected host:port")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise ValueError(f"etcd endpoint {raw.strip()!r}: the port must be a number") from None
        if not 0 < port < 65536:
            raise ValueError(f"etcd endpoint {raw.strip()!r}: the port must be 1-65535")
        out.append(Endpoint(scheme, host, port))
    if not out:
        raise ValueError("etcd endpoints: none given")
    return out


def tls_context(
    cacert: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """The TLS settings of an https endpoint: the CA bundle that signed the members' certificates
    (the system's trust store when None), and this client's certificate and key when the cluster
    asks for one (--client-cert-auth). Hostnames (or IP addresses) are checked against the
    certificates. ValueError, one line, when a file cannot be loaded."""
    if key and not cert:
        raise ValueError("etcd TLS: a client key needs its certificate (--etcd-cert)")
    try:
        ctx = ssl.create_default_context(cafile=cacert) if cacert else ssl.create_default_context()
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"etcd TLS: cannot load {cacert if cacert and not cert else cert}: {_line(e)}"
        ) from None
    return ctx


def connect(
    endpoints: str,
    timeout: float,
    *,
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    user: str | None = None,
    password: str | None = None,
    password_file: str | None = None,
    check_timeout: float | None = None,
) -> EtcdKV:
    """An EtcdKV on the cluster at `endpoints` ("h1:2379,h2:2379,h3:2379"), checked: a member
    answers with a leader (and the user authenticates) within `check_timeout` (default: `timeout`),
    else NoAnswer (Refused for bad credentials; Misconfigured, at once, when no endpoint can ever
    answer: names that do not resolve, certificates that do not verify); ValueError for malformed
    endpoints or options, or TLS files that cannot be loaded; config.ConfigError for a password
    file that breaks a secret file's rules (signing.read_private). `timeout` then bounds every
    call of the returned store. TLS (https) is used when any of cacert / cert / key is given or
    an endpoint says https://."""
    if password_file is not None:
        if password is not None:
            raise ValueError("etcd: give a password or a password file, not both")
        password = signing.load_password(password_file)
    store = EtcdKV(
        endpoints, timeout, cacert=cacert, cert=cert, key=key, user=user, password=password
    )
    store._current = preferred_endpoint(store.endpoints)
    try:
        store.status(timeout=check_timeout, fail_fast=True)
    except BaseException:
        store.close()
        raise
    return store


def preferred_endpoint(endpoints: Sequence[Endpoint]) -> int:
    """The member to talk to first: the first one on this machine (etcd run beside the node: its
    own member fails only with the node, and a partition that cuts a member off cuts off only
    that member's node), else one at random (the nodes spread over the members)."""
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    for i, ep in enumerate(endpoints):
        if _addresses(ep.host) & mine:
            return i
    return random.randrange(len(endpoints))


def _addresses(host: str) -> set[str]:
    """host's addresses (an IP literal as it is, a name as the resolver gives it; none if it cannot)."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {
            str(ai[4][0]).split("%")[0]
            for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        }
    except (OSError, UnicodeError):
        return set()


class EtcdKV:
    """kv.KV on an etcd cluster (see the module's description). The constructor does no I/O."""

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
        self._tokens: dict[
            int, str
        ] = {}  # endpoint index -> auth token (simple tokens are per member)
        self._conns: dict[
            int, http.client.HTTPConnection
        ] = {}  # changed under _conns_lock (close reads it)
        self._conns_lock = threading.Lock()
        self._current = 0
        self._streams: dict[
            threading.Thread, _Stream
        ] = {}  # wait's open watch per thread, between slices
        self._streams_lock = threading.Lock()
        self._lock = threading.Lock()  # one call at a time
        self._closing = threading.Event()
        # A member gets this long to answer before the call moves on (when there are others): a
        # stalled member, or a follower holding a request for a leader that just died, must not
        # eat the time a healthy one needs.
        n = len(self.endpoints)
        self._attempt_cap = (
            self.timeout if n == 1 else min(ATTEMPT_TIMEOUT, max(self.timeout / n, 0.25))
        )

    # --- the KV operations -------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)}, _header)

    def get(self, key: str) -> bytes | None:
        return self._range(key)[0]

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i : i + MAX_TXN_OPS]
            values, _ = self._call(
                "/v3/kv/txn",
                {"success": [{"request_range": {"key": _b64(k)}} for k in chunk]},
                functools.partial(_reads, len(chunk)),
            )
            out.extend(values)
        return out

    def take(self, key: str) -> int:
        # The roll is the key's version, which etcd raises by one at every put: one put that
        # returns the version before it is an atomic fetch-and-add with nothing to retry (a
        # compare-and-swap of a value made N nodes arriving together cost O(N^2) requests).
        version, _ = self._call(
            "/v3/kv/put", {"key": _b64(key), "value": "", "prev_kv": True}, _prev_version
        )
        return version + 1

    def taken(self, key: str) -> int:
        return self._call("/v3/kv/range", {"key": _b64(key)}, _version)[0]

    def keys(self, prefix: str) -> list[str]:
        end = prefix.encode()[:-1] + bytes(
            [prefix.encode()[-1] + 1]
        )  # every key with the prefix: etcd's range end
        return self._call(
            "/v3/kv/range",
            {"key": _b64(prefix), "range_end": _b64(end), "keys_only": True, "limit": MAX_KEYS},
            _keys,
        )[0]

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        # b"" (someone's empty value) is compared as the value it is: absent is None
        k = _b64(key)
        compare = (
            {"target": "CREATE", "key": k, "create_revision": "0", "result": "EQUAL"}
            if expected is None
            else {"target": "VALUE", "key": k, "value": _b64(expected), "result": "EQUAL"}
        )
        (succeeded, value), lost_reply = self._call(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": {"key": k, "value": _b64(desired)}}],
                "failure": [{"request_range": {"key": k}}],
            },
            _txn_outcome,
        )
        # an earlier attempt may have set it: then the key holding `desired` says it did
        return succeeded or (lost_reply and value == desired)

    def wait(self, key: str, timeout: float) -> bool:
        # A caller waits on one key in slices (stop flags are looked at between them): the watch
        # stays open from one slice to the next until it is due for renewal, so a waiter costs
        # the cluster one read and one watch per WATCH_RENEW, not per slice. Each thread has its
        # own (a waiter of the next round may start before the last one has left).
        deadline = time.monotonic() + max(float(timeout), 0.0)
        while True:
            st = self._streams.get(threading.current_thread())
            if st is not None and (st.key != key or time.monotonic() >= st.renew_at):
                self._end_stream(st)
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
                    self._keep_stream(st)
                if self._next_put(st, min(deadline, st.renew_at)):
                    self._end_stream(st)
                    return True
            except _Failed as f:
                if st is not None:
                    self._end_stream(st)
                with self._lock:
                    if f.cause == "reply":
                        self._rejected(self._current, f.reason)
                    self._drop(self._current)
                    self._current = (self._current + 1) % len(self.endpoints)
                self._closing.wait(min(_BACKOFF[0], max(deadline - time.monotonic(), 0)))
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
        with self._conns_lock:
            self._closing.set()
            conns = list(self._conns.values())
        for conn in conns:
            _shut(conn.sock)
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for thread, st in streams.items():
            if thread is threading.current_thread() or not thread.is_alive():
                st.conn.close()
            else:  # its thread may be reading it: the end of the stream wakes it, and it closes it
                _shut(st.conn.sock)
        if self._lock.acquire(blocking=False):  # no call in progress: nobody else will close them
            try:
                self._drop_all()
            finally:
                self._lock.release()

    def status(self, timeout: float | None = None, fail_fast: bool = False) -> dict:
        """The member in use's status (version, leader, revision): a cheap check that the cluster
        answers with a leader, and that the user authenticates (`timeout`: the call's, when not
        the store's; `fail_fast`: Misconfigured once every endpoint failed for good)."""
        return self._call(
            "/v3/maintenance/status", {}, _status, timeout=timeout, fail_fast=fail_fast
        )[0]

    # --- requests, failover -------------------------------------------------------------------

    def _range(self, key: str) -> tuple[bytes | None, int, int]:
        """(value or None, the key's mod_revision (0 when absent), the store's revision)."""
        return self._call("/v3/kv/range", {"key": _b64(key)}, _range_reply)[0]

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
            errors: dict[int, _Failed] = {}  # endpoint index -> its last failure
            lost_reply = False
            failures = 0
            reauthed: set[int] = set()
            while True:
                if self._closing.is_set():
                    self._drop_all()
                    raise kv.Unreachable(f"etcd {self.endpoint}: this connection was closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoAnswer(
                        f"etcd {self.endpoint}: no answer within {timeout:g} s ({self._summary(errors)})",
                        frozenset(f.cause for f in errors.values()),
                    )
                i = self._current
                # each round of failures doubles a member's time: a member cut off costs half a
                # second, while a cluster that is only slow (overloaded) is not sent every
                # request again and again at half-second intervals
                cap = self._attempt_cap * 2 ** (failures // len(self.endpoints))
                try:
                    reply = self._attempt(i, path, data, time.monotonic() + min(left, cap))
                    return _decoded(decode, reply), lost_reply
                except _Failed as f:
                    errors[i] = f
                    lost_reply |= f.applied_maybe
                    self._drop(i)
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
                        self._closing.wait(max(min(pause, deadline - time.monotonic()), 0))

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
                self._tokens[i] = _decoded(_token, reply)
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
            raise _Failed("timed out", applied_maybe=False, cause="timeout")
        conn = self._connection(i, end)
        try:
            conn.sock.settimeout(_left(end))  # sending: sendall's timeout bounds it in total
            conn.response_class = functools.partial(_response, deadline=end)
            conn.request("POST", path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = _body(resp)
        except Exception as e:  # noqa: BLE001 - whatever the member sends or does: a failed attempt
            raise _Failed(_line(e), applied_maybe=True, cause=_cause(e)) from None
        if resp.will_close:
            self._drop(i)
        return self._judge(i, resp, raw, authenticating)

    def _judge(
        self, i: int, resp: http.client.HTTPResponse, raw: bytes, authenticating: bool
    ) -> dict:
        """The reply of a 200 that is a JSON object; else the failure its status and error say."""
        try:
            reply = _parse(raw) if raw else {}
        except Exception:  # noqa: BLE001 - not JSON (or too much of it): judged by its status below
            reply = None
        if resp.status == 200:
            if isinstance(reply, dict):
                return reply
            raise _Failed("a reply that is not a JSON object", applied_maybe=True, cause="reply")
        message = _error_text(reply) or f"HTTP {resp.status} {_line(resp.reason)}"
        code = reply.get("code") if isinstance(reply, dict) else None
        if (
            resp.status == 401 or code == 16
        ):  # Unauthenticated: the token expired or the member restarted
            if authenticating or self._user is None:
                raise Refused(f"etcd {self.endpoints[i]}: {message}")
            raise _Failed(message, applied_maybe=False, reauth=True)
        if any(m in message for m in _NOT_APPLIED):
            raise _Failed(
                message, applied_maybe=False, cause="leader" if "leader" in message else "other"
            )
        if resp.status >= 500 or resp.status in (408, 429) or code in (4, 8, 10, 13, 14):
            raise _Failed(message, applied_maybe=True)
        raise Refused(f"etcd {self.endpoints[i]}: {message}")

    def _connection(self, i: int, end: float) -> http.client.HTTPConnection:
        """The kept-alive connection to endpoint i, or a new one (connected by `end`); one the
        member closed while idle (it died, or timed the connection out) is replaced before use, so
        a request is never sent into a dead connection."""
        conn = self._conns.get(i)
        if conn is not None and (conn.sock is None or _dropped(conn.sock)):
            self._drop(i)
            conn = None
        return conn if conn is not None else self._new_connection(self.endpoints[i], end, slot=i)

    def _new_connection(
        self, ep: Endpoint, end: float, slot: int | None = None
    ) -> http.client.HTTPConnection:
        """A connection to `ep`, connected (and its TLS handshake done) by `end`; `slot`: the
        endpoint index it is kept under, from before it connects (close() shuts it down there)."""
        conn = http.client.HTTPConnection(ep.host, ep.port)
        conn.auto_open = 0  # http.client never connects by itself (it would not speak TLS)
        with self._conns_lock:
            if self._closing.is_set():
                raise _Failed("this connection was closed", applied_maybe=False, cause="closed")
            if slot is not None:
                self._conns[slot] = conn
        failure: Exception = OSError(f"no address for {ep.host}")
        for family, kind, proto, _, address in _resolve(ep):
            try:
                conn.sock = socket.socket(family, kind, proto)
                if self._closing.is_set():
                    raise _Failed("this connection was closed", applied_maybe=False, cause="closed")
                conn.sock.settimeout(_left(end))
                conn.sock.connect(address)
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if ep.scheme == "https":
                    self._handshake(conn, ep, end)
                return conn
            except _Failed:
                conn.close()
                raise
            except Exception as e:  # noqa: BLE001 - the next address, else a failed attempt
                failure = e
                conn.close()
        # a TLS handshake that failed did reach the member, but no request was sent yet
        raise _Failed(_line(failure), applied_maybe=False, cause=_cause(failure))

    def _handshake(self, conn: http.client.HTTPConnection, ep: Endpoint, end: float) -> None:
        """TLS on conn's connected socket, the member's certificate verified (a failure to verify
        does not heal by waiting: the CA or the name is wrong)."""
        conn.sock = self._tls.wrap_socket(
            conn.sock, server_hostname=ep.host, do_handshake_on_connect=False
        )
        conn.sock.settimeout(_left(end))
        try:
            conn.sock.do_handshake()
        except ssl.SSLCertVerificationError as e:
            raise _Failed(
                f"TLS: {_line(e)}", applied_maybe=False, cause="tls", lasting=True
            ) from None

    def _drop(self, i: int) -> None:
        with self._conns_lock:
            conn = self._conns.pop(i, None)
        if conn is not None:
            conn.close()

    def _drop_all(self) -> None:
        for i in list(self._conns):
            self._drop(i)

    def _summary(self, errors: dict[int, _Failed]) -> str:
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

    def _watch(self, key: str, start_revision: int, deadline: float) -> _Stream | None:
        """A watch of `key` from `start_revision` on the member in use, on a connection of its
        own; None when `deadline` passed before the member took it. _Failed when the member
        cannot take it (the caller reads again elsewhere)."""
        with self._lock:
            i = self._current
            ep = self.endpoints[i]
            headers = dict(_HEADERS)
            if self._user is not None and i in self._tokens:
                headers["Authorization"] = self._tokens[i]
        # the member gets one attempt's time to take the watch (a cut-off one is left as a call
        # would leave it); the stream then runs until it is due for renewal
        start = max(min(deadline - time.monotonic(), self._attempt_cap), 0.001)
        taken_by = time.monotonic() + start
        conn = self._new_connection(ep, taken_by)
        try:
            body = {"create_request": {"key": _b64(key), "start_revision": str(start_revision)}}
            try:
                conn.sock.settimeout(_left(taken_by))
                conn.response_class = functools.partial(_response, deadline=taken_by)
                conn.request("POST", "/v3/watch", body=json.dumps(body).encode(), headers=headers)
                resp = conn.getresponse()
            except TimeoutError:
                if deadline - time.monotonic() <= 0:
                    conn.close()
                    return None
                raise _Failed(
                    f"watch: no answer within {start:g} s", applied_maybe=False, cause="timeout"
                ) from None
            except Exception as e:  # noqa: BLE001 - whatever the member sends or does: it cannot take the watch
                raise _Failed(f"watch: {_line(e)}", applied_maybe=False, cause=_cause(e)) from None
            if resp.status != 200:
                raise _Failed(
                    f"watch: HTTP {resp.status} {_line(resp.reason)}", applied_maybe=False
                )
        except BaseException:
            conn.close()
            raise
        return _Stream(key, conn, resp, time.monotonic() + WATCH_RENEW)

    def _next_put(self, st: _Stream, until: float) -> bool:
        """Read the stream until the key's first put (True) or `until` (False). _Failed when the
        member fails, closes or cancels it, or sends what cannot be read: the stream is then
        given up and the key read again, so nothing half-read can hide a put. The waiting is
        select's: a read begins only once bytes are there, and what has begun to arrive must
        come whole within one attempt's time, at most MAX_REPLY bytes of it (a socket file
        cannot be read again after a timeout, and http.client's chunked reader blocks for the
        next chunk at the end of each one)."""
        sock = st.conn.sock
        while True:
            if _put_in(st, until + self._attempt_cap):
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            try:
                reader = st.resp.fp.raw
                reader.limit(time.monotonic() + self._attempt_cap)
                sock.settimeout(0.0)
                try:
                    waiting = st.resp.fp.peek(
                        1
                    )  # bytes an earlier read took in, or any that came since
                except ssl.SSLWantReadError:  # TLS: nothing to decrypt yet (plain sockets give b"")
                    waiting = b""
                if not waiting and not select.select([sock], [], [], left)[0]:
                    return False
                sock.settimeout(self._attempt_cap)
                reader.limit(time.monotonic() + self._attempt_cap)
                st.pending += _payload(st.resp)
            except _Failed:
                raise
            except Exception as e:  # noqa: BLE001 - whatever the member sends or does: the stream is given up
                raise _Failed(f"watch: {_line(e)}", applied_maybe=False, cause=_cause(e)) from None
            if len(st.pending) > MAX_REPLY:
                raise _Failed(
                    f"watch: a message of more than {MAX_REPLY} bytes",
                    applied_maybe=False,
                    cause="reply",
                )

    def _keep_stream(self, st: _Stream) -> None:
        """Keep this thread's stream for its next slice; the streams of threads that have ended
        are closed here."""
        with self._streams_lock:
            for thread in [t for t in self._streams if not t.is_alive()]:
                self._streams.pop(thread).conn.close()
            self._streams[threading.current_thread()] = st

    def _end_stream(self, st: _Stream) -> None:
        with self._streams_lock:
            if self._streams.get(threading.current_thread()) is st:
                del self._streams[threading.current_thread()]
        st.conn.close()


@dataclass
class _Stream:
    """An open watch: its key, connection, streamed reply, when it is read afresh, and the
    bytes of a message not yet whole."""

    key: str
    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    renew_at: float
    pending: bytearray = field(default_factory=bytearray)


def _put_in(st: _Stream, end: float) -> bool:
    """Whether a whole message among the stream's pending bytes reports a put of the key (the
    messages read are dropped); _Failed for one that cannot be read, or when reading them
    takes past `end` (a member may send a flood of them)."""
    start = 0
    try:
        while (newline := st.pending.find(b"\n", start)) >= 0:
            line, start = bytes(st.pending[start:newline]), newline + 1
            if line.strip() and _is_put(line):
                return True
            if time.monotonic() > end:
                raise _Failed(
                    "watch: more messages than can be read in time",
                    applied_maybe=False,
                    cause="reply",
                )
        return False
    finally:
        del st.pending[:start]


_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


def _payload(resp: http.client.HTTPResponse) -> bytes:
    """The next piece of a streamed reply's body: one chunk (chunked), or what has come."""
    fp = resp.fp
    if not resp.chunked:
        data = fp.read1(65536)
    else:
        text = fp.readline(256).split(b";")[0].strip() or b"0"
        if not _CHUNK_SIZE.fullmatch(text) or int(text, 16) > MAX_REPLY:
            raise ValueError(f"a chunk size of {text[:20]!r}")
        size = int(text, 16)
        data = fp.read(size) if size else b""
        if len(data) < size or (size and fp.read(2) != b"\r\n"):
            raise ValueError("a chunk cut short")
    if not data:
        raise _Failed("watch: the member closed the stream", applied_maybe=False, cause="dropped")
    return data


def _is_put(line: bytes) -> bool:
    """Whether one message of a watch stream reports a put of the key; _Failed for an error, a
    cancelled or compacted watch, or what is not a message of that form."""
    try:
        msg = _obj(_parse(line), "a watch message")
        if "error" in msg:
            raise _Failed(f"watch: {_error_text(msg)}", applied_maybe=False)
        result = _obj(msg.get("result") or {}, "a watch result")
        if any(
            _obj(event, "an event").get("type", "PUT") == "PUT" for event in _list(result, "events")
        ):
            return True
        if _field(result, "canceled") or _field(result, "compact_revision"):
            why = _line(_field(result, "cancel_reason") or "compacted")
            raise _Failed(f"watch canceled: {why}", applied_maybe=False)
        return False
    except _Failed:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the line held: the stream is given up
        raise _Failed(
            f"watch: a message that is not etcd's ({_line(e)})", applied_maybe=False, cause="reply"
        ) from None


# --- reading a member's reply ------------------------------------------------------------------


class _Reader(io.RawIOBase):
    """A socket's bytes as http.client reads a reply, bounded: each read waits only for what is
    left of one deadline (a member trickling a byte at a time cannot stretch the reply past it,
    as it could a timeout per recv), and no more than a reply's bytes come through (a chunk size
    of -1 or a Content-Length of 10^13 cannot fill the memory)."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock = sock
        self._io = sock.makefile("rb", buffering=0)
        self.limit(deadline)

    def limit(self, deadline: float) -> None:
        """From now on: read by `deadline`, at most a whole reply's bytes."""
        self.deadline = deadline
        self.budget = MAX_REPLY + _FRAMING

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._io.fileno()

    def readinto(self, buffer) -> int | None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        if self.budget <= 0:
            raise ValueError(f"a reply of more than {MAX_REPLY} bytes")
        timeout = self._sock.gettimeout()
        if timeout is None or timeout > left:  # 0 (a look without waiting) stays 0
            self._sock.settimeout(left)
        n = self._io.readinto(memoryview(buffer).cast("B")[: self.budget])
        self.budget -= n or 0
        return n

    def close(self) -> None:
        self._io.close()
        super().close()


class _Timed:
    """A socket as an http.client response takes it in: its file is a _Reader."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_Reader(self.sock, self.deadline))


def _response(sock: socket.socket, *args, deadline: float, **kwargs) -> http.client.HTTPResponse:
    """http.client's response, read under one deadline for the whole of it (conn.response_class)."""
    return http.client.HTTPResponse(_Timed(sock, deadline), *args, **kwargs)


def _body(resp: http.client.HTTPResponse) -> bytes:
    """A reply's whole body, read in pieces; ValueError past MAX_REPLY (a Content-Length above it
    before a byte is read), IncompleteRead when it ends before its Content-Length."""
    if resp.length is not None and resp.length > MAX_REPLY:
        raise ValueError(
            f"a reply of {resp.length} bytes, more than the {MAX_REPLY} a member may send"
        )
    pieces, size = [], 0
    while piece := resp.read(65536):
        size += len(piece)
        if size > MAX_REPLY:
            raise ValueError(f"a reply of more than {MAX_REPLY} bytes")
        pieces.append(piece)
    if resp.length:  # http.client returns what came when the connection ends early
        raise http.client.IncompleteRead(b"".join(pieces), resp.length)
    return b"".join(pieces)


def _parse(raw: bytes):
    """A member's JSON; ValueError when it holds more items than a reply of ours can (parsing
    millions of tiny ones would cost gigabytes), RecursionError when nested too deep."""
    if raw.count(b",") + raw.count(b"[") + raw.count(b"{") > MAX_ITEMS:
        raise ValueError(f"more than {MAX_ITEMS} JSON items")
    return json.loads(raw)


def _decoded(decode, reply):
    """decode(reply); whatever it raises (a field missing, of another type, bad base64...) is a
    failed attempt on that member: it may have applied the request."""
    try:
        return decode(reply)
    except Exception as e:  # noqa: BLE001 - a reply that is not etcd's: never a traceback
        raise _Failed(
            f"a reply that is not etcd's ({_line(e)})", applied_maybe=True, cause="reply"
        ) from None


def _left(end: float) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _resolve(ep: Endpoint) -> list[tuple]:
    """The addresses of ep's host; _Failed when its name does not resolve (lasting, unless the
    resolver says to try again later)."""
    try:
        return socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise _Failed(
            f"cannot resolve host {ep.host} ({e.strerror})",
            applied_maybe=False,
            cause="dns",
            lasting=e.errno != socket.EAI_AGAIN,
        ) from None
    except (OSError, UnicodeError) as e:
        raise _Failed(
            f"cannot resolve host {ep.host} ({_line(e)})",
            applied_maybe=False,
            cause="dns",
            lasting=True,
        ) from None


def _cause(e: BaseException) -> str:
    """The kind of a failed attempt's exception (NoAnswer.causes)."""
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(
        e, ConnectionError | EOFError | http.client.IncompleteRead | http.client.RemoteDisconnected
    ):
        return "dropped"
    if isinstance(e, OSError):
        return "other"
    return "reply"  # what came is not an HTTP reply, or too large


def _shut(sock: socket.socket | None) -> None:
    """Shut a socket down both ways: a thread blocked reading it wakes at once (its owner
    closes it). The base class's shutdown, as TLS's would unwrap under the reader."""
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass


_REJECTIONS = logs.Throttle(REJECTED_EVERY)


# --- the wire form ---------------------------------------------------------------------------
# Each reply decoded strictly, as etcd's gateway gives it: int64s as strings of digits, bytes in
# base64, a field at its default left out. Anything else raises (a failed attempt: _decoded).


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _field(d: dict, name: str):
    """A field of a reply by its proto name, or by protojson's camelCase (etcd 3.6's gateway)."""
    if name in d:
        return d[name]
    head, *rest = name.split("_")
    return d.get(head + "".join(p.title() for p in rest))


def _obj(x, what: str = "a reply") -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{what} that is not a JSON object")
    return x


def _list(d: dict, name: str) -> list:
    x = _field(d, name)
    if x is None:
        return []
    if not isinstance(x, list):
        raise ValueError(f"{name} that is not a list")
    return x


def _int(d: dict, name: str) -> int:
    """An int64 field (a string of digits; 0 when left out)."""
    x = _field(d, name)
    if x is None:
        return 0
    if isinstance(x, str) and x.isascii() and x.isdigit() and len(x) <= 19:
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**63:
        raise ValueError(f"{name} that is not a number from 0 to 2^63-1")
    return x


def _bool(d: dict, name: str) -> bool:
    x = _field(d, name)
    if x is not None and not isinstance(x, bool):
        raise ValueError(f"{name} that is not true or false")
    return bool(x)


def _header(reply) -> dict:
    """The header etcd puts in every reply."""
    return _obj(_field(_obj(reply), "header"), "a header")


def _status(reply) -> dict:
    _header(reply)
    return reply


def _first_kv(range_reply: dict) -> dict | None:
    kvs = _list(_obj(range_reply, "a range"), "kvs")
    return _obj(kvs[0], "a key-value") if kvs else None


def _value(range_reply: dict) -> bytes | None:
    kv_ = _first_kv(range_reply)
    if kv_ is None:
        return None
    value = kv_.get("value", "")
    if not isinstance(value, str):
        raise ValueError("a value that is not base64 text")
    return base64.b64decode(value, validate=True)


def _kv_int(range_reply: dict, name: str) -> int:
    kv_ = _first_kv(range_reply)
    return _int(kv_, name) if kv_ is not None else 0


def _range_reply(reply) -> tuple[bytes | None, int, int]:
    revision = _int(_header(reply), "revision")
    return _value(reply), _kv_int(reply, "mod_revision"), revision


def _keys(reply) -> list[str]:
    """The keys of a keys-only range (one not text, or not ours, is left out)."""
    _header(reply)
    kvs = _field(reply, "kvs") or []
    if not isinstance(kvs, list):
        raise ValueError("kvs that is not a list")
    found = []
    for item in kvs:
        try:
            found.append(base64.b64decode(item["key"], validate=True).decode())
        except (KeyError, TypeError, ValueError):
            continue
    return found


def _version(reply) -> int:
    _header(reply)
    return _kv_int(reply, "version")


def _prev_version(reply) -> int:
    _header(reply)
    prev = _field(reply, "prev_kv")
    return 0 if prev is None else _int(_obj(prev, "prev_kv"), "version")


def _reads(n: int, reply) -> list[bytes | None]:
    """The values of a transaction of n reads, in order."""
    _header(reply)
    replies = _list(reply, "responses")
    if len(replies) != n:
        raise ValueError(f"a transaction of {n} reads answered {len(replies)}")
    return [_value(_field(_obj(r, "a response"), "response_range")) for r in replies]


def _txn_outcome(reply) -> tuple[bool, bytes | None]:
    """compare_set's transaction: whether it succeeded, else the key's value (its failure read)."""
    _header(reply)
    if _bool(reply, "succeeded"):
        return True, None
    replies = _list(reply, "responses")
    return False, _value(
        _field(_obj(replies[0], "a response"), "response_range")
    ) if replies else None


_TOKEN = re.compile(r"[!-~]{1,4096}")  # printable ASCII, no space: it goes into a header as it is


def _token(reply) -> str:
    token = _obj(reply).get("token")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError("an authentication token that is not one")
    return token


def _error_text(reply) -> str:
    """The message of an error reply (text only: a member's nested JSON is not printed)."""
    if not isinstance(reply, dict):
        return ""
    err = reply.get("error")
    if isinstance(err, dict):  # a stream's error: {"error": {"grpc_code": 14, "message": ...}}
        err = err.get("message")
    text = next((m for m in (reply.get("message"), err) if isinstance(m, str) and m.strip()), None)
    return _line(text) if text else ""


def _line(e: object) -> str:
    """One short printable line (a member's words land in logs and on terminals)."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, ConnectionRefusedError):
        text = "connection refused"
    elif isinstance(e, TimeoutError):
        text = "timed out"
    return "".join(c if c.isprintable() else "?" for c in " ".join(text.split())[:200])


def _dropped(sock: socket.socket) -> bool:
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


__all__ = [
    "DEFAULT_PORT",
    "MAX_REPLY",
    "EtcdKV",
    "Endpoint",
    "Misconfigured",
    "NoAnswer",
    "Refused",
    "connect",
    "parse_endpoints",
    "tls_context",
]
