"""A node joining a round: it takes an arrival number (a counter) and claims the record at that
number (create-only), then waits for the round's members: written by the first arrival, which
closes the round (closing.py), or by any node once the closer may have died. A node that arrives
after the round closed waits for that round's restart and joins the next. Group rank 0 hosts the
round's worker store and writes its address; the others wait for it (a node whose workers go on
in their group, daemon/grow.py, says so in its record, and group rank 0's then goes on hosting
the store they use). A node that was in a multi-node round and forms one of its own says so
(`rendezvous_alone`).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from elasticd import logs, names
from elasticd.cluster import closing, values
from elasticd.cluster.errors import BudgetSpent, Deterministic, RendezvousFailed, store_call
from elasticd.cluster.rounds import Round
from elasticd.cluster.timing import CLOSE_POLL, GARBAGE_BACKOFF, LOST_SILENCE, WAIT_SLICE

if TYPE_CHECKING:
    from elasticd.cluster.rendezvous import Rendezvous

log = logs.get("elasticd.rendezvous")


def next_round(rz: Rendezvous, nproc: int) -> Round:
    """Join rounds until this node is a member of one. RendezvousFailed when the job has ended or
    --join-timeout passes; a store that stops answering is retried until then."""
    deadline = time.monotonic() + rz.cfg.join_timeout
    while True:
        # None: late, or no answer
        rnd = rz.answered(lambda: _try_round(rz, nproc, deadline), deadline)
        if rnd is not None:
            if rnd.group_world_size == 1 and rz.partners:
                _alone(rz, rnd)
            rz.last = rnd
            rz.partners = [m.node_id for m in rnd.members if m.node_id != rz.node_id]
            return rnd


def _alone(rz: Rendezvous, rnd: Round) -> None:
    """A node that was in a round with others and is now in one of its own says so, once, with
    whom it lost and why: a --nnodes 1:N job may go on alone, but a node training apart in
    another run would share the job's id and its checkpoint directory."""
    found_lost = [n for n in rz.partners if n in rnd.lost]
    log.warning(
        "rendezvous_alone",
        round=rnd.number,
        run=rz.run.id,
        lost=rz.partners,
        why=(f"found lost (silent): {', '.join(found_lost)}; " if found_lost else "")
        + "the round closed with this node only (the others did not come before it closed, "
        f"or were lost); training on alone at --nnodes {rz.cfg.nnodes}: check those nodes",
    )


@store_call
def _try_round(rz: Rendezvous, nproc: int, deadline: float) -> Round | None:
    if rz.run.follows:
        rz.follow_run(deadline)  # the store's host may have been started again: a new run
    rz.check_open()
    number = rz.current_round()
    rz.arrivals.forget()  # keys of earlier rounds: never read again anyway
    rz.enter(number)
    prev = rz.last.group_rank if rz.last and rz.last.number == number - 1 else -1
    record = {"id": rz.node_id, "nproc": nproc, "addr": rz.addr, "prev": prev, "link": rz.link}
    if rz.carry is not None and prev >= 0:  # daemon/grow.py: its workers go on in their group
        record["carries"] = [rz.carry.round, rz.carry.generation]
    if not rz.in_place:  # its ranks cannot start into a group that goes on in place
        record["fresh"] = True
    index = rz.arrivals.claim(number, json.dumps(record))
    found = _members(rz, number, index, deadline)
    if found["failed"]:
        raise (Deterministic if found["deterministic"] else BudgetSpent)(found["failed"])
    ids = [m.node_id for m in found["members"]]
    if rz.node_id not in ids:  # late: take part in the next round
        log.info("rendezvous_waiting", round=number, arrival=index)
        await_value(rz, rz.round_key(number, names.RESTART), values.reason, deadline)
        rz.last = None
        rz.enter(number + 1)
        return None
    rnd = Round(
        number=number,
        group_rank=ids.index(rz.node_id),
        members=found["members"],
        lost=found["lost"],
    )
    rnd.rank_base = sum(m.nproc for m in rnd.members[: rnd.group_rank])
    rnd.world_size = sum(m.nproc for m in rnd.members)
    master = rz.round_key(number, names.MASTER)
    if rnd.group_rank == 0:
        # the group goes on only where every node that starts ranks into it can start them in place
        goes_on = rnd.members[0].carries and not rnd.fresh
        carry = rz.carry if rz.carry is not None and goes_on else None
        if carry is not None and carry.store is not None:
            # its workers, and every carrying node's, are the store's clients: hosted on
            rnd.worker_store, rnd.carried = carry.store, (carry.round, carry.generation)
        else:
            from elasticd.cluster.tcpstore import serve_store  # torch: the workers' store

            rnd.worker_store = serve_store(rz.addr, 0, max(rz.cfg.join_timeout, 60.0))
        rnd.master_addr, rnd.master_port = rz.addr, rnd.worker_store.port
        rz.kv.set(master, rz.seal(master, rnd.master_value()))
    rnd.master_addr, rnd.master_port, rnd.carried = await_value(rz, master, values.master, deadline)
    return rnd


def await_value(rz: Rendezvous, key: str, parse, deadline: float):
    """A sealed value someone else writes: wait for it (in slices, checking that the job still
    runs) and read it until it verifies, or fail at the deadline."""
    pause = 0.1
    while time.monotonic() < deadline:
        if rz.kv.wait(key, min(WAIT_SLICE, max(0.01, deadline - time.monotonic()))):
            value = rz.open(key, rz.kv.get(key), parse)
            if value is not None:
                return value
            time.sleep(pause)  # a forger's value: its writer's may still replace it
            pause = min(2 * pause, GARBAGE_BACKOFF)
        rz.check_open()
    raise RendezvousFailed(
        f"timed out after --join-timeout {rz.cfg.join_timeout:g}s waiting for {key} (a "
        "node of the round stopped, or values fail verification: give every node the same "
        "--rdzv-secret-file)"
    )


def _members(rz: Rendezvous, number: int, index: int, deadline: float) -> dict:
    """The closed round's members: as the closer (the first arrival) or, after a wait that
    leaves time for the closer to have died, as any node (compare-and-set: one closing wins)."""
    key = rz.round_key(number, names.MEMBERS)
    cfg = rz.cfg
    grace = max(cfg.restart_grace, cfg.crash_grace)
    patience = cfg.last_call_timeout + grace + cfg.kill_timeout + 2 * LOST_SILENCE
    wait_until = min(time.monotonic() + patience, deadline)
    pause = CLOSE_POLL
    while index != 1 and time.monotonic() < wait_until:
        if rz.kv.wait(key, min(WAIT_SLICE, max(0.01, wait_until - time.monotonic()))):
            found = rz.open(key, rz.kv.get(key), values.members)
            if found is not None:
                return found
            # woken with no value that verifies (see timing.LOOK_WAIT); the closer replaces it
            time.sleep(pause)
            pause = min(2 * pause, GARBAGE_BACKOFF)
        rz.check_open()
    return closing.close_round(rz, number, deadline)
