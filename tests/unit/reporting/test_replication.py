"""A sharded job's replication figures without a job: what the heartbeats' replica_* figures come
to per node and per rank (sums, the slowest, across attempts), the node's state from its ranks',
why the ring is off, the /dev/shm bytes counted from the slot files, and how status and the
metrics show them."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elasticd.checkpoint.memory import directory
from elasticd.checkpoint.memory.replica import off_reason, partners
from elasticd.ops import render
from elasticd.reporting import metrics, replication
from elasticd.reporting.replication import Replication, node_state, state_of
from elasticd.reporting.status_snapshot import Snapshot, Worker, from_json
from elasticd.worker import heartbeat
from unit.reporting.test_metrics import beat

BASE = ("run_id", "node")  # the labels every series carries
ON = heartbeat.REPLICA_STATES.index("on")
FAILED = heartbeat.REPLICA_STATES.index("failed")


def sent(sends, total, last, seconds_total, seconds_last, state=ON) -> heartbeat.Beat:
    return beat(
        replica_state=state,
        replica_sends=sends,
        replica_bytes_total=total,
        replica_bytes_last=last,
        replica_seconds_total=seconds_total,
        replica_seconds_last=seconds_last,
    )


def test_node_figures_sum_ranks_and_keep_totals_across_attempts():
    r = Replication()
    r.observe(1, [0, 1], [sent(3, 300, 100, 0.3, 0.1), sent(3, 600, 200, 0.6, 0.25)])
    r.observe(1, [0, 1], [sent(4, 400, 100, 0.4, 0.1), sent(4, 800, 200, 0.8, 0.2)])
    rep = r.report()
    assert rep["state"] == "on" and rep["sends"] == 8 and rep["bytes_total"] == 1200, rep
    assert rep["last_bytes"] == 300  # one refresh of the node: its ranks' last exchanges summed
    assert rep["last_seconds"] == 0.2  # the slowest rank's last
    assert rep["seconds_total"] == 1.2
    # a restart: the new processes count from 0 again, the node's totals keep the old attempt's
    r.observe(2, [0, 1], [None, None])
    r.observe(2, [0, 1], [sent(1, 100, 100, 0.1, 0.1), sent(1, 200, 200, 0.2, 0.3)])
    rep = r.report()
    assert (rep["sends"], rep["bytes_total"], rep["last_seconds"]) == (10, 1500, 0.3), rep
    rows = [{"local_rank": 0}, {"local_rank": 1}, {"local_rank": 2}]
    r.annotate(rows)
    assert rows[1] == {
        "local_rank": 1,
        "replica": "on",
        "replica_bytes": 200,  # this attempt's
        "replica_last_bytes": 200,
        "replica_last_seconds": 0.3,
    }
    assert rows[2]["replica"] is None and rows[2]["replica_bytes"] is None  # no such worker


def test_state_words_and_the_nodes_state():
    assert state_of(0) is None and state_of(ON) == "on" and state_of(99) is None
    assert state_of(-1) is None
    assert node_state([None, None]) is None
    assert node_state(["on", None]) == "on"
    assert node_state(["on", "failed"]) == "failed"  # one rank off: the node says why
    assert node_state(["one_node", "no_directory"]) == "no_directory"
    r = Replication()
    r.observe(1, [0, 1], [sent(2, 20, 10, 0.1, 0.05), sent(2, 20, 10, 0.1, 0.05, FAILED)])
    r.observe(1, [0, 1], [sent(2, 20, 10, 0.1, 0.05, 0), None])  # a reading of 0 keeps the word
    assert r.report()["state"] == "failed"


def test_why_the_ring_is_off():
    for rank, world, local_world, directory_, want in [
        (0, 2, 2, "/dev/shm/x", "one_node"),  # two ranks, one node: nothing to send to
        (0, 3, 2, "/dev/shm/x", "uneven_nodes"),
        (0, 4, 0, "/dev/shm/x", "uneven_nodes"),  # local world unknown
        (0, 4, 2, None, "no_directory"),
        (1, 4, 2, "/dev/shm/x", "on"),
    ]:
        ring = partners(rank, world, local_world)
        assert off_reason(ring, directory_, world, local_world) == want, (world, local_world)
    assert partners(1, 4, 2) == (3, 3)


def test_shm_bytes_counted_from_the_slot_files(tmp_path):
    for name, size in [("l0.0", 8192), ("l0.1", 8192), ("l1.0", 4096), ("r0.0", 16384)]:
        fd = os.open(tmp_path / name, os.O_CREAT | os.O_WRONLY, 0o600)
        os.posix_fallocate(fd, 0, size)
        os.close(fd)
    (tmp_path / "lock").write_bytes(b"x" * 10000)  # not a slot
    (tmp_path / "r0.0.tmp").write_bytes(b"x" * 10000)
    own, replica = directory.held_bytes(str(tmp_path))
    assert 20480 <= own < 20480 + 3 * 4096 and 16384 <= replica < 16384 + 4096, (own, replica)
    assert directory.held_bytes(None) == (0, 0)
    assert directory.held_bytes(str(tmp_path / "gone")) == (0, 0)


def _snapshot(rep: dict, workers: list[dict]) -> Snapshot:
    return from_json(
        Snapshot,
        {
            "state": "RUNNING",
            "run_id": "job",
            "node": "n0",
            "memory_step": 7,
            "memory_replica": rep,
            "workers": workers,
        },
    )


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(name, its labels but run_id and node, sorted) -> value, of every sample exposed in
    `text` (tests/e2e/test_replica_figures.py reads a daemon's /metrics with it)."""
    return {
        (x.name, tuple(sorted((k, v) for k, v in x.labels.items() if k not in BASE))): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }


