"""Network namespaces for tests: nodes on addresses of their own, and links a test can cut.

`Network(n)` makes a switch namespace holding a bridge, and n node namespaces, each with loopback
and one veth (`DEV`, at 10.231.S.(i+1)/24) plugged into the bridge. Nothing outside the
namespaces it made is touched (the addresses exist only inside them). close() kills whatever
still runs inside them and deletes them, their links with them; the `netns` fixture calls it
after the test, failed or not; a test process killed before that (SIGKILL, SIGTERM) leaves them,
and the next Network made sweeps them (their names carry the owner's pid). Every `ip` call is
bounded in time. Needs root and iproute2.

Use: `Daemon(..., prefix=net.prefix(i))` runs a node inside namespace i (`ip netns exec` execs,
so the daemon keeps its pid); `call(i, fn)` runs a function of the test inside it (a helper
thread that enters the namespace: the sockets fn opens live there). `cut(i)` takes node i's
port on the switch down: its packets are then lost, as in a partition (its own link stays up, so
nothing fails fast); `heal(i)` undoes it.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time

import pytest

DEV = "eth0"  # the node's interface inside its namespace (GLOO_SOCKET_IFNAME for its workers)
BRIDGE = "br0"
IP_TIMEOUT = 10.0  # seconds any one `ip` command may take
CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is missing"
    return None


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _owner_gone(ns: str) -> bool:
    """Whether `ns` is a Network's whose test process (named in it) no longer runs."""
    parts = ns.split("-")
    if len(parts) != 3 or not parts[0].startswith("ed") or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def sweep_orphans() -> None:
    """Delete the namespaces of test processes that were killed before their teardown ran (a
    SIGKILLed or SIGTERMed pytest), after killing what still runs inside them."""
    for ns in (line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()):
        if _owner_gone(ns):
            _delete(ns, time.monotonic() + 10.0)


def _pids(ns: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", ns).split()]


def _delete(ns: str, deadline: float) -> None:
    """SIGKILL what runs inside `ns`, wait (until `deadline`) for it to go, delete `ns` (and its
    /etc/netns/ files: `Network.silent_dns`)."""
    while (left := _pids(ns)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    ip("netns", "del", ns)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


class Network:
    def __init__(self, nodes: int, subnet: int = 0):
        sweep_orphans()
        # unique names that say whose they are: test sessions may run side by side
        tag = f"ed-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{tag}sw"
        self.nodes = [f"{tag}n{i}" for i in range(nodes)]
        self.subnet = subnet
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.switch, *self.nodes):
            ip("netns", "add", ns)
            self._made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for i, ns in enumerate(self.nodes):
            ip(
                "-n",
                self.switch,
                "link",
                "add",
                self._port(i),
                "type",
                "veth",
                "peer",
                "name",
                DEV,
                "netns",
                ns,
            )
            ip("-n", self.switch, "link", "set", self._port(i), "master", BRIDGE, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", DEV)
            ip("-n", ns, "link", "set", DEV, "up")

    @staticmethod
    def _port(i: int) -> str:
        return f"p{i}"

    def addr(self, i: int) -> str:
        return f"10.231.{self.subnet}.{i + 1}"

    def prefix(self, i: int) -> tuple[str, ...]:
        """The command prefix that runs a program as node i."""
        return ("ip", "netns", "exec", self.nodes[i])

    def call(self, i: int, fn, timeout: float = 10.0):
        """fn() run inside node i's namespace, its result returned (its exception raised). A
        network namespace is per thread (setns), so a thread of its own enters it and ends."""
        out: dict = {}

        def run() -> None:
            try:
                fd = os.open(f"/run/netns/{self.nodes[i]}", os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.nodes[i]}")
                finally:
                    os.close(fd)
                out["value"] = fn()
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                out["error"] = e

        t = threading.Thread(target=run, name=f"in-{self.nodes[i]}", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a call inside {self.nodes[i]} took over {timeout} s")
        if "error" in out:
            raise out["error"]
        return out["value"]

    def silent_dns(self, i: int, hosts: str = "127.0.0.1 localhost\n") -> None:
        """Node i's resolver asks a DNS server on its own link that nobody answers for: each
        query waits glibc's timeout (1 s), as where a DNS server drops queries or is cut off.
        `ip netns exec` mounts /etc/netns/NAME/ over /etc: `hosts` is node i's /etc/hosts.
        Programs run there with RES_OPTIONS set to "" (tests/conftest.py sets attempts:0)."""
        server = self.addr(i).rsplit(".", 1)[0] + ".99"  # the query leaves, unanswered
        ip("-n", self.nodes[i], "neigh", "add", server, "lladdr", "02:00:00:00:00:63", "dev", DEV)
        etc = f"/etc/netns/{self.nodes[i]}"  # removed with the namespace (_delete)
        os.makedirs(etc)
        with open(f"{etc}/resolv.conf", "w") as f:
            f.write(f"nameserver {server}\noptions timeout:1 attempts:1\n")
        with open(f"{etc}/hosts", "w") as f:
            f.write(hosts)

    def cut(self, i: int) -> None:
        ip("-n", self.switch, "link", "set", self._port(i), "down")

    def heal(self, i: int) -> None:
        ip("-n", self.switch, "link", "set", self._port(i), "up")

    def pids(self, ns: str) -> list[int]:
        return _pids(ns)

    def close(self, timeout: float = 10.0) -> None:
        """SIGKILL what runs inside our namespaces, wait (bounded) for it to go, delete them."""
        deadline = time.monotonic() + timeout
        for ns in reversed(self._made):
            _delete(ns, deadline)
        self._made.clear()


@pytest.fixture(name="netns")
def netns_fixture():
    """Factory: netns(n, subnet=0) -> a Network of n nodes, closed after the test whatever happened.
    Skips the test (with the reason) where namespaces cannot be made."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Network] = []

    def make(nodes: int, subnet: int = 0) -> Network:
        try:
            net = Network(nodes, subnet)
        except RuntimeError as e:  # a container without CAP_NET_ADMIN, a kernel without veth
            pytest.skip(f"cannot make network namespaces here: {e}")
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()
