"""elasticd/cluster/etcd.py: the control plane's KV on a real etcd cluster (tests/etcd_cluster.py: 3
members on loopback), held to the same semantics as the c10d TCPStore's (one set of tests run
against both), plus what only a cluster has: a member SIGKILLed under load, quorum lost and
regained, every endpoint dead or silent, authentication and TLS."""

from __future__ import annotations

import datetime
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from elasticd.cluster import etcd, kv, tcpstore
from etcd_cluster import (  # noqa: F401 (the fixtures)
    SKIP_REASON,
    EtcdCluster,
    etcd_binary,
    free_port,
    own_cluster_fixture,
    shared_cluster_fixture,
)

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason=SKIP_REASON)


@pytest.fixture(params=["tcpstore", "etcd", "local"])
def connect(request):
    """A function making a new connection (a kv.KV) to one store: a c10d TCPStore, the etcd cluster,
    or a single-node job's in-process store (each connection a clone of the first)."""
    if request.param == "local":
        first = kv.LocalKV()
        yield first.clone
        return
    if request.param == "etcd":
        c = request.getfixturevalue("cluster")
        made = []

        def open_etcd():
            made.append(etcd.connect(c.endpoints, timeout=5))
            return made[-1]

        yield open_etcd
        for s in made:
            s.close()
        return
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    port = server.port

    def open_tcp():
        return tcpstore.TCPStoreKV(
            tcpstore.tcp_connector("127.0.0.1", port), f"127.0.0.1:{port}", timeout=5
        )

    yield open_tcp
    del server


_n = iter(range(1_000_000))


@pytest.fixture
def prefix(request):
    """Keys of this test's own, on a store other tests share."""
    return f"elasticd/test/{request.node.name}/{next(_n)}/"


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


def _one_line_naming(err: Exception, endpoints: str):
    text = str(err)
    assert "\n" not in text and len(text) < 1000, text
    for ep in endpoints.split(","):
        assert ep in text, text


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
