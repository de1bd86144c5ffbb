"""A node that joins a job on the in-place path (one that comes back after it was lost, or a new
one) joins by reconfigure: the nodes already running carry their workers into the next round
instead of stopping them (`carry`), and once that round closes every worker re-forms at the
larger world in its own process while the joining node's ranks start into the group's next
generation, as a replacement does (`joined`, `joining`).

The round is met as any other (the members, their order, the liveness, the budget: a node
joining spends none), with two differences. Each carrying node says in its arrival record which
group its workers stand in (round and generation, `Member.carries`), and group rank 0, which
hosts the workers' store, goes on hosting the one they use and says so in the round's master
value (`Round.carried`); every node reads there whether the group goes on, so none acts on a
guess. Then group rank 0 announces the next generation in that store with the larger world and
the kept ranks' new numbers, and the joining ranks start, with the group's round and the new
generation, while the running ones train on. Once every joining rank has given its handle, each
carrying node asks its workers to re-form at their next step boundary (inplace.regroup,
heartbeat.ask_regroup; asked at once, they waited at that boundary for the joining ranks' start,
seconds on a GPU node): the checkpoint library agrees on the boundary across ranks in the call it
makes at every one, keeps that step in memory and unwinds the script on every rank at once
(worker/reconfigure.py `Regroup`), so no step is lost. A script without the library never says it
reached one: after about a step, its pending collective is ended from outside
(daemon/outside_abort.py; the step in flight is lost, as with any fault). The joining ranks
receive the state from the survivors' memory (checkpoint/memory/state.py).

Where the group cannot go on (this torch has no reconfigure, `--in-place off`, a generation
forming, a rank that exited or never stepped, a rank that did not form its group in place, the
store's host not carrying), every node restarts as before: a carrying node whose group did not go
on stops its workers then, one line saying why (`grow_in_place_refused`). A rank that dies while
the round meets is found by the loop afterwards, while the generation forms: a second fault,
which goes to the restart (daemon/inplace.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from elasticd import names
from elasticd.cluster.kv import Unreachable
from elasticd.cluster.rounds import Carry, Round
from elasticd.daemon import inplace
from elasticd.lifecycle.states import Failure, RestartCause, Scale
from elasticd.lifecycle.triage import FailureClass

if TYPE_CHECKING:
    from elasticd.daemon.agent import Agent


def _scale(why: Failure | Scale) -> bool:
    """A restart for nodes waiting to join: this node's (Scale) or another node's request."""
    if isinstance(why, Scale):
        return True
    return why.kind is RestartCause.PEER and why.failure_class == FailureClass.SCALE.value


def _refused(agent: Agent) -> str | None:
    """Why this node's workers cannot go on in their group into the next round (None: they can)."""
    group, rnd = agent.group, agent.round
    if agent.forming is not None:
        return "a generation was forming in place"
    if any(w.exit_code is not None or w.proc.poll() is not None for w in group.workers):
        return "a rank of this node has exited"
    if any(b is None or not b.beats for b in group.beats()):
        return "a rank had not stepped yet"
    if rnd.group_rank == 0 and rnd.worker_store is None:
        return "this node hosts no workers' store to go on with"
    kv = inplace.store(agent)
    if kv is None:
        return "no workers' store"
    return inplace.not_formed(agent, kv)


def carry(agent: Agent, why: Failure | Scale) -> bool:
    """At a restart for nodes waiting to join: whether this node's workers go on in their group
    into the next round. True: what it carries is set for its arrival record (and the workers'
    store, where it hosts it, taken from the round so that nothing closes it); the caller asks
    the restart where it is this node's and meets the next round, its workers running."""
    path = agent.recovery_path
    if path is None or not path.in_place or not _scale(why) or agent.group.spec is None:
        return False
    if refused := _refused(agent):
        agent.event("grow_in_place_refused", level="warning", why=refused, cause=why.summary())
        return False
    rnd, group = agent.round, agent.group
    formed_in = int(group.spec.extra_env.get(names.ROUND_NUMBER, rnd.number))
    agent.rdzv.carry = Carry(formed_in, group.generation, rnd.worker_store)
    rnd.worker_store = None  # carried on: the round's close must not stop it
    agent.event(
        "carrying_in_place",
        cause=why.summary(),
        round=rnd.number,
        generation=group.generation,
        pids=[w.pid for w in group.workers],
    )
    return True


