"""A hang's culprit named before the recovery (the agent's hook, `name_culprit`): this node's
ranks' stack dumps reduced to where each waits (culprit.py), with each rank's collectives'
sequence numbers and ops (collective_seq.py: they decide a desync and who never arrived), the
other nodes' gathered (cluster/hang_summaries.py), and the job-wide verdict added to the
failure's reason (and a `hang_culprit` event), so that the cause, status and the final line name
the rank (and node) elsewhere while the others waited in a collective; the failure's rank, node,
pid and log become the culprit's. Every wait is bounded (GATHER, 3 s): a node that says nothing
in time is named as such, never waited for.

Over several nodes, on the in-place path, the node that declares the hang asks the others for
their stacks by an inquiry (cluster/hang_inquiry.py), which restarts nothing: each answers
(`answer`, from the loop's quiet tick) and waits for the asker's verdict; the culprit's node then
replaces it in place and the others follow its generation (`Hold`: past its deadline, a
restart). An idle silence no node's ranks prove alone (`Failure.across`: one rank a node, or
every rank of a node in one data read) is asked about the same way, at the learned deadline, and
is a hang only where the culprit every node's stacks name was idle on its node too (each node's
summary says which of its ranks are); else the verdict is no hang (`hang_cleared`) and every node
goes on, its own verdicts no longer held (on the restart path, the culprit's node restarts the
group; where a generation forms, such a silence is left to the ceiling, --heartbeat-timeout). On
the restart path the request that makes the others dump for a hang proven on one node is the
restart itself, and a node told of the hang by it dumps its own workers' stacks for it first.
A rank stopped by a signal (state T: SIGSTOP, Ctrl-Z) is the culprit wherever the others wait,
so its node asks no other node and only publishes its own summary, for a node told of the hang
by a restart that follows."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from elasticd.cluster import hang_inquiry, hang_summaries
from elasticd.cluster.errors import RendezvousFailed, StoreUnreachable
from elasticd.daemon import collective_seq, culprit
from elasticd.lifecycle.states import Failure, RestartCause, Scale, restart_request

if TYPE_CHECKING:
    from elasticd.daemon.agent import Agent

GATHER = 3.0  # seconds a node waits for the other nodes' summaries (they dump within ~1 s)
# the same for a silence no node proves alone (`Failure.across`), which may be no hang at all: the
# loop waits no longer on it (a node silent meanwhile, lost or cut off, is its liveness check's)
GATHER_UNPROVEN = 1.0
HUNG = "hung: "  # how a hang's reason begins (group.py), in a peer's restart request too
# seconds the other nodes wait for the culprit's node to announce its replacement in place, once
# the verdict named it (it does so at its next tick)
HANDOFF = 3.0


@dataclasses.dataclass
class Hold:
    """This node waits on a hang judged across nodes in place (inquiry `index` of round
    `round`): for the verdict (`judged` False), then for the culprit's node's generation (past
    `generation`); past `until`, `fallback` is the failure (the group restarts). `told`: the
    verdict's failure where it named a rank of this node (the loop recovers it)."""

    round: int
    index: int
    generation: int
    until: float
    fallback: Failure
    judged: bool = False
    told: Failure | None = None
    quiet_was: float = 0.0  # the group's quiet_from before the hold: back to it where no hang


def told_of_hang(why: Failure | Scale) -> bool:
    return why.kind is RestartCause.PEER and HUNG in why.reason


def name_culprit(why: Failure | Scale, agent: Agent) -> Failure | Scale | None:
    """`why` with the culprit's verdict in its reason, for a hang declared here or told of by a
    peer; any other failure as it is. None: judged across nodes in place, its verdict (or the
    culprit's node's generation) waited for (`Hold`)."""
    hold = agent.hang_hold
    if hold is not None and why is hold.told:  # named by an inquiry's verdict already
        agent.hang_hold = None
        return why
    local = why.kind is RestartCause.HANG
    if not (local or told_of_hang(why)) or agent.cfg.no_python:
        return why
    if local and hold is not None:  # one hang, judged across nodes: its verdict is awaited
        return None
    t0 = time.monotonic()
    rows = agent.group.dumps if local else agent.group.stacks(agent.state.value).get("stacks", [])
    ranks = _wheres(agent, rows)
    rnd = agent.round
    multi = rnd is not None and rnd.group_world_size > 1
    stopped = local and multi and _stopped(why, agent)
    if local and multi and not stopped and _inquired(why, agent):
        return _inquire(why, agent, ranks, t0)
    if why.across and not why.driver:  # only an inquiry judges it: till then, none
        agent.event(
            "hang_deadline_passed",
            rank=why.rank,
            why="idle, its culprit maybe on another node; judged at --heartbeat-timeout "
            "(no inquiry: a generation forms)",
        )
        return None
    silent: list[str] = []
    if multi:
        ranks, silent = _across_nodes(why, agent, ranks, ask=not stopped)
    named, _ = _named(why, agent, ranks, silent, stopped, t0)
    return named


