"""A fuzz of etcd replies (hypothesis, derandomized): a fake member (tests/fake_member.py) answers
every request with a generated reply: a healthy one with a field replaced by random JSON, random
JSON, random bytes, deep nesting, a flood of items, under a random status, framed right or cut
short, chunked right or wrong, with a Content-Length of 10^13, or trickled. Every EtcdKV
operation then returns a value of its type or raises kv.Unreachable, within its deadline: never
another exception, never a hang. A few seconds in all."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticd.cluster import etcd, kv
from fake_member import FakeMember, healthy_reply

TIMEOUT = 0.15  # each store call's: a reply that cannot be read costs it whole
WAIT = 0.1
# An operation's result must be of its type; every one ends within its deadline (a wait reads the
# key first: its own deadline plus one call's).
OPS = {
    "get": (lambda s: s.get("k"), lambda r: r is None or type(r) is bytes),
    "multi_get": (
        lambda s: s.multi_get(["a", "b"]),
        lambda r: type(r) is list and len(r) == 2 and all(v is None or type(v) is bytes for v in r),
    ),
    "set": (lambda s: s.set("k", b"v"), lambda r: r is None),
    "take": (lambda s: s.take("n"), lambda r: type(r) is int and r >= 1),
    "taken": (lambda s: s.taken("n"), lambda r: type(r) is int and r >= 0),
    "compare_set": (lambda s: s.compare_set("k", None, b"v"), lambda r: type(r) is bool),
    "compare_set_value": (lambda s: s.compare_set("k", b"old", b"v"), lambda r: type(r) is bool),
    "wait": (lambda s: s.wait("k", WAIT), lambda r: type(r) is bool),
}
SLACK = 0.6  # seconds past an operation's deadline allowed for a loaded 2-core machine

FIELDS = [
    "header",
    "kvs",
    "key",
    "value",
    "version",
    "mod_revision",
    "revision",
    "count",
    "prev_kv",
    "succeeded",
    "responses",
    "response_range",
    "token",
    "result",
    "events",
    "type",
    "canceled",
    "compact_revision",
    "error",
    "message",
    "code",
    "kv",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(
        ["", "7", "-1", "9" * 25, "1e3", "0x10", "!!!", "aGk=", "aGk", "==", "PUT", "DELETE"]
    ),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=10,
)


def mutate(reply, steps: list[int], value):
    """`reply` with the place `steps` lead to (each an index into a dict's keys or a list) replaced
    by `value`; where a step finds nothing to enter, the place it reached is replaced."""
    if not steps or not isinstance(reply, dict | list) or not reply:
        return value
    if isinstance(reply, dict):
        key = list(reply)[steps[0] % len(reply)]
        return {**reply, key: mutate(reply[key], steps[1:], value)}
    i = steps[0] % len(reply)
    return [*reply[:i], mutate(reply[i], steps[1:], value), *reply[i + 1 :]]


bodies = st.one_of(
    st.tuples(st.just("mutated"), st.lists(st.integers(0, 20), max_size=5), json_values),
    st.tuples(st.just("json"), json_values),
    st.tuples(st.just("bytes"), st.binary(max_size=64)),
    st.tuples(st.just("deep"), st.sampled_from([900, 5_000, 200_000])),
    st.tuples(st.just("items"), st.sampled_from([50_000, 200_000])),
)
framings = st.sampled_from(
    [
        "length",
        "length",
        "length",
        "chunked",
        "no length, closed",
        "cut short",
        "bad chunk size",
        "chunk cut short",
        "length 10^13",
        "slow",
        "status line garbage",
    ]
)
statuses = st.sampled_from(
    ["200 OK"] * 6
    + [
        "400 Bad Request",
        "401 Unauthorized",
        "404 Not Found",
        "429 Too Many Requests",
        "500 Internal Server Error",
        "503 Service Unavailable",
        "204 No Content",
        "302 Found",
        "999 X",
    ]
)
replies = st.fixed_dictionaries(
    {
        "body": bodies,
        "framing": framings,
        "status": statuses,
        "pieces": st.integers(1, 4),
        "bad_size": st.sampled_from(
            [b"zz", b"-1", b"", b"1000000000000000", b"ffffffffffffffffffff", b"3;x"]
        ),
    }
)


def body_bytes(spec: dict, path: str, request: dict) -> bytes:
    kind, *args = spec["body"]
    if kind == "mutated":
        return json.dumps(mutate(healthy_reply(path, request), *args)).encode() + b"\n"
    if kind == "json":
        return json.dumps(args[0]).encode() + b"\n"
    if kind == "bytes":
        return args[0]
    if kind == "deep":
        return b"[" * args[0] + b"]" * args[0]
    return b"[" + b"0," * args[0] + b"0]"


def send(member: FakeMember, conn, spec: dict, body: bytes) -> bool:
    """Frame `body` as `spec` says and send it; whether the connection stays open."""
    framing, status = spec["framing"], spec["status"]
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
    n = max(1, len(body) // spec["pieces"])
    pieces = [body[i : i + n] for i in range(0, len(body), n)] or [b""]
    if framing == "status line garbage":
        conn.sendall(b"HTTQ/9 nope\r\n\r\n" + body)
        return False
    if framing == "length 10^13":
        conn.sendall(f"{head}Content-Length: 10000000000000\r\n\r\n".encode() + body)
        return False
    if framing == "no length, closed":
        conn.sendall(f"{head}Connection: close\r\n\r\n".encode() + body)
        return False
    if framing == "cut short":
        conn.sendall(f"{head}Content-Length: {len(body) + 10}\r\n\r\n".encode() + body)
        return False
    if framing in ("chunked", "bad chunk size", "chunk cut short"):
        conn.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        for piece in pieces:
            size = spec["bad_size"] if framing == "bad chunk size" else f"{len(piece):x}".encode()
            cut = piece[: len(piece) // 2] if framing == "chunk cut short" else piece
            conn.sendall(size + b"\r\n" + cut + b"\r\n")
        if framing == "chunked":
            conn.sendall(b"0\r\n\r\n")
            return True
        return False
    conn.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
    if (
        framing == "slow"
    ):  # a piece every 0.1 s: longer than a call may take, for all but the shortest
        for piece in pieces:
            if not member.sleep(0.1):
                return False
            conn.sendall(piece)
        return True
    conn.sendall(body)
    return True


@pytest.fixture(scope="module")
def member():
    current: dict = {}

    def handler(m, conn, path, request):
        spec = current.get("spec")
        return spec is not None and send(m, conn, spec, body_bytes(spec, path, request))

    with FakeMember(handler) as m:
        m.current = current
        yield m


@settings(
    max_examples=20,
    deadline=3000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=replies, op=st.sampled_from(sorted(OPS)))
def test_every_operation_returns_its_type_or_unreachable_in_time(member, spec, op):
    member.current["spec"] = spec
    call, well_typed = OPS[op]
    s = etcd.EtcdKV(member.endpoint, timeout=TIMEOUT)
    t0 = time.monotonic()
    try:
        result = call(s)
    except kv.Unreachable as e:
        assert "\n" not in str(e), str(e)
    else:
        assert well_typed(result), (op, result)
    finally:
        took = time.monotonic() - t0
        s.close()
    bound = TIMEOUT + (WAIT + TIMEOUT if op == "wait" else 0) + SLACK
    assert took < bound, f"{op} took {took:.2f} s"
    assert threading.active_count() < 50  # the member's threads end with their connections
