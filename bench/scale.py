"""The control plane at scale: N simulated nodes run elasticd's real rendezvous, liveness and
restart code (rendezvous.Rendezvous + peers.Peers, no workers) against one c10d TCPStore served
by a process of its own, or (--backend etcd) a 3-member etcd cluster on loopback; side by side
on c10d, torch's c10d DynamicRendezvousHandler as torchrun uses it.

Design. The N nodes live as threads in P worker processes (--procs, default 8: N/P nodes each),
so that no single GIL bounds them and both cores are used. Every simulated node is what a daemon
holds: its own Rendezvous with its own store connection (a tcpstore.TCPStoreKV made as the daemon
makes it, with tcpstore.tcp_connector), its own Peers (the liveness thread and, per round, the
restart-waiter thread, each on its own cloned connection) and a thread that calls next_round. So
the store sees what it would see from N daemons: the same keys and requests, from 3 connections
per node. What a daemon's agent loop does with Peers (check() every --monitor-interval) one thread
per process does for its nodes. The store is a process of its own hosting a TCPStore server as
the daemon hosts it (tcpstore.serve_store), whose CPU psutil measures; torch's side uses the
same server. What the simulation changes, and why:
- the worker processes run with sys.setswitchinterval(0.05) (--switch-interval): with hundreds
  of threads per interpreter, Python's 5 ms hand-over of the GIL spent the 2 cores on waking
  threads (a 1024-node round took 13-48 s instead of 3-4 s); a daemon has a handful of threads;
- our processes see a private /etc/hosts naming ::ffff:127.0.0.1 (a mount namespace of their
  own, when root): torch's TCPStore makes a reverse DNS lookup for every connection, on the
  store's only event-loop thread too, and this VM's resolver drops about 2% of queries (5 s each);
- the restart waiter's connection is opened at start-up (a daemon opens it at its first round and
  keeps it): the phases measured are those of any later round;
- a store call is bounded at 5 s (STORE_CALL_TIMEOUT: the daemon's, at the default --peer-timeout)
  while --peer-timeout is 3 s, to time the fallback path of node loss quickly.

--backend etcd: the store is a real 3-member etcd cluster on 127.0.0.1 (tests/etcd_cluster.py; the
data directories in a temporary directory, as bench/etcd_kv.py makes them, so on this machine's
disk, and fsync on, as a deployment runs it). Each node's connection is made as
rendezvous.open_etcd makes a daemon's (etcd.connect with every member's endpoint, checked to
answer with a leader; Peers clones it twice), with the same 5 s bound on a call. Requests are
counted on the wire in etcd's unit: every HTTP request elasticd's etcd client sends a member (a
range, put or txn, each watch opened; EtcdRequests); the store's CPU is the three members'
summed. torch's side is not run: its etcd rendezvous backend needs python-etcd and etcd's v2 API,
neither of which elasticd uses (etcd 3.4 serves v2 only with --enable-v2, 3.6 not at all).

For each N, elasticd:
- round_s: all N call next_round at the same instant T (threads released at a shared
  CLOCK_MONOTONIC time) -> the last one returns;
- store_requests_per_s and store_cpu: a steady window after the round (liveness beats, the
  waiters' blocking waits, the waiting-nodes check): requests counted on the client side (each
  TCPStore call through a counting proxy, summed over processes), the store process's CPU time
  over the window / wall (cores); the same while N-1 nodes wait at the exit barrier for the last;
- propagation_s: one node's request_restart -> every node's restart waiter has seen it (the
  wake-up Peers gives the agent loop), the latest of N timestamps;
- detection_s: one node silenced (its Peers threads stopped: it beats no more) -> both of its
  watchers' Peers.lost_neighbour return NODE_LOST, on the evidence path: the beats handed in are
  fake worker heartbeats of workers stepping every --step-time seconds until the node went
  silent, then stalled (their collectives wait on it), as real ones would be. The fallback (no
  evidence: silence for --peer-timeout, 3 s here) is timed on the same event (table only);
- recovery_s: the control plane's part of a node's loss, on a second event: one node silenced ->
  every survivor has returned from its next next_round (detection on the evidence path, the
  watcher's restart request naming the lost node as the agent writes it, its propagation, the
  round of those left). The workers' teardown a daemon does in between is not simulated; the
  end-to-end figure (survivors stepping again) is the tests'. It needs a round whose restart key
  is unset, so the nodes first rejoin after the propagation phase's restart (the N-1 not
  silenced for detection; that round's closing finds that node lost), with --nnodes N-2:2N from
  then on, as an elastic job that may lose two nodes.
The nodes are configured --nnodes N:2N with --last-call-timeout 0: the round closes the moment N
nodes are in (as N:N would), and the liveness threads run the waiting-nodes check an elastic job
runs (a full N:N round skips it), so the steady state is the costlier of the two.

torch (torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler.from_backend
over C10dRendezvousBackend, min = max = N, keep_alive_interval 5 s as torchrun's default, and 1 s
with --torch-keepalive 5,1), one handler and one TCPStore client per node as torchrun makes them:
- torchrun_round_s: all N call next_rendezvous at T -> the last one returns;
- its steady state (keep-alives, plus num_nodes_waiting() every --monitor-interval as torchrun's
  agent loop calls it): store CPU and requests/s, counted through a dist.Store subclass proxy.

Every phase is bounded (--timeout, --start-timeout); a size that does not finish in time is
reported as such (null in --json, with why on stderr), never hangs. All N nodes share this
machine's cores, where a real node has its own: where our client processes use the cores up (the
log says how many they used), a latency measured here is an upper bound and a request rate a
lower one. The table shows what else ran on the machine during the steady window.

    PYTHONPATH=$PWD python bench/scale.py                 # 16, 64, 256, 1024, 2048
    PYTHONPATH=$PWD python bench/scale.py --nodes 1024 --json
    PYTHONPATH=$PWD python bench/scale.py --backend etcd  # 16, 64, 256 (etcd 3.4+ on PATH)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE_SERVER = ROOT / "tests" / "scripts" / "store_server.py"
SIZES = (16, 64, 256, 1024, 2048)
ETCD_SIZES = (16, 64, 256)
KEYS = (
    "nodes",
    "round_s",
    "torchrun_round_s",
    "propagation_s",
    "detection_s",
    "recovery_s",
    "store_requests_per_s",
    "store_cpu",
)


class PhaseTimeout(Exception):
    """A phase did not finish within its bound."""


# ---------------------------------------------------------------------------------------------
# coordinator
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _more_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCH_CPP_LOG_LEVEL"] = (
        "ERROR"  # as the daemon sets it (systemd.quiet_torch_cpp): no line per wait timeout
    )
    return env


class Child:
    """A process we started, spoken to with one JSON object per line (its stdout is ours alone;
    its stderr goes to a log file shown when it fails)."""

    hosts: Path | None = None  # a private /etc/hosts for our processes (see private_hosts)

    def __init__(self, argv: list[str], log_path: Path):
        self.log_path = log_path
        if Child.hosts is not None:
            argv = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"',
                str(Child.hosts),
                *argv,
            ]
        self._log = open(log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=_env(),
            preexec_fn=_more_files,
            cwd=ROOT,
        )
        self._buf = b""

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise RuntimeError(f"worker {self.proc.pid} is gone ({e}): {self.tail()}") from None

    def line(self, timeout: float) -> bytes:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PhaseTimeout(f"process {self.proc.pid} did not answer within {timeout:g}s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise RuntimeError(
                        f"process {self.proc.pid} exited ({self.proc.poll()}): {self.tail()}"
                    )
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def recv(self, timeout: float) -> dict:
        return json.loads(self.line(timeout))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def private_hosts(work: Path) -> Path | None:
    """torch's TCPStore names every socket it connects or accepts with getnameinfo: a reverse
    lookup, made on the store's one event-loop thread for each accepted connection, and in each
    client's connect. The loopback address a client uses (::ffff:127.0.0.1) is not in /etc/hosts,
    so it goes to DNS, and where the resolver drops a query (this VM's drops about 2%) that
    lookup takes 5 s: the whole store stops answering for 5 s, or a connect times out. Our
    processes get a private /etc/hosts naming that address (a mount namespace of their own; the
    machine's file is untouched), so that what is measured is the control plane, not the resolver.
    None where that cannot be done (not root, no unshare): then say so."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    hosts = work / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + "\n::ffff:127.0.0.1 scale-loopback\n")
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            'mount --bind "$0" /etc/hosts && exec true',
            str(hosts),
        ],
        capture_output=True,
    )
    return hosts if probe.returncode == 0 else None