def _wheres(agent: Agent, rows: list[dict]) -> dict[int, culprit.Where | None]:
    """This node's ranks' stack dumps (group.py's rows) as where each waits."""
    rnd = agent.round
    node = agent.rdzv.node_id if rnd is not None and rnd.group_world_size > 1 else ""
    idle = agent.group.idle(time.monotonic())
    wheres = {
        r["rank"]: culprit.where(r["text"], node, r["path"], r.get("collectives", ""))
        for r in rows
        if r.get("text")
    }
    return {r: w and dataclasses.replace(w, idle=r in idle) for r, w in wheres.items()}


def _named(
    why: Failure,
    agent: Agent,
    ranks: dict[int, culprit.Where | None],
    silent: list[str],
    stopped: bool,
    t0: float,
    **said,
) -> tuple[Failure, str]:
    """The verdict over `ranks` (every node's that came): a `hang_culprit` event, and the
    failure blamed on its culprit, with the verdict's text."""
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
        **said,
    )
    why = dataclasses.replace(why, reason=f"{why.reason}; {text}")
    if stopped:  # the blame stays on it (this node's ranks alone may seem to wait on another)
        return why, text
    return _blamed(why, verdict, ranks, agent), text


def _inquired(why: Failure, agent: Agent) -> bool:
    """Whether a hang declared here is judged across nodes by an inquiry: no generation forms, a
    rank was named, and the job recovers in place (else the group restarts anyway), or the hang
    is one no node proves alone (`Failure.across`: the inquiry decides whether it is one; on the
    restart path the culprit's node then restarts the group)."""
    path = agent.recovery_path
    return (
        path is not None
        and (path.in_place or why.across)
        and agent.forming is None
        and agent.peers is not None
        and why.rank is not None
        and not why.driver
    )


def _inquire(
    why: Failure, agent: Agent, ranks: dict[int, culprit.Where | None], t0: float
) -> Failure | None:
    """Ask the other nodes for their stacks (an inquiry, hang_inquiry.py), publish ours for it,
    gather theirs and say the verdict: the culprit, where it is ours (the loop replaces it in
    place); else None, this node holding for the culprit's node's generation. Where another node
    claimed the inquiry first (the same hang, declared there at once), it judges: None, holding
    for its verdict."""
    rdzv, rnd, waiter = agent.rdzv, agent.round, agent.peers.inquiries
    mine = {r: w for r, w in ranks.items() if w is not None}
    deadline = time.monotonic() + (GATHER_UNPROVEN if why.across else GATHER)
    gen = agent.group.generation
    try:
        index, claimed = hang_inquiry.ask(rdzv, rnd, waiter.next, gen)
        agent.hang_answered = (rnd.number, index)  # ours, or one we joined: never answered again
        hang_summaries.publish(rdzv, rnd, culprit.summary(mine), index)
        if not claimed:
            agent.event("hang_inquiry_joined", inquiry=index)
            _hold(agent, index, gen, hang_inquiry.VERDICT_WAIT, _unjudged(why, index))
            return None
        agent.event("hang_inquiry", inquiry=index, rank=why.rank, proven=not why.across)
        found, silent = hang_summaries.gather(rdzv, rnd, culprit.parse_summary, deadline, index)
    except (StoreUnreachable, RendezvousFailed) as e:
        agent.event("hang_summaries_unreachable", level="warning", why=str(e))
        if why.across:  # unproven, and no other node's stacks to prove it: the store's silence
            return None  # is the liveness check's to judge, the rank's the next look's
        return _named(why, agent, ranks, ["the store did not answer"], False, t0)[0]
    for theirs in found.values():
        ranks.update(theirs)
    doubt = _unproven(ranks) if why.across else None
    if doubt is not None:
        said = f"; no stacks from node(s) {', '.join(silent)}" if silent else ""
        _cleared(agent, index, doubt + said, t0)
        return None
    agent.status.figures.on_hang_inquiry("hang")
    named, text = _named(why, agent, ranks, silent, False, t0, inquiry=index)
    where = ranks.get(named.rank)
    holder = rdzv.node_id if named.pid is not None else (where.node if where else "")
    try:
        hang_inquiry.say(rdzv, rnd, index, named.rank, holder, text)
    except (StoreUnreachable, RendezvousFailed) as e:  # the others restart at their deadline
        agent.event("hang_verdict_unsaid", level="warning", why=str(e))
    if named.pid is not None:  # this node's rank: replaced in place (inplace.replace)
        return named
    _handed(agent, index, gen, named, holder)
    return None


