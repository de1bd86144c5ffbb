"""The run: a nonce each daemon run takes, bound into every key, so that nothing written in an
earlier run of the same --rdzv-id (and the same secret) verifies in this one.

A new store (hosted here, or in-process) is ours to begin: its host writes the run before any
other node can join, and writes over anything found there. Elsewhere a node takes the run it
finds, or begins one (create-only, so one node's wins) where there is none (an etcd cluster,
whose keys outlive runs; a c10d store someone else hosts, after RUN_GRACE), where a value in the
way does not verify, or (on etcd) where the run it finds ended before this daemon started. (On a
c10d store whose host began the run, a value that does not verify is never written over: its
writer has another secret, or is not one of the job's nodes.)

A c10d store's host that dies and is started again hosts a fresh store and begins a new run
there; the other nodes, which never begin a run on a store they do not host once they have one,
follow it (`current_run`, at every try to join a round: Rendezvous.follow_run).
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from elasticd import logs, names
from elasticd.cluster import values
from elasticd.cluster.errors import RendezvousFailed, store_call
from elasticd.cluster.timing import (
    CLOCK_SKEW,
    CLOSE_POLL,
    GARBAGE_BACKOFF,
    RUN_GRACE,
    WAIT_SLICE,
)

if TYPE_CHECKING:
    from elasticd.cluster.rendezvous import Rendezvous

log = logs.get("elasticd.rendezvous")


def join_run(rz: Rendezvous, begins: bool) -> str:
    """This daemon's run (`begins`: ours to begin), retried while the store does not answer."""
    deadline = time.monotonic() + rz.cfg.join_timeout
    while True:
        found = rz.answered(lambda: _find_run(rz, begins, deadline), deadline)
        if found is not None:
            return found


@store_call
def _find_run(rz: Rendezvous, begins: bool, deadline: float) -> str:
    """One try of join_run (a store call that gets no answer ends it: StoreUnreachable)."""
    key = names.job_key(rz.cfg.rdzv_id, names.RUN)
    mine = secrets.token_hex(8)
    sealed = rz.seal(key, f"{mine} {time.time():.3f}")
    if begins:
        if not rz.kv.compare_set(key, None, sealed):
            # someone wrote it before we could: ours stands
            rz.rejected(key, "written before the store's host began the run")
            rz.kv.set(key, sealed)
        return mine
    started = time.monotonic()
    pause = CLOSE_POLL
    while True:
        raw = rz.kv.get(key)
        found = rz.open(key, raw, values.run)
        if found is not None and not (rz.cfg.etcd and _ended_before_us(rz, found)):
            return found
        rz.unverified_run = rz.unverified_run or (raw is not None and found is None)
        if raw is None and not rz.cfg.etcd and time.monotonic() - started < RUN_GRACE:
            rz.kv.wait(key, RUN_GRACE)  # the store's host writes it as it starts
            continue
        if (raw is None or rz.cfg.etcd) and rz.kv.compare_set(key, raw, sealed):
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
            if rz.kv.get(rz.job_key(names.ROUND)) is not None:  # our run's store: a forgery
                return rz.run
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousFailed(
                f"no run of job {rz.cfg.rdzv_id} at {rz.endpoint} within --join-timeout "
                f"{rz.cfg.join_timeout:g}s: the store there was started again without it (a "
                "store of another job, or of another --rdzv-secret-file), or its record does not "
                "verify"
            )
        if raw is None:
            rz.kv.wait(key, min(WAIT_SLICE, left))
        else:
            time.sleep(min(pause, left))
            pause = min(2 * pause, GARBAGE_BACKOFF)
