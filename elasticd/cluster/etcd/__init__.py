"""The control plane's key-value store (kv.KV) on an etcd cluster, through etcd's v3 API.

etcd answers its v3 gRPC API also as JSON over HTTP/1.1 (the gRPC-JSON gateway every member
serves on its client port, etcd 3.4 to 3.6): POST /v3/kv/range, /v3/kv/put, /v3/kv/txn,
/v3/watch (a stream of JSON lines), /v3/auth/authenticate; keys and values in base64. That is all
this package speaks, with the standard library's http.client: no new dependency, and none of
the v2 API that etcd 3.6 removed (docs/multinode.md, "Rendezvous on etcd", says why not
python-etcd or etcd3).

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
`clone()`. Keys are used exactly as given (the caller scopes them per job). `connect()` makes
the daemon's. tests/etcd_cluster.py starts a real cluster for the tests and bench/etcd_kv.py.
"""

from __future__ import annotations

from elasticd.cluster import signing
from elasticd.cluster.etcd.client import ATTEMPT_TIMEOUT, EtcdKV
from elasticd.cluster.etcd.endpoints import (
    DEFAULT_PORT,
    Endpoint,
    parse_endpoints,
    preferred_endpoint,
    tls_context,
)
from elasticd.cluster.etcd.errors import Misconfigured, NoAnswer, Refused
from elasticd.cluster.etcd.reply import MAX_REPLY


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


__all__ = [
    "ATTEMPT_TIMEOUT",
    "DEFAULT_PORT",
    "MAX_REPLY",
    "EtcdKV",
    "Endpoint",
    "Misconfigured",
    "NoAnswer",
    "Refused",
    "connect",
    "parse_endpoints",
    "preferred_endpoint",
    "tls_context",
]
