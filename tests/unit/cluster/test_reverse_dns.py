"""cluster/reverse_dns.py against a real resolver whose DNS server never answers: a network
namespace whose resolver asks a server on the node's own link that nobody is (tests/netns.py
`silent_dns`); glibc waits its timeout (1 s here) for each query. The lookups `check` times are
the ones torch's TCPStore makes: a store made there stalls as long, and `watch` says so in one
line; with the addresses in the namespace's hosts file (the fix the line names) nothing is
slow. These are the only tests that send a query (tests/conftest.py: RES_OPTIONS=attempts:0
everywhere else)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from netns import netns_fixture  # noqa: F401 (the netns fixture)

SCRIPT = """
import json, sys, time
import structlog
from elasticd.cluster import reverse_dns, tcpstore
host = sys.argv[1]
timed = reverse_dns.check(host)
with structlog.testing.capture_logs() as said:
    reverse_dns.watch(host).join(30)
    again = reverse_dns.watch(host)
began = time.monotonic()
tcpstore.serve_store(host, 0, 30.0)
print(json.dumps(
    {"timed": timed, "store": time.monotonic() - began, "said": said, "again": again}
))
"""


def _run(command: list[str]) -> dict:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**os.environ, "RES_OPTIONS": ""}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("listed", [False, True], ids=["unlisted", "in-hosts"])
def test_a_slow_lookup_of_a_store_address_is_said_in_one_line(netns, listed):
    net = netns(1)
    host = net.addr(0)
    listing = f"{host} node0\n::ffff:{host} node0\n" if listed else ""
    net.silent_dns(0, "127.0.0.1 localhost\n" + listing)
    got = _run([*net.prefix(0), sys.executable, "-c", SCRIPT, host])
    assert [a for a, _ in got["timed"]] == [
        f"::ffff:{host}",
        host,
    ]  # torch's client's, then the store's
    assert got["again"] is None  # once per host
    if listed:
        assert all(s < 0.2 for _, s in got["timed"]), got
        assert got["store"] < 0.5 and got["said"] == [], got
        return
    assert all(s >= 0.9 for _, s in got["timed"]), got  # each query waited out
    assert got["store"] >= 0.9, got  # the store's own client stalled on the same lookup
    (line,) = got["said"]
    assert line["event"] == "store_address_lookup_slow" and line["log_level"] == "warning"
    assert line["host"] == host and line["seconds"] >= 0.9
    assert "every connection" in line["consequence"] and "/etc/hosts" in line["fix"]


def test_an_address_that_does_not_resolve_has_nothing_to_look_up():
    from elasticd.cluster import reverse_dns

    assert reverse_dns.forms("no-such-host.invalid") == []
    assert reverse_dns.check("") == [] and reverse_dns.watch("") is None