def ask_all(workers: list[Child], msg: dict | list[dict], timeout: float) -> list[dict]:
    """Send to every worker (the same message, or one each), then collect every reply."""
    msgs = msg if isinstance(msg, list) else [msg] * len(workers)
    for w, m in zip(workers, msgs):
        w.send(m)
    deadline = time.monotonic() + timeout
    return [w.recv(max(0.1, deadline - time.monotonic())) for w in workers]


def split(n: int, procs: int) -> list[tuple[int, int]]:
    """(first node index, count) per process."""
    procs = max(1, min(procs, n))
    out, first = [], 0
    for p in range(procs):
        count = n // procs + (1 if p < n % procs else 0)
        out.append((first, count))
        first += count
    return out


def busy_cores() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def steady_window(store, workers: list[Child], warmup: float, window: float) -> dict:
    """Requests/s (client-side counts), store CPU, our clients' CPU and the whole machine's busy
    cores over `window` seconds, after `warmup`."""
    time.sleep(warmup)
    a = ask_all(workers, {"cmd": "counts"}, 30)
    s0, m0, t0 = sum(store.cpu_times()[:2]), busy_cores(), time.monotonic()
    time.sleep(window)
    b = ask_all(workers, {"cmd": "counts"}, 30)
    s1, m1, t1 = sum(store.cpu_times()[:2]), busy_cores(), time.monotonic()
    if os.environ.get("SCALE_DEBUG"):
        log(f"counts {a} {b}")
        ask_all(workers, {"cmd": "stacks"}, 30)  # every worker's threads, into its log
    rate = sum((y["requests"] - x["requests"]) / (y["t"] - x["t"]) for x, y in zip(a, b))
    clients = sum((y["cpu"] - x["cpu"]) / (y["t"] - x["t"]) for x, y in zip(a, b))
    store_cpu = (s1 - s0) / (t1 - t0)
    machine = (m1 - m0) / (t1 - t0)
    return {
        "requests_per_s": rate,
        "store_cpu": store_cpu,
        "client_cpu": clients,
        "other_cpu": max(0.0, machine - store_cpu - clients),
        "unexpected": sum((y.get("unexpected", 0)) for y in b),
        "errors": [e for y in b for e in y.get("errors", [])][:3],
    }


class StoreCpu:
    """The store's processes as psutil sees them, summed: the c10d store process, or the etcd
    cluster's members (a write there costs all three: the leader and two followers fsync it)."""

    def __init__(self, pids: list[int]):
        import psutil

        self._procs = [psutil.Process(pid) for pid in pids]

    def cpu_times(self) -> tuple[float, float]:
        times = [p.cpu_times() for p in self._procs]
        return sum(t.user for t in times), sum(t.system for t in times)


def start_etcd(start_timeout: float):
    """A 3-member etcd cluster on loopback (tests/etcd_cluster.py), its data directories in a
    temporary directory as bench/etcd_kv.py makes them (/tmp: this VM's one disk); fsync on, as a
    real deployment runs it."""
    sys.path.insert(0, str(ROOT / "tests"))
    from etcd_cluster import SKIP_REASON, EtcdCluster, etcd_binary

    if etcd_binary() is None:
        raise RuntimeError(SKIP_REASON)
    root = Path(tempfile.mkdtemp(prefix="elasticd-scale-etcd-"))
    try:
        return EtcdCluster(root).start(timeout=min(start_timeout, 60.0)), root
    except BaseException:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        raise


class Session:
    """One store (a c10d store process, or an etcd cluster) and P worker processes for one size of
    one system."""

    def __init__(self, kind: str, n: int, args, work: Path, extra: list[str] = ()):
        self.kind, self.n, self.args = kind, n, args
        self.store: Child | None = None
        self.cluster = None  # the etcd cluster (--backend etcd) and its data directories
        self.workers: list[Child] = []
        try:
            self._start(work, extra)
        except BaseException:
            self.close()
            raise

    def _start(self, work: Path, extra: list[str]) -> None:
        args, n, kind = self.args, self.n, self.kind
        if args.backend == "etcd":
            self.cluster = start_etcd(args.start_timeout)
            self.store_ps = StoreCpu([m.proc.pid for m in self.cluster[0].members])
            self.port = 0
            extra = [*extra, "--backend", "etcd", "--endpoints", self.cluster[0].endpoints]
        else:
            self.port = self._start_store(work)
        for i, (first, count) in enumerate(split(n, args.procs)):
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                kind,
                "--port",
                str(self.port),
                "--total",
                str(n),
                "--first",
                str(first),
                "--count",
                str(count),
                *extra,
                "--secret",
                str(args.secret_path),
                "--peer-timeout",
                str(args.peer_timeout),
                "--monitor-interval",
                str(args.monitor_interval),
                "--step-time",
                str(args.step_time),
                "--join-timeout",
                str(args.timeout),
                "--switch-interval",
                str(args.switch_interval),
                *(["--lift-value-limit"] if args.lift_value_limit else []),
            ]
            self.workers.append(Child(argv, work / f"{kind}-{n}-w{i}.log"))
        self.ready = ask_all(self.workers, {"cmd": "ready"}, args.start_timeout)

    def _start_store(self, work: Path) -> int:
        self.store = Child(
            [sys.executable, str(Path(__file__).resolve()), "--serve-store"],
            work / f"store-{self.kind}-{self.n}.log",
        )
        word, _, port = self.store.line(self.args.start_timeout).decode().partition(" ")
        if word != "serving":
            raise RuntimeError(f"the store did not start: {self.store.tail()}")
        self.store_ps = StoreCpu([self.store.proc.pid])
        return int(port)

    def round(self) -> dict:
        """Release every node's join at one instant; the time to the last return."""
        import psutil

        at = time.monotonic() + 1.0 + 0.002 * self.n / max(1, len(self.workers))
        for w in self.workers:
            w.send({"cmd": "round", "at": at, "timeout": self.args.timeout})
        procs = [psutil.Process(w.proc.pid) for w in self.workers]
        time.sleep(max(0.0, at - time.monotonic()))
        cpu0, store0 = (
            sum(sum(p.cpu_times()[:2]) for p in procs),
            sum(self.store_ps.cpu_times()[:2]),
        )
        t0 = time.monotonic()
        deadline = time.monotonic() + self.args.timeout + 30
        replies = [w.recv(max(0.1, deadline - time.monotonic())) for w in self.workers]
        t1 = time.monotonic()
        cpu1, store1 = (
            sum(sum(p.cpu_times()[:2]) for p in procs),
            sum(self.store_ps.cpu_times()[:2]),
        )
        done = sum(r["done"] for r in replies)
        errors = [e for r in replies for e in r["errors"]][:3]
        out = {
            "done": done,
            "errors": errors,
            "ranks": [r["ranks"] for r in replies],
            "state": next((r["state"] for r in replies if r.get("state")), None),
            "rejected": sum(r.get("rejected", 0) for r in replies),
            "requests": sum(r.get("requests", 0) for r in replies),
            "sent": sum(r.get("sent", 0) for r in replies),
            "arrived": next((r["arrived"] for r in replies if r.get("arrived")), None),
            "clients_cores": (cpu1 - cpu0) / (t1 - t0),
            "store_cores": (store1 - store0) / (t1 - t0),
        }
        if done == self.n and not errors:
            sizes = {s for r in replies for s in r["sizes"]}
            if sizes != {self.n}:
                out["errors"] = [f"rounds of sizes {sorted(sizes)}, not {self.n}"]
            else:
                out["round_s"] = max(r["end"] for r in replies) - at
                closer = next((r["closer"] for r in replies if r.get("closer")), None)
                if closer:
                    out["closer_s"], out["closer_requests"] = closer[0] - at, closer[1]
                out["round_requests"] = sum(r.get("requests", 0) for r in replies)
        return out

    def where(self, ranks: list[list[int]], group_rank: int) -> tuple[int, int]:
        for w, rs in enumerate(ranks):
            if group_rank in rs:
                return w, rs.index(group_rank)
        raise KeyError(group_rank)

    def close(self) -> None:
        for c in [*self.workers, self.store]:
            if c is not None:
                c.stop()
        if self.cluster is not None:
            import shutil

            cluster, root = self.cluster
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)