def _unproven(ranks: dict[int, culprit.Where | None]) -> str | None:
    """Why every node's stacks do not make an idle silence a hang (`Failure.across`), or None
    where they do: a desync, or a culprit whose node saw it idle (or stopped). A culprit that
    computes is a straggler (or in a long step of its own); no culprit (every rank waits in one
    collective, or none in any: an evaluation, the network) is no rank's hang."""
    verdict, _ = judge(ranks)
    if verdict.desync:
        return None
    if not verdict.culprits:
        return f"not a hang by every node's stacks: {verdict.text}"
    rank = verdict.culprits[0]
    where = ranks[rank]  # a culprit is a rank with stacks
    if where.idle:
        return None
    uses = "uses the CPU (a straggler?)" if where.idle is False else "is not known to be idle"
    return f"not a hang: its culprit {culprit.placed(rank, where)} {uses}"


def _cleared(agent: Agent, index: int, why: str, t0: float) -> None:
    """No hang, every node told (the verdict `hang` False): they go on holding nothing."""
    try:
        hang_inquiry.say(agent.rdzv, agent.round, index, None, "", why, hang=False)
    except (StoreUnreachable, RendezvousFailed) as e:  # they go on at their deadline (a restart)
        agent.event("hang_verdict_unsaid", level="warning", why=str(e))
    agent.status.figures.on_hang_inquiry("cleared")
    agent.event("hang_cleared", inquiry=index, why=why, seconds=round(time.monotonic() - t0, 3))


def _unjudged(why: Failure, index: int) -> Failure:
    """What a node holding for inquiry `index`'s verdict restarts for when none comes."""
    return dataclasses.replace(
        why,
        reason=f"{HUNG}no verdict on hang inquiry {index} came within "
        f"{hang_inquiry.VERDICT_WAIT:g}s (its asker may be gone); {why.reason.removeprefix(HUNG)}",
        rank=None,
        pid=None,
    )


def _hold(agent: Agent, index: int, gen: int, seconds: float, fallback: Failure) -> Hold:
    """Hold for `seconds`, or until a generation past `gen` (the one the inquiry was asked in:
    one formed since, for this hang or a fault found at once elsewhere, ends the hold, and a
    verdict on it, which may name a rank started for it, is no longer acted on): this node's
    own ranks' silence is judged from its end (the hang is judged, or recovered, elsewhere)."""
    now, was = time.monotonic(), agent.group.quiet_from
    if agent.hang_hold is not None:  # a hold after another (the verdict came): the first's
        was = agent.hang_hold.quiet_was
    hold = Hold(agent.round.number, index, gen, now + seconds, fallback, quiet_was=was)
    agent.group.quiet_from = max(agent.group.quiet_from, hold.until)
    agent.hang_hold = hold
    return hold


def _handed(agent: Agent, index: int, gen: int, named: Failure, holder: str) -> None:
    """The verdict named another node's rank: hold for its node's generation in place."""
    fallback = dataclasses.replace(
        named,
        reason=f"{named.reason}; its node {holder} did not replace it in place within {HANDOFF:g}s",
    )
    _hold(agent, index, gen, HANDOFF, fallback).judged = True


