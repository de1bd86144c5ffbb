"""A c10d store's host started again: the other nodes take the fresh store's new run for the same
job's next incarnation (Rendezvous.follow_run), never a different job's or a finished one, and
never begin a run there themselves. Real Rendezvous objects over in-process stores (kv.LocalKV),
one per incarnation of the store, as a restarted host's would be."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd import config, names
from elasticd.cluster import kv, rendezvous
from elasticd.cluster.peers import Peers
from elasticd.cluster.rounds import Member, Round
from elasticd.cluster.timing import BEAT_EVERY, LOST_SILENCE
from harness import secret_flags


def _cfg(job: str = "job", secret: str | None = None):
    return config.build(
        {
            "entrypoint": "x.py",
            "nnodes": "2",
            "rdzv_id": job,
            "rdzv_endpoint": "127.0.0.1:29400",
            "join_timeout": 0.5,
            "rdzv_secret_file": secret or secret_flags()[1],
        },
        None,
        environ={},
    )


def _nodes(store: kv.LocalKV, cfg=None):
    """The store's host (it begins the run) and another node that joined it."""
    cfg = cfg or _cfg()
    host = rendezvous.Rendezvous(cfg, store=store, begins_run=True)
    other = rendezvous.Rendezvous(cfg, store=store.clone(), begins_run=False)
    assert other.run == host.run and other.follows_run and not host.follows_run
    return host, other


def _deadline() -> float:
    return time.monotonic() + 0.5


def test_the_same_store_keeps_the_run():
    host, other = _nodes(kv.LocalKV())
    other.last = Round(3, 1, [Member("a", 1, "h"), Member(other.node_id, 1, "h")])
    other.follow_run(_deadline())
    assert (other.run, other.last.number) == (host.run, 3)  # a healed partition: nothing new


def test_a_restarted_host_s_fresh_store_is_the_job_s_next_run_with_its_budget():
    old_host, other = _nodes(kv.LocalKV())
    assert old_host.spend_restart(1) == 1 and old_host.spend_restart(2) == 2
    assert other.restarts_used() == 2
    other.last = Round(3, 1, [Member("a", 1, "h"), Member(other.node_id, 1, "h")])
    closed_before = other.job_key(names.CLOSED)
    fresh = kv.LocalKV()  # the host's daemon started again: a new store, none of the old keys
    new_host = rendezvous.Rendezvous(_cfg(), store=fresh, begins_run=True)
    other.kv = fresh.clone()
    other.follow_run(_deadline())
    assert other.run == new_host.run != old_host.run
    assert other.scope == new_host.scope and other.job_key(names.CLOSED) != closed_before
    assert other.last is None and other.current_round() == 0  # round numbers start again
    assert new_host.restarts_used() == 2  # the job's spent restarts carried into the new run
    other.check_open()  # a fresh store is not a finished job


def test_a_fresh_store_without_a_run_is_waited_for_never_begun():
    _, other = _nodes(kv.LocalKV())
    before = other.run
    other.kv = kv.LocalKV()  # listening, but its host has not begun the run (or never will)
    t0 = time.monotonic()
    with pytest.raises(rendezvous.RendezvousFailed, match="--join-timeout"):
        other.follow_run(_deadline())
    assert time.monotonic() - t0 < 3
    assert other.kv.get(names.job_key("job", names.RUN)) is None and other.run == before


@pytest.mark.parametrize("stranger", ["another job", "another secret"])
def test_a_store_started_by_someone_else_is_not_taken_for_the_job(tmp_path, stranger):
    _, other = _nodes(kv.LocalKV())
    before = other.run
    fresh = kv.LocalKV()
    if stranger == "another job":
        rendezvous.Rendezvous(_cfg(job="job2"), store=fresh, begins_run=True)
    else:
        path = tmp_path / "other.secret"
        path.write_bytes(b"another secret, another job" * 2)
        path.chmod(0o600)
        rendezvous.Rendezvous(_cfg(secret=str(path)), store=fresh, begins_run=True)
    other.kv = fresh.clone()
    with pytest.raises(rendezvous.RendezvousFailed, match="no run of job job"):
        other.follow_run(_deadline())
    assert other.run == before


def test_a_failed_job_s_host_keeps_its_store_up_while_the_others_still_beat():
    """The store's host that ends the job with a failure closes it, then keeps its store while
    the last round's other nodes beat (they read the closing at their next look), and leaves
    once they have been quiet for LOST_SILENCE; a finished job's host leaves at once."""
    host, other = _nodes(kv.LocalKV())
    host.is_host = True  # (an in-process store: no server object to say so)
    host.last = Round(0, 0, [Member(host.node_id, 1, "h"), Member(other.node_id, 1, "h")])
    stop = threading.Event()

    def beats() -> None:
        for count in range(1, 1000):
            if stop.wait(BEAT_EVERY):
                return
            other.beat(other.kv, count)

    beater = threading.Thread(target=beats)
    beater.start()
    t0 = time.monotonic()
    threading.Timer(1.0, stop.set).start()  # the other node read the verdict and exits
    host.close(job_finished=True, why="failed: rank 1 raised")
    took = time.monotonic() - t0
    beater.join()
    # it stayed while the other beat, and left once it was quiet (a loaded machine's slack)
    assert LOST_SILENCE + 0.5 <= took < 1.0 + LOST_SILENCE + 3.0, took
    with pytest.raises(rendezvous.RendezvousFailed, match="the job has ended"):
        other.check_open()
    t0 = time.monotonic()
    host.close(job_finished=True, why="finished")
    assert time.monotonic() - t0 < 0.2


def test_the_old_round_is_never_kept_under_the_new_run_s_keys():
    """Between taking a restarted host's run and its first round, the liveness thread must not
    write the old round's worker-store address (group rank 0 keeps it once a second) under the
    new run's keys: the new run's round of that number would read a dead address."""
    _, other = _nodes(kv.LocalKV())
    old = Round(0, 0, [Member(other.node_id, 1, "h"), Member("gone", 1, "h")])
    old.master_addr, old.master_port = "10.0.0.9", 4242
    other.last = old
    peers = Peers(other.cfg, other, "node", wake=lambda: None)
    try:
        peers.new_round(old)
        fresh = kv.LocalKV()
        new_host = rendezvous.Rendezvous(_cfg(), store=fresh, begins_run=True)
        other.kv = fresh.clone()
        peers._beat_kv = fresh.clone()
        other.follow_run(_deadline())
        peers._beat(1)
        time.sleep(1.1)  # past WAITING_EVERY: the once-a-second chores are due
        peers._beat(2)
        master = new_host.round_key(0, names.MASTER)
        assert fresh.get(master) is None and peers.waiting == (-1, [])
    finally:
        peers.close()
