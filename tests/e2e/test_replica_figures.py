"""What a sharded job's replication costs, where operators look: a 2-rank FSDP2 job over two
loopback daemons (one rank each, so each rank's shards have a replica on the other node) shows in
`elasticd status --json`, in the human status and on /metrics the replica on, nonzero bytes per
refresh and in all that grow with the refreshes, and the /dev/shm bytes each node holds for its
own slots and its replica."""

from __future__ import annotations

import json
import re

import pytest

from e2e.test_operability import scrape
from harness import free_port, node_flags, script, wait_until
from unit.reporting.test_replication import samples

pytest.importorskip("torch.distributed.fsdp")

HEADER = 4096  # a slot's header (checkpoint/memory/slots.py): every exchange sends more


def _replica(d) -> dict | None:
    r = d.status("--json")
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def test_fsdp2_replica_bytes_and_shm_in_status_and_metrics(daemons, tmp_path):
    port, metrics = free_port(), free_port()
    nodes = [
        daemons(
            script("fsdp_train.py"),
            "--nproc-per-node",
            "1",
            *node_flags(port, "2"),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            *(("--metrics-address", f"127.0.0.1:{metrics}") if i == 0 else ()),
            name=f"n{i}",
            args=["3000", "100000", "0.01", str(tmp_path)],  # no disk save: memory only
        )
        for i in range(2)
    ]
    a = nodes[0]

    def replicated(more_than: int = 0):
        s = _replica(a)
        rep = s and s["memory_replica"]
        return s if rep and rep["state"] == "on" and rep["sends"] > more_than else None

    first = wait_until(replicated, 90, 0.2, what="the first replica exchanges in status")
    rep = first["memory_replica"]
    assert rep["bytes_total"] > HEADER and rep["last_bytes"] > HEADER, rep
    assert rep["bytes_total"] >= rep["last_bytes"] and rep["last_seconds"] > 0, rep
    (worker,) = first["workers"]
    assert worker["replica"] == "on" and worker["replica_last_bytes"] > HEADER, worker
    later = wait_until(
        lambda: replicated(rep["sends"] + 2), 60, 0.2, what="more refreshes replicated"
    )["memory_replica"]
    # one rank: every exchange about the same slot's size (the description's numbers vary by a
    # digit), so the total grows by it per refresh
    sends = later["sends"] - rep["sends"]
    grown = later["bytes_total"] - rep["bytes_total"]
    assert abs(grown - sends * later["last_bytes"]) <= sends * 64, (rep, later)
    # /dev/shm: the own slots and, once the other node's first exchange landed, a replica
    held = wait_until(
        lambda: (r := _replica(a)["memory_replica"])["shm_replica_bytes"] and r, 10, 0.2
    )
    assert held["shm_own_bytes"] >= later["last_bytes"], held
    assert held["shm_replica_bytes"] >= later["last_bytes"], held

    human = a.status().stdout
    assert re.search(r"replica to the next node on: \d+ sends, .* per refresh", human), human
    assert "/dev/shm" in human and "REPLICA" in human, human

    got = samples(scrape(metrics))
    assert got[("elasticd_memory_replica_state", (("state", "on"),))] == 1, got
    assert got[("elasticd_memory_replica_state", (("state", "one_node"),))] == 0, got
    total = got[("elasticd_memory_replica_bytes_total", ())]
    assert total >= later["bytes_total"], got
    assert got[("elasticd_memory_replica_last_bytes", ())] > HEADER, got
    assert got[("elasticd_memory_shm_bytes", (("slots", "replica"),))] > 0, got
    assert got[("elasticd_memory_shm_bytes", (("slots", "own"),))] > 0, got
    rank = (("local_rank", "0"), ("rank", str(worker["rank"])))
    assert got[("elasticd_rank_replica_last_bytes", rank)] > HEADER, got
    wait_until(
        lambda: samples(scrape(metrics))[("elasticd_memory_replica_bytes_total", ())] > total,
        30,
        0.2,
        what="the metric to grow with the refreshes",
    )
    for d in nodes:
        d.kill()  # SIGKILL: each daemon's guard takes its workers along (a SIGTERM would save)
    for d in nodes:
        d.wait(30)
