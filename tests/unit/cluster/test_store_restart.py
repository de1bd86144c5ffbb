"""A c10d store's host started again: the other nodes take the fresh store's new run for the same
job's next incarnation (Rendezvous.follow_run), never a different job's or a finished one, and
never begin a run there themselves; they follow a run only once its host answers them in it, so
an earlier run's record written back (by anyone who reaches the store) moves no one. Real
Rendezvous objects over in-process stores (kv.LocalKV), one per incarnation of the store, as a
restarted host's would be, each host beating on a thread as its liveness thread would."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd import config, names
from elasticd.cluster import kv, rendezvous, values
from elasticd.cluster.peers import Peers
from elasticd.cluster.rounds import Member, Round
from elasticd.cluster.timing import BEAT_EVERY, LOST_SILENCE
from harness import secret_flags


def _cfg(job: str = "job", secret: str | None = None, join_timeout: float = 0.5):
    return config.build(
        {
            "entrypoint": "x.py",
            "nnodes": "2",
            "rdzv_id": job,
            "rdzv_endpoint": "127.0.0.1:29400",
            "join_timeout": join_timeout,
            "rdzv_secret_file": secret or secret_flags()[1],
        },
        None,
        environ={},
    )


_beating: list[threading.Event] = []


@pytest.fixture(autouse=True)
def _stop_beating():
    yield
    while _beating:
        _beating.pop().set()


def _host(store: kv.LocalKV, cfg=None) -> rendezvous.Rendezvous:
    """A store's host that begins its run and beats in it (every 50 ms: a fast liveness thread)
    until the test ends, or until `host.stop_beating` is set (its daemon died)."""
    host = rendezvous.Rendezvous(cfg or _cfg(), store=store, begins_run=True)
    _beat(host, store)
    return host


def _beat(host: rendezvous.Rendezvous, store: kv.LocalKV, count: int = 0) -> None:
    stop = threading.Event()
    _beating.append(stop)
    host.stop_beating = stop

    def beats(count: int) -> None:
        while not stop.wait(0.05):
            count += 1
            host.beat(store, count)

    threading.Thread(target=beats, args=(count,), daemon=True).start()


def _nodes(store: kv.LocalKV, cfg=None):
    """The store's host (it begins the run) and another node that joined it."""
    cfg = cfg or _cfg()
    host = _host(store, cfg)
    other = rendezvous.Rendezvous(cfg, store=store.clone(), begins_run=False)
    assert other.run.id == host.run.id and other.run.follows and not host.run.follows
    return host, other


def _deadline() -> float:
    return time.monotonic() + 0.5


def test_the_same_store_keeps_the_run():
    host, other = _nodes(kv.LocalKV())
    other.last = Round(3, 1, [Member("a", 1, "h"), Member(other.node_id, 1, "h")])
    other.follow_run(_deadline())
    assert (other.run.id, other.last.number) == (host.run.id, 3)  # a healed partition: nothing new


def test_a_restarted_host_s_fresh_store_is_the_job_s_next_run_with_its_budget():
    old_host, other = _nodes(kv.LocalKV())
    assert old_host.budget.spend(1) == 1 and old_host.budget.spend(2) == 2
    assert other.restarts_used() == 2
    other.last = Round(3, 1, [Member("a", 1, "h"), Member(other.node_id, 1, "h")])
    closed_before = other.job_key(names.CLOSED)
    old_host.stop_beating.set()
    fresh = kv.LocalKV()  # the host's daemon started again: a new store, none of the old keys
    new_host = _host(fresh)
    other.sealed.kv = fresh.clone()
    other.follow_run(_deadline())
    assert other.run.id == new_host.run.id != old_host.run.id
    assert other.scope == new_host.scope and other.job_key(names.CLOSED) != closed_before
    assert other.last is None and other.current_round() == 0  # round numbers start again
    assert new_host.restarts_used() == 2  # the job's spent restarts carried into the new run
    other.check_open()  # a fresh store is not a finished job


