"""elasticd/cluster/etcd.py against members that misbehave. A fake member on a loopback port
(tests/fake_member.py) answers crafted replies: wrong shapes, bad base64, JSON nested 200,000 deep,
a Content-Length of 10^13, bad chunking, a reply trickled a byte at a time; every EtcdKV call then
returns or raises kv.Unreachable within its deadline, never another exception, fails over to a
member that behaves, and close() ends a call in progress at once. End to end, a daemon whose
member trickles leaves at --join-timeout with one line, and SIGTERM stops it at once."""

from __future__ import annotations

import signal
import time

from fake_member import FakeMember, trickle
from harness import final_lines, wait_until


def run_flags(endpoint: str, *extra: str) -> tuple[str, ...]:
    return (
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        endpoint,
        "--nproc-per-node",
        "1",
        "--no-warm-spawn",
        *extra,
    )


def test_a_trickling_member_ends_the_join_at_join_timeout(daemons):
    """Every reply trickled a byte every 0.2 s: the daemon leaves at --join-timeout (each store
    call bounded by --peer-timeout / 2) with one line saying what happened, exit 1."""
    with FakeMember(trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", every=0.2)) as m:
        t0 = time.monotonic()
        d = daemons(None, *run_flags(m.endpoint, "--join-timeout", "2", "--peer-timeout", "2"))
        code = d.wait(20)
        took = time.monotonic() - t0
    lines = final_lines(d.stderr())
    assert code == 1, d.stderr()[-3000:]
    assert (
        len(lines) == 1 and "cannot reach the etcd cluster" in lines[0] and "timed out" in lines[0]
    ), lines
    assert "Traceback" not in d.stderr()
    assert took < 2 + 6, took


def test_sigterm_while_a_member_trickles_exits_at_once(daemons):
    """The member answers the connection's check, then trickles every reply (the join and the
    liveness beats hang on it): SIGTERM stops the daemon at once, exit 0, no traceback."""
    answered = ("/v3/maintenance/status",)
    with FakeMember(trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", 0.2, answered)) as m:
        d = daemons(None, *run_flags(m.endpoint, "--join-timeout", "60"))
        wait_until(
            lambda: len(m.requests) >= 2, 30, what="calls hanging on the member"
        )  # past the status check
        time.sleep(0.3)
        t0 = time.monotonic()
        d.kill(signal.SIGTERM)
        code = d.wait(10)
        took = time.monotonic() - t0
    assert code == 0, d.stderr()[-3000:]
    assert took < 3, took
    assert "Traceback" not in d.stderr()
