"""The first arrival closes the round: it reads the arrivals (and, for a restarted round, the
beats of the expected nodes that have not come) until the closing rule (closing_rule.py) says
to close, spends the job's restart budget where the rule says so, and writes the members in one
value each node reads once (compare-and-set: when several close, one closing wins).

The nodes it expects are the previous members and the nodes that waited to join, less the lost;
the beats of those missing are read for the rule. After a failure, the repeat verdict (`_repeats`,
lifecycle/triage.py's rule) is taken here, so every node reads the same one from the members.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from elasticd import logs, names
from elasticd.cluster import silence, values
from elasticd.cluster.closing_rule import Decision, Limits, budget_spent, decide, missing
from elasticd.cluster.errors import RendezvousFailed
from elasticd.cluster.timing import CLOSE_POLL
from elasticd.lifecycle import triage

if TYPE_CHECKING:
    from elasticd.cluster.rendezvous import Rendezvous

log = logs.get("elasticd.rendezvous")


def close_round(rz: Rendezvous, number: int, deadline: float) -> dict:
    """Close the round once the rule says so, write its members, return what was written (ours,
    or another closer's)."""
    key = rz.round_key(number, names.MEMBERS)
    limits = Limits.of(rz.cfg)
    expected, gone, reason = expected_nodes(rz, number)
    lost: set[str] = set(gone)
    records: dict[str, dict] = {}  # arrival key -> its record
    heard: dict[str, silence.Heard] = {}  # missing node -> (its beat count, since when)
    reached_min = None
    while True:
        now = time.monotonic()
        records.update(rz.arrivals.read_records(rz.arrivals.new_records(number, set(records))))
        if expected is not None:
            ids = {r["id"] for r in records.values()}
            beats = rz.read_beats(rz.kv, missing(expected, ids, lost))
            heard, newly_lost = silence.missing_lost(heard, beats, now)
            for node_id, silent in newly_lost.items():
                # the round ended and it neither came nor beat
                lost.add(node_id)
                log.warning("node_lost", node=node_id, round=number, silent=round(silent, 2))
        spends = bool(reason.get("spends"))
        d = decide(records, expected, gone, lost, reached_min, now, deadline, limits, spends)
        reached_min = d.reached_min
        if d.close:
            if spends:  # read again: a replay's verdict may have replaced it since (states.py)
                reason = _restart_request(rz, number) or reason
            found = _write_members(rz, key, _verdict(rz, number, d, reason))
            if found is not None:
                return found
        if d.timed_out:
            raise RendezvousFailed(_too_few(rz, d.count))
        if rz.kv.wait(key, CLOSE_POLL):  # the pause between looks: another node closed the round
            found = rz.open(key, rz.kv.get(key), values.members)
            if found is not None:
                return found
            time.sleep(CLOSE_POLL)  # a value in the way that does not verify


def _verdict(rz: Rendezvous, number: int, d: Decision, reason: dict) -> str:
    """The members value the decision makes; where it spends the budget, spent here, and the
    job's failure when that passes --max-restarts."""
    verdict: dict = {"members": d.members, "lost": d.lost}
    if d.spends:  # a failure, not a node lost: it costs the budget
        verdict.update(_repeats(rz, number, reason))
        if verdict["deterministic"]:
            return json.dumps(verdict)
        failed = budget_spent(
            rz.budget.spend(number), rz.cfg.max_restarts, reason.get("summary", "?")
        )
        if failed is not None:
            verdict["failed"] = failed
    return json.dumps(verdict)


def _repeats(rz: Rendezvous, number: int, reason: dict) -> dict:
    """The repeat rule (lifecycle/triage.py) for the failure that ended round `number` - 1: its
    signature against the one the previous closing recorded; the record this closing keeps, and
    where the failure is deterministic, the job's end (every node reads it from the members)."""
    sig = reason.get("sig", "")
    prev_key = rz.round_key(number - 1, names.MEMBERS)
    prev = rz.open(prev_key, rz.kv.get(prev_key), values.members) if number > 0 else None
    previous = (prev["sig"], prev["repeats"]) if prev and prev["sig"] else None
    reproduced = reason.get("replayed") == "reproduced"
    count, deterministic = triage.repeats(previous, sig, rz.cfg.deterministic_retries, reproduced)
    record: dict = {"sig": sig if count else "", "repeats": count, "deterministic": deterministic}
    if deterministic and reproduced and count <= rz.cfg.deterministic_retries:
        record["failed"] = (
            f"deterministic failure: its replay from the repro bundle, in one process, failed "
            f"the same way ({sig}); not restarted: {reason.get('summary', '?')}"
        )[: values.MAX_REASON]
    elif deterministic:
        # rounds number - count .. number - 1 ended in it: attempts number - count + 1 .. number
        first, last = number - count + 1, number
        span = f"{first} and {last}" if count == 2 else f"{first} to {last}"
        record["failed"] = (
            f"deterministic failure: the same failure ({sig}) in attempts {span}, "
            f"--deterministic-retries {rz.cfg.deterministic_retries}; not restarted: "
            f"{reason.get('summary', '?')}"
        )[: values.MAX_REASON]
    return record


def _too_few(rz: Rendezvous, count: int) -> str:
    hint = (
        f"; {rz.signer.rejected} store value(s) failed verification: give every node the same "
        "--rdzv-secret-file"
        if rz.signer.rejected
        else ": start elasticd on the other nodes, or lower --nnodes"
    )
    return (
        f"only {count} of the {rz.cfg.min_nodes} nodes needed joined within --join-timeout "
        f"{rz.cfg.join_timeout:g}s{hint}"
    )


def _write_members(rz: Rendezvous, key: str, value: str) -> dict | None:
    """Write the round's members unless another closer did: what won, ours or theirs. A value
    in the way that does not verify is written over (compare-and-set against it)."""
    raw = None
    for _ in range(8):
        if rz.kv.compare_set(key, raw, rz.seal(key, value)):
            return values.members(value)
        raw = rz.kv.get(key)
        found = rz.open(key, raw, values.members)
        if found is not None:
            return found
    return None  # it changed under us each time: look again at the next poll


def _restart_request(rz: Rendezvous, number: int) -> dict | None:
    """The restart request that ended round `number` - 1, as it is now."""
    restart = rz.round_key(number - 1, names.RESTART)
    return rz.open(restart, rz.kv.get(restart), values.reason)


def expected_nodes(rz: Rendezvous, number: int) -> tuple[set[str] | None, set[str], dict]:
    """Whom a restarted round waits for: the previous round's members (as that round's closing
    wrote them) but those its restart request named lost, plus the nodes that were waiting to
    join; the lost; and the restart request. (None, {}, {}) for a first round."""
    if number == 0:
        return None, set(), {}
    reason = _restart_request(rz, number) or {}
    prev = rz.round_key(number - 1, names.MEMBERS)
    closed = rz.open(prev, rz.kv.get(prev), values.members)
    if closed is not None:
        members = closed["members"]
    elif rz.last is not None and rz.last.number == number - 1:
        # what it was when we read it (a forger has written over it)
        members = rz.last.members
    else:
        return None, set(), reason
    gone = set(reason.get("lost", []))
    return {m.node_id for m in members} - gone | set(reason.get("waiting", [])), gone, reason