def test_a_fresh_store_without_a_run_is_waited_for_never_begun():
    _, other = _nodes(kv.LocalKV())
    before = other.run.id
    other.sealed.kv = kv.LocalKV()  # listening, but its host has not begun the run (or never will)
    t0 = time.monotonic()
    with pytest.raises(rendezvous.RendezvousFailed, match="--join-timeout"):
        other.follow_run(_deadline())
    assert time.monotonic() - t0 < 3
    assert other.kv.get(names.job_key("job", names.RUN)) is None and other.run.id == before


@pytest.mark.parametrize("stranger", ["another job", "another secret"])
def test_a_store_started_by_someone_else_is_not_taken_for_the_job(tmp_path, stranger):
    _, other = _nodes(kv.LocalKV())
    before = other.run.id
    fresh = kv.LocalKV()
    if stranger == "another job":
        rendezvous.Rendezvous(_cfg(job="job2"), store=fresh, begins_run=True)
    else:
        path = tmp_path / "other.secret"
        path.write_bytes(b"another secret, another job" * 2)
        path.chmod(0o600)
        rendezvous.Rendezvous(_cfg(secret=str(path)), store=fresh, begins_run=True)
    other.sealed.kv = fresh.clone()
    with pytest.raises(rendezvous.RendezvousFailed, match="no run of job job"):
        other.follow_run(_deadline())
    assert other.run.id == before


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
        new_host = _host(fresh)
        other.sealed.kv = fresh.clone()
        peers._beat_kv = fresh.clone()
        other.follow_run(_deadline())
        peers._beat(1)
        time.sleep(1.1)  # past WAITING_EVERY: the once-a-second chores are due
        peers._beat(2)
        master = new_host.round_key(0, names.MASTER)
        assert fresh.get(master) is None and peers.waiting == (-1, [])
    finally:
        peers.close()


RECORD = names.job_key("job", names.RUN)


def _earlier_record() -> bytes:
    """The record of an earlier run of the same job and secret (a job started again), as anyone
    who read the store then kept it: it verifies."""
    earlier = kv.LocalKV()
    rendezvous.Rendezvous(_cfg(), store=earlier, begins_run=True)
    return earlier.get(RECORD)


def test_a_node_never_begins_a_run_on_a_store_it_does_not_host():
    """The record missing (deleted while this node starts, or a host that never begins): it
    waits for its host until --join-timeout and writes nothing (it began its own run after 2 s,
    a second job at world 1 beside the host's)."""
    store = kv.LocalKV()
    t0 = time.monotonic()
    with pytest.raises(rendezvous.RendezvousFailed, match="no run of job job"):
        rendezvous.Rendezvous(_cfg(), store=store.clone(), begins_run=False)
    assert time.monotonic() - t0 < 3 and store.get(RECORD) is None


def test_the_host_puts_its_run_record_back():
    host = _host(kv.LocalKV())
    mine = host.kv.get(RECORD)
    for bad in (None, _earlier_record(), b"garbage"):
        if bad is None:
            with host.kv._cond:  # deleted (LocalKV has no delete: its dict, as a store's)
                host.kv._data.pop(RECORD)
        else:
            host.kv.set(RECORD, bad)
        wait = time.monotonic() + 3
        while host.kv.get(RECORD) != mine and time.monotonic() < wait:
            time.sleep(0.02)
        assert host.kv.get(RECORD) == mine, bad


def test_an_earlier_run_s_record_written_back_moves_no_one(caplog):
    """A node in the host's run, at its next try to join a round, finds an earlier run's record
    (it verifies): it stays, as the host still answers in its own run; it followed the record,
    into a run of its own at world 1."""
    store = kv.LocalKV()
    host, other = _nodes(store)
    store.set(RECORD, _earlier_record())
    other.follow_run(time.monotonic() + 5)
    assert other.run.id == host.run.id


def test_a_node_starting_on_an_earlier_run_s_record_follows_the_live_host():
    """Written back as a node starts: no one answers in that run, so the node waits (one line)
    and follows the host's run once the host has put its record back."""
    store = kv.LocalKV()
    host = _host(store)
    host.stop_beating.set()  # hold the host's beats (and its keeping of the record) a moment
    time.sleep(0.1)
    store.set(RECORD, _earlier_record())
    threading.Timer(0.5, lambda: _beat(host, store, 100)).start()  # back
    other = rendezvous.Rendezvous(_cfg(join_timeout=8), store=store.clone(), begins_run=False)
    assert other.run.id == host.run.id


