"""The run: a nonce each daemon run takes, bound into every key, so that nothing written in an
earlier run of the same --rdzv-id (and the same secret) verifies in this one.

A new store (hosted here, or in-process) is ours to begin: its host writes the run before any
other node can join, and writes over anything found there. Elsewhere a node takes the run it
finds, or begins one (create-only, so one node's wins) where there is none (an etcd cluster,
whose keys outlive runs; a c10d store someone else hosts, after RUN_GRACE), where a value in the
way does not verify, or (on etcd) where the run it finds ended before this daemon started. (On a
c10d store whose host began the run, a value that does not verify is never written over: its
writer has another secret, or is not one of the job's nodes.)
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from elasticd import logs, names
from elasticd.cluster import values
from elasticd.cluster.errors import RendezvousFailed, store_call
from elasticd.cluster.timing import CLOCK_SKEW, CLOSE_POLL, GARBAGE_BACKOFF, RUN_GRACE

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