def larger(previous: Round, rnd: Round) -> tuple[dict[int, int], tuple[int, ...]]:
    """The kept ranks' numbers in `rnd` (from the previous round's, for the nodes that carry the
    group `rnd` goes on with) and the ranks that start for it (every other node's)."""
    old_base, base = {}, 0
    for m in previous.members:
        old_base[m.node_id] = base
        base += m.nproc
    mapping, base = {}, 0
    for m in rnd.members:
        if m.carries == rnd.carried and m.node_id in old_base:
            mapping.update({old_base[m.node_id] + i: base + i for i in range(m.nproc)})
        base += m.nproc
    starting = tuple(r for r in range(rnd.world_size) if r not in mapping.values())
    return mapping, starting


def cannot_start(nodes: list[str]) -> str:
    """Why a round goes on no group in place: the nodes whose ranks cannot start so."""
    return (
        f"node(s) {', '.join(nodes)} cannot start their ranks into a group in place (their torch "
        "has no reconfigure, or --in-place off)"
    )


def joined(agent: Agent, previous: Round | None, rnd: Round) -> bool:
    """After the round closed, on a node that carried its workers: True where they go on in the
    group `rnd` carries (this node's view and theirs renumbered, the next generation announced
    by group rank 0, the workers asked to take it at their next step boundary); False where the
    group did not go on (its line said): the caller stops them and starts afresh."""
    carry, agent.rdzv.carry = agent.rdzv.carry, None
    if carry is None:
        return False
    if previous is None or rnd.carried != (carry.round, carry.generation):
        why = cannot_start(rnd.fresh) if rnd.fresh else "group rank 0's node did not carry it"
        agent.event(
            "grow_in_place_refused",
            level="warning",
            why=f"round {rnd.number} closed without the group this node carried going on "
            f"({why}): its workers stop and start afresh",
        )
        return False
    group, now = agent.group, time.monotonic()
    mapping, starting = larger(previous, rnd)
    old = {w.global_rank: w.pid for w in group.workers}
    for w in group.workers:
        w.global_rank = mapping[w.global_rank]
    group.spec = dataclasses.replace(
        group.spec, rank_base=rnd.rank_base, world_size=rnd.world_size,
        group_rank=rnd.group_rank, group_world_size=rnd.group_world_size,
    )  # fmt: skip
    gen = carry.generation + 1
    if rnd.group_rank == 0:
        try:
            inplace.announce_generation(agent, starting, rnd.world_size, mapping)
        except (Unreachable, ValueError) as e:  # its own store: the workers find no word, fall back
            agent.event("grow_in_place_unannounced", level="warning", why=str(e))
    group.generation = gen
    running = tuple(w.global_rank for w in group.workers)
    after = inplace.stuck_after(getattr(group, "deadline", None))
    # asked to re-form once the joining ranks gave their handles (inplace.unstick), not now:
    # until then they train, where they would wait at their next boundary for those ranks' start
    agent.forming = inplace.Forming(gen, now, after, running, starting, ask_when_started=True)
    agent.event(
        "grown_in_place",
        level="warning",
        round=rnd.number,
        generation=gen,
        world=rnd.world_size,
        starting=list(starting),
        ranks={str(r): mapping[r] for r in old},
        survivors=list(old.values()),
    )
    return True


def joining(rnd: Round) -> tuple[int, int] | None:
    """For a node that starts its workers in a round whose group goes on in place: the round the
    group was formed in and the generation its ranks start into (names.ROUND_NUMBER and
    names.IN_PLACE_GEN, which the group's uuid and handles are bound to). None: a fresh start."""
    if rnd.carried is None:
        return None
    return rnd.carried[0], rnd.carried[1] + 1
