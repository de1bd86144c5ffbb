"""The agent's state machine as types: its states, the transitions allowed between them, and why
a running group ends early (restart causes, failures, scale events), and what a restart asks of
the other nodes.

INIT → RENDEZVOUS ────────────→ RUNNING ──all local workers exit 0──→ EXIT_BARRIER → SUCCEEDED
           ▲                      │ a RestartCause that restarts: crash / signal / hang /
           │                      │ peer asked / node lost / store unreachable / scale
           │                      ▼
           └── next round ── RESTARTING (stop the group, backoff) ──fatal exit code──→ FAILED

RENDEZVOUS, RUNNING ──stop request or SIGTERM──→ STOPPING (workers checkpoint & exit) → STOPPED
RENDEZVOUS, RESTARTING ──stop while blocked on the store (joining, a replay's word)──→ STOPPED
RENDEZVOUS, RUNNING, RESTARTING, EXIT_BARRIER, STOPPING ──store lost / rendezvous failed──→ FAILED
  (a c10d store's host down is not lost: RUNNING → RESTARTING → RENDEZVOUS, waiting for it to
   come back within --join-timeout, else FAILED)
RENDEZVOUS ──the round's closing found the restart budget spent──→ FAILED
RENDEZVOUS, RUNNING ──this node's health check failed──→ LEFT (exit 5; the rendezvous stays open)
RENDEZVOUS, RUNNING ──that failure, or a hardware-class one, quarantines the node──→ LEFT (exit 7)
RESTARTING ──a failure whose replay reproduced on this node only: its hardware──→ LEFT (exit 7)

The agent checks every transition against TRANSITIONS where it happens (Agent.set_state): one
that is not in the table is a bug in the agent and raises IllegalTransition.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from elasticd.lifecycle import triage
from elasticd.lifecycle.triage import FailureClass


class State(str, enum.Enum):
    """Where the agent is; the values are what status and the `state` events show."""

    INIT = "INIT"
    """Constructed, nothing started. Next: RENDEZVOUS."""
    RENDEZVOUS = "RENDEZVOUS"
    """Connecting to the store, meeting the other nodes, then spawning the local workers (waiting
    for spares still being forked). Next: RUNNING; STOPPING (stop requested between rounds);
    STOPPED (stop requested while blocked in the rendezvous); FAILED (rendezvous failed); LEFT
    (the health check before a start failed)."""
    RUNNING = "RUNNING"
    """The local workers run; the loop watches their exits and heartbeats and the peers. Next:
    EXIT_BARRIER (every local worker exited 0); RESTARTING (a RestartCause); STOPPING (stop
    request or signal); FAILED (the store was lost); LEFT (the periodic health check failed)."""
    RESTARTING = "RESTARTING"
    """The local group is torn down and the backoff waited out (the restart budget is spent by
    the closing of the next round, cluster/closing.py, which knows whether a node was lost).
    Next: RENDEZVOUS (the next round, also when a stop came during the backoff: it is acted on
    there); STOPPED (a stop while blocked on the store, the workers already down: a replay's
    word, daemon/replay_elsewhere.py); FAILED (a fatal exit code, or the store was lost); LEFT
    (the failure's replay found this node's hardware at fault)."""
    EXIT_BARRIER = "EXIT_BARRIER"
    """Local workers are done; waiting for the other nodes to be done too. Next: SUCCEEDED;
    FAILED (the store was lost)."""
    STOPPING = "STOPPING"
    """A stop was requested: the workers get the grace to checkpoint and exit, then the exit
    barrier. Next: STOPPED; FAILED (the store was lost in the exit barrier)."""
    SUCCEEDED = "SUCCEEDED"
    """Final: the job finished (exit code 0)."""
    FAILED = "FAILED"
    """Final: the job failed (exit code 1); first_failure says why."""
    STOPPED = "STOPPED"
    """Final: stopped on request (exit code 0)."""
    LEFT = "LEFT"
    """Final: this node's health check failed (exit code 5): it refused to start, or stopped its
    workers and left the job, having asked the others to restart without it (the reason is their
    restart's cause). The job goes on without it if it is elastic and enough nodes remain."""


TRANSITIONS: dict[State, frozenset[State]] = {
    State.INIT: frozenset({State.RENDEZVOUS}),
    State.RENDEZVOUS: frozenset(
        {State.RUNNING, State.STOPPING, State.STOPPED, State.FAILED, State.LEFT}
    ),
    State.RUNNING: frozenset(
        {State.EXIT_BARRIER, State.RESTARTING, State.STOPPING, State.FAILED, State.LEFT}
    ),
    State.RESTARTING: frozenset({State.RENDEZVOUS, State.STOPPED, State.FAILED, State.LEFT}),
    State.EXIT_BARRIER: frozenset({State.SUCCEEDED, State.FAILED}),
    State.STOPPING: frozenset({State.STOPPED, State.FAILED}),
    State.SUCCEEDED: frozenset(),
    State.FAILED: frozenset(),
    State.STOPPED: frozenset(),
    State.LEFT: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition TRANSITIONS does not allow: a bug in the agent, never a job's fault."""


def check_transition(old: State, new: State) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(
            f"agent state {old.value} -> {new.value} is not a transition of the state "
            f"machine (elasticd/lifecycle/states.py TRANSITIONS)"
        )


class RestartCause(str, enum.Enum):
    """Why a running group ended before it finished. Each cause carries its `label`, the `cause`
    label of elasticd_restarts_total (and the key of status's restarts_by_cause), and `restarts`,
    whether it restarts the group (all but RENDEZVOUS, STOP and HEALTH do): the figures count a
    cause by these alone, so a new cause cannot go uncounted. The values are the `kind` that
    status's `last_failure` has always shown."""

    label: str
    restarts: bool

    def __new__(cls, value: str, label: str, restarts: bool) -> RestartCause:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label
        member.restarts = restarts
        return member

    CRASH = ("exited", "crash", True)
    """A local worker exited non-zero. Spends the job's restart budget."""
    SIGNAL = ("signaled", "signal", True)
    """A local worker was killed by a signal. Spends the budget."""
    HANG = ("hung", "hang", True)
    """A local worker stopped beating, or stayed stopped or a zombie. Spends the budget."""
    PEER = ("peer", "peer", True)
    """Another node asked for a restart (its own failure spent the budget)."""
    NODE_LOST = ("node lost", "node_lost", True)
    """A peer node went silent for --peer-timeout, or for a few beats while our workers waited on
    it (peers.py). Spends nothing."""
    STORE_UNREACHABLE = ("store unreachable", "store_unreachable", True)
    """This node could not reach the store for --peer-timeout (cut off from the others, or etcd
    lost its quorum), or at once when a c10d store's host refuses the connection (its daemon
    down: it may be started again with a fresh store): its workers stop, and it joins again once
    the store answers, within --join-timeout. Spends nothing."""
    SCALE = ("scale", "scale", True)
    """Nodes are waiting to join. Not a failure: spends nothing, and the workers may save
    first."""
    RENDEZVOUS = ("fatal", "rendezvous_failed", False)
    """The rendezvous itself failed (store lost, job failed elsewhere): no restart, the job
    fails."""
    STOP = ("stop", "stop", False)
    """A stop request or signal: the group gets its grace and ends for good (STOPPING). Spends
    nothing; shown as the STOPPING event's cause."""
    HEALTH = ("unhealthy", "unhealthy", False)
    """This node's health check failed: it leaves the job (LEFT). Spends nothing; the other nodes
    restart without it (for them, a PEER restart whose reason is the check's)."""

    @property
    def spends_budget(self) -> bool:
        return self in (RestartCause.CRASH, RestartCause.SIGNAL, RestartCause.HANG)


# the class of a failure whose maker says none: its cause's (a worker's exit is judged in group.py)
DEFAULT_CLASS: dict[RestartCause, FailureClass] = {
    RestartCause.CRASH: FailureClass.USER,
    RestartCause.SIGNAL: FailureClass.KILLED,
    RestartCause.HANG: FailureClass.HANG,
    RestartCause.PEER: FailureClass.UNKNOWN,
    RestartCause.NODE_LOST: FailureClass.NODE_LOST,
    RestartCause.STORE_UNREACHABLE: FailureClass.STORE_UNREACHABLE,
    RestartCause.SCALE: FailureClass.SCALE,
    RestartCause.RENDEZVOUS: FailureClass.RENDEZVOUS,
    RestartCause.STOP: FailureClass.STOP,
    RestartCause.HEALTH: FailureClass.HARDWARE,
}


@dataclass(frozen=True)
class Failure:
    """What went wrong first, with everything an engineer needs to find it."""

    kind: RestartCause
    reason: str
    rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    exception: str | None = None
    log_path: str | None = None
    stacks: tuple[str, ...] = ()
    node: str = ""
    lost: tuple[str, ...] = ()  # node ids found lost (NODE_LOST)
    at: float = field(default_factory=time.time)
    # what kind of trouble it is (triage.FailureClass's value); by default its cause's
    failure_class: str = ""
    # what makes it the same as another (triage.signature, with its step), where the repeat rule
    # judges it; "" where it does not
    signature: str = ""
    step: int | None = None  # the failing rank's step as it last beat (None: before its first)
    frame: str = ""  # the innermost frame of user code of its traceback (triage.user_frame)
    # the other failures of the attempt, after this one (triage.first): "rank R: what (+T s)"
    consequences: tuple[str, ...] = ()
    # what the GPU driver reported meanwhile (daemon/driver.py): hardware evidence, a strike
    driver: str = ""
    # the replay's verdict on it (daemon/replay_verdict.py): "reproduced" (the closing calls it
    # deterministic at once), "transient", or "" where none ran or it decided nothing
    replayed: str = ""
    # a hang this node's ranks alone do not prove (idle, while the culprit may be on another
    # node): judged on every node's stacks (daemon/hangs.py), or not a hang
    across: bool = False

    def __post_init__(self) -> None:
        if not self.failure_class:
            object.__setattr__(self, "failure_class", DEFAULT_CLASS[self.kind].value)

    def summary(self) -> str:
        """The cause in its first words: the rank and its node, its exception and frame (else
        its exit), then the log, the stacks and the consequences."""
        who = f"node {self.node}"
        if self.rank is not None:
            who = f"rank {self.rank} (node {self.node})" if self.node else f"rank {self.rank}"
        parts = [who]
        if self.exception:
            parts.append(f"{self.exception} ({self.frame})" if self.frame else self.exception)
        parts.append(self.reason)
        if self.log_path:
            parts.append(f"log {self.log_path}")
        if self.stacks:
            parts.append(f"stacks {', '.join(self.stacks)}")
        if self.consequences:
            parts.append(f"then {', '.join(self.consequences)}")
        if self.driver:
            parts.append(self.driver)
        return "; ".join(parts)

    def reported(self) -> str:
        """The summary with the failure's class, as the final line and events show it."""
        return f"{self.summary()} [class {self.failure_class}]"


@dataclass(frozen=True)
class Scale:
    """Nodes are waiting to join a running round: every node restarts to take them in."""

    waiting: int
    node: str
    ids: tuple[str, ...] = ()  # the waiting nodes' ids: the next round waits for them
    kind: ClassVar[RestartCause] = RestartCause.SCALE
    failure_class: ClassVar[str] = FailureClass.SCALE.value

    @property
    def reason(self) -> str:
        return f"{self.waiting} node(s) waiting to join"

    def summary(self) -> str:
        return f"node {self.node}; {self.reason}"


def restart_request(why: Failure | Scale, node: str) -> dict[str, Any] | None:
    """What a restart for `why` asks of every node of the round (rendezvous.request_restart; the
    next round's closing reads `spends` and `lost`, cluster/values.py): None where it asks
    nothing, because another node asked already (its reason is in the store) or the store cannot
    be reached."""
    # the class travels, so that every node shows it
    reason: dict[str, Any] = {"summary": why.summary(), "node": node, "class": why.failure_class}
    if why.kind.spends_budget:
        # the signature too: the next round's closing judges repeats by it (triage.repeats); and
        # when it happened and whether it is a consequence's death, so that a request for a
        # failure that came first takes the place of one already there (triage.comes_first)
        first = {"at": why.at, "consequence": triage.consequence(why.exception)}
        if why.replayed:  # the next closing's repeat rule reads it (triage.repeats)
            first["replayed"] = why.replayed
        return {**reason, "spends": True, "sig": why.signature, "rank": why.rank, **first}
    if why.kind is RestartCause.SCALE:
        return {**reason, "summary": why.reason, "scale": True, "waiting": list(why.ids)}
    if why.kind is RestartCause.NODE_LOST:
        # when it went quiet: a request for a death of its going gives way to it
        # (triage.comes_first)
        return {**reason, "lost": list(why.lost), "at": why.at}
    return None


def first_elsewhere(
    request: dict | None, mine: Failure, lost: list[str] | tuple[str, ...] = ()
) -> Failure | None:
    """This node's failure as the job's, where the restart request the round ended with names
    another node's failure that came first (triage.comes_first; a node told to restart put it in
    our request's place), or a node lost (the request's, or `lost`: the previous round's members
    the next one's closing found gone) where ours was a death of a closed connection: that
    failure, ours among its consequences; None where the request is ours, names none, or came
    after."""
    if not mine.kind.spends_budget:
        return None
    then = f"rank {mine.rank} (node {mine.node}): {mine.exception or mine.reason}"[:160]
    ours = restart_request(mine, mine.node) or {}
    if request and (request.get("at"), request.get("rank")) == (ours.get("at"), ours.get("rank")):
        request = None  # ours
    if request and triage.comes_first(request, ours):
        return requested(request, mine.kind, (then,), mine.failure_class)
    if lost and triage.consequence(mine.exception):
        names = ", ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
        return Failure(
            RestartCause.NODE_LOST,
            f"lost: never came back to the next round (node(s) {names}); our rank died of a "
            "closed connection before",
            node=lost[0],
            lost=tuple(lost),
            at=mine.at,
            consequences=(then,),
        )
    return None


def requested(
    request: dict, kind: RestartCause, consequences: tuple[str, ...], klass: str = ""
) -> Failure:
    """The failure another node's restart request names (its rank, node, time, class and
    signature), as `kind`, with this node's `consequences` of it."""
    if request.get("lost"):
        return node_lost(request, consequences)
    rank, node = request.get("rank"), str(request.get("node", "?"))
    summary = str(request.get("summary", "?"))
    return Failure(
        kind,
        summary.removeprefix(f"rank {rank} (node {node}); "),
        rank=rank,
        node=node,
        at=request.get("at", time.time()),
        failure_class=str(request.get("class") or klass),
        signature=str(request.get("sig", "")),
        consequences=consequences,
    )


def node_lost(request: dict, consequences: tuple[str, ...] = ()) -> Failure:
    """The failure a restart request that names lost nodes describes (another node saw it): the
    first lost node in its first words, the asker named after."""
    lost = tuple(str(n) for n in request.get("lost", []))
    asker = str(request.get("node", "?"))
    summary = str(request.get("summary", "?")).removeprefix(f"node {lost[0]}; ")
    at = request.get("at")
    return Failure(
        RestartCause.NODE_LOST,
        summary if f"node {asker}" in summary else f"{summary} (told by node {asker})",
        node=lost[0],
        lost=lost,
        failure_class=FailureClass.NODE_LOST.value,
        consequences=consequences,
        **({"at": float(at)} if isinstance(at, (int, float)) and at > 0 else {}),
    )
