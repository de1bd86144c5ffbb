"""Someone who reaches a c10d store (no secret needed) must not split an elastic job into two runs
that train apart under one job id and one checkpoint directory. Two real daemons on loopback,
`--nnodes 1:2`, one secret; the attacker is a plain TCPStore client in the test process.

Before: a node that did not host the store began a run of its own when the run record was
missing for 2 s at its start, and at every round followed any record that verified, an earlier
run's of the same --rdzv-id and secret included: each attack below left both nodes training at
world 1 in different runs."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import torch.distributed as dist

from harness import RESTART, end_soon, free_port, node_flags, script, wait_until

RECORD = "elasticd/job/run"


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))


class _Attacker:
    """Deletes the run record, or writes `value` over it, every 10 ms until `done()` (at most
    `limit` seconds)."""

    def __init__(self, port: int, done, value: bytes | None = None, limit: float = 90) -> None:
        self.store, self.value, self.done, self.limit = _client(port), value, done, limit
        self.writes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        end = time.monotonic() + self.limit
        while time.monotonic() < end and not self.done():
            if self.value is None:
                self.store.delete_key(RECORD)
            else:
                self.store.set(RECORD, self.value)
            self.writes += 1
            time.sleep(0.01)

    def join(self) -> None:
        self.thread.join(self.limit + 10)
        assert not self.thread.is_alive() and self.writes > 50, self.writes


def _node(daemons, port: int, name: str, stop_file):
    return daemons(
        script("ddp_tutorial.py"),
        *RESTART,
        "--nproc-per-node",
        "1",
        *node_flags(port, "1:2"),
        name=name,
        args=["--steps", "100000", "--step-time", "0.05", "--stop-file", str(stop_file)],
    )


def _events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


def _running(d) -> list[dict]:
    return [e for e in _events(d, "state") if e.get("new") == "RUNNING"]


def _run_of(d) -> str:
    return wait_until(lambda: _events(d, "rendezvous_run"), 60, what="the run")[0]["run"]


def _finish(stop_file, *nodes) -> None:
    end_soon(stop_file, *nodes)
    for n in nodes:
        assert n.wait(120) == 0, n.stderr()[-3000:]


def test_deleting_the_run_record_while_a_node_starts_does_not_split_the_job(daemons, tmp_path):
    """The second node waits for the host's run (put back by the host within a second of each
    deletion) and joins it: both train at world 2 in the host's run; the second node never
    trains alone in a run of its own."""
    port, stop_file = free_port(), tmp_path / "stop"
    host = _node(daemons, port, "host", stop_file)
    wait_until(lambda: _running(host), 90, what="the host training alone")
    run = _run_of(host)
    nodes = []
    attacker = _Attacker(port, lambda: nodes and _events(nodes[0], "rendezvous_run"))
    time.sleep(0.5)
    other = _node(daemons, port, "other", stop_file)
    nodes.append(other)
    first = wait_until(lambda: _running(other), 120, what="the second node training")[0]
    attacker.join()
    assert first["world_size"] == 2, first  # it trained at world 1, in a run of its own
    assert not _events(other, "rendezvous_new_run"), other.events()
    assert _run_of(other) == run and not _events(other, "rendezvous_store_restarted")
    assert [e for e in _events(host, "rendezvous_run_restored")], "the host put its record back"
    wait_until(lambda: _running(host)[-1]["world_size"] == 2, 60, what="the host at world 2")
    _finish(stop_file, host, other)
    assert all(e["world_size"] == 2 for e in _running(other))
    assert "done world_size=2" in host.all_logs() + other.all_logs()


def test_an_earlier_run_s_record_written_back_before_a_crash_does_not_split_the_job(
    daemons, tmp_path
):
    """An earlier run's record (same --rdzv-id, same secret, same port: the job started again)
    written back over and over as a worker crashes: the second node followed it at its next try
    (it verifies); now it stays in the run whose host answered it on the connection it still
    holds (the same store, in the same host's daemon), and the host puts its record back (one
    line): the restart forms at world 2 in the same run. Then the second node dies for good:
    the host, alone now, says so in one line naming it."""
    port, stop_file = free_port(), tmp_path / "stop"
    earlier = _node(daemons, port, "earlier", stop_file)
    wait_until(lambda: _running(earlier), 90, what="the earlier run training")
    recorded = _client(port).get(RECORD)
    earlier.kill(signal.SIGTERM)
    assert earlier.wait(60) is not None
    host = _node(daemons, port, "host", stop_file)
    wait_until(lambda: _running(host), 90, what="the host")
    other = _node(daemons, port, "other", stop_file)
    wait_until(
        lambda: _running(other) and _running(host)[-1]["world_size"] == 2,
        90,
        what="both nodes at world 2",
    )
    run = _run_of(host)
    assert _run_of(other) == run != _run_of(earlier)
    before = len(_running(other))
    t0 = time.monotonic()  # (a few seconds at least: the host looks at its record every second)
    attacker = _Attacker(
        port, lambda: len(_running(other)) > before and time.monotonic() - t0 > 3, recorded
    )
    time.sleep(0.5)
    pid = next(iter(other.worker_pids().values()))
    os.kill(pid, signal.SIGKILL)  # an ordinary crash: the next round's tries read the record
    wait_until(lambda: len(_running(other)) > before, 90, what="the restart formed")
    attacker.join()
    after = _running(other)[before:]
    assert after and all(e["world_size"] == 2 for e in after), after  # was 1: a run apart
    wait_until(lambda: _running(host)[-1]["world_size"] == 2, 30, what="the host at world 2")
    assert not _events(other, "rendezvous_store_restarted"), _events(other, "rendezvous_run")
    # the second node's connection to the store was never cut, so the store and its host are
    # the ones that answered it in their run: it did not even read the record; the host put its
    # own back, in one line
    assert _events(host, "rendezvous_run_restored"), "the host put its record back"
    assert _run_of(other) == run
    node_id = _events(other, "rendezvous_store")[0]["node_id"]
    other.kill()  # for good: the host goes on alone (--nnodes 1:2), and says so
    alone = wait_until(lambda: _events(host, "rendezvous_alone"), 90, what="the host alone")
    assert alone[0]["lost"] == [node_id], alone
    assert len(_events(host, "rendezvous_alone")) == 1
    wait_until(lambda: _running(host)[-1]["world_size"] == 1, 60, what="the host at world 1")
    _finish(stop_file, host)
