"""elasticd/cluster/etcd.py: the control plane's KV on a real etcd cluster (tests/etcd_cluster.py: 3
members on loopback), held to the same semantics as the c10d TCPStore's (one set of tests run
against both), plus what only a cluster has: a member SIGKILLed under load, quorum lost and
regained, every endpoint dead or silent, authentication and TLS."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import psutil
import pytest

import stores
from elasticd.cluster import etcd, kv
from etcd_cluster import (  # noqa: F401 (the fixtures)
    SKIP_REASON,
    EtcdCluster,
    etcd_binary,
    free_port,
    own_cluster_fixture,
    shared_cluster_fixture,
)

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason=SKIP_REASON)


@pytest.fixture(params=stores.BACKENDS)
def connect(request):
    """A function making a new connection (a kv.KV) to one store: a c10d TCPStore, the etcd cluster,
    or a single-node job's in-process store (each connection a clone of the first)."""
    for made, _endpoint in stores.connections(request):
        yield made


_n = iter(range(1_000_000))


@pytest.fixture
def prefix(request):
    """Keys of this test's own, on a store other tests share."""
    return f"elasticd/test/{request.node.name}/{next(_n)}/"


# --- the same semantics on both stores ------------------------------------------------------------


def test_get_set_compare_set_take_multi_get(connect, prefix):
    s = connect()
    k = prefix
    assert s.get(k + "absent") is None
    s.set(k + "a", b"one")
    assert s.get(k + "a") == b"one"
    s.set(k + "a", b"\x00\xff binary\n")  # overwritten, any bytes
    assert s.get(k + "a") == b"\x00\xff binary\n"
    s.set(k + "empty", b"")
    assert s.get(k + "empty") == b""  # present and empty is not absent

    # compare_set: None means absent
    assert s.compare_set(k + "cas", None, b"first") is True
    assert s.get(k + "cas") == b"first"
    assert s.compare_set(k + "cas", None, b"second") is False  # present now
    assert s.get(k + "cas") == b"first"
    assert s.compare_set(k + "cas", b"first", b"third") is True
    assert s.get(k + "cas") == b"third"
    assert s.compare_set(k + "cas", b"first", b"fourth") is False  # mismatch
    assert s.get(k + "cas") == b"third"
    assert s.compare_set(k + "cas-absent", b"something", b"x") is False
    assert s.get(k + "cas-absent") is None  # a failed compare_set creates nothing
    # b"" is a value like any other (someone else's: garbage to write over), never an error
    assert s.compare_set(k + "cas", b"", b"x") is False  # the key holds b"third"
    assert s.compare_set(k + "empty", b"", b"filled") is True and s.get(k + "empty") == b"filled"

    # keys: what is there under a prefix (for records a raised counter no longer finds)
    assert sorted(s.keys(k + "c")) == [k + "cas"]
    assert set(s.keys(k)) >= {k + "a", k + "cas", k + "empty"} and s.keys(k + "nothing/") == []

    # take: a roll numbered from 1; taken reads how far it got
    assert s.taken(k + "n") == 0
    assert [s.take(k + "n") for _ in range(3)] == [1, 2, 3]
    assert s.taken(k + "n") == 3 and s.taken(k + "n") == 3  # reading takes nothing
    assert s.take(k + "n") == 4

    assert s.multi_get([k + "a", k + "absent", k + "cas"]) == [b"\x00\xff binary\n", None, b"third"]
    assert s.multi_get([]) == []
    assert isinstance(s.endpoint, str) and s.endpoint
    s.close()


def test_wait(connect, prefix):
    s = connect()
    waiter = s.clone()
    s.set(prefix + "there", b"x")
    t0 = time.monotonic()
    assert waiter.wait(prefix + "there", 5) is True  # already there: at once
    assert time.monotonic() - t0 < 1

    t0 = time.monotonic()
    assert waiter.wait(prefix + "never", 0.4) is False
    assert 0.35 <= time.monotonic() - t0 < 1.5

    got = {}

    def wait_for_it():
        t = time.monotonic()
        got["found"] = waiter.wait(prefix + "later", 10)
        got["at"] = time.monotonic()
        got["took"] = got["at"] - t

    th = threading.Thread(target=wait_for_it)
    th.start()
    time.sleep(0.3)
    set_at = time.monotonic()
    s.set(prefix + "later", b"now")  # another connection sets it
    th.join(10)
    assert got["found"] is True
    assert 0.25 <= got["took"] < 2
    assert got["at"] - set_at < 0.5  # woken by the write, not by polling
    waiter.close()
    s.close()


