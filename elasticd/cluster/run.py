"""The run: a nonce each daemon run takes, bound into every key, so that nothing written in an
earlier run of the same --rdzv-id (and the same secret) verifies in this one.

A new store (hosted here, or in-process) is ours to begin: its host writes the run before any
other node can join, writes over anything found there, and keeps it there (put back within a
second where someone deleted it or wrote another run's record over it: `host_beat`). On etcd,
whose keys outlive runs, a node takes the run it finds, or begins one (create-only, so one
node's wins) where there is none, where a value in the way does not verify, or where the run it
finds ended before this daemon started.

On a c10d store someone else hosts, a node never begins a run: only the store's host does (a
run begun by another node would be a second job on the same store). And it follows a run only
once that run's host has answered it there (`followed`): the node writes a fresh random
challenge under the run (`hello`, the newest MAX_CHALLENGES kept) and the host's liveness
thread, which reads them every ANSWER_EVERY, echoes them sealed under the run (`host`). A
record that verifies may be an earlier run's of the same --rdzv-id and secret, written back by
anyone who reaches the store: no one but a live host with the secret answers a challenge drawn
after it. So a c10d store's host
that dies and is started again hosts a fresh store and begins a new run there, which the other
nodes follow once it answers (at each try to join a round after their connection to the store
was made anew: Rendezvous.follow_run); an earlier run's record written back moves no one, nor
keeps anyone in a run whose host is gone. `current_run` reads the run's record.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from elasticd import logs, names
from elasticd.cluster import kv as kvmod
from elasticd.cluster import values
from elasticd.cluster.errors import RendezvousFailed, store_call
from elasticd.cluster.timing import (
    ANSWER_POLL,
    CLOCK_SKEW,
    CLOSE_POLL,
    GARBAGE_BACKOFF,
    HOST_ANSWER,
    WAIT_SLICE,
)

if TYPE_CHECKING:
    from elasticd.cluster.rendezvous import Rendezvous

log = logs.get("elasticd.rendezvous")

KEEP_RUN_EVERY = 4  # the host's beats between looks at its run's record (BEAT_EVERY each)
ASK_AGAIN = 1.0  # seconds before a node that got no answer asks again (many others asked since)


def join_run(rz: Rendezvous, begins: bool) -> str:
    """This daemon's run (`begins`: ours to begin), retried while the store does not answer."""
    deadline = time.monotonic() + rz.cfg.join_timeout
    while True:
        if begins or rz.cfg.etcd:
            found = rz.answered(lambda: _find_run(rz, begins, deadline), deadline)
        else:
            found = rz.answered(lambda: followed(rz, deadline), deadline)
        if found is not None:
            return found


@store_call
def _find_run(rz: Rendezvous, begins: bool, deadline: float) -> str:
    """One try of join_run where this node may begin the run: the store's host (or a single
    node's dict), or any node on etcd (a store call that gets no answer ends it:
    StoreUnreachable)."""
    key = names.job_key(rz.cfg.rdzv_id, names.RUN)
    mine = secrets.token_hex(8)
    sealed = rz.seal(key, f"{mine} {time.time():.3f}")
    if begins:
        if not rz.kv.compare_set(key, None, sealed):
            # someone wrote it before we could: ours stands
            rz.rejected(key, "written before the store's host began the run")
            rz.kv.set(key, sealed)
        rz.run_record = sealed
        return mine
    pause = CLOSE_POLL
    while True:
        raw = rz.kv.get(key)
        found = rz.open(key, raw, values.run)
        if found is not None and not _ended_before_us(rz, found):
            return found
        rz.unverified_run = rz.unverified_run or (raw is not None and found is None)
        if rz.kv.compare_set(key, raw, sealed):
            log.info("rendezvous_new_run", run=mine, previous=found or "")
            return mine
        if time.monotonic() > deadline:
            raise RendezvousFailed(
                f"no run of job {rz.cfg.rdzv_id} to join at {rz.endpoint} within "
                f"--join-timeout {rz.cfg.join_timeout:g}s: its record there does not verify "
                "(give every node the same --rdzv-secret-file), or something other than the "
                "job's nodes writes to the store"
            )
        time.sleep(pause)  # another node's run won, or a value changed under us: look again
        pause = min(2 * pause, GARBAGE_BACKOFF)