def run_elasticd(n: int, args, work: Path) -> dict:
    from elasticd.cluster import timing

    out: dict = {
        "round_s": None,
        "propagation_s": None,
        "detection_s": None,
        "fallback_s": None,
        "recovery_s": None,
        "requests_per_s": None,
        "store_cpu": None,
        "notes": [],
    }
    t = time.monotonic()
    try:
        s = Session("elasticd", n, args, work)
    except (PhaseTimeout, RuntimeError) as e:
        out["notes"].append(f"elasticd: {n} nodes did not start: {e}")
        return out
    try:
        log(f"elasticd n={n}: {n} nodes up in {time.monotonic() - t:.1f}s; forming a round")
        r = s.round()
        if "round_s" not in r:
            out["notes"].append(
                f"elasticd: no round of {n} within {args.timeout:g}s ({r['done']} joined; the "
                f"store's arrival counter: {r['arrived']}; {r['sent']} requests sent; "
                f"{r['rejected']} store values failed verification; our clients used "
                f"{r['clients_cores']:.2f} cores, the store {r['store_cores']:.2f}; {r['errors']})"
            )
            return out
        out["round_s"] = r["round_s"]
        log(
            f"elasticd n={n}: round {r['round_s']:.3f}s (the closer's next_round returned at "
            f"{r.get('closer_s', 0):.3f}s after {r.get('closer_requests')} requests; "
            f"{r.get('round_requests')} "
            f"requests in all; our clients used {r['clients_cores']:.2f} cores, the store "
            f"{r['store_cores']:.2f}); "
            "steady window"
        )
        st = steady_window(s.store_ps, s.workers, args.warmup, args.window)
        out.update(
            requests_per_s=st["requests_per_s"],
            store_cpu=st["store_cpu"],
            client_cpu=st["client_cpu"],
            other_cpu=st["other_cpu"],
        )
        if st["unexpected"] or st["errors"]:
            out["notes"].append(
                f"elasticd n={n}: in the steady window {st['unexpected']} unexpected verdicts "
                f"(a healthy node found lost or the store unreachable): {st['errors']}"
            )

        # the exit barrier: every node but one has finished and waits for it; then it finishes too
        w, local = s.where(r["ranks"], n - 1)
        ask_all(
            s.workers,
            [
                {
                    "cmd": "barrier",
                    "timeout": 60.0,
                    "straggler": local if i == w else None,
                    "straggler_only": False,
                }
                for i in range(len(s.workers))
            ],
            30,
        )
        st = steady_window(s.store_ps, s.workers, 1.0, args.window)
        out.update(barrier_requests_per_s=st["requests_per_s"], barrier_store_cpu=st["store_cpu"])
        t_last = time.monotonic()
        ends = ask_all(
            s.workers,
            [
                {"cmd": "barrier", "timeout": 60.0, "straggler": local, "straggler_only": True}
                if i == w
                else {"cmd": "barrier_wait", "timeout": 60.0}
                for i in range(len(s.workers))
            ],
            90,
        )
        released = sum(e["done"] for e in ends)
        out["barrier_release_s"] = max(e["last"] for e in ends) - t_last
        log(
            f"elasticd n={n}: {n - 1} nodes at the exit barrier: {st['requests_per_s']:.0f} "
            "requests/s, store "
            f"{st['store_cpu']:.3f} cores; the last node in -> {released} of {n} released in "
            f"{out['barrier_release_s']:.3f}s"
        )
        if released != n:
            out["notes"].append(
                f"elasticd n={n}: only {released} of {n} nodes left the exit barrier within 60s"
            )

        # propagation: a node in the middle of the ring asks for a restart
        w, local = s.where(r["ranks"], n // 2)
        s.workers[w].send({"cmd": "restart", "local": local})
        t0 = s.workers[w].recv(30)["t0"]
        seen = ask_all(s.workers, {"cmd": "seen", "timeout": 10.0}, 40)
        count = sum(x["seen"] for x in seen)
        if count == n:
            out["propagation_s"] = max(x["last"] for x in seen) - t0
            lat = sorted(v - t0 for x in seen for v in x["all"])
            out["propagation_p50"] = lat[len(lat) // 2]
            if lat[-1] > 0.5:
                slow = sum(1 for v in lat if v > 0.5)
                out["notes"].append(
                    f"elasticd n={n}: propagation median {lat[len(lat) // 2]:.3f}s, {slow} node(s) "
                    f"over 0.5s (the slowest {lat[-1]:.3f}s)"
                )
        else:
            out["notes"].append(
                f"elasticd n={n}: only {count} of {n} nodes saw the restart within 10s"
            )
        log(f"elasticd n={n}: propagation {out['propagation_s']}; silencing a node")

        # detection: silence a node, its workers' peers stall; its two watchers must find it lost
        target = (n // 2 + 1) % n
        w, local = s.where(r["ranks"], target)
        s.workers[w].send({"cmd": "silence", "local": local})
        reply = s.workers[w].recv(30)
        t_s, target_id = reply["t"], reply["id"]
        bound = args.peer_timeout + 10.0
        found = ask_all(
            s.workers,
            {"cmd": "stall", "since": t_s, "target": target_id, "timeout": bound},
            bound + 30,
        )
        watchers = sum(x["watchers"] for x in found)
        ev = [v for x in found for v in x["evidence"]]
        fb = [v for x in found for v in x["fallback"]]
        false = [v for x in found for v in x["false"]]
        if watchers and len(ev) == watchers:
            out["detection_s"] = too_early(
                max(ev) - t_s, min(ev) - t_s, timing.LOST_SILENCE, "evidence", out["notes"], n
            )
        else:
            out["notes"].append(
                f"elasticd n={n}: {len(ev)} of {watchers} watchers found the silent node lost "
                f"(evidence) within {bound:g}s"
            )
        if watchers and len(fb) == watchers:
            out["fallback_s"] = too_early(
                max(fb) - t_s, min(fb) - t_s, args.peer_timeout, "peer_timeout", out["notes"], n
            )
        if false:
            out["notes"].append(
                f"elasticd n={n}: {len(false)} healthy node(s) taken for lost after the stall: "
                f"{false[:3]}"
            )
        log(
            f"elasticd n={n}: detection {out['detection_s']} (fallback {out['fallback_s']}); "
            "recovery"
        )
        if n >= 3:
            out["recovery_s"] = recovery(s, n, args, out["notes"])
        log(f"elasticd n={n}: recovery {out['recovery_s']}")
    except (PhaseTimeout, RuntimeError, KeyError) as e:
        out["notes"].append(f"elasticd n={n}: {e}")
    finally:
        s.close()
    return out


def too_early(
    last: float, first: float, silence: float, path: str, notes: list[str], n: int
) -> float | None:
    """The detection time, or None where a watcher found the node lost sooner than `silence` (what
    the verdict needs) allows, less what it can have missed before the silence began (its last
    look and the beat before): it had lost sight of the node before it went silent (its beats were
    late: an overloaded store), so the figure would time a false verdict, not a detection."""
    from elasticd.cluster.timing import BEAT_EVERY

    if first >= silence - 2 * BEAT_EVERY:
        return last
    notes.append(
        f"elasticd n={n}: a watcher found the node lost {first:.3f}s after it went silent "
        f"({path}): its "
        "beats were already late (the store overloaded); not a detection"
    )
    return None


def recovery(s: Session, n: int, args, notes: list[str]) -> float | None:
    """One node silenced -> every survivor has returned from its next next_round, the round
    restarted without it: detection on the evidence path, the watcher's restart request naming
    it, the request's propagation and the next round's formation (the workers' teardown, which a
    daemon does in between, is not simulated). It needs a round whose restart key is unset: the
    nodes first rejoin after the propagation phase's restart (N-1 of them: that round's closing
    finds the node silenced for detection lost), with --nnodes N-2:2N from then on, as an
    elastic job that may lose two nodes."""
    t0 = time.monotonic()
    setup = ask_all(
        s.workers, {"cmd": "rejoin", "min": n - 2, "timeout": args.timeout}, args.timeout + 30
    )
    sizes = {x for r in setup for x in r["sizes"]}
    if sum(r["done"] for r in setup) != n - 1 or sizes != {n - 1}:
        errors = [e for r in setup for e in r["errors"]][:3]
        notes.append(
            f"elasticd n={n}: the rejoin before the recovery phase formed rounds of "
            f"{sorted(sizes)} "
            f"({sum(r['done'] for r in setup)} of {n - 1} joined): {errors}"
        )
        return None
    log(
        f"elasticd n={n}: the {n - 1} left rejoined in {max(r['end'] for r in setup) - t0:.3f}s; "
        "silencing one"
    )
    w, local = s.where([r["ranks"] for r in setup], (n - 1) // 2)
    s.workers[w].send({"cmd": "silence", "local": local})
    t_s = s.workers[w].recv(30)["t"]
    bound = args.peer_timeout + args.timeout
    got = ask_all(s.workers, {"cmd": "recover", "since": t_s, "timeout": bound}, bound + 30)
    done = sum(r["done"] for r in got)
    sizes = {x for r in got for x in r["sizes"]}
    if done != n - 2 or sizes != {n - 2}:
        notes.append(
            f"elasticd n={n}: recovery: {done} of {n - 2} survivors in a next round within "
            f"{bound:g}s "
            f"(rounds of {sorted(sizes)}): {[e for r in got for e in r['errors']][:3]}"
        )
        return None
    from elasticd.cluster.timing import LOST_SILENCE

    took = max(r["end"] for r in got) - t_s
    return too_early(took, took, LOST_SILENCE, "recovery", notes, n)


def run_torch(n: int, args, work: Path, keep_alive: float) -> dict:
    out: dict = {"round_s": None, "requests_per_s": None, "store_cpu": None, "notes": []}
    t = time.monotonic()
    try:
        s = Session("torch", n, args, work, ["--keep-alive", str(keep_alive)])
    except (PhaseTimeout, RuntimeError) as e:
        out["notes"].append(f"torch (keep-alive {keep_alive:g}s): {n} nodes did not start: {e}")
        return out
    try:
        log(
            f"torch ka={keep_alive:g} n={n}: {n} handlers up in {time.monotonic() - t:.1f}s; "
            "next_rendezvous"
        )
        r = s.round()
        if "round_s" not in r:
            out["notes"].append(
                f"torch (keep-alive {keep_alive:g}s): no round of {n} within {args.timeout:g}s "
                f"({r['done']} of {n} returned; the state in the store: {r['state']}; our clients "
                f"used {r['clients_cores']:.2f} cores, the store {r['store_cores']:.2f}; "
                f"{r['errors']})"
            )
            return out
        out["round_s"] = r["round_s"]
        log(
            f"torch ka={keep_alive:g} n={n}: round {r['round_s']:.3f}s (our clients used "
            f"{r['clients_cores']:.2f} "
            f"cores, the store {r['store_cores']:.2f}); steady window"
        )
        window = (
            args.torch_window if args.torch_window is not None else max(args.window, 2 * keep_alive)
        )
        st = steady_window(s.store_ps, s.workers, args.warmup, window)
        out.update(
            requests_per_s=st["requests_per_s"],
            store_cpu=st["store_cpu"],
            client_cpu=st["client_cpu"],
            other_cpu=st["other_cpu"],
        )
        if st["errors"]:
            out["notes"].append(f"torch n={n}: errors in the steady window: {st['errors']}")
    except (PhaseTimeout, RuntimeError, KeyError) as e:
        out["notes"].append(f"torch (keep-alive {keep_alive:g}s) n={n}: {e}")
    finally:
        s.close()
    return out


def log(msg: str) -> None:
    print(f"[scale] {msg}", file=sys.stderr, flush=True)


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "timeout"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(rows: list[dict], keep_alives: list[float]) -> str:
    cols = [("nodes", "nodes", 0), ("round_s", "round_s", 3)]
    cols += [(f"torchrun_round_s@{k:g}", f"torch_round_s(ka {k:g}s)", 3) for k in keep_alives]
    cols += [
        ("propagation_s", "propagation_s", 3),
        ("detection_s", "detection_s(evidence)", 3),
        ("fallback_s", "detection_s(peer_timeout)", 3),
        ("recovery_s", "recovery_s", 3),
        ("store_requests_per_s", "store_req/s", 0),
        ("store_cpu", "store_cpu", 3),
        ("barrier_requests_per_s", "exit_barrier_req/s", 0),
        ("barrier_store_cpu", "exit_barrier_store_cpu", 3),
        ("barrier_release_s", "exit_barrier_release_s", 3),
        ("client_cpu", "our_clients_cpu", 2),
        ("other_cpu", "others_cpu", 2),
    ]
    for k in keep_alives:
        cols += [
            (f"torch_requests_per_s@{k:g}", f"torch_req/s(ka {k:g}s)", 0),
            (f"torch_store_cpu@{k:g}", f"torch_store_cpu(ka {k:g}s)", 3),
            (f"torch_client_cpu@{k:g}", f"torch_clients_cpu(ka {k:g}s)", 2),
        ]
    cells = [[title for _, title, _ in cols]]
    for r in rows:
        cells.append(
            [
                fmt(r.get(key), d)
                if d
                else (str(round(r[key])) if r.get(key) is not None else "timeout")
                for key, _, d in cols
            ]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def measure(n: int, args, work: Path, keep_alives: list[float]) -> dict:
    row: dict = {"nodes": n}
    e = (
        run_elasticd(n, args, work)
        if not args.no_elasticd
        else {
            "round_s": None,
            "propagation_s": None,
            "detection_s": None,
            "fallback_s": None,
            "recovery_s": None,
            "requests_per_s": None,
            "store_cpu": None,
            "notes": [],
        }
    )
    row.update(
        round_s=e["round_s"],
        propagation_s=e["propagation_s"],
        detection_s=e["detection_s"],
        fallback_s=e["fallback_s"],
        recovery_s=e["recovery_s"],
        store_requests_per_s=e["requests_per_s"],
        store_cpu=e["store_cpu"],
        barrier_requests_per_s=e.get("barrier_requests_per_s"),
        barrier_store_cpu=e.get("barrier_store_cpu"),
        barrier_release_s=e.get("barrier_release_s"),
        client_cpu=e.get("client_cpu"),
        other_cpu=e.get("other_cpu"),
    )
    notes = list(e["notes"])
    for k in keep_alives:
        if args.no_torch:
            break
        tr = run_torch(n, args, work, k)
        row[f"torchrun_round_s@{k:g}"] = tr["round_s"]
        row[f"torch_requests_per_s@{k:g}"] = tr["requests_per_s"]
        row[f"torch_store_cpu@{k:g}"] = tr["store_cpu"]
        row[f"torch_client_cpu@{k:g}"] = tr.get("client_cpu")
        notes += tr["notes"]
    row["torchrun_round_s"] = (
        row.get(f"torchrun_round_s@{keep_alives[0]:g}") if keep_alives else None
    )
    row["notes"] = notes
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--nodes",
        type=int,
        action="append",
        help=f"one size (repeatable; default {SIZES}, with etcd {ETCD_SIZES})",
    )
    p.add_argument(
        "--backend",
        choices=("c10d", "etcd"),
        default="c10d",
        help="elasticd's store: one c10d "
        "TCPStore (default), or a 3-member etcd cluster on loopback (etcd on PATH; torch's side is "
        "skipped)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per size (the keys: " + ", ".join(KEYS) + ")",
    )
    p.add_argument(
        "--procs", type=int, default=8, help="processes the simulated nodes are spread over"
    )
    p.add_argument(
        "--timeout", type=float, default=180.0, help="bound of a round's formation, seconds"
    )
    p.add_argument(
        "--start-timeout", type=float, default=600.0, help="bound of starting the nodes, seconds"
    )
    p.add_argument(
        "--warmup", type=float, default=3.0, help="seconds after the round before the steady window"
    )
    p.add_argument("--window", type=float, default=6.0, help="steady window, seconds")
    p.add_argument(
        "--torch-window",
        type=float,
        help="torch's steady window (default: the window, at least two keep-alive intervals)",
    )
    p.add_argument(
        "--peer-timeout", type=float, default=3.0, help="the nodes' --peer-timeout (fallback path)"
    )
    p.add_argument(
        "--monitor-interval", type=float, default=0.1, help="the agent loop's period (both systems)"
    )
    p.add_argument(
        "--step-time", type=float, default=0.1, help="the fake workers' step time (evidence path)"
    )
    p.add_argument(
        "--torch-keepalive", default="5", help="keep_alive_interval(s) of torch's handler, e.g. 5,1"
    )
    p.add_argument("--no-torch", action="store_true", help="elasticd only")
    p.add_argument("--no-elasticd", action="store_true", help="torch only")
    p.add_argument(
        "--no-private-hosts",
        action="store_true",
        help="run our processes without the private "
        "/etc/hosts that keeps torch's reverse DNS lookups off the resolver",
    )
    p.add_argument(
        "--lift-value-limit",
        action="store_true",
        help="raise "
        "elasticd.cluster.signing.MAX_VALUE (64 KiB) in the simulated nodes: a round's members "
        "value "
        "outgrows it at about 1800 nodes here (fewer with longer host names), and every node then "
        "rejects it",
    )
    p.add_argument("--keep-logs", metavar="DIR", help="keep the processes' logs in DIR")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=0.05,
        help="the worker processes' "
        "sys.setswitchinterval (default %(default)s; Python's is 0.005, which with hundreds of "
        "threads "
        "per process spends the CPU on handing the GIL around)",
    )
    p.add_argument("--worker", choices=("elasticd", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--serve-store", action="store_true", help=argparse.SUPPRESS)
    for name in ("--port", "--total", "--first", "--count"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    p.add_argument("--secret", help=argparse.SUPPRESS)
    p.add_argument("--endpoints", help=argparse.SUPPRESS)
    p.add_argument("--join-timeout", type=float, help=argparse.SUPPRESS)
    p.add_argument("--keep-alive", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_store:
        return serve_store()
    if args.worker:
        return worker_main(args)

    sizes = args.nodes or list(ETCD_SIZES if args.backend == "etcd" else SIZES)
    if (
        args.backend == "etcd"
    ):  # torch's etcd backend speaks etcd's v2 API, through python-etcd: not ours
        args.no_torch = True
    keep_alives = [float(x) for x in args.torch_keepalive.split(",") if x.strip()]
    _more_files()
    rows = []
    with tempfile.TemporaryDirectory(prefix="elasticd-scale-") as tmp:
        work = Path(args.keep_logs or tmp)
        work.mkdir(parents=True, exist_ok=True)
        args.secret_path = work / "job.secret"
        args.secret_path.write_bytes(os.urandom(32).hex().encode())
        args.secret_path.chmod(0o600)
        Child.hosts = None if args.no_private_hosts else private_hosts(work)
        if Child.hosts is None:
            log(
                "warning: no private /etc/hosts (needs root and unshare): a reverse DNS lookup "
                "torch's store makes "
                "per connection may stall it for seconds where the resolver drops queries"
            )
        for n in sizes:
            row = measure(n, args, work, keep_alives)
            rows.append(row)
            for note in row["notes"]:
                log("note: " + note)
            if args.json:
                print(json.dumps({k: row.get(k) for k in KEYS}), flush=True)
    if not args.json:
        print(table(rows, keep_alives if not args.no_torch else []))
        print(
            "\nelasticd on "
            f"{'a 3-member etcd cluster' if args.backend == 'etcd' else 'a c10d TCPStore'}: "
            f"--peer-timeout {args.peer_timeout:g}s, fake workers stepping every "
            f"{args.step_time:g}s "
            f"(evidence path); {args.procs} processes; cores: CPU seconds per second (this "
            "machine has "
            f"{os.cpu_count()})"
        )
        for r in rows:
            for note in r["notes"]:
                print(f"note: {note}")
    return 0


# ---------------------------------------------------------------------------------------------
# worker processes: N/P simulated nodes each
# ---------------------------------------------------------------------------------------------


def serve_store() -> int:
    """The store process: a TCPStore server hosted as the daemon hosts it (tcpstore.serve_store:
    a listener bound to the endpoint's IPv4 address), until the coordinator closes our stdin."""
    from elasticd.cluster import tcpstore

    store = tcpstore.serve_store("127.0.0.1", 0, 3600.0)
    print(f"serving {store.port}", flush=True)
    sys.stdin.buffer.read()
    os._exit(0)


class _Out:
    """The protocol's channel: the stdout we were given; anything else printing goes to stderr."""

    def __init__(self):
        self._f = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        self._lock = threading.Lock()

    def __call__(self, msg: dict) -> None:
        with self._lock:
            self._f.write(json.dumps(msg) + "\n")
            self._f.flush()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _wait_all(items, until_done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(until_done(x) for x in items):
        time.sleep(0.01)


TRACE = bool(os.environ.get("SCALE_DEBUG"))  # keep each connection's last calls, for a diagnosis


class CountingClient:
    """A TCPStore client that counts the requests made through it (one per call; a connection
    serves one thread at a time, so a plain counter per connection is exact), and keeps its last
    calls for a diagnosis."""

    registry: list[CountingClient] = []

    def __init__(self, store):
        self._s = store
        self.n = 0
        self.trace: collections.deque = collections.deque(maxlen=24)
        CountingClient.registry.append(self)

    def __repr__(self) -> str:  # tcpstore.bound_replies finds the socket in it
        return repr(self._s)

    def _do(self, name: str, *a):
        self.n += 1
        if not TRACE:
            return getattr(self._s, name)(*a)
        key = (
            a[0]
            if a and isinstance(a[0], str)
            else (a[0][:2] if a and isinstance(a[0], list) else "")
        )
        try:
            result = getattr(self._s, name)(*a)
        except Exception as e:
            self.trace.append(
                (round(time.monotonic(), 3), name, key, f"{type(e).__name__}: {str(e)[:80]}")
            )
            raise
        self.trace.append(
            (
                round(time.monotonic(), 3),
                name,
                key,
                repr(result[:40] if isinstance(result, bytes) else result)[:60],
            )
        )
        return result

    def set(self, *a):
        return self._do("set", *a)

    def compare_set(self, *a):
        return self._do("compare_set", *a)

    def check(self, *a):
        return self._do("check", *a)

    def multi_get(self, *a):
        return self._do("multi_get", *a)

    def add(self, *a):
        return self._do("add", *a)

    def wait(self, *a):
        return self._do("wait", *a)

    def get(self, *a):
        return self._do("get", *a)

    @classmethod
    def total(cls) -> int:
        return sum(c.n for c in list(cls.registry))


def _retried(call, timeout: float):
    """`call` until the store answers (as a daemon's start-up retries it), for `timeout` seconds."""
    from elasticd.cluster import kv as kvmod
    from elasticd.cluster import rendezvous

    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except (kvmod.Unreachable, rendezvous.StoreUnreachable):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _etcd_connect(endpoints: str):
    """A node's etcd connection as rendezvous.open_etcd makes it (every member's endpoint, checked
    to answer with a leader), with the bench's bound on a call; Peers clones it twice."""
    from elasticd.cluster import etcd

    return etcd.connect(endpoints, STORE_CALL_TIMEOUT)


class EtcdRequests:
    """elasticd's etcd client counted on the wire: every HTTP request it sends a member (a range,
    put or txn, and each watch it opens), by wrapping EtcdKV's two senders in the worker processes.
    A proxy over the KV calls would miss what a wait costs (a read, then a watch per slice);
    c10d's figures count TCPStore requests, which a KV call makes one or two of."""

    n = 0
    _lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        from elasticd.cluster import etcd

        for name in ("_post", "_watch"):
            setattr(etcd.EtcdKV, name, cls._counted(getattr(etcd.EtcdKV, name)))

    @classmethod
    def _counted(cls, send):
        def counted(kv, *a, **kw):
            kv.bench_requests = (
                getattr(kv, "bench_requests", 0) + 1
            )  # per connection: one thread at a time
            with cls._lock:
                cls.n += 1
            return send(kv, *a, **kw)

        return counted


def worker_main(args) -> int:
    import logging

    out = _Out()
    sys.setswitchinterval(args.switch_interval)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.worker == "elasticd":
        sim = ElasticdNodes(args)
    else:
        sim = TorchNodes(args)
    for raw in sys.stdin:
        msg = json.loads(raw)
        cmd = msg["cmd"]
        if cmd == "quit":
            break
        if cmd == "stacks":
            import faulthandler

            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            out({})
            continue
        out(sim.handle(cmd, msg))
    os._exit(0)  # threads may be inside store calls: leave without waiting for them


class ElasticdNodes:
    def __init__(self, args):
        from elasticd import config, logs, names
        from elasticd.cluster import rendezvous, tcpstore
        from elasticd.cluster.peers import Peers

        logs.setup("json", level=logging_level(), stream=sys.stderr)
        if args.lift_value_limit:
            from elasticd.cluster import signing

            signing.MAX_VALUE = 16 << 20
        self.args = args
        total = args.total
        etcd = args.backend == "etcd"
        self.cfg = cfg = config.build(
            {
                "nnodes": f"{total}:{2 * total}",
                "rdzv_id": "scale",
                "rdzv_backend": args.backend,
                "rdzv_endpoint": args.endpoints if etcd else f"127.0.0.1:{args.port}",
                "nproc_per_node": 1,
                "last_call_timeout": 0,
                "peer_timeout": args.peer_timeout,
                "join_timeout": args.join_timeout,
                "monitor_interval": args.monitor_interval,
                "rdzv_secret_file": args.secret,
                "local_addr": "127.0.0.1",
            },
            environ={},
        )
        if etcd:
            EtcdRequests.install()
        connect = tcpstore.tcp_connector("127.0.0.1", args.port)

        def counted(timeout: float):
            return CountingClient(connect(timeout))

        self.mode = "run"  # what the agent loops do: run, detect (the stall), recover, idle
        self.restart_lock = threading.Lock()
        self.nodes = []
        ids = set()
        for i in range(args.count):
            if etcd:
                kv = _retried(lambda: _etcd_connect(cfg.rdzv_endpoint), args.join_timeout)
            else:
                kv = tcpstore.TCPStoreKV(counted, f"127.0.0.1:{args.port}", STORE_CALL_TIMEOUT)
            # the store's host begins the run (a daemon on the endpoint's node does): here the
            # first simulated node; the others, as daemons that connect, wait for its run
            rdzv = rendezvous.Rendezvous(cfg, store=kv, begins_run=not etcd and args.first + i == 0)
            while rdzv.node_id in ids:  # one host, one pid: the id's random tag must not repeat
                rdzv.node_id = rendezvous.new_node_id()
            ids.add(rdzv.node_id)
            # connected, as open_store leaves a daemon's store (retried as it does)
            _retried(rdzv.current_round, args.join_timeout)
            node = Node(rdzv, self.woken)
            node.peers = Peers(cfg, rdzv, f"sim{args.first + i}", wake=node.woken)
            # The restart waiter's connection, which a daemon opens at its first round's wait and
            # keeps for the next rounds, is opened here: the measured phases see any later round.
            _retried(
                lambda: node.peers._wait_kv.get(names.job_key(rdzv.scope, names.ROUND)),
                args.join_timeout,
            )
            self.nodes.append(node)
        self.stall: float | None = None
        self.t_start = time.monotonic()
        self.unexpected: list[str] = []
        self.unexpected_count = 0
        self.watchers: list[Node] = []
        self.checker = threading.Thread(target=self._agent_loops, daemon=True)
        self.checker.start()

    def fake_beats(self, now: float):
        """Our workers' heartbeats as the agent loop reads them: stepping every --step-time,
        stalled since the silent node went quiet (their collectives wait on it)."""
        from elasticd.worker.heartbeat import Beat

        step = self.args.step_time
        last = min(now, self.stall) if self.stall is not None else now
        count = max(2, int((last - self.t_start) / step) + 1)
        return [Beat(beats=count, step=count, last=last, first=last - (count - 1) * step)]

    def _agent_loops(self) -> None:
        """What each node's agent loop does with Peers every monitor_interval (for all of this
        process's nodes): check() while running; after the stall, the node-loss verdicts with
        the evidence of our stalled workers and without it (--peer-timeout)."""
        from elasticd.cluster.errors import StoreLost
        from elasticd.lifecycle.states import RestartCause

        period = self.args.monitor_interval
        every = max(1, round(1.0 / period))
        tick = 0
        while True:
            start = time.monotonic()
            # the watchers of the silent node every period (their latency is measured), every node
            # once a second (to catch a healthy node taken for lost): the checks cost no store
            # request, only the CPU a real node would spend on its own
            nodes = self.nodes if tick % every == 0 else self.watchers
            tick += 1
            mode = self.mode
            if mode == "recover":
                nodes = self.nodes  # a restart request's wake-up is answered at once (woken)
            for node in nodes:
                rnd = node.rnd
                if rnd is None or node.silenced or mode == "idle":
                    continue
                now = time.monotonic()
                beats = self.fake_beats(
                    now
                )  # as the agent reads its workers' heartbeat files, just before
                try:
                    if mode == "recover":
                        self.recover_check(node, rnd, now, beats)
                    elif mode == "run":
                        why = node.peers.check(rnd, now, lambda: beats)
                        if why is not None and why.kind not in (RestartCause.PEER,):
                            self.note_unexpected(f"{node.rdzv.node_id}: {why.kind}: {why.reason}")
                    else:
                        for path, evidence in (("evidence", beats), ("fallback", [])):
                            why = node.peers.lost_neighbour(rnd, now, lambda: evidence)
                            if why is not None:
                                node.detected[path].setdefault(why.lost[0], now)
                except StoreLost as e:
                    self.note_unexpected(str(e))
            time.sleep(max(0.0, period - (time.monotonic() - start)))

    def note_unexpected(self, what: str) -> None:
        self.unexpected_count += 1
        if len(self.unexpected) < 3:
            self.unexpected.append(what)

    def recover_check(self, node: Node, rnd, now: float, beats) -> None:
        """The agent loop after a node's loss, as the daemon's: a lost neighbour makes this node
        ask for a restart naming it; a restart asked (by anyone) sends it to the next round."""
        from elasticd.cluster.errors import StoreUnreachable
        from elasticd.lifecycle.states import RestartCause

        if node.restarting:
            return
        why = node.peers.check(rnd, now, lambda: beats)
        if why is None:
            return
        if why.kind is RestartCause.NODE_LOST:
            try:
                node.rdzv.request_restart(
                    rnd,
                    {"summary": why.summary(), "node": node.rdzv.node_id, "lost": list(why.lost)},
                )
            except StoreUnreachable as e:
                self.note_unexpected(f"restart request: {e}")
        elif why.kind is not RestartCause.PEER:
            self.note_unexpected(f"{node.rdzv.node_id}: {why.kind}: {why.reason}")
            return
        self.restart(node)

    def woken(self, node: Node) -> None:
        """A node's Peers woke its agent loop: in the recovery phase, a restart asked is acted on
        at once (the daemon's loop wakes on it; a tick of ours would add up to
        --monitor-interval)."""
        restart = node.peers._restart if node.peers is not None else None
        if (
            self.mode == "recover"
            and restart is not None
            and node.rnd is not None
            and restart[0] == node.rnd.number
        ):
            self.restart(node)

    def restart(self, node: Node) -> None:
        """Join the next round (once), as a daemon does after its restart: the workers' teardown
        is not simulated."""
        with self.restart_lock:
            if node.restarting:
                return
            node.restarting = True

        def rejoin() -> None:
            try:
                rnd = node.rdzv.next_round(1)
                end = time.monotonic()
                node.peers.new_round(rnd)
                node.rnd = rnd
                node.recovered = end  # last: the coordinator's wait reads node.rnd once this is set
            except Exception as e:  # noqa: BLE001 - reported
                node.error = f"recovery: {type(e).__name__}: {e}"

        threading.Thread(target=rejoin, daemon=True).start()

    COMMANDS = (
        "ready",
        "round",
        "counts",
        "barrier",
        "barrier_wait",
        "restart",
        "seen",
        "silence",
        "rejoin",
        "recover",
        "stall",
    )

    def handle(self, cmd: str, msg: dict) -> dict:
        """One command of the coordinator, run by the method of its name."""
        if cmd not in self.COMMANDS:
            raise ValueError(cmd)
        return getattr(self, f"_{cmd}")(msg)

    def _ready(self, msg: dict) -> dict:
        return {"ready": len(self.nodes)}

    def _round(self, msg: dict) -> dict:
        return self.round(msg["at"], msg["timeout"])

    def _counts(self, msg: dict) -> dict:
        return {
            "t": time.monotonic(),
            "requests": CountingClient.total() + EtcdRequests.n,
            "cpu": _cpu(),
            "unexpected": self.unexpected_count,
            "errors": self.unexpected[:3],
        }

    def _barrier(self, msg: dict) -> dict:
        """Nodes done with training wait at the exit barrier (all but a straggler)."""

        def barrier(node: Node) -> None:
            try:
                node.rdzv.exit_barrier(node.rnd, msg["timeout"])
                node.barrier_end = time.monotonic()
            except Exception as e:  # noqa: BLE001 - reported
                node.error = f"exit barrier: {type(e).__name__}: {e}"

        chosen = [
            x for i, x in enumerate(self.nodes) if (i == msg["straggler"]) == msg["straggler_only"]
        ]
        for node in chosen:
            threading.Thread(target=barrier, args=(node,), daemon=True).start()
        if not msg["straggler_only"]:
            return {}
        return self._barrier_wait(msg)

    def _barrier_wait(self, msg: dict) -> dict:
        _wait_all(
            self.nodes,
            lambda x: x.barrier_end is not None or x.error is not None,
            msg["timeout"],
        )
        return {
            "done": sum(x.barrier_end is not None for x in self.nodes),
            "last": max((x.barrier_end for x in self.nodes if x.barrier_end), default=0.0),
        }

    def _restart(self, msg: dict) -> dict:
        node = self.nodes[msg["local"]]
        t0 = time.monotonic()
        node.rdzv.request_restart(
            node.rnd, {"summary": "bench: restart asked", "node": node.rdzv.node_id}
        )
        return {"t0": t0}

    def _seen(self, msg: dict) -> dict:
        _wait_all(self.nodes, lambda x: x.seen is not None, msg["timeout"])
        seen = [x.seen for x in self.nodes if x.seen is not None]
        return {"seen": len(seen), "last": max(seen, default=0.0), "all": seen}

    def _silence(self, msg: dict) -> dict:
        node = self.nodes[msg["local"]]
        node.silenced = True
        t = time.monotonic()
        node.peers._stop.set()  # its liveness thread beats no more (and its waiter leaves)
        return {"t": t, "id": node.rdzv.node_id}

    def _rejoin(self, msg: dict) -> dict:
        # after the propagation phase's restart; the recovery phase's --nnodes
        import dataclasses

        self.mode = "idle"
        cfg = dataclasses.replace(self.cfg, nnodes=f"{msg['min']}:{2 * self.args.total}")
        for node in self.nodes:
            node.rdzv.cfg = node.peers.cfg = cfg
        return self.round(time.monotonic(), msg["timeout"])

    def _recover(self, msg: dict) -> dict:
        live = [x for x in self.nodes if not x.silenced]
        self.stall = msg["since"]
        self.mode = "recover"
        _wait_all(live, lambda x: x.recovered is not None or x.error is not None, msg["timeout"])
        self.mode = "idle"
        done = [x for x in live if x.recovered is not None and x.rnd is not None]
        return {
            "done": len(done),
            "end": max((x.recovered for x in done), default=0.0),
            "sizes": sorted({x.rnd.group_world_size for x in done}),
            "lost": sorted({m for x in done for m in x.rnd.lost}),
            "errors": [x.error for x in live if x.error][:3],
        }

    def _stall(self, msg: dict) -> dict:
        self.stall = msg["since"]
        self.mode = "detect"
        target = msg["target"]
        from elasticd.cluster.peers import WATCHED

        watchers = [
            x
            for x in self.nodes
            if not x.silenced
            and x.rnd is not None
            and target in [m.node_id for m in x.rnd.neighbours(WATCHED)]
        ]
        self.watchers = watchers
        _wait_all(
            watchers,
            lambda x: target in x.detected["evidence"] and target in x.detected["fallback"],
            msg["timeout"],
        )
        false = [
            f"{x.rdzv.node_id} took {lost} for lost"
            for x in self.nodes
            for lost in x.detected["evidence"]
            if lost != target
        ]
        return {
            "watchers": len(watchers),
            "evidence": [
                x.detected["evidence"][target] for x in watchers if target in x.detected["evidence"]
            ],
            "fallback": [
                x.detected["fallback"][target] for x in watchers if target in x.detected["fallback"]
            ],
            "false": false[:5],
        }

    def arrived(self) -> str:
        """How far a round that did not form got: its arrival counter (every node takes a number
        from it first), as the store holds it."""
        from elasticd import names

        rdzv = self.nodes[0].rdzv
        kv = rdzv.kv.clone()  # its own connection: the nodes' threads may still be in theirs
        try:
            key = names.job_key(rdzv.scope, names.ROUND)
            number = rdzv.open(key, kv.get(key), int) or 0
            raw = kv.get(rdzv.sealed.arrivals_key(number))
            return f"round {number}: {raw.decode() if raw else 0} arrived"
        except Exception as e:  # noqa: BLE001 - reported
            return f"{type(e).__name__}: {e}"
        finally:
            kv.close()

    def round(self, at: float, timeout: float) -> dict:
        def join(node: Node) -> None:
            time.sleep(max(0.0, at - time.monotonic()))
            before = node.requests()
            try:
                rnd = node.rdzv.next_round(1)
                node.end = time.monotonic()
                node.round_requests = node.requests() - before
                node.peers.new_round(
                    rnd
                )  # as the agent does at once: watch the ring, wait for restarts
                node.rnd = rnd
            except Exception as e:  # noqa: BLE001 - reported
                node.error = f"{type(e).__name__}: {e}"

        live = [x for x in self.nodes if not x.silenced]
        sent = CountingClient.total() + EtcdRequests.n
        for node in live:
            node.rnd = None
            threading.Thread(target=join, args=(node,), daemon=True).start()
        _wait_all(
            live,
            lambda x: x.rnd is not None or x.error is not None,
            max(0.0, at - time.monotonic()) + timeout,
        )
        sent = CountingClient.total() + EtcdRequests.n - sent
        done = [x for x in live if x.rnd is not None]
        closer = [x for x in done if x.rnd.group_rank == 0]
        busiest = max(live, key=lambda x: x.round_requests)
        if busiest.round_requests > 100:
            store = getattr(busiest.rdzv.kv, "store", None)
            print(
                f"busiest node {busiest.rdzv.node_id}: {busiest.round_requests} requests in "
                "next_round; its "
                f"last calls: {list(store.trace) if store is not None else None}",
                file=sys.stderr,
                flush=True,
            )
        return {
            "done": len(done),
            "end": max((x.end for x in done), default=0.0),
            "closer": [closer[0].end, closer[0].round_requests] if closer else None,
            "rejected": sum(x.rdzv.signer.rejected for x in self.nodes),
            "requests": sum(x.round_requests for x in done),
            "sent": sent,
            "arrived": self.arrived() if len(done) < len(live) else None,
            "errors": [x.error for x in self.nodes if x.error][:3],
            "sizes": sorted({x.rnd.group_world_size for x in done}),
            "ranks": [
                x.rnd.group_rank if x.rnd is not None and not x.silenced else -1 for x in self.nodes
            ],
        }


# A store call's bound: the daemon's default (rendezvous.op_timeout at the default --peer-timeout of
# 10 s). The small --peer-timeout given for the fallback path would make it 1.5 s, which a 2-core
# machine running N simulated nodes and other people's tests does not always meet.
STORE_CALL_TIMEOUT = 5.0


class Node:
    def __init__(self, rdzv, on_wake):
        self.rdzv = rdzv
        self.on_wake = on_wake
        self.peers = None
        self.rnd = None
        self.restarting = False  # the recovery phase: joining the next round
        self.recovered: float | None = None  # when that next_round returned
        self.end = 0.0
        self.error: str | None = None
        self.seen: float | None = None
        self.silenced = False
        self.detected: dict[str, dict[str, float]] = {"evidence": {}, "fallback": {}}
        self.round_requests = 0
        self.barrier_end: float | None = None

    def requests(self) -> int:
        store = getattr(self.rdzv.kv, "store", None)
        return store.n if store is not None else getattr(self.rdzv.kv, "bench_requests", 0)

    def woken(self) -> None:
        """The wake-up Peers gives the agent loop; the restart waiter's is the one timed."""
        if self.seen is None and self.peers is not None and self.peers._restart is not None:
            self.seen = time.monotonic()
        self.on_wake(self)


def logging_level() -> int:
    import logging

    return logging.WARNING


def _torch_store_class():
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """torch's handler and backend take any c10d Store: this one forwards to a TCPStore
        client and counts the requests."""

        registry: list = []

        def __init__(self, inner):
            super().__init__()
            self._s = inner
            self.n = 0
            CountingStore.registry.append(self)

        def set(self, key, value):
            self.n += 1
            return self._s.set(key, value)

        def get(self, key):
            self.n += 1
            return self._s.get(key)

        def add(self, key, amount):
            self.n += 1
            return self._s.add(key, amount)

        def compare_set(self, key, expected, desired):
            self.n += 1
            return self._s.compare_set(key, expected, desired)

        def wait(self, keys, timeout=None):
            self.n += 1
            return self._s.wait(keys) if timeout is None else self._s.wait(keys, timeout)

        def check(self, keys):
            self.n += 1
            return self._s.check(keys)

        def delete_key(self, key):
            self.n += 1
            return self._s.delete_key(key)

        def num_keys(self):
            self.n += 1
            return self._s.num_keys()

        def multi_get(self, keys):
            self.n += 1
            return self._s.multi_get(keys)

        def multi_set(self, keys, values):
            self.n += 1
            return self._s.multi_set(keys, values)

        def set_timeout(self, timeout):
            return self._s.set_timeout(timeout)

    return CountingStore


class TorchNodes:
    """torch's c10d rendezvous as torchrun uses it: per node one TCPStore client
    (multi_tenant, read_timeout 60 s), C10dRendezvousBackend over it, and a
    DynamicRendezvousHandler.from_backend with min = max = N; after the round, its keep-alive
    timer and, every monitor_interval, num_nodes_waiting() (torchrun's agent loop)."""

    def __init__(self, args):
        import datetime
        import logging

        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
        self.args = args
        counting = _torch_store_class()
        self.counting = counting
        td = datetime.timedelta
        self.handlers = []
        self.backends = []
        for _ in range(args.count):
            inner = dist.TCPStore(
                "127.0.0.1", args.port, None, False, td(seconds=60), multi_tenant=True
            )
            store = counting(inner)
            backend = C10dRendezvousBackend(store, "scale")
            h = DynamicRendezvousHandler.from_backend(
                "scale",
                store,
                backend,
                args.total,
                args.total,
                local_addr="127.0.0.1",
                timeout=RendezvousTimeout(join=td(seconds=args.join_timeout)),
                keep_alive_interval=args.keep_alive,
                keep_alive_max_attempt=3,
            )
            self.handlers.append(h)
            self.backends.append(backend)
        self.results: list = [None] * len(self.handlers)
        self.errors: list[str] = []
        self.monitor_errors: list[str] = []

    def _monitor(self) -> None:
        period = self.args.monitor_interval
        while True:
            start = time.monotonic()
            for h in self.handlers:
                try:
                    h.num_nodes_waiting()
                except Exception as e:  # noqa: BLE001 - reported
                    if len(self.monitor_errors) < 3:
                        self.monitor_errors.append(f"{type(e).__name__}: {e}")
            time.sleep(max(0.0, period - (time.monotonic() - start)))

    def handle(self, cmd: str, msg: dict) -> dict:
        if cmd == "ready":
            return {"ready": len(self.handlers)}
        if cmd == "counts":
            return {
                "t": time.monotonic(),
                "requests": sum(s.n for s in self.counting.registry),
                "cpu": _cpu(),
                "errors": self.monitor_errors[:3],
            }
        if cmd == "round":
            at = msg["at"]
            before = sum(s.n for s in self.counting.registry)

            def join(i: int) -> None:
                time.sleep(max(0.0, at - time.monotonic()))
                try:
                    info = self.handlers[i].next_rendezvous()
                    self.results[i] = (time.monotonic(), info.rank, info.world_size)
                except Exception as e:  # noqa: BLE001 - reported
                    self.errors.append(f"{type(e).__name__}: {e}")
                    self.results[i] = False

            for i in range(len(self.handlers)):
                threading.Thread(target=join, args=(i,), daemon=True).start()
            _wait_all(
                range(len(self.handlers)),
                lambda i: self.results[i] is not None,
                max(0.0, at - time.monotonic()) + msg["timeout"],
            )
            done = [r for r in self.results if r]
            if done:
                threading.Thread(target=self._monitor, daemon=True).start()
            state = {}
            if len(done) < len(self.handlers):  # how far the rendezvous got: the state in the store
                import pickle

                try:
                    got = self.backends[0].get_state()
                    if got is not None:
                        st = pickle.loads(got[0])
                        state = {
                            "participants": len(st.participants),
                            "wait_list": len(st.wait_list),
                            "complete": st.complete,
                            "bytes": len(got[0]),
                        }
                except Exception as e:  # noqa: BLE001 - reported
                    state = {"error": f"{type(e).__name__}: {e}"}
            return {
                "done": len(done),
                "state": state,
                "end": max((r[0] for r in done), default=0.0),
                "errors": self.errors[:3],
                "requests": sum(s.n for s in self.counting.registry) - before,
                "sizes": sorted({r[2] for r in done}),
                "ranks": [r[1] if r else -1 for r in self.results],
            }
        raise ValueError(cmd)


if __name__ == "__main__":
    sys.exit(main())
