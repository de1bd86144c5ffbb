"""The control plane's KV operations timed on a c10d TCPStore and on a 3-member etcd cluster.

Both on loopback (tests/etcd_cluster.py starts the cluster: one data directory per member on the
same disk), one connection each, N calls of each operation, median and 90th percentile in ms:

    set, get (present / absent), multi_get (8 keys), take (one roll), compare_set (a swap that
    succeeds), wait propagation (a clone blocked in wait, another connection sets the key: set's
    start to the waiter's return)

then, for etcd, failover: the member in use SIGKILLed (a follower, then the leader), the time of
the next set, and quorum loss (2 of 3 stopped): how long a call takes to raise Unreachable.

    python bench/etcd_kv.py [--n 200] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from elasticd.cluster import etcd, kv, tcpstore
from etcd_cluster import SKIP_REASON, EtcdCluster, etcd_binary


def timed(fn, n: int) -> dict:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1000)
    out.sort()
    return {
        "median_ms": round(statistics.median(out), 3),
        "p90_ms": round(out[int(0.9 * (n - 1))], 3),
    }


def wait_propagation(s: kv.KV, n: int, tag: str) -> dict:
    waiter = s.clone()
    out = []
    for i in range(n):
        key = f"bench/{tag}/wait/{i}"
        done = {}
        th = threading.Thread(
            target=lambda k=key, d=done: d.update(ok=waiter.wait(k, 10), at=time.perf_counter())
        )
        th.start()
        time.sleep(0.02)  # the waiter is blocked (read done, watch open)
        t0 = time.perf_counter()
        s.set(key, b"x")
        th.join(10)
        assert done.get("ok") is True
        out.append((done["at"] - t0) * 1000)
    waiter.close()
    out.sort()
    return {
        "median_ms": round(statistics.median(out), 3),
        "p90_ms": round(out[int(0.9 * (n - 1))], 3),
    }


def measure(s: kv.KV, n: int, tag: str) -> dict:
    p = f"bench/{tag}/"
    value = os.urandom(64)
    res = {}
    res["set"] = timed(lambda i: s.set(f"{p}set/{i}", value), n)
    res["get"] = timed(lambda i: s.get(f"{p}set/{i}"), n)
    res["get absent"] = timed(lambda i: s.get(f"{p}absent/{i}"), n)
    keys = [f"{p}set/{i}" for i in range(8)]
    res["multi_get 8"] = timed(lambda i: s.multi_get(keys), n)
    res["take"] = timed(lambda i: s.take(f"{p}counter"), n)
    s.set(f"{p}cas", b"0")
    res["compare_set"] = timed(
        lambda i: s.compare_set(f"{p}cas", str(i).encode(), str(i + 1).encode()), n
    )
    res["wait propagation"] = wait_propagation(s, n, tag)
    return res


def failover(root: str) -> dict:
    out = {}
    for victim in ("follower", "leader"):
        c = EtcdCluster(os.path.join(root, victim)).start()
        try:
            leader = c.leader()
            first = leader if victim == "leader" else (leader + 1) % 3
            order = [first] + [i for i in range(3) if i != first]
            s = etcd.connect(",".join(c.members[i].endpoint for i in order), timeout=10)
            s.set("f/k", b"0")
            c.members[first].kill()
            t0 = time.perf_counter()
            s.set("f/k", b"1")
            out[f"next set after SIGKILL of the {victim} in use"] = round(
                time.perf_counter() - t0, 3
            )
            s.close()
        finally:
            c.stop()
    c = EtcdCluster(os.path.join(root, "quorum")).start()
    try:
        s = etcd.connect(c.endpoints, timeout=2.0)
        s.set("q/k", b"0")
        c.members[1].stop()
        c.members[2].stop()
        t0 = time.perf_counter()
        try:
            s.get("q/k")
        except kv.Unreachable as e:
            out["get with quorum lost, timeout 2 s: Unreachable after"] = round(
                time.perf_counter() - t0, 3
            )
            out["its message"] = str(e)
        s.close()
    finally:
        c.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if etcd_binary() is None:
        print(SKIP_REASON, file=sys.stderr)
        return 2
    import torch.distributed as dist

    root = tempfile.mkdtemp(prefix="elasticd-bench-etcd-")
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    tcp = tcpstore.TCPStoreKV(
        tcpstore.tcp_connector("127.0.0.1", server.port), f"127.0.0.1:{server.port}", 10
    )
    cluster = EtcdCluster(os.path.join(root, "steady")).start()
    try:
        store = etcd.connect(cluster.endpoints, timeout=10)
        result = {"tcpstore": measure(tcp, args.n, "tcp"), "etcd": measure(store, args.n, "etcd")}
        store.close()
    finally:
        cluster.stop()
    result["etcd failover (s)"] = failover(root)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'operation':<18} {'TCPStore median / p90 ms':>26} {'etcd x3 median / p90 ms':>26}")
    for op in result["etcd"]:
        t, e = result["tcpstore"][op], result["etcd"][op]
        print(
            f"{op:<18} {t['median_ms']:>15.3f} / {t['p90_ms']:<8.3f} {e['median_ms']:>15.3f} / "
            f"{e['p90_ms']:<8.3f}"
        )
    for what, v in result["etcd failover (s)"].items():
        print(f"{what}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
