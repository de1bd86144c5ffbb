"""A real etcd cluster for tests and benchmarks: N members (3 by default), each with its own data
directory and two free ports, bound to 127.0.0.1 only, or, given a tests/netns.Network, member i
inside node i's namespace on that node's address (as etcd co-located with the training nodes:
a node lost or cut off takes its member with it); started, checked healthy
within a bound, members stopped / killed / started again one by one, and the whole cluster
stopped (SIGTERM, then SIGKILL after a grace) at the end. Members die with the process that
started them (parent-death signal), so a killed test run leaves no etcd behind.

`etcd_binary()` is None where etcd is not installed (`apt-get install etcd-server` on Debian);
the tests skip then, saying so."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from harness import free_port

SKIP_REASON = "no etcd binary on PATH (apt-get install etcd-server, or put etcd 3.4+ on PATH)"
# Raft timing for a loopback cluster on a busy 2-core machine: a lost leader is replaced in about
# a second, without elections started by a scheduling hiccup.
HEARTBEAT_MS = 100
ELECTION_MS = 1000


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Member:
    def __init__(self, cluster: EtcdCluster, index: int):
        self.cluster = cluster
        self.index = index
        self.name = f"m{index}"
        net = cluster.net
        self.host = "127.0.0.1" if net is None else net.addr(index)
        self.prefix: tuple[str, ...] = () if net is None else net.prefix(index)
        # a namespace of the test's own has every port free
        self.client_port = free_port() if net is None else 2379
        self.peer_port = free_port() if net is None else 2380
        self.dir = cluster.root / self.name
        self.data_dir = self.dir / "data"
        self.log = self.dir / "etcd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def url(self) -> str:
        return f"{self.cluster.scheme}://{self.endpoint}"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        c = self.cluster
        cmd = [
            c.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            c.initial_cluster,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            c.token,
            "--heartbeat-interval",
            str(HEARTBEAT_MS),
            "--election-timeout",
            str(ELECTION_MS),
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            "--log-level",
            "warn",
            *c.extra,
        ]
        # Not tagged with the test session: a module's cluster outlives each test's leak check
        # (the fixture stops it; the parent-death signal covers a killed run).
        env = {k: v for k, v in os.environ.items() if k != "ELASTICD_TEST_SESSION"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, *cmd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                preexec_fn=_die_with_parent,
            )

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, and reaped."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        self.signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get_json(
        self, path: str, timeout: float = 1.0, method: str = "GET", body: dict | None = None
    ) -> dict:
        """A request to this member's client URL (from inside its namespace, where it has one)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )

        def ask() -> dict:
            with urllib.request.urlopen(req, timeout=timeout, context=self.cluster.client_tls) as r:
                return json.loads(r.read())

        return (
            ask()
            if self.cluster.net is None
            else self.cluster.net.call(self.index, ask, timeout + 5)
        )

    def healthy(self) -> bool:
        try:
            return self.get_json("/health").get("health") == "true"
        except (OSError, ValueError):
            return False

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class EtcdCluster:
    """`size` members on 127.0.0.1, or in the first `size` namespaces of `net`. `extra`: more etcd
    flags for every member (TLS, ...); `scheme`/`client_tls`: how the members' client URLs are
    served and reached by the helpers."""

    def __init__(
        self,
        root: Path,
        size: int = 3,
        extra: tuple[str, ...] = (),
        scheme: str = "http",
        client_tls=None,
        binary: str | None = None,
        net=None,
    ):
        self.root = Path(root)
        self.net = net
        self.binary = binary or etcd_binary()
        if self.binary is None:
            raise RuntimeError(SKIP_REASON)
        self.size = size
        self.extra = tuple(extra)
        self.scheme = scheme
        self.client_tls = client_tls
        self.token = f"elasticd-test-{os.getpid()}-{time.monotonic_ns()}"
        self.members: list[Member] = []

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        """Start every member and wait (bounded) until each says it is healthy; ports that another
        process took in between are chosen again (three tries)."""
        for attempt in range(3):
            self.members = [Member(self, i) for i in range(self.size)]
            for m in self.members:
                m.start()
            try:
                self.wait_healthy(timeout)
                return self
            except RuntimeError:
                if attempt == 2 or all(m.alive() for m in self.members):
                    self.stop()
                    raise
                self.stop()  # a member lost its port to another process: new ports, new data dirs
                shutil.rmtree(self.root, ignore_errors=True)
        raise AssertionError("unreachable")

    def wait_healthy(self, timeout: float = 20.0, members: list[Member] | None = None) -> float:
        """Seconds until every (given, else live) member reports healthy (it has a leader and
        serves reads); RuntimeError with the members' logs when `timeout` passes."""
        t0 = time.monotonic()
        members = members if members is not None else [m for m in self.members if m.alive()]
        while True:
            if all(m.healthy() for m in members):
                return time.monotonic() - t0
            dead = [m for m in members if not m.alive()]
            if dead or time.monotonic() - t0 > timeout:
                logs = "\n".join(
                    f"--- {m.name} ({'alive' if m.alive() else 'exited'}):\n{m.log_tail()}"
                    for m in members
                )
                raise RuntimeError(
                    f"etcd cluster not healthy after {time.monotonic() - t0:.1f} s\n{logs}"
                )
            time.sleep(0.05)

    def leader(self) -> int:
        """The index of the member that leads, as the live members report it."""
        status = {
            i: m.get_json("/v3/maintenance/status", method="POST", body={})
            for i, m in enumerate(self.members)
            if m.alive()
        }
        by_id = {st["header"]["member_id"]: i for i, st in status.items()}
        leaders = {st.get("leader") for st in status.values()}
        if len(leaders) != 1 or next(iter(leaders)) not in by_id:
            raise RuntimeError(f"no single live leader: {leaders}")
        return by_id[next(iter(leaders))]

    def move_leader(self, index: int, timeout: float = 10.0) -> None:
        """Hand the leadership to member `index` (etcd's own transfer, asked of the leader) and
        wait (bounded) until the live members agree it leads."""
        target = self.members[index].get_json("/v3/maintenance/status", method="POST", body={})[
            "header"
        ]["member_id"]
        deadline = time.monotonic() + timeout
        while True:
            try:
                leader = self.leader()
                if leader == index:
                    return
                self.members[leader].get_json(
                    "/v3/maintenance/transfer-leadership",
                    method="POST",
                    body={"targetID": target},
                    timeout=5.0,
                )
            except (OSError, ValueError, KeyError, RuntimeError):
                pass  # an election under way: ask again
            if time.monotonic() > deadline:
                raise RuntimeError(f"member {index} did not take the leadership within {timeout} s")
            time.sleep(0.1)

    def stop(self, grace: float = 3.0) -> None:
        """Every member stopped: SIGTERM, then SIGKILL after `grace`; one at a time, the leader last
        (a leader told to stop hands its leadership to a follower first, and waits seconds for one
        that is stopping too)."""
        order = list(range(len(self.members)))
        try:
            order.append(order.pop(self.leader()))
        except (OSError, ValueError, KeyError, RuntimeError):
            pass
        for i in order:
            self.members[i].stop(grace)


@pytest.fixture(name="own_cluster")
def own_cluster_fixture(tmp_path):
    """A 3-member cluster of the test's own, for tests that stop or kill members (skipped, saying
    why, where etcd is not installed)."""
    if etcd_binary() is None:
        pytest.skip(SKIP_REASON)
    c = EtcdCluster(tmp_path / "etcd").start()
    yield c
    c.stop()


@pytest.fixture(name="cluster", scope="module")
def shared_cluster_fixture(tmp_path_factory):
    """One healthy 3-member cluster for a module's tests that only read and write (each uses its
    own keys)."""
    if etcd_binary() is None:
        pytest.skip(SKIP_REASON)
    c = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield c
    c.stop()