def _samples(s: Snapshot) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.SnapshotCollector(lambda: s))
    return samples(generate_latest(registry).decode())


def test_status_and_metrics_show_the_replication():
    r = Replication()
    r.observe(1, [0], [sent(5, 5 * 3 << 20, 3 << 20, 0.5, 0.012)])
    r.held = (6 << 20, 6 << 20)
    rep = r.report()
    row = {"rank": 2, "local_rank": 0, "pid": 10, "state": "running", "step": 7}
    r.annotate([row])
    s = _snapshot(rep, [row])
    text = render.status(s)
    assert (
        "replica to the next node on: 5 sends, 3.0MiB per refresh, 15.0MiB total, last took "
        "12.0ms; /dev/shm 12.0MiB (own slots 6.0MiB, replicas 6.0MiB)"
    ) in text, text
    assert "REPLICA LAST/THIS ATTEMPT" in text and "3.0MiB/15.0MiB in 12.0ms" in text, text
    got = _samples(s)
    assert got[("elasticd_memory_replica_state", (("state", "on"),))] == 1
    assert got[("elasticd_memory_replica_state", (("state", "failed"),))] == 0
    assert got[("elasticd_memory_replica_sends_total", ())] == 5
    assert got[("elasticd_memory_replica_bytes_total", ())] == 15 << 20
    assert got[("elasticd_memory_replica_last_bytes", ())] == 3 << 20
    assert got[("elasticd_memory_replica_last_seconds", ())] == 0.012
    assert got[("elasticd_memory_replica_seconds_total", ())] == 0.5
    assert got[("elasticd_memory_shm_bytes", (("slots", "replica"),))] == 6 << 20
    who = (("local_rank", "0"), ("rank", "2"))
    assert got[("elasticd_rank_replica_bytes", who)] == 15 << 20
    assert got[("elasticd_rank_replica_last_seconds", who)] == 0.012


def test_off_on_one_node_and_nothing_before_the_first_refresh():
    off = _snapshot(
        {"state": "one_node", "shm_own_bytes": 4096},
        [{"rank": 0, "local_rank": 0, "pid": 1, "state": "running", "replica": "one_node"}],
    )
    text = render.status(off)
    assert "replica to the next node off (one node); /dev/shm 4.0KiB" in text, text
    got = _samples(off)
    assert got[("elasticd_memory_replica_state", (("state", "one_node"),))] == 1
    assert ("elasticd_memory_replica_bytes_total", ()) not in got  # nothing was ever sent
    assert not any(name.startswith("elasticd_rank_replica") for name, _ in got)
    worker = Worker(rank=0, local_rank=0, pid=1, state="running").__dict__
    none = from_json(Snapshot, {"state": "RUNNING", "workers": [worker]})
    assert "replica" not in render.status(none) and "REPLICA" not in render.status(none)
    assert not any("replica" in name or "shm" in name for name, _ in _samples(none))


def test_every_replication_metric_is_in_the_table():
    names = {m[0] for m in metrics.METRICS}
    assert {m[0] for m in replication.METRICS} <= names
    assert [render.size(n) for n in (None, 0, 1023, 1536, 5 << 30)] == [
        "-",
        "0B",
        "1023B",
        "1.5KiB",
        "5.0GiB",
    ]
