"""When the node closing a round closes it, with whom, and what it costs: the rule, pure (plain
data in, a `Decision` out; the store's reads and writes are closing.py's), so that a table of
cases can check every branch (tests/unit/cluster/test_closing_rule.py).

A round closes once MAX nodes are in; a restarted round also once every node it expects came
(the previous members and the nodes that waited to join, less the lost) and MIN are in; else
--last-call-timeout after MIN were in (a restarted round waits at least long enough for the
previous members to have stopped their workers and beaten: --restart-grace + --kill-timeout +
LOST_SILENCE). The members keep the previous round's group-rank order (the node holding rank 0
keeps it while it lives), the newcomers after them by arrival. Closing after a failure that
lost no node spends one restart of the job's budget.

`decide` says close now (full, everyone, late) or wait, with the members in group-rank order, the
lost, whether closing spends the budget and the join deadline; `budget_spent` is the verdict past
--max-restarts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticd.cluster.timing import LOST_SILENCE
from elasticd.cluster.values import MAX_COUNT, MAX_REASON


@dataclass(frozen=True)
class Limits:
    """The settings the rule reads (`of(cfg)`)."""

    min_nodes: int
    max_nodes: int
    last_call: float  # --last-call-timeout: how long after MIN nodes a round waits for more
    restart_wait: float  # the least a restarted round waits after MIN nodes for the expected

    @classmethod
    def of(cls, cfg) -> Limits:
        return cls(
            cfg.min_nodes,
            cfg.max_nodes,
            cfg.last_call_timeout,
            max(cfg.restart_grace, cfg.crash_grace) + cfg.kill_timeout + LOST_SILENCE,
        )


@dataclass(frozen=True)
class Decision:
    """One look at the arrivals: close now (`why`: "full", "everyone" or "late"), or wait."""

    close: bool
    why: str  # "" while waiting
    members: list[list]  # [node id, nproc, addr, link port] in group-rank order (empty: waiting)
    lost: list[str]  # the previous round's nodes that never came, and those its request named
    spends: bool  # closing spends a restart of the job's budget (a failure, no node lost)
    count: int  # distinct nodes arrived
    reached_min: float | None  # when MIN nodes were first in: the next look's `reached_min`
    timed_out: bool  # past the join deadline: unless this look closed the round, it fails


def decide(
    records: Mapping[str, dict],
    expected: set[str] | None,
    gone: set[str],
    lost: set[str],
    reached_min: float | None,
    now: float,
    deadline: float,
    limits: Limits,
    spends: bool,
) -> Decision:
    """`records`: the arrival records read, by arrival key; `expected`: whom a restarted round
    waits for (None for a first round); `gone`: the nodes the restart request named lost;
    `lost`: those and the expected found silent since; `reached_min`: as the last look left it;
    `spends`: the restart request says its failure spends the budget."""
    ids = {r["id"] for r in records.values()}
    count = len(ids)
    if count >= limits.min_nodes and reached_min is None:
        reached_min = now
    full = count >= limits.max_nodes
    everyone = expected is not None and not (expected - ids - lost) and count >= limits.min_nodes
    late = (
        reached_min is not None
        and now - reached_min >= limits.last_call
        and (expected is None or now - reached_min >= limits.restart_wait)
    )
    why = "full" if full else "everyone" if everyone else "late" if late else ""
    found_lost = sorted(lost & (expected or set()) | gone) if why else []
    return Decision(
        close=bool(why),
        why=why,
        members=order(records, limits.max_nodes) if why else [],
        lost=found_lost,
        spends=bool(why) and spends and not found_lost,
        count=count,
        reached_min=reached_min,
        timed_out=now > deadline,
    )


def order(records: Mapping[str, dict], max_nodes: int) -> list[list]:
    """The members in group-rank order: the previous round's by their rank there, then the
    others by arrival number (the key's length, then the key); one entry per node, at most
    `max_nodes`."""
    chosen = sorted(
        records.items(),
        key=lambda kv: (kv[1]["prev"] if kv[1]["prev"] >= 0 else MAX_COUNT, len(kv[0]), kv[0]),
    )
    members, seen_ids = [], set()
    for _, r in chosen:
        if r["id"] not in seen_ids and len(members) < max_nodes:
            seen_ids.add(r["id"])
            tail = [r["carries"]] if "carries" in r else []
            if r.get("fresh"):  # a sixth field marks it, after its carries (or null)
                tail = [r.get("carries"), True]
            members.append([r["id"], r["nproc"], r["addr"], r.get("link", 0), *tail])
    return members


def missing(expected: set[str] | None, ids: set[str], lost: set[str]) -> list[str]:
    """The expected nodes that have neither arrived nor been found lost (none for a first round)."""
    return sorted(expected - ids - lost) if expected is not None else []


def budget_spent(used: int, max_restarts: int, summary: str) -> str | None:
    """The verdict once a closing spent a restart (`used`: the budget spent with it): why the
    job fails, past --max-restarts; else None."""
    if used <= max_restarts:
        return None
    return (
        f"restart budget spent ({used - 1} of --max-restarts {max_restarts} used) at: {summary}"
    )[:MAX_REASON]
