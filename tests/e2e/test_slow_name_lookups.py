"""A node whose DNS server never answers (tests/netns.py `silent_dns`: glibc waits 1 s for each
query): torch's TCPStore looks up the store's address at every connection (its client's,
::ffff:127.0.0.1, which the node's /etc/hosts does not list), so the daemon says once which
address is slow and how to fix it, and the job still runs to the end."""

from __future__ import annotations

from harness import FAST, script
from netns import netns_fixture  # noqa: F401 (the netns fixture)


def test_a_node_whose_name_lookups_stall_says_so_once_and_trains(daemons, netns, tmp_path):
    net = netns(1, subnet=41)
    net.silent_dns(0)
    d = daemons(
        script("ddp_tutorial.py"),
        "--nproc-per-node",
        "2",
        *FAST,
        args=["--steps", "4", "--snapshot", str(tmp_path / "snapshot.pt")],
        env={"RES_OPTIONS": ""},  # the namespace's resolver, not the tests' (tests/conftest.py)
        prefix=net.prefix(0),
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    said = [e for e in d.events() if e.get("event") == "store_address_lookup_slow"]
    assert len(said) == 1, said  # every store of a one-node job is on loopback: one line
    (line,) = said
    assert (line["level"], line["host"], line["address"]) == (
        "warning",
        "127.0.0.1",
        "::ffff:127.0.0.1",
    ), line
    assert line["seconds"] >= 0.9 and "/etc/hosts" in line["fix"] and "run_id" in line
