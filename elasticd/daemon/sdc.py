"""Silent data corruption as the daemon judges it (`Corruption`): the workers' audit of the
replicas (checkpoint/audit.py) found a rank's state differing, kept nothing of it and ended every
rank with names.SDC_EXIT; its verdict (the step, the rank a majority outvoted, or none: undecided)
is in the ranks' heartbeat figures, the library's numbers, never read from text. A sharded
state's audit in time names the rank whose shards changed at rest, as a majority would.

The restart that follows resumes from the newest certified state (the newest one kept: every
state kept passed an audit), so a one-off flip ends bit-identical to the fault-free run. Each
detection is an `sdc_suspected` event naming the rank, its node and the step; a node blamed
again in this daemon's run (the same rank's hardware, a persistent fault) is `sdc_confirmed` and
quarantined at once (daemon/quarantine.py), its first blame being one strike. An undecided
verdict (two replicas, no majority) goes to the referee (daemon/referee.py), whose replay of the
step names the odd rank as a majority would; where it cannot, it blames no node and the
restart's budget bounds its repeats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from elasticd import names
from elasticd.cluster.rounds import Round
from elasticd.lifecycle.states import Failure
from elasticd.worker import heartbeat

UNDECIDED = "undecided"  # the detections' label where no majority named a node


@dataclasses.dataclass(frozen=True)
class Finding:
    """The audit's verdict as the local ranks' figures give it."""

    step: int
    rank: int | None  # the rank a majority outvoted; None: undecided
    node: str  # its node ("" where the round does not say)


def finding(beats: list[heartbeat.Beat | None], rnd: Round | None) -> Finding | None:
    """The verdict the local ranks noted (every rank notes the same), or None."""
    for beat in beats:
        if beat is not None and beat.figure("sdc_found") > 0:
            blamed = int(beat.figure("sdc_rank")) - 1
            rank = blamed if blamed >= 0 else None
            return Finding(int(beat.figure("sdc_step")), rank, node_of(rnd, rank))
    return None


def ended_by_audit(exit_code: int | None, beat: heartbeat.Beat | None) -> bool:
    """Whether a worker's end is the audit's: its figures say it found a disagreement (the
    library's numbers, noted just before it raised), and it ended with names.SDC_EXIT, is still
    ending, or died of a signal on the way out (a C++ thread ended badly in the interpreter's
    teardown: SIGABRT, seen 1 time in 7 with gloo; taken for the job's own failure, the
    detection went unjudged, no referee, no strike)."""
    ending = exit_code is None or exit_code == names.SDC_EXIT or exit_code < 0
    return ending and beat is not None and beat.figure("sdc_found") > 0


def node_of(rnd: Round | None, rank: int | None) -> str:
    """The node of a global rank in the round (ranks are dealt out in group-rank order)."""
    if rnd is None or rank is None:
        return ""
    base = 0
    for member in rnd.members:
        if base <= rank < base + member.nproc:
            return member.node_id
        base += member.nproc
    return ""


class Corruption:
    """This daemon's detections: by node blamed (status), those that blamed this node
    (elasticd_sdc_detected_total, whose node label is this node's) and the undecided ones."""

    def __init__(self, event: Callable[..., None]) -> None:
        self.event = event
        self.detected: dict[str, int] = {}
        self.here = 0  # detections that blamed this node

    def judge(
        self,
        why: Failure,
        beats: list[heartbeat.Beat | None],
        rnd: Round | None,
        referee: Callable[[int], Any] | None = None,
    ) -> tuple[Failure, bool, bool]:
        """The local failure `why` (class sdc) restated as the verdict, whether this node is
        blamed (a strike), and whether it was blamed before in this run (quarantine at once).
        `referee(step)` (daemon/referee.py `Call`) breaks an undecided verdict where it can."""
        found = finding(beats, rnd)
        if found is None:
            return why, False, False
        refereed: dict[str, Any] = {}
        if found.rank is None and referee is not None:
            call = referee(found.step)
            if call.odd is not None:
                found = Finding(found.step, call.odd, node_of(rnd, call.odd))
                refereed = {"referee": call.said, "referee_seconds": round(call.seconds, 3),
                            "referee_warm": call.warm}  # fmt: skip
            else:
                self.event("sdc_referee_undecided", level="warning", step=found.step,
                           said=call.said, seconds=round(call.seconds, 3), warm=call.warm,
                           action="undecided: no node struck")  # fmt: skip
        label = (found.node or UNDECIDED) if found.rank is not None else UNDECIDED
        self.detected[label] = self.detected.get(label, 0) + 1
        again = found.rank is not None and self.detected[label] > 1
        if found.rank is None:
            reason = (
                f"silent data corruption suspected at step {found.step}: the replicas disagree "
                "with no majority (undecided); restarting from the newest certified state"
            )
        else:
            reason = (
                f"silent data corruption at step {found.step}: rank {found.rank} (node "
                f"{found.node or '?'}) "
                + ("named by the referee's replay" if refereed else "named by the audit")
                + (", again: a persistent fault" if again else "")
                + "; restarting from the newest certified state"
            )
        fields: dict[str, Any] = {"rank": found.rank, "node": found.node, "step": found.step}
        self.event(
            "sdc_suspected", level="error", **fields, undecided=found.rank is None, **refereed
        )
        if again:
            self.event("sdc_confirmed", level="error", **fields, detections=self.detected[label])
        restated = dataclasses.replace(
            why,
            reason=reason,
            rank=found.rank if found.rank is not None else why.rank,
            node=found.node or why.node,
            step=found.step,
        )
        here = rnd is not None and found.rank is not None and found.node == rnd.node_id
        self.here += here
        return restated, here, again

    def report(self) -> dict[str, Any]:
        """Status's part (reporting/status_snapshot.py `SdcAudit`, less the workers' figures)."""
        return {
            "detected": self.here,
            "undecided": self.detected.get(UNDECIDED, 0),
            "by_node": dict(self.detected),
        }
