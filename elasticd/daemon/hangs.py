"""A hang's culprit named before the restart (the agent's hook, `name_culprit`): this node's ranks'
stack dumps reduced to where each waits (culprit.py), with each rank's collectives' sequence
numbers and ops (collective_seq.py: they decide a desync and who never arrived), published to the
other nodes and theirs gathered (cluster/hang_summaries.py), and the job-wide verdict added to the
failure's reason (and a `hang_culprit` event), so that the restart cause, status and the final
line name the rank (and node) elsewhere while the others waited in a collective; the failure's
rank, node, pid and log become the culprit's. A node told of a hang by another node dumps its own
workers' stacks for it first. Every wait is bounded (GATHER, 3 s): a node that says nothing in
time is named as such, never waited for. A rank stopped by a signal (state T: SIGSTOP, Ctrl-Z)
is the culprit wherever the others wait, so its node asks no other node (the restart that makes
them dump would also end a recovery in place) and only publishes its own summary, for a node
told of the hang by a restart that follows."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from elasticd.cluster import hang_summaries
from elasticd.cluster.errors import RendezvousFailed, StoreUnreachable
from elasticd.daemon import collective_seq, culprit
from elasticd.lifecycle.states import Failure, RestartCause, Scale, restart_request

if TYPE_CHECKING:
    from elasticd.daemon.agent import Agent

GATHER = 3.0  # seconds a node waits for the other nodes' summaries (they dump within ~1 s)
HUNG = "hung: "  # how a hang's reason begins (group.py), in a peer's restart request too


def told_of_hang(why: Failure | Scale) -> bool:
    return why.kind is RestartCause.PEER and HUNG in why.reason


def name_culprit(why: Failure | Scale, agent: Agent) -> Failure | Scale:
    """`why` with the culprit's verdict in its reason, for a hang declared here or told of by a
    peer; any other failure as it is."""
    local = why.kind is RestartCause.HANG
    if not (local or told_of_hang(why)) or agent.cfg.no_python:
        return why
    t0 = time.monotonic()
    rows = agent.group.dumps if local else agent.group.stacks(agent.state.value).get("stacks", [])
    rnd = agent.round
    multi = rnd is not None and rnd.group_world_size > 1
    node = agent.rdzv.node_id if multi else ""
    ranks = {
        r["rank"]: culprit.where(r["text"], node, r["path"], r.get("collectives", ""))
        for r in rows
        if r.get("text")
    }
    silent: list[str] = []
    stopped = local and multi and _stopped(why, agent)
    if multi:
        ranks, silent = _across_nodes(why, agent, ranks, ask=not stopped)
    verdict, seqs = judge(ranks)
    text = verdict.text + (f"; no stacks from node(s) {', '.join(silent)}" if silent else "")
    if stopped:
        text = f"rank {why.rank} is stopped by a signal (state T), the culprit: {text}"
    agent.event(
        "hang_culprit",
        level="warning",
        verdict=text,
        culprits=list(verdict.culprits),
        waited_in=verdict.waited_in,
        desync=verdict.desync,
        collectives=seqs.kind,  # what the ranks' sequence numbers said (collective_seq.py)
        seq=seqs.seq,
        seconds=round(time.monotonic() - t0, 3),  # what naming it added to the recovery
    )
    if stopped:  # the blame stays on it (this node's ranks alone may seem to wait on another)
        return dataclasses.replace(why, reason=f"{why.reason}; {text}")
    return _blamed(dataclasses.replace(why, reason=f"{why.reason}; {text}"), verdict, ranks, agent)


def _stopped(why: Failure, agent: Agent) -> bool:
    """The hung rank's process was stopped by a signal (state T) when the loop last looked, before
    the stack dump continued it (processes.dump_stacks)."""
    return why.pid is not None and agent.group.suspects.stopped(why.pid)


def judge(
    ranks: dict[int, culprit.Where | None],
) -> tuple[culprit.Verdict, collective_seq.Verdict]:
    """The job-wide verdict: the collectives' sequence numbers where they decide (a desync, or
    the ranks that never arrived: named first), the stacks' otherwise (where each rank was, said
    after); and the collectives' own verdict."""
    stacks = culprit.judge_hang(ranks)
    found = {r: w and collective_seq.parse_compact(w.collectives) for r, w in ranks.items()}
    nodes = {r: w.node for r, w in ranks.items() if w and w.node}
    seqs = collective_seq.judge(found, nodes) if any(found.values()) else collective_seq.NONE
    if not seqs.text:
        return stacks, seqs
    if not seqs.decides:  # every rank arrived, or none waits: the stacks name whom they can
        return dataclasses.replace(stacks, text=f"{stacks.text}; {seqs.text}"), seqs
    text = f"{seqs.text}; {stacks.text}"
    if set(stacks.culprits) != set(seqs.culprits):
        # the stacks blame others: on NCCL a rank waits where it syncs, not in the collective's
        # call (none seen in one; in a desync the odd rank is the one seen in a collective), so
        # say where the collectives' culprits were, from their own stacks
        named = [
            culprit.placed(r, ranks[r]) for r in seqs.culprits[: culprit.NAMED] if ranks.get(r)
        ]
        text = "; ".join([seqs.text, *(named or [stacks.text])])
    blamed = seqs.culprits or stacks.culprits
    desync = seqs.kind == "desync" or stacks.desync
    return culprit.Verdict(blamed, stacks.waited_in, stacks.waiting, text, desync), seqs


def _blamed(
    why: Failure, verdict: culprit.Verdict, ranks: dict[int, culprit.Where | None], agent: Agent
) -> Failure:
    """The failure's fields the first culprit's: its rank and node, and where it is this node's,
    its pid and log (the heartbeat names whichever rank's silence was read first: a rank that
    waited); as it was where the verdict names none."""
    if not verdict.culprits:
        return why
    rank = verdict.culprits[0]
    mine = next((w for w in agent.group.workers if w.global_rank == rank), None)
    if mine is not None:
        log = str(getattr(mine, "err_path", None) or mine.log_path)
        return dataclasses.replace(why, rank=rank, node=agent.node, pid=mine.pid, log_path=log)
    where = ranks.get(rank)
    node = where.node if where is not None and where.node else why.node
    return dataclasses.replace(why, rank=rank, node=node, pid=None, log_path=None)


def _across_nodes(
    why: Failure | Scale, agent: Agent, ranks: dict[int, culprit.Where | None], ask: bool
) -> tuple[dict[int, culprit.Where | None], list[str]]:
    """Publish ours (and, for a hang declared here, ask the others to restart now, so that they
    dump theirs), then gather the others' until GATHER passes. Not `ask`: ours only, for a node
    told of this hang by a restart that may follow (it gathers, and would wait for ours)."""
    mine = {r: w for r, w in ranks.items() if w is not None}
    deadline = time.monotonic() + GATHER
    try:
        hang_summaries.publish(agent.rdzv, agent.round, culprit.summary(mine))
        if not ask:
            return ranks, []
        if why.kind is RestartCause.HANG:
            agent.rdzv.request_restart(agent.round, restart_request(why, agent.node))
        found, silent = hang_summaries.gather(
            agent.rdzv, agent.round, culprit.parse_summary, deadline
        )
    except (StoreUnreachable, RendezvousFailed) as e:
        agent.event("hang_summaries_unreachable", level="warning", why=str(e))
        return ranks, ["the store did not answer"]
    for theirs in found.values():
        ranks.update(theirs)
    return ranks, silent
