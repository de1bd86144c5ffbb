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
import http.client
import ipaddress
import json
import math
import random
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

from elasticd import kv

DEFAULT_PORT = 2379
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
MAX_KEYS = 100_000  # keys one listing returns at most (a round has one per node; more is a forger's)
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
_HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-Hasleader": "true"}
# Answers that mean the member did not take the request in (safe to send again anywhere).
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: too many requests", "etcdserver: not capable")


class Refused(kv.Unreachable):
    """The cluster answered and refused (authentication, permission, a malformed or too large
    request): sending it again, to this member or another, would not help."""

    def __init__(self, message: str):
        super().__init__(message, refused=True)


class _Failed(Exception):
    """One attempt on one endpoint failed; `applied_maybe`: the request may have reached etcd."""

    def __init__(self, reason: str, applied_maybe: bool, reauth: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.applied_maybe = applied_maybe
        self.reauth = reauth


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


def tls_context(cacert: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
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
        raise ValueError(f"etcd TLS: cannot load {cacert if cacert and not cert else cert}: {_line(e)}") from None
    return ctx


def connect(endpoints: str, timeout: float, *, cacert: str | None = None, cert: str | None = None,
            key: str | None = None, user: str | None = None, password: str | None = None,
            password_file: str | None = None) -> EtcdKV:
    """An EtcdKV on the cluster at `endpoints` ("h1:2379,h2:2379,h3:2379"), checked: a member
    answers with a leader (and the user authenticates) within `timeout`, else kv.Unreachable
    (Refused for bad credentials); ValueError for malformed endpoints or options, or TLS or
    password files that cannot be read. `timeout` then bounds every call of the returned store.
    TLS (https) is used when any of cacert / cert / key is given or an endpoint says https://."""
    if password_file is not None:
        if password is not None:
            raise ValueError("etcd: give a password or a password file, not both")
        try:
            with open(password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"etcd password file {password_file}: {_line(e)}") from None
    store = EtcdKV(endpoints, timeout, cacert=cacert, cert=cert, key=key, user=user, password=password)
    store._current = preferred_endpoint(store.endpoints)
    try:
        store.status()
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
        return {str(ai[4][0]).split("%")[0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


class EtcdKV:
    """kv.KV on an etcd cluster (see the module's description). The constructor does no I/O."""

    def __init__(self, endpoints: str | Sequence[str], timeout: float, *, cacert: str | None = None,
                 cert: str | None = None, key: str | None = None, user: str | None = None,
                 password: str | None = None, _tls: ssl.SSLContext | None = None):
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
        self._tokens: dict[int, str] = {}  # endpoint index -> auth token (simple tokens are per member)
        self._conns: dict[int, http.client.HTTPConnection] = {}
        self._current = 0
        self._streams: dict[threading.Thread, _Stream] = {}  # wait's open watch per thread, between slices
        self._streams_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        # A member gets this long to answer before the call moves on (when there are others): a
        # stalled member, or a follower holding a request for a leader that just died, must not
        # eat the time a healthy one needs.
        n = len(self.endpoints)
        self._attempt_cap = self.timeout if n == 1 else min(ATTEMPT_TIMEOUT, max(self.timeout / n, 0.25))

    # --- the KV operations -------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def get(self, key: str) -> bytes | None:
        return self._range(key)[0]

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i:i + MAX_TXN_OPS]
            resp, _ = self._call("/v3/kv/txn", {"success": [{"request_range": {"key": _b64(k)}} for k in chunk]})
            replies = _field(resp, "responses") or []
            if len(replies) != len(chunk):
                raise kv.Unreachable(f"etcd {self.endpoint}: a transaction of {len(chunk)} reads "
                                     f"answered {len(replies)}")
            out.extend(_value(_field(r, "response_range") or {}) for r in replies)
        return out

    def take(self, key: str) -> int:
        # The roll is the key's version, which etcd raises by one at every put: one put that
        # returns the version before it is an atomic fetch-and-add with nothing to retry (a
        # compare-and-swap of a value made N nodes arriving together cost O(N^2) requests).
        resp, _ = self._call("/v3/kv/put", {"key": _b64(key), "value": "", "prev_kv": True})
        return int(_field(_field(resp, "prev_kv") or {}, "version") or 0) + 1

    def taken(self, key: str) -> int:
        resp, _ = self._call("/v3/kv/range", {"key": _b64(key)})
        return _kv_int(resp, "version")

    def keys(self, prefix: str) -> list[str]:
        end = prefix.encode()[:-1] + bytes([prefix.encode()[-1] + 1])  # every key with the prefix: etcd's range end
        resp, _ = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end), "keys_only": True,
                                              "limit": MAX_KEYS})
        found = []
        for item in _field(resp, "kvs") or []:
            try:
                found.append(base64.b64decode(item["key"], validate=True).decode())
            except (KeyError, TypeError, ValueError):
                continue  # not a key of ours
        return found

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        # b"" (someone's empty value) is compared as the value it is: absent is None
        k = _b64(key)
        compare = ({"target": "CREATE", "key": k, "create_revision": "0", "result": "EQUAL"} if expected is None
                   else {"target": "VALUE", "key": k, "value": _b64(expected), "result": "EQUAL"})
        resp, lost_reply = self._call("/v3/kv/txn", {
            "compare": [compare],
            "success": [{"request_put": {"key": k, "value": _b64(desired)}}],
            "failure": [{"request_range": {"key": k}}],
        })
        if _field(resp, "succeeded"):
            return True
        if lost_reply:  # an earlier attempt may have set it: the key holding `desired` says it did
            rng = _field((_field(resp, "responses") or [{}])[0], "response_range") or {}
            return _value(rng) == desired
        return False

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
            except _Failed:
                if st is not None:
                    self._end_stream(st)
                with self._lock:
                    self._drop(self._current)
                    self._current = (self._current + 1) % len(self.endpoints)
                time.sleep(min(_BACKOFF[0], max(deadline - time.monotonic(), 0)))
                continue
            if time.monotonic() >= deadline:
                return False  # the stream stays open for this thread's next slice

    def clone(self) -> EtcdKV:
        c = EtcdKV([e.url for e in self.endpoints], self.timeout, user=self._user, password=self._password,
                   _tls=self._tls)
        c._tokens = dict(self._tokens)
        c._current = self._current
        return c

    def close(self) -> None:
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for thread, st in streams.items():
            if thread is threading.current_thread() or not thread.is_alive():
                st.conn.close()
            else:  # its thread may be reading it: the end of the stream wakes it, and it closes it
                try:
                    st.conn.sock.shutdown(socket.SHUT_RDWR)
                except (OSError, AttributeError):
                    pass
        with self._lock:
            self._closed = True
            for i in list(self._conns):
                self._drop(i)

    def status(self) -> dict:
        """The member in use's status (version, leader, revision): a cheap check that the cluster
        answers with a leader, and that the user authenticates."""
        return self._call("/v3/maintenance/status", {})[0]

    # --- requests, failover -------------------------------------------------------------------

    def _range(self, key: str) -> tuple[bytes | None, int, int]:
        """(value or None, the key's mod_revision (0 when absent), the store's revision)."""
        resp, _ = self._call("/v3/kv/range", {"key": _b64(key)})
        header = _field(resp, "header") or {}
        return _value(resp), _kv_int(resp, "mod_revision"), int(_field(header, "revision") or 0)

    def _call(self, path: str, body: dict) -> tuple[dict, bool]:
        """POST to the member in use, failing over until the deadline. Returns the decoded reply and
        whether an earlier attempt failed after the request may have reached etcd."""
        data = json.dumps(body).encode()
        with self._lock:
            if self._closed:
                raise kv.Unreachable(f"etcd {self.endpoint}: this connection was closed")
            deadline = time.monotonic() + self.timeout
            errors: dict[str, str] = {}
            lost_reply = False
            failures = 0
            reauthed: set[int] = set()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise kv.Unreachable(self._summary(errors))
                i = self._current
                # each round of failures doubles a member's time: a member cut off costs half a
                # second, while a cluster that is only slow (overloaded) is not sent every
                # request again and again at half-second intervals
                cap = self._attempt_cap * 2 ** (failures // len(self.endpoints))
                try:
                    return self._attempt(i, path, data, time.monotonic() + min(left, cap)), lost_reply
                except _Failed as f:
                    errors[str(self.endpoints[i])] = f.reason
                    lost_reply |= f.applied_maybe
                    self._drop(i)
                    if f.reauth:
                        self._tokens.pop(i, None)
                        if i not in reauthed:  # a token the member no longer knows: log in again, same member
                            reauthed.add(i)
                            continue
                        raise Refused(f"etcd {self.endpoints[i]}: {f.reason}") from None
                    self._current = (i + 1) % len(self.endpoints)
                    failures += 1
                    if failures % len(self.endpoints) == 0:  # every endpoint failed once more: pause
                        pause = min(_BACKOFF[0] * 2 ** (failures // len(self.endpoints) - 1), _BACKOFF[1])
                        time.sleep(max(min(pause, deadline - time.monotonic()), 0))

    def _attempt(self, i: int, path: str, data: bytes, end: float) -> dict:
        """One request to endpoint i (logging in first where needed), answered by `end`."""
        headers = dict(_HEADERS)
        if self._user is not None:
            if i not in self._tokens:
                reply = self._post(i, "/v3/auth/authenticate", json.dumps(
                    {"name": self._user, "password": self._password}).encode(), end, headers, authenticating=True)
                self._tokens[i] = str(reply.get("token", ""))
            headers["Authorization"] = self._tokens[i]
        return self._post(i, path, data, end, headers)

    def _post(self, i: int, path: str, data: bytes, end: float, headers: dict,
              authenticating: bool = False) -> dict:
        limit = end - time.monotonic()
        if limit <= 0:
            raise _Failed("timed out", applied_maybe=False)
        conn = self._connection(i, limit)
        try:
            conn.request("POST", path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise _Failed(_line(e), applied_maybe=True) from None
        if resp.will_close:
            self._drop(i)
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = {}
        if resp.status == 200 and isinstance(reply, dict):
            return reply
        message = _error_text(reply) or f"HTTP {resp.status} {resp.reason}"
        code = reply.get("code") if isinstance(reply, dict) else None
        if resp.status == 401 or code == 16:  # Unauthenticated: the token expired or the member restarted
            if authenticating or self._user is None:
                raise Refused(f"etcd {self.endpoints[i]}: {message}")
            raise _Failed(message, applied_maybe=False, reauth=True)
        if any(m in message for m in _NOT_APPLIED):
            raise _Failed(message, applied_maybe=False)
        if resp.status >= 500 or resp.status in (408, 429) or code in (4, 8, 10, 13, 14):
            raise _Failed(message, applied_maybe=True)
        raise Refused(f"etcd {self.endpoints[i]}: {message}")

    def _connection(self, i: int, limit: float) -> http.client.HTTPConnection:
        """The kept-alive connection to endpoint i, or a new one (connected within `limit`); one the
        member closed while idle (it died, or timed the connection out) is replaced before use, so
        a request is never sent into a dead connection."""
        conn = self._conns.get(i)
        if conn is not None and (conn.sock is None or _dropped(conn.sock)):
            self._drop(i)
            conn = None
        if conn is None:
            conn = self._new_connection(self.endpoints[i], limit)
            self._conns[i] = conn
        else:
            conn.sock.settimeout(limit)
        return conn

    def _new_connection(self, ep: Endpoint, limit: float) -> http.client.HTTPConnection:
        if ep.scheme == "https":
            conn = http.client.HTTPSConnection(ep.host, ep.port, timeout=limit, context=self._tls)
        else:
            conn = http.client.HTTPConnection(ep.host, ep.port, timeout=limit)
        try:
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            # a TLS handshake that failed did reach the member, but no request was sent yet
            raise _Failed(_line(e), applied_maybe=False) from None
        return conn

    def _drop(self, i: int) -> None:
        conn = self._conns.pop(i, None)
        if conn is not None:
            conn.close()

    def _summary(self, errors: dict[str, str]) -> str:
        what = "; ".join(f"{ep}: {err}" for ep, err in errors.items()) or "no attempt finished"
        return f"etcd {self.endpoint}: no answer within {self.timeout:g} s ({what})"

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
        conn = self._new_connection(ep, start)
        try:
            body = {"create_request": {"key": _b64(key), "start_revision": str(start_revision)}}
            try:
                conn.request("POST", "/v3/watch", body=json.dumps(body).encode(), headers=headers)
                resp = conn.getresponse()
            except TimeoutError:
                if deadline - time.monotonic() <= 0:
                    conn.close()
                    return None
                raise _Failed(f"watch: no answer within {start:g} s", applied_maybe=False) from None
            except (OSError, http.client.HTTPException) as e:
                raise _Failed(_line(e), applied_maybe=False) from None
            if resp.status != 200:
                raise _Failed(f"watch: HTTP {resp.status} {resp.reason}", applied_maybe=False)
        except BaseException:
            conn.close()
            raise
        return _Stream(key, conn, resp, time.monotonic() + WATCH_RENEW)

    def _next_put(self, st: _Stream, until: float) -> bool:
        """Read the stream until the key's first put (True) or `until` (False). _Failed when the
        member fails, closes or cancels it, or sends what cannot be read: the stream is then
        given up and the key read again, so nothing half-read can hide a put. The waiting is
        select's: a read begins only once bytes are there, and is bounded (a socket file
        cannot be read again after a timeout, and http.client's chunked reader blocks for the
        next chunk at the end of each one)."""
        sock = st.conn.sock
        while True:
            while b"\n" in st.pending:
                line, _, st.pending = st.pending.partition(b"\n")
                if line.strip() and _is_put(line):
                    return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            try:
                sock.settimeout(0.0)
                try:
                    waiting = st.resp.fp.peek(1)  # bytes an earlier read took in, or any that came since
                except ssl.SSLWantReadError:  # TLS: nothing to decrypt yet (plain sockets give b"")
                    waiting = b""
                if not waiting and not select.select([sock], [], [], left)[0]:
                    return False
                sock.settimeout(self._attempt_cap)  # what has begun to arrive comes whole by then
                st.pending += _payload(st.resp)
            except (OSError, ValueError, AttributeError) as e:
                raise _Failed(f"watch: {_line(e)}", applied_maybe=False) from None

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


def _payload(resp: http.client.HTTPResponse) -> bytes:
    """The next piece of a streamed reply's body: one chunk (chunked), or what has come."""
    fp = resp.fp
    if not resp.chunked:
        data = fp.read1(65536)
    else:
        size = int(fp.readline(256).split(b";")[0].strip() or b"0", 16)
        data = fp.read(size) if size else b""
        if len(data) < size or (size and fp.read(2) != b"\r\n"):
            raise ValueError("a chunk cut short")
    if not data:
        raise _Failed("watch: the member closed the stream", applied_maybe=False)
    return data


def _is_put(line: bytes) -> bool:
    """Whether one message of a watch stream reports a put of the key; _Failed for an error, a
    cancelled or compacted watch, or what is not a message."""
    try:
        msg = json.loads(line)
    except ValueError:
        raise _Failed("watch: an answer that is not JSON", applied_maybe=False) from None
    if not isinstance(msg, dict):
        raise _Failed("watch: an answer that is not an object", applied_maybe=False)
    if "error" in msg:
        raise _Failed(f"watch: {_error_text(msg)}", applied_maybe=False)
    result = msg.get("result") or {}
    if any(event.get("type", "PUT") == "PUT" for event in _field(result, "events") or []):
        return True
    if _field(result, "canceled") or _field(result, "compact_revision"):
        why = _field(result, "cancel_reason") or "compacted"
        raise _Failed(f"watch canceled: {why}", applied_maybe=False)
    return False


# --- the wire form ---------------------------------------------------------------------------


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _field(d: dict, name: str):
    """A field of a reply by its proto name, or by protojson's camelCase (etcd 3.6's gateway)."""
    if name in d:
        return d[name]
    head, *rest = name.split("_")
    return d.get(head + "".join(p.title() for p in rest))


def _value(range_reply: dict) -> bytes | None:
    kvs = _field(range_reply, "kvs") or []
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def _kv_int(range_reply: dict, name: str) -> int:
    kvs = _field(range_reply, "kvs") or []
    return int(_field(kvs[0], name) or 0) if kvs else 0


def _error_text(reply) -> str:
    if not isinstance(reply, dict):
        return ""
    err = reply.get("error")
    if isinstance(err, dict):  # a stream's error: {"error": {"grpc_code": 14, "message": ...}}
        err = err.get("message")
    return _line(reply.get("message") or err or "")


def _line(e: object) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, ConnectionRefusedError):
        text = "connection refused"
    elif isinstance(e, TimeoutError):
        text = "timed out"
    return " ".join(text.split())[:200]


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


__all__ = ["DEFAULT_PORT", "EtcdKV", "Endpoint", "Refused", "connect", "parse_endpoints", "tls_context"]