def answer(agent: Agent, now: float) -> Failure | None:
    """The loop's quiet tick: another node's inquiry answered (this node's stacks published for
    it, then held for its verdict); a verdict acted on: a rank of ours named is the failure
    returned (recovered in place), another node's is waited for (its generation); a hold past its
    deadline, its fallback (the group restarts)."""
    rnd, peers = agent.round, agent.peers
    if rnd is None or peers is None or agent.cfg.no_python:
        return None
    waiter = peers.inquiries
    asked = waiter.asked
    if (
        asked is not None
        and asked.round == rnd.number
        and asked.node != agent.rdzv.node_id
        and (rnd.number, asked.index) > agent.hang_answered
        and agent.hang_hold is None
    ):
        _answer(agent, asked)
    hold = agent.hang_hold
    if hold is None:
        return None
    if hold.round != rnd.number or agent.group.generation > hold.generation:
        agent.hang_hold = None  # the culprit's node's generation followed (or a new round)
        return None
    verdict = waiter.verdict
    came = verdict is not None and (verdict.round, verdict.index) == (rnd.number, hold.index)
    if not hold.judged and came:
        return _verdict(agent, hold, verdict)
    if now >= hold.until:
        agent.hang_hold = None
        agent.event("hang_hold_expired", level="warning", inquiry=hold.index)
        if not hold.judged:  # else counted as its verdict came
            agent.status.figures.on_hang_inquiry("none")
        return hold.fallback
    return None


def _answer(agent: Agent, asked: hang_inquiry.Asked) -> None:
    """Our ranks' stacks for another node's inquiry, published; held for its verdict."""
    t0 = time.monotonic()
    agent.hang_answered = (asked.round, asked.index)
    rows = agent.group.stacks(agent.state.value).get("stacks", [])
    mine = {r: w for r, w in _wheres(agent, rows).items() if w is not None}
    try:
        hang_summaries.publish(agent.rdzv, agent.round, culprit.summary(mine), asked.index)
    except (StoreUnreachable, RendezvousFailed) as e:
        agent.event("hang_summaries_unreachable", level="warning", why=str(e))
    agent.event(
        "hang_inquiry_answered",
        inquiry=asked.index,
        asker=asked.node,
        ranks=sorted(mine),
        seconds=round(time.monotonic() - t0, 3),
    )
    why = Failure(
        RestartCause.HANG,
        f"{HUNG}node {asked.node} asked for every node's stacks",
        node=agent.node,
    )
    fallback = _unjudged(why, asked.index)
    _hold(agent, asked.index, asked.generation, hang_inquiry.VERDICT_WAIT, fallback)


def _verdict(agent: Agent, hold: Hold, verdict: hang_inquiry.Verdict) -> Failure | None:
    """The asker's verdict, held for: a rank of ours named is this node's failure (replaced in
    place by the loop); another node's, its generation waited for; none, the fallback."""
    if not verdict.hang:  # an idle silence nobody's stacks explain: no hang, nothing held
        agent.hang_hold = None
        agent.group.quiet_from = hold.quiet_was
        agent.status.figures.on_hang_inquiry("cleared")
        agent.event("hang_cleared", inquiry=verdict.index, why=verdict.text, told=True)
        return None
    agent.status.figures.on_hang_inquiry("hang" if verdict.rank is not None else "none")
    if verdict.rank is None:
        agent.hang_hold = None
        return hold.fallback
    mine = next(
        (w for w in agent.group.workers if w.global_rank == verdict.rank and w.exit_code is None),
        None,
    )
    agent.event(
        "hang_culprit",
        level="warning",
        verdict=verdict.text,
        culprits=[verdict.rank],
        inquiry=verdict.index,
        told=True,  # the asker's verdict, on every node's stacks
    )
    if verdict.node != agent.rdzv.node_id or mine is None:
        fallback = Failure(
            RestartCause.HANG,
            f"{HUNG}{verdict.text}; its node {verdict.node} did not replace it in place within "
            f"{HANDOFF:g}s",
            rank=verdict.rank,
            node=verdict.node,
        )
        _hold(agent, verdict.index, hold.generation, HANDOFF, fallback).judged = True
        return None
    hold.told = Failure(
        RestartCause.HANG,
        f"{HUNG}{verdict.text} (judged on every node's stacks, hang inquiry {verdict.index})",
        rank=mine.global_rank,
        pid=mine.pid,
        log_path=str(getattr(mine, "err_path", None) or mine.log_path),
        node=agent.node,
    )
    return hold.told


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
    blamed = culprit.roots_first(seqs.culprits, ranks) or stacks.culprits
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