@store_call
def followed(rz: Rendezvous, deadline: float) -> str:
    """The run a node follows on a c10d store it does not host, at its start and at every try
    to join a round: the one the record names, once that run's host has answered a challenge
    drawn now; else our own, if its host still answers in it (the record is then an earlier
    run's written back, which the host puts back within a second: one warning). Neither
    answering (the host is starting, or started again and has not begun its run yet): one
    warning per run named, and looked at again until the deadline. Nothing to look at while the
    connection on which our run's host last answered is still the one in use: the store is the
    same (a store started again, or another process's, is a new connection), and so is the
    daemon hosting it, in our run."""
    rz.kv.get(names.job_key(rz.cfg.rdzv_id, names.RUN))  # (a call: a dropped one made anew)
    kept = (rz.kv, getattr(rz.kv, "connections", None))
    if rz.run and kept[1] is not None and rz.confirmed_on == kept:
        return rz.run
    told: set[str] = set()
    while True:
        found = current_run(rz, deadline)
        runs = [found] if found == rz.run or not rz.run else [found, rz.run]
        answered = answering(rz, runs, min(deadline, time.monotonic() + HOST_ANSWER))
        if answered is not None:
            if answered != found and found not in told:
                told.add(found)
                log.warning(
                    "rendezvous_run_replayed",
                    endpoint=rz.endpoint,
                    record=found,
                    run=answered,
                    why="the run record names a run whose host does not answer in it (an "
                    "earlier run's record written back by someone who reaches the store): "
                    "staying in this run, whose host does",
                )
            rz.confirmed_on = (rz.kv, getattr(rz.kv, "connections", None))
            return answered
        if found not in told:
            told.add(found)
            log.warning(
                "rendezvous_run_unconfirmed",
                endpoint=rz.endpoint,
                run=found,
                why=f"its host did not answer in it within {HOST_ANSWER:g}s (still starting, "
                "or an earlier run's record written back): not followed; waiting for the host",
            )
        if time.monotonic() > deadline:
            raise RendezvousFailed(
                f"no run of job {rz.cfg.rdzv_id} at {rz.endpoint} whose host answers within "
                f"--join-timeout {rz.cfg.join_timeout:g}s: the run record there names run "
                f"{found}, whose host does not answer in it (an earlier run's record written "
                "back, or the store's host stuck): start elasticd again on the store's node"
            )


def answering(rz: Rendezvous, runs: list[str], until: float) -> str | None:
    """The first of `runs` whose host answers, before `until`, a challenge drawn now (asked
    again every ASK_AGAIN, where many others asked since), or None."""
    asked: dict[str, set[str]] = {r: set() for r in runs}
    keys = [names.job_key(f"{rz.cfg.rdzv_id}/{r}", names.HOST) for r in runs]
    ask_at = 0.0
    while True:
        now = time.monotonic()
        if now >= ask_at:
            for r in runs:
                asked[r].add(_challenge(rz, r))
            ask_at = now + ASK_AGAIN
        for r, key, raw in zip(runs, keys, rz.kv.multi_get(keys)):
            beat = rz.open(key, raw, values.host_beat)
            if beat is not None and asked[r].intersection(beat[1]):
                return r
        if time.monotonic() >= until:
            return None
        time.sleep(ANSWER_POLL)


def _challenge(rz: Rendezvous, run_id: str) -> str:
    """A fresh nonce added to the run's challenges (compare-and-set; a value there that does not
    verify is written over). Returned even when others kept changing the key: asked again."""
    nonce = secrets.token_hex(8)
    key = names.job_key(f"{rz.cfg.rdzv_id}/{run_id}", names.HELLO)
    for _ in range(20):
        raw = rz.kv.get(key)
        before = rz.open(key, raw, values.challenges) or []
        payload = " ".join([*before, nonce][-values.MAX_CHALLENGES :])
        if rz.kv.compare_set(key, raw, rz.seal(key, payload)):
            break
    return nonce


