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
keeps anyone in a run whose host is gone. `current` reads the run's record.

`Run` holds this node's part of it (which run, the record it began, what its host echoed) and
sees the store through the sealed view (sealed.py) only.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from elasticd import logs, names
from elasticd.cluster import kv as kvmod
from elasticd.cluster import values
from elasticd.cluster.errors import RendezvousFailed, store_call
from elasticd.cluster.sealed import Sealed
from elasticd.cluster.timing import (
    ANSWER_POLL,
    CLOCK_SKEW,
    CLOSE_POLL,
    GARBAGE_BACKOFF,
    HOST_ANSWER,
    WAIT_SLICE,
)

log = logs.get("elasticd.rendezvous")

KEEP_RUN_EVERY = 4  # the host's beats between looks at its run's record (BEAT_EVERY each)
ASK_AGAIN = 1.0  # seconds before a node that got no answer asks again (many others asked since)

_restored_logs = logs.Throttle(10.0)


class Run:
    """This node's run: `begins` (the store is new: hosted here, or in-process) makes it the
    run's beginner on a c10d store, which then hosts it (`hosts`); a node of a c10d store it
    does not host `follows` its host's run. On etcd every node may begin one."""

    def __init__(
        self, sealed: Sealed, join_timeout: float, started: float, begins: bool, etcd: bool
    ) -> None:
        self.sealed = sealed
        self.join_timeout = join_timeout
        self.started = started  # a run closed before this (less CLOCK_SKEW) is not joined
        self.begins, self.etcd = begins, etcd
        self.follows = not begins and not etcd
        self.hosts = begins and not etcd
        self.id = ""
        self.record: bytes | None = None  # the record of the run this node began
        self.unverified = False  # a run record seen here did not verify (another secret?)
        self.host_beats, self.echoed = 0, None  # the host's beat count, the challenges it echoed
        self.confirmed_on: tuple = (None, None)  # the connection our run's host last answered on

    @property
    def endpoint(self) -> str:
        return self.sealed.endpoint

    def _record_key(self) -> str:
        return names.job_key(self.sealed.job, names.RUN)

    def _key(self, run_id: str, name: str) -> str:
        return names.job_key(f"{self.sealed.job}/{run_id}", name)

    def join(self, answered: Callable) -> str:
        """This daemon's run, retried while the store does not answer (`answered`: the
        rendezvous's retry of a store call until --join-timeout)."""
        deadline = time.monotonic() + self.join_timeout
        while True:
            if self.begins or self.etcd:
                found = answered(lambda: self._find(deadline), deadline)
            else:
                found = answered(lambda: self.followed(deadline), deadline)
            if found is not None:
                self.id = found
                return found

    @store_call
    def _find(self, deadline: float) -> str:
        """One try of join where this node may begin the run: the store's host (or a single
        node's dict), or any node on etcd (a store call that gets no answer ends it:
        StoreUnreachable)."""
        s, key = self.sealed, self._record_key()
        mine = secrets.token_hex(8)
        sealed = s.seal(key, f"{mine} {time.time():.3f}")
        if self.begins:
            if not s.kv.compare_set(key, None, sealed):
                # someone wrote it before we could: ours stands
                s.rejected(key, "written before the store's host began the run")
                s.kv.set(key, sealed)
            self.record = sealed
            return mine
        pause = CLOSE_POLL
        while True:
            raw = s.kv.get(key)
            found = s.open(key, raw, values.run)
            if found is not None and not self._ended_before_us(found):
                return found
            self.unverified = self.unverified or (raw is not None and found is None)
            if s.kv.compare_set(key, raw, sealed):
                log.info("rendezvous_new_run", run=mine, previous=found or "")
                return mine
            if time.monotonic() > deadline:
                raise RendezvousFailed(
                    f"no run of job {s.job} to join at {s.endpoint} within "
                    f"--join-timeout {self.join_timeout:g}s: its record there does not verify "
                    "(give every node the same --rdzv-secret-file), or something other than the "
                    "job's nodes writes to the store"
                )
            time.sleep(pause)  # another node's run won, or a value changed under us: look again
            pause = min(2 * pause, GARBAGE_BACKOFF)

    @store_call
    def followed(self, deadline: float) -> str:
        """The run a node follows on a c10d store it does not host, at its start and at every try
        to join a round: the one the record names, once that run's host has answered a challenge
        drawn now; else our own, if its host still answers in it (the record is then an earlier
        run's written back, which the host puts back within a second: one warning). Neither
        answering (the host is starting, or started again and has not begun its run yet): one
        warning per run named, and looked at again until the deadline. Nothing to look at while
        the connection on which our run's host last answered is still the one in use: the store
        is the same (a store started again, or another process's, is a new connection), and so
        is the daemon hosting it, in our run."""
        s = self.sealed
        s.kv.get(self._record_key())  # (a call: a dropped one made anew)
        kept = (s.kv, getattr(s.kv, "connections", None))
        if self.id and kept[1] is not None and self.confirmed_on == kept:
            return self.id
        told: set[str] = set()
        while True:
            found = self.current(deadline)
            runs = [found] if found == self.id or not self.id else [found, self.id]
            answered = self.answering(runs, min(deadline, time.monotonic() + HOST_ANSWER))
            if answered is not None:
                if answered != found and found not in told:
                    told.add(found)
                    log.warning(
                        "rendezvous_run_replayed",
                        endpoint=s.endpoint,
                        record=found,
                        run=answered,
                        why="the run record names a run whose host does not answer in it (an "
                        "earlier run's record written back by someone who reaches the store): "
                        "staying in this run, whose host does",
                    )
                self.confirmed_on = (s.kv, getattr(s.kv, "connections", None))
                return answered
            if found not in told:
                told.add(found)
                log.warning(
                    "rendezvous_run_unconfirmed",
                    endpoint=s.endpoint,
                    run=found,
                    why=f"its host did not answer in it within {HOST_ANSWER:g}s (still "
                    "starting, or an earlier run's record written back): not followed; waiting "
                    "for the host",
                )
            if time.monotonic() > deadline:
                raise RendezvousFailed(
                    f"no run of job {s.job} at {s.endpoint} whose host answers within "
                    f"--join-timeout {self.join_timeout:g}s: the run record there names run "
                    f"{found}, whose host does not answer in it (an earlier run's record written "
                    "back, or the store's host stuck): start elasticd again on the store's node"
                )

    def answering(self, runs: list[str], until: float) -> str | None:
        """The first of `runs` whose host answers, before `until`, a challenge drawn now (asked
        again every ASK_AGAIN, where many others asked since), or None."""
        s = self.sealed
        asked: dict[str, set[str]] = {r: set() for r in runs}
        keys = [self._key(r, names.HOST) for r in runs]
        ask_at = 0.0
        while True:
            now = time.monotonic()
            if now >= ask_at:
                for r in runs:
                    asked[r].add(self._challenge(r))
                ask_at = now + ASK_AGAIN
            for r, key, raw in zip(runs, keys, s.kv.multi_get(keys)):
                beat = s.open(key, raw, values.host_beat)
                if beat is not None and asked[r].intersection(beat[1]):
                    return r
            if time.monotonic() >= until:
                return None
            time.sleep(ANSWER_POLL)

    def _challenge(self, run_id: str) -> str:
        """A fresh nonce added to the run's challenges (compare-and-set; a value there that does
        not verify is written over). Returned even when others kept changing the key: asked
        again."""
        s = self.sealed
        nonce = secrets.token_hex(8)
        key = self._key(run_id, names.HELLO)
        for _ in range(20):
            raw = s.kv.get(key)
            before = s.open(key, raw, values.challenges) or []
            payload = " ".join([*before, nonce][-values.MAX_CHALLENGES :])
            if s.kv.compare_set(key, raw, s.seal(key, payload)):
                break
        return nonce

    def host_beat(self, store: kvmod.KV, count: int) -> None:
        """The store's host, at each of its beats: the challenges read under its run echoed under
        its `host` key (sealed: only a live host with the secret answers a fresh one); every
        KEEP_RUN_EVERY beats its run's record put back where someone deleted it or wrote
        something else over it (another run's record, garbage)."""
        self.host_beats = count
        self.answer(store, always=True)
        if count % KEEP_RUN_EVERY or self.record is None:
            return
        record = self._record_key()
        raw = store.get(record)
        if raw != self.record and store.compare_set(record, raw, self.record):
            held = _restored_logs(record)
            if held is not None:
                log.warning(
                    "rendezvous_run_restored",
                    key=record,
                    found="nothing" if raw is None else "another value",
                    held_back=held,
                )

    def answer(self, store: kvmod.KV, always: bool = False) -> None:
        """The store's host: the challenges under its run echoed under its `host` key with its
        beat count, when they changed since it last did (`always`: at its beat); between its
        beats too, every ANSWER_EVERY (peers.py), so that a node joining a round waits
        hundredths of a second for the answer, not a beat."""
        s = self.sealed
        hello = s.job_key(names.HELLO)
        raw = store.get(hello)
        if raw == self.echoed and not always:
            return
        asked = s.open(hello, raw, values.challenges) or []
        key = s.job_key(names.HOST)
        store.set(key, s.seal(key, " ".join([str(self.host_beats), *asked])))
        self.echoed = raw

    def _no_run(self, raw: bytes | None) -> str:
        """Why no run was found in time: at the start, or after the store was started again."""
        s = self.sealed
        head = f"no run of job {s.job} at {s.endpoint} within --join-timeout "
        head += f"{self.join_timeout:g}s: "
        if raw is not None:
            return head + (
                "its record there does not verify (give every node the same "
                "--rdzv-secret-file: or it is a store of another job), or something other than "
                "the job's nodes writes to the store"
            )
        if not self.id:
            return head + (
                "the store's host has not begun it (only the daemon on the --rdzv-endpoint node "
                "begins the job's run: start elasticd there)"
            )
        return head + "the store there was started again without it (a store of another job?)"

    def _ended_before_us(self, found: str) -> bool:
        """Whether that run (of this --rdzv-id, on etcd) ended before this daemon started."""
        closed = self.sealed.read(self._key(found, names.CLOSED), values.closed)
        return closed is not None and closed[0] < self.started - CLOCK_SKEW

    @store_call
    def current(self, deadline: float) -> str:
        """The run the store holds now, which its host began: waited for (a fresh store's host
        writes it as it starts), never begun here, since a run begun by a node that is not the
        host would be a second job on the same store once the host writes its own. A record that
        does not verify, on the store that still holds this node's run, is a forger's: it moves
        nothing (it must not hold a restart: tests/e2e/test_store_security.py); on a fresh store
        it is another job's or another secret's: looked at again until the deadline. One read
        when the record verifies (every try of every node); else waits before it reads again (a
        read of a missing key wakes every waiter on it, timing.LOOK_WAIT)."""
        s, key = self.sealed, self._record_key()
        pause = CLOSE_POLL
        while True:
            raw = s.kv.get(key)
            if raw is not None:
                found = s.open(key, raw, values.run)
                if found is not None:
                    return found
                if self.id and s.kv.get(s.job_key(names.ROUND)) is not None:  # ours: a forgery
                    return self.id
                self.unverified = True
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousFailed(self._no_run(raw))
            if raw is None:
                s.kv.wait(key, min(WAIT_SLICE, left))
            else:
                time.sleep(min(pause, left))
                pause = min(2 * pause, GARBAGE_BACKOFF)