def test_a_replay_of_the_old_run_on_a_restarted_host_s_store_is_not_followed():
    """The store's host started again and someone writes the old run's record (ours) over the
    new one: our run's host no longer answers, so the node does not stay in it (it did, and
    trained alone in it beside the new host's run): it takes the new run once the host has put
    its record back."""
    old_host, other = _nodes(kv.LocalKV())
    old_record = old_host.kv.get(RECORD)
    old_host.stop_beating.set()
    fresh = kv.LocalKV()
    new_host = _host(fresh)
    fresh.set(RECORD, old_record)
    other.sealed.kv = fresh.clone()
    other.follow_run(time.monotonic() + 8)
    assert other.run.id == new_host.run.id != old_host.run.id


def test_values_of_the_challenge_and_the_answer():
    assert values.challenges("") == [] and values.challenges("0123456789abcdef") is not None
    assert values.challenges("0123456789abcdeF") is None and values.challenges("x y") is None
    assert values.challenges(" ".join(["0123456789abcdef"] * 65)) is None
    assert values.host_beat("3 0123456789abcdef") == (3, ["0123456789abcdef"])
    assert values.host_beat("3") == (3, []) and values.host_beat("-1") is None


def test_the_host_answers_between_its_beats():
    """Its liveness thread reads the challenges every ANSWER_EVERY: a node joining a round waits
    hundredths of a second for the answer (the median of 5), not up to a beat."""
    store = kv.LocalKV()
    host = rendezvous.Rendezvous(_cfg(), store=store, begins_run=True)
    peers = Peers(host.cfg, host, "host", wake=lambda: None)
    try:
        other = rendezvous.Rendezvous(_cfg(join_timeout=5), store=store.clone(), begins_run=False)
        took = []
        for _ in range(5):
            t0 = time.monotonic()
            assert other.run.answering([host.run.id], t0 + 2) == host.run.id
            took.append(time.monotonic() - t0)
        assert sorted(took)[2] < BEAT_EVERY / 2, took
    finally:
        peers.close()


class _Connected(kv.LocalKV):
    """An in-process store whose client counts its connections, as TCPStoreKV does."""

    connections = 1

    def clone(self) -> _Connected:
        return _Connected((self._data, self._cond))


def test_a_connection_kept_since_the_host_answered_is_the_same_store_and_host():
    """Nothing is read while it lasts (a record written back there is the host's to put back);
    a new connection (the store's host started again, or a network cut) is asked again."""
    store = _Connected()
    host = _host(store)
    other = rendezvous.Rendezvous(_cfg(join_timeout=3), store=store.clone(), begins_run=False)
    host.stop_beating.set()
    store.set(RECORD, _earlier_record())
    t0 = time.monotonic()
    other.follow_run(time.monotonic() + 3)
    assert other.run.id == host.run.id and time.monotonic() - t0 < 0.1
    other.kv.connections += 1  # reconnected: no host answers in either run now
    with pytest.raises(rendezvous.RendezvousFailed, match="whose host answers"):
        other.follow_run(time.monotonic() + 1)


def test_a_recovery_in_place_spends_the_job_s_budget_as_a_restart_does():
    """--max-restarts bounds the failures a job survives, whichever path recovered them: a
    recovery in place (one node announces each generation) costs one, and a round's restart
    after it costs one more however many closers spend for it (it cost nothing before: the
    in-place recoveries had a budget of their own, on top)."""
    host, other = _nodes(kv.LocalKV())
    assert other.budget.spend_in_place() == 1
    assert host.budget.spend(1) == 2 and other.budget.spend(1) == 2  # one restart of round 1
    assert host.budget.spend_in_place() == 3 and other.budget.spend_in_place() == 4
    assert other.budget.spend(1) == 4  # round 1's restart is spent already
    assert other.budget.spend(2) == 5 and host.restarts_used() == 5