_restored_logs = logs.Throttle(10.0)


def host_beat(rz: Rendezvous, store: kvmod.KV, count: int) -> None:
    """The store's host, at each of its beats: the challenges read under its run echoed under
    its `host` key (sealed: only a live host with the secret answers a fresh one); every
    KEEP_RUN_EVERY beats its run's record put back where someone deleted it or wrote something
    else over it (another run's record, garbage)."""
    rz.host_beats = count
    answer(rz, store, always=True)
    if count % KEEP_RUN_EVERY or rz.run_record is None:
        return
    record = names.job_key(rz.cfg.rdzv_id, names.RUN)
    raw = store.get(record)
    if raw != rz.run_record and store.compare_set(record, raw, rz.run_record):
        held = _restored_logs(record)
        if held is not None:
            log.warning(
                "rendezvous_run_restored",
                key=record,
                found="nothing" if raw is None else "another value",
                held_back=held,
            )


def answer(rz: Rendezvous, store: kvmod.KV, always: bool = False) -> None:
    """The store's host: the challenges under its run echoed under its `host` key with its beat
    count, when they changed since it last did (`always`: at its beat); between its beats too,
    every ANSWER_EVERY (peers.py), so that a node joining a round waits hundredths of a second
    for the answer, not a beat."""
    hello = rz.job_key(names.HELLO)
    raw = store.get(hello)
    if raw == rz.echoed and not always:
        return
    asked = rz.open(hello, raw, values.challenges) or []
    key = rz.job_key(names.HOST)
    store.set(key, rz.seal(key, " ".join([str(rz.host_beats), *asked])))
    rz.echoed = raw


def _no_run(rz: Rendezvous, raw: bytes | None) -> str:
    """Why no run was found in time: at the start, or after the store was started again."""
    head = f"no run of job {rz.cfg.rdzv_id} at {rz.endpoint} within --join-timeout "
    head += f"{rz.cfg.join_timeout:g}s: "
    if raw is not None:
        return head + (
            "its record there does not verify (give every node the same --rdzv-secret-file: "
            "or it is a store of another job), or something other than the job's nodes writes "
            "to the store"
        )
    if not rz.run:
        return head + (
            "the store's host has not begun it (only the daemon on the --rdzv-endpoint node "
            "begins the job's run: start elasticd there)"
        )
    return head + "the store there was started again without it (a store of another job?)"


def _ended_before_us(rz: Rendezvous, found: str) -> bool:
    """Whether that run (of this --rdzv-id, on etcd) ended before this daemon started."""
    key = names.job_key(f"{rz.cfg.rdzv_id}/{found}", names.CLOSED)
    closed = rz.open(key, rz.kv.get(key), values.closed)
    return closed is not None and closed[0] < rz.started - CLOCK_SKEW


@store_call
def current_run(rz: Rendezvous, deadline: float) -> str:
    """The run the store holds now, which its host began: waited for (a fresh store's host
    writes it as it starts), never begun here, since a run begun by a node that is not the host
    would be a second job on the same store once the host writes its own. A record that does
    not verify, on the store that still holds this node's run, is a forger's: it moves nothing
    (it must not hold a restart: tests/e2e/test_store_security.py); on a fresh store it is
    another job's or another secret's: looked at again until the deadline. One read when the
    record verifies (every try of every node); else waits before it reads again (a read of a
    missing key wakes every waiter on it, timing.LOOK_WAIT)."""
    key = names.job_key(rz.cfg.rdzv_id, names.RUN)
    pause = CLOSE_POLL
    while True:
        raw = rz.kv.get(key)
        if raw is not None:
            found = rz.open(key, raw, values.run)
            if found is not None:
                return found
            if rz.run and rz.kv.get(rz.job_key(names.ROUND)) is not None:  # ours: a forgery
                return rz.run
            rz.unverified_run = True
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousFailed(_no_run(rz, raw))
        if raw is None:
            rz.kv.wait(key, min(WAIT_SLICE, left))
        else:
            time.sleep(min(pause, left))
            pause = min(2 * pause, GARBAGE_BACKOFF)
