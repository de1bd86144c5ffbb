"""elasticd/cluster/etcd.py against members that misbehave. A fake member on a loopback port
(tests/fake_member.py) answers crafted replies: wrong shapes, bad base64, JSON nested 200,000 deep,
a Content-Length of 10^13, bad chunking, a reply trickled a byte at a time; every EtcdKV call then
returns or raises kv.Unreachable within its deadline, never another exception, fails over to a
member that behaves, and close() ends a call in progress at once. End to end, a daemon whose
member trickles leaves at --join-timeout with one line, and SIGTERM stops it at once."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from structlog.testing import capture_logs

from elasticd.cluster import etcd, kv
from fake_member import FakeMember, healthy, healthy_reply, json_reply, response, trickle
from harness import wait_until

HEADER = {"cluster_id": "1", "member_id": "2", "revision": "7", "raft_term": "2"}


def always(raw: bytes):
    """A member that answers every request with `raw`, keeping the connection (unless the reply
    says Connection: close)."""

    def handler(member, conn, path, body):
        conn.sendall(raw)
        return b"\r\nConnection: close\r\n" not in raw

    return handler


def outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test judges it
        return e


CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"


CRAFTED = {
    "kvs holding a number": json_reply({"header": HEADER, "kvs": [1]}),
    "a value that is not base64": json_reply(
        {"header": HEADER, "kvs": [{"key": "aw==", "value": "!!not base64!!"}]}
    ),
    "JSON nested 200,000 deep": response(b"[" * 200_000),
    "a Content-Length of 10^13": b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000000\r\n\r\n{",
    "a chunk of 2^60 bytes": CHUNKED + b"1000000000000000\r\n{",
    "a body larger than any reply": (
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b" " * (etcd.MAX_REPLY + 1024)
    ),
    "a million items": json_reply({"header": HEADER, "x": [{}] * 1_000_000}),
    "a header that is a list": json_reply({"header": [], "kvs": []}),
    "a version that is not a number": json_reply(
        {"header": HEADER, "kvs": [{"value": "", "version": "1e3"}]}
    ),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_reply_is_a_failed_attempt(name):
    """Each crafted reply makes the call fail over (here, to the same lone member) until its
    deadline: kv.Unreachable, one line, in time; the member's replies are logged once, not once
    per attempt."""
    with FakeMember(always(CRAFTED[name])) as m, capture_logs() as logs:
        s = etcd.EtcdKV(m.endpoint, timeout=0.5)
        t0 = time.monotonic()
        got = outcome(s.taken if "version" in name else s.get, "k")
        took = time.monotonic() - t0
        s.close()
    assert isinstance(got, kv.Unreachable), repr(got)
    assert "\n" not in str(got) and m.endpoint in str(got)
    assert took < 0.5 + 0.4, took
    assert len([e for e in logs if e["event"] == "etcd_reply_rejected"]) <= 1, logs


def test_a_bad_member_fails_over_to_a_good_one():
    """The member in use answers garbage: every call goes on to the next endpoint and succeeds
    there, and the garbage is logged once for all of them (held-back lines counted)."""
    store = {b"k": b"v"}
    with (
        FakeMember(always(json_reply({"header": [HEADER], "kvs": [1], "prev_kv": "x"}))) as bad,
        FakeMember(healthy(store)) as good,
        capture_logs() as logs,
    ):
        for _ in range(5):
            s = etcd.EtcdKV(f"{bad.endpoint},{good.endpoint}", timeout=2)  # the bad member first
            assert s.get("k") == b"v"
            s.close()
        s = etcd.EtcdKV(f"{bad.endpoint},{good.endpoint}", timeout=2)
        s.set("k2", b"w")
        assert store[b"k2"] == b"w"
        assert s.multi_get(["k", "k2"]) == [b"v", b"w"]
        assert s.take("n") == 1
        s.close()
    rejected = [e for e in logs if e["event"] == "etcd_reply_rejected"]
    assert len(rejected) == 1 and rejected[0]["endpoint"] == bad.endpoint, rejected
    assert "not etcd's" in rejected[0]["why"]


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"HTTP/1.1 200 OK\r\nX-A:"],
    ids=["body", "headers"],
)
def test_a_trickled_reply_ends_at_the_deadline(head):
    """A byte every 0.1 s (in the body, or in the headers): the call's deadline holds for the
    whole reply, not for each byte."""
    with FakeMember(trickle(head)) as m:
        s = etcd.EtcdKV(m.endpoint, timeout=1.0)
        t0 = time.monotonic()
        got = outcome(s.get, "k")
        took = time.monotonic() - t0
        s.close()
    assert isinstance(got, kv.Unreachable) and "timed out" in str(got), repr(got)
    assert took < 1.0 + 0.4, took


def test_close_ends_a_call_in_progress_at_once():
    """Another thread's call waits on a trickling member (its deadline 30 s away): close()
    returns at once, and the call raises Unreachable ("closed") at once."""
    with FakeMember(trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")) as m:
        s = etcd.EtcdKV(m.endpoint, timeout=30)
        got = {}
        caller = threading.Thread(
            target=lambda: got.update(result=outcome(s.get, "k"), at=time.monotonic()), daemon=True
        )
        caller.start()
        wait_until(lambda: m.requests, 5, what="the request")
        time.sleep(0.3)
        t0 = time.monotonic()
        closer = threading.Thread(target=s.close, daemon=True)
        closer.start()
        closer.join(2)
        caller.join(2)
        assert not closer.is_alive(), "close() waited for the call in progress"
        assert not caller.is_alive(), "the call went on after close()"
    assert isinstance(got["result"], kv.Unreachable) and "closed" in str(got["result"]), got
    assert got["at"] - t0 < 0.5


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


WATCHES = {
    "events that are not objects": chunk(b'{"result":{"events":[1]}}\n'),
    "a message nested 200,000 deep": chunk(b"[" * 200_000 + b"\n"),
    "a chunk size of 2^60": b"1000000000000000\r\n{",
    "a chunk size of -1": b"-1\r\n" + b"{" * 1000,
    "an error that is not text": chunk(b'{"error":{"message":[1,2]}}\n'),
}


@pytest.mark.parametrize("name", [*WATCHES, "a chunk trickled"])
def test_a_hostile_watch_stream_ends_in_time(name):
    """The key is absent and the member's watch stream holds garbage (or trickles a chunk):
    wait() gives the stream up and reads again until its time is up; False or Unreachable in
    time, nothing else."""

    def handler(member, conn, path, body):
        if path != "/v3/watch":
            conn.sendall(json_reply(healthy_reply(path, body)))
            return True
        conn.sendall(CHUNKED)
        if name == "a chunk trickled":
            conn.sendall(b"64\r\n")
            while member.sleep(0.1):
                conn.sendall(b" ")
        else:
            conn.sendall(WATCHES[name])
            member.sleep(5)
        return False

    with FakeMember(handler) as m:
        s = etcd.EtcdKV(m.endpoint, timeout=0.5)
        t0 = time.monotonic()
        got = outcome(s.wait, "k", 1.0)
        took = time.monotonic() - t0
        s.close()
    assert got is False or isinstance(got, kv.Unreachable), repr(got)
    assert took < 1.0 + 0.5 + 0.5, took
    assert any(path == "/v3/watch" for path, _ in m.requests)


NO_LEADER = response(
    json.dumps({"error": "etcdserver: no leader", "message": "etcdserver: no leader", "code": 14})
    .encode(),
    status="503 Service Unavailable",
)  # fmt: skip


def test_a_call_through_an_election_is_not_held_by_a_member_still_catching_up():
    """An election (etcd's leader killed): for 1 s every member answers "no leader" at once or
    refuses the connection, many failures in a row; then one member, still catching up, holds
    what it is sent until 2.5 s (a request forwarded to the dead leader is never answered) and
    answers after. Those quick refusals are no sign of a slow cluster: each attempt keeps its
    half second, and the call succeeds soon after 2.5 s. (It used to double the attempt's time
    with every round of refusals, so the first held request ate the call's whole deadline: a
    node's beats stalled that long were taken for a lost node, and the job went on without it.)"""
    t0 = time.monotonic()
    store: dict[bytes, bytes] = {}

    def catching_up(member, conn, path, body):
        came = time.monotonic() - t0
        if came < 1.0:
            conn.sendall(NO_LEADER)
            return True
        if came < 2.5:
            member.sleep(30)  # held: never answered
            return False
        conn.sendall(json_reply(healthy_reply(path, body, store)))
        return True

    def leaderless(member, conn, path, body):
        conn.sendall(NO_LEADER)
        return True

    refused = socket.create_server(("127.0.0.1", 0))  # a port nobody answers: the dead member
    dead = f"127.0.0.1:{refused.getsockname()[1]}"
    refused.close()
    with FakeMember(catching_up) as a, FakeMember(leaderless) as b:
        s = etcd.EtcdKV(f"{a.endpoint},{b.endpoint},{dead}", timeout=6)
        got = outcome(s.set, "k", b"v")
        took = time.monotonic() - t0
        s.close()
    assert got is None and store == {b"k": b"v"}, repr(got)
    assert took < 2.5 + etcd.ATTEMPT_TIMEOUT + 0.5 + 0.5, took  # an attempt, a pause, a margin
