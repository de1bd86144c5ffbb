"""The in-place path's load on the workers' store from each daemon while nothing fails, and how soon
a daemon follows another node's announced generation (daemon/inplace.py `follow`).

`--nodes` followers, each a thread running the agent loop's part that matters here (the real
Inbox wait at --monitor-interval, then `inplace.follow`), hold clients of one real TCPStore (the
round's workers' store, as group rank 0's daemon hosts it); every request their clients send is
counted. After `--idle` seconds with nothing announced (requests per second per daemon), another
node announces generation 1 (`inplace._announce`, as after a rank's death there), and each
follower's delay to `in_place_followed` is taken. Several trees (checkouts of elasticd, e.g. one
before a change) run one after the other in the same run, each in a process of its own.

    python bench/store_load.py --trees /path/to/old/checkout,.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent


class Counting:
    """A real TCPStore client that counts the requests it sends."""

    calls = 0
    lock = threading.Lock()

    def __init__(self, inner):
        self._inner = inner

    def __repr__(self):
        return repr(self._inner)  # tcpstore.bound_replies finds the client's socket there

    def __getattr__(self, name):
        fn = getattr(self._inner, name)

        def call(*args):
            with Counting.lock:
                Counting.calls += 1
            return fn(*args)

        return call


def _node(inplace, port: int, ranks, inbox, events):
    return SimpleNamespace(
        recovery_path=inplace.Path(inplace.IN_PLACE, "bench"),
        forming=None,
        round=SimpleNamespace(number=1, master_addr="127.0.0.1", master_port=port, state_key=b"k"),
        in_place_kv=None,
        in_place_waits=None,
        in_place_watch=None,
        inbox=inbox,
        group=SimpleNamespace(
            workers=[SimpleNamespace(global_rank=r, exit_code=None) for r in ranks],
            generation=0,
            quiet_from=0.0,
        ),
        event=lambda name, **kw: events.append((name, time.monotonic())),
    )


def one(nodes: int, idle: float, interval: float) -> dict:
    """This interpreter's elasticd (sys.path) measured: {requests_per_s, follow_s: [...]}."""
    from elasticd.cluster import tcpstore
    from elasticd.daemon import inplace
    from elasticd.daemon.inbox import Inbox

    server = tcpstore.serve_store("127.0.0.1", 0, 10.0)
    real = tcpstore.tcp_connector
    tcpstore.tcp_connector = lambda h, p: lambda t: Counting(real(h, p)(t))
    stop, followers = threading.Event(), []

    def loop(agent) -> None:
        while not stop.is_set() and agent.forming is None:
            agent.inbox.wait(interval)
            list(agent.inbox.take())
            inplace.follow(agent, time.monotonic())

    for i in range(nodes):
        events: list = []
        agent = _node(inplace, server.port, (2 * i, 2 * i + 1), Inbox(), events)
        followers.append((agent, events, threading.Thread(target=loop, args=(agent,))))
    for _a, _e, t in followers:
        t.start()
    time.sleep(1.0)  # connections made, watches armed
    before, began = Counting.calls, time.monotonic()
    time.sleep(idle)
    idle_calls, idle_s = Counting.calls - before, time.monotonic() - began
    announcer = _node(inplace, server.port, (2 * nodes, 2 * nodes + 1), Inbox(), [])
    announced = time.monotonic()
    inplace._announce(announcer, (2 * nodes + 1,))
    for _a, _e, t in followers:
        t.join(10.0)
    stop.set()
    follow_s = [e[0][1] - announced for _a, e, _t in followers if e]
    for agent, _e, _t in followers:
        if getattr(agent, "in_place_watch", None) is not None:
            agent.in_place_watch.end()
    return {
        "requests_per_s": idle_calls / idle_s / nodes,
        "follow_s": follow_s,
        "followed": len(follow_s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", default=str(HERE.parent), help="comma-separated elasticd checkouts")
    p.add_argument("--nodes", type=int, default=4, help="following daemons (threads)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds measured with no fault")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="the loop's tick (s)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        sys.path.insert(0, args.one)
        print(json.dumps(one(args.nodes, args.idle, args.monitor_interval)))
        return
    print(
        f"{'tree':<40} {'requests/s per daemon':>22} {'followed':>9} {'follow s (median/max)':>22}"
    )
    for tree in args.trees.split(","):
        root = str(Path(tree).resolve())
        cmd = [sys.executable, __file__, "--one", root, "--nodes", str(args.nodes)]
        cmd += ["--idle", str(args.idle), "--monitor-interval", str(args.monitor_interval)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.idle + 60, cwd=root)
        if r.returncode:
            raise SystemExit(f"bench/store_load.py: {tree} failed: {r.stderr[-2000:]}")
        got = json.loads(r.stdout.splitlines()[-1])
        f = got["follow_s"] or [float("nan")]
        print(
            f"{root:<40} {got['requests_per_s']:>22.2f} {got['followed']:>5}/{args.nodes:<3} "
            f"{statistics.median(f):>13.3f} / {max(f):.3f}"
        )


if __name__ == "__main__":
    main()