def test_clone(connect, prefix):
    s = connect()
    c = s.clone()
    s.set(prefix + "k", b"from s")
    assert c.get(prefix + "k") == b"from s"
    c.set(prefix + "k2", b"from clone")
    assert s.get(prefix + "k2") == b"from clone"
    assert c.take(prefix + "n") == 1 and s.take(prefix + "n") == 2 and c.taken(prefix + "n") == 2
    c.close()
    assert s.get(prefix + "k") == b"from s"  # closing a clone leaves the original working
    s.close()


def test_take_is_atomic_under_contention(connect, prefix):
    """4 threads x 50 takes, each thread its own connection: exactly 200, every number returned
    once."""
    s = connect()
    conns = [s.clone() for _ in range(4)]
    results: list[list[int]] = [[] for _ in conns]
    errors = []

    def taker(i):
        try:
            for _ in range(50):
                results[i].append(conns[i].take(prefix + "counter"))
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(repr(e))

    threads = [threading.Thread(target=taker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert s.taken(prefix + "counter") == 200
    assert sorted(v for r in results for v in r) == list(range(1, 201))
    for c in conns:
        c.close()
    s.close()


def _watches_started(cluster) -> int:
    """Watch streams the members have started (their own Prometheus counter)."""
    pattern = re.compile(
        r'^grpc_server_started_total\{grpc_method="Watch",grpc_service="etcdserverpb.Watch",'
        r'grpc_type="bidi_stream"\} (\d+)',
        re.M,
    )
    total = 0
    for m in cluster.members:
        with urllib.request.urlopen(f"{m.url}/metrics", timeout=5, context=cluster.client_tls) as r:
            total += int(pattern.search(r.read().decode()).group(1))
    return total


def test_a_wait_in_slices_keeps_one_watch(cluster, prefix):
    """A waiter looks around between slices of its wait (as the daemon's restart waiter does every
    second): the slices share one watch on the cluster until it is due for renewal, and a key set
    between two slices is still seen at once."""
    s = etcd.connect(cluster.endpoints, timeout=5)
    waiter = s.clone()
    before = _watches_started(cluster)
    for _ in range(10):
        assert waiter.wait(prefix + "k", 0.1) is False
    assert _watches_started(cluster) - before == 1
    s.set(prefix + "k", b"v")  # between two slices
    t0 = time.monotonic()
    assert waiter.wait(prefix + "k", 2) is True
    assert time.monotonic() - t0 < 0.5
    assert waiter.wait(prefix + "other", 0.1) is False  # another key: a watch of its own
    assert _watches_started(cluster) - before == 2
    waiter.close()
    s.close()


# --- etcd only: strict compare_set, a lost reply --------------------------------------------------


def test_compare_set_is_strict(cluster, prefix):
    """True only when this call swapped expected for desired. (tcpstore.TCPStoreKV answers True in
    both cases below: c10d's compare_set returns the key's value after the call, which is `desired`
    also when the key held it already, and `expected` for an absent key.)"""
    s = etcd.connect(cluster.endpoints, timeout=5)
    s.set(prefix + "k", b"4")
    assert s.compare_set(prefix + "k", b"3", b"4") is False
    assert s.compare_set(prefix + "absent", b"x", b"x") is False
    assert s.get(prefix + "absent") is None
    s.close()


class ReplyDropper:
    """An endpoint that passes each request on to a real member, lets it answer, and closes the
    client's connection without the reply: a member that applied a request and died."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.forwarded = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
                while len(body) < length:
                    body += conn.recv(65536)
                with socket.create_connection(("127.0.0.1", self.target_port), timeout=5) as up:
                    up.sendall(head + b"\r\n\r\n" + body)
                    up.recv(65536)  # the member answered: it applied the request
                self.forwarded += 1

    def close(self):
        self.sock.close()


def test_lost_reply_is_resolved(cluster, prefix):
    """A request applied by a member whose reply never came is sent again to the next endpoint:
    set and get as if nothing happened; compare_set answers True (the key holds desired);
    take skips a number (at-least-once, as documented)."""
    dropper = ReplyDropper(cluster.members[0].client_port)
    endpoints = f"{dropper.endpoint},{cluster.members[1].endpoint}"
    try:
        s = etcd.EtcdKV(endpoints, timeout=5)
        s.set(prefix + "k", b"v")
        assert s.get(prefix + "k") == b"v"

        s = etcd.EtcdKV(endpoints, timeout=5)
        assert s.compare_set(prefix + "cas", None, b"mine") is True  # applied via the dropper
        assert s.get(prefix + "cas") == b"mine"

        s = etcd.EtcdKV(endpoints, timeout=5)
        assert s.take(prefix + "n") == 2  # applied via the dropper, then again
        assert s.taken(prefix + "n") == 2
        assert dropper.forwarded == 3
    finally:
        dropper.close()


# --- etcd only: endpoints, failover, quorum -------------------------------------------------------


def test_endpoints_parsed():
    eps = etcd.parse_endpoints("h1:2379, h2 ,https://h3:1234,[::1]:2380,http://[fe80::1]")
    assert [str(e) for e in eps] == [
        "h1:2379",
        "h2:2379",
        "https://h3:1234",
        "[::1]:2380",
        "[fe80::1]:2379",
    ]
    assert [e.scheme for e in etcd.parse_endpoints("h1,h2", tls=True)] == ["https", "https"]
    for bad in ["", "h1,,h2", "h1:port", "h1:0", "ftp://h1", "h1:2379/path"]:
        with pytest.raises(ValueError):
            etcd.parse_endpoints(bad)
    with pytest.raises(ValueError):
        etcd.EtcdKV("h1", timeout=0)
    with pytest.raises(ValueError):
        etcd.EtcdKV("h1", timeout=1, user="root")  # no password
    with pytest.raises(ValueError, match="TLS"):
        etcd.EtcdKV("h1", timeout=1, cacert="/nonexistent/ca.pem")


def _one_line_naming(err: Exception, endpoints: str):
    text = str(err)
    assert "\n" not in text and len(text) < 1000, text
    for ep in endpoints.split(","):
        assert ep in text, text


def test_all_endpoints_dead_or_silent():
    """Nothing listens (refused), or a port accepts connections and never answers: every call
    raises Unreachable within its timeout, one line naming the endpoints."""
    dead = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))
    s = etcd.EtcdKV(dead, timeout=0.5)
    for op in (
        lambda: s.get("k"),
        lambda: s.set("k", b"v"),
        lambda: s.take("k"),
        lambda: s.compare_set("k", None, b"v"),
        lambda: s.multi_get(["a", "b"]),
        lambda: s.wait("k", 5),
    ):
        t0 = time.monotonic()
        with pytest.raises(kv.Unreachable) as e:
            op()
        assert time.monotonic() - t0 < 0.5 + 0.3
        _one_line_naming(e.value, dead)
        assert "connection refused" in str(e.value)
    t0 = time.monotonic()
    with pytest.raises(kv.Unreachable):
        etcd.connect(dead, timeout=0.5)
    assert time.monotonic() - t0 < 1.0

    with socket.socket() as silent:  # the kernel accepts; nobody reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        ep = f"127.0.0.1:{silent.getsockname()[1]}"
        s = etcd.EtcdKV(ep, timeout=0.8)
        t0 = time.monotonic()
        with pytest.raises(kv.Unreachable, match="timed out") as e:
            s.get("k")
        assert 0.7 < time.monotonic() - t0 < 1.3
        _one_line_naming(e.value, ep)


@needs_etcd
@pytest.mark.parametrize("victim", ["leader", "follower"])
def test_member_sigkilled_mid_way(own_cluster, victim):
    """The member in use (the leader, or a follower) is SIGKILLed while one connection takes in a
    loop and another waits for a key: every call goes on (failing over), the waiter sees the key."""
    c = own_cluster
    leader = c.leader()
    first = leader if victim == "leader" else (leader + 1) % 3
    order = [first] + [i for i in range(3) if i != first]
    endpoints = ",".join(
        c.members[i].endpoint for i in order
    )  # the victim first: it is the one in use
    s = etcd.connect(endpoints, timeout=5)
    adder, waiter = s.clone(), s.clone()
    s.set("k/before", b"1")

    returned, errors, stop = [], [], threading.Event()

    def add_loop():
        try:
            while not stop.is_set():
                returned.append(adder.take("k/counter"))
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(repr(e))

    woke = {}

    def wait_loop():
        woke["found"] = waiter.wait("k/after", 15)
        woke["at"] = time.monotonic()

    threads = [threading.Thread(target=add_loop), threading.Thread(target=wait_loop)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    c.members[first].kill()
    killed_at = time.monotonic()
    s.set("k/after", b"2")  # fails over from the dead member
    first_op = time.monotonic() - killed_at
    assert s.get("k/before") == b"1"
    assert s.compare_set("k/cas", None, b"x") is True
    assert s.multi_get(["k/before", "k/after"]) == [b"1", b"2"]
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(20)
    assert not errors
    assert woke.get("found") is True and woke["at"] - killed_at < 6
    assert first_op < 5, f"the first call after the kill took {first_op:.1f} s"
    assert returned == sorted(set(returned))  # each take returned a number no other take did
    total = s.taken("k/counter")
    # at-least-once: a take in flight on the killed member may have been applied before its retry
    assert total in (len(returned), len(returned) + 1)
    assert s.take("k/counter") == total + 1
    for x in (s, adder, waiter):
        x.close()


def test_first_member_tried_is_the_nodes_own_else_one_at_random():
    """etcd beside the node: its own member first (an address of this machine, by literal or by
    name); none here (documentation addresses this machine does not have): the nodes spread
    over the members."""
    mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    a, b, c = [
        ip
        for ip in (f"{net}.{i}" for net in ("198.51.100", "203.0.113") for i in range(1, 9))
        if ip not in mine
    ][:3]
    assert etcd.preferred_endpoint(etcd.parse_endpoints(f"{a}:2379,127.0.0.1:2379,{b}")) == 1
    assert etcd.preferred_endpoint(etcd.parse_endpoints(f"{a}:2379,localhost:2379")) == 1
    far = etcd.parse_endpoints(f"{a},{b},{c}")
    assert {etcd.preferred_endpoint(far) for _ in range(200)} == {0, 1, 2}


@needs_etcd
def test_member_that_stops_answering_costs_a_call_one_attempt(own_cluster):
    """The member in use stops answering (SIGSTOP: the kernel still takes the bytes in, as with
    a member cut off mid-request): the next call moves on after one attempt's time (well under
    the 1.25 s of silence that makes a node lost), later calls go to the member that answered,
    and a connection made now (its first member the stopped one) serves calls and waits."""
    c = own_cluster
    first = (c.leader() + 1) % 3  # a follower: the cluster keeps its leader and quorum
    endpoints = ",".join(
        c.members[i].endpoint for i in [first] + [i for i in range(3) if i != first]
    )
    s = etcd.connect(endpoints, timeout=5)
    s.set("k/a", b"1")
    c.members[first].signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        s.set("k/b", b"2")
        took = time.monotonic() - t0
        assert took < etcd.ATTEMPT_TIMEOUT + 0.4, took
        t0 = time.monotonic()
        assert s.get("k/b") == b"2" and s.take("k/n") == 1
        assert time.monotonic() - t0 < 0.3
        fresh = etcd.connect(endpoints, timeout=5)
        woke = {}
        t = threading.Thread(
            target=lambda: woke.update(found=fresh.clone().wait("k/c", 10), at=time.monotonic())
        )
        t.start()
        time.sleep(1.0)
        t_set = time.monotonic()
        s.set("k/c", b"3")
        t.join(12)
        assert woke.get("found") is True and woke["at"] - t_set < 1.0, woke
        fresh.close()
    finally:
        c.members[first].signal(signal.SIGCONT)
    s.close()


@needs_etcd
def test_quorum_lost_then_regained(own_cluster):
    """Two of three members stopped: every call raises Unreachable within its timeout (no write or
    linearizable read can succeed without a quorum); started again, the same connection works."""
    c = own_cluster
    s = etcd.connect(c.endpoints, timeout=1.0)
    s.set("q/k", b"v")
    down = [m for i, m in enumerate(c.members) if i != 0][:2]
    for m in down:
        m.stop()
    ops = {
        "set": lambda: s.set("q/k", b"w"),
        "get": lambda: s.get("q/k"),
        "multi_get": lambda: s.multi_get(["q/k"]),
        "take": lambda: s.take("q/n"),
        "taken": lambda: s.taken("q/n"),
        "compare_set": lambda: s.compare_set("q/k", b"v", b"x"),
        "wait": lambda: s.wait("q/absent", 5),
    }
    for name, op in ops.items():
        t0 = time.monotonic()
        with pytest.raises(kv.Unreachable) as e:
            op()
        took = time.monotonic() - t0
        assert took < 1.0 + 0.5, f"{name} took {took:.2f} s"
        _one_line_naming(e.value, c.endpoints)
    for m in down:
        m.start()
    c.wait_healthy(20)
    # The set that raised may still have been applied: a lone leader takes a proposal in before it
    # notices it lost its quorum, and commits it once the quorum is back (as a TCPStore timeout, it
    # is "unknown", never "not done").
    assert s.get("q/k") in (b"v", b"w")
    s.set("q/k", b"back")
    assert s.take("q/n") in (1, 2)  # a take that raised may have been applied too
    assert s.compare_set("q/k", b"back", b"again") is True
    s.close()


# --- authentication and TLS (one member each) -----------------------------------------------------


@needs_etcd
def test_user_password_auth(tmp_path):
    c = EtcdCluster(tmp_path / "etcd", size=1).start()
    try:
        m = c.members[0]
        for path, body in [
            ("/v3/auth/user/add", {"name": "root", "password": "s3cret"}),
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ]:
            m.get_json(path, method="POST", body=body)
        (tmp_path / "pw").write_text("s3cret\n")
        (tmp_path / "pw").chmod(0o600)  # a secret's file: no one else may read it
        s = etcd.connect(c.endpoints, timeout=3, user="root", password_file=str(tmp_path / "pw"))
        s.set("a/k", b"v")
        assert s.get("a/k") == b"v"
        assert s.take("a/n") == 1

        for user, password in [("root", "wrong"), ("nobody", "x")]:
            t0 = time.monotonic()
            with pytest.raises(etcd.Refused, match="authentication failed"):
                etcd.connect(c.endpoints, timeout=3, user=user, password=password)
            assert time.monotonic() - t0 < 2  # refused at once, not retried until the timeout
        anonymous = etcd.EtcdKV(c.endpoints, timeout=3)
        with pytest.raises(etcd.Refused, match="user name is empty"):
            anonymous.get("a/k")

        # A restarted member forgets its tokens: the connection logs in again by itself.
        m.stop()
        m.start()
        c.wait_healthy(20)
        assert s.get("a/k") == b"v"
        s.close()
    finally:
        c.stop()


_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@needs_etcd
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make test certificates")
def test_tls_with_client_certificates(tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    _openssl(
        "req",
        "-x509",
        *_EC,
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=elasticd test CA",
        cwd=d,
    )
    # the member's certificate serves clients and is also the client certificate its own gateway
    # presents to the member's gRPC (etcd 3.4), hence clientAuth too
    for name, ext in [
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "req",
            *_EC,
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )
    tls = dict(cacert=str(d / "ca.pem"), cert=str(d / "client.pem"), key=str(d / "client.key"))
    c = EtcdCluster(
        tmp_path / "etcd",
        size=1,
        scheme="https",
        client_tls=etcd.tls_context(**tls),
        extra=(
            "--cert-file",
            str(d / "server.pem"),
            "--key-file",
            str(d / "server.key"),
            "--trusted-ca-file",
            str(d / "ca.pem"),
            "--client-cert-auth",
        ),
    ).start()
    try:
        s = etcd.connect(c.endpoints, timeout=3, **tls)
        assert s.endpoint.startswith("https://127.0.0.1:")
        s.set("t/k", b"v")
        assert s.get("t/k") == b"v"
        waiter = s.clone()
        threading.Timer(0.2, s.set, args=("t/later", b"x")).start()
        assert waiter.wait("t/later", 5) is True
        before = _watches_started(c)  # a wait in slices keeps its watch over TLS too
        for _ in range(5):
            assert waiter.wait("t/sliced", 0.1) is False
        assert _watches_started(c) - before == 1
        threading.Timer(0.2, s.set, args=("t/sliced", b"x")).start()
        t0 = time.monotonic()
        assert waiter.wait("t/sliced", 5) is True and time.monotonic() - t0 < 1.5
        waiter.close()

        https = ",".join(f"https://{ep}" for ep in c.endpoints.split(","))
        with pytest.raises(
            kv.Unreachable, match="CERTIFICATE_VERIFY_FAILED"
        ):  # the system's CAs do not know it
            etcd.connect(https, timeout=0.5)
        with pytest.raises(
            kv.Unreachable
        ):  # no client certificate: the member refuses the handshake
            etcd.connect(c.endpoints, timeout=0.5, cacert=tls["cacert"])
        s.close()
    finally:
        c.stop()
