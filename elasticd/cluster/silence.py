"""Who has been silent how long: the liveness rules, pure (the clock is passed in, the store's
reads are done by the caller), so that a table of cases can check them
(tests/unit/cluster/test_silence.py).

A node's silence is the time since its beat counter last went up. Two readers keep it: the
liveness thread for the ring neighbours this node watches (peers.py: `account`, then `judge`
whether one is lost), and the node closing a restarted round for the expected nodes that have
not arrived (closing.py: `missing_lost`). Time we could not see the store is excused; the
closer's missing nodes are lost after LOST_SILENCE; a watched node is lost when silent for
--peer-timeout, or for a few beats while our workers wait on it, or for two beats once one of our
workers died of a closed connection (`died_at`: the peer's going is then both evidences at once),
or for one beat once its daemon's address stopped answering after it went quiet (`unreachable`,
probe.py: a starved or stopped node still answers, so this is evidence it is gone), or at once
once its daemon's held connection ended with no word (`gone`, links.py: the daemon died).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from elasticd.cluster.timing import BEAT_EVERY, LOST_SILENCE

K = TypeVar("K", bound=Hashable)
Heard = tuple[int, float]  # (the beat count last read, when it last went up)


def heard(seen: Heard | None, value: int | None, now: float) -> Heard:
    """A node's entry after reading its counter `value` (None: absent or not verified) at `now`:
    a first reading, or a count above the one seen, starts its silence afresh; the same count, a
    lower one (a replay) or none leaves it as it was."""
    if seen is None or (value is not None and value > seen[0]):
        return (value or 0, now)
    return seen


def excuse_blindness(
    seen: Mapping[K, Heard], now: float, last_ok: float, beat_every: float = BEAT_EVERY
) -> dict[K, Heard]:
    """Time this node could not see the store (its calls stalled: an etcd election, a starved
    daemon) is nobody's silence, since the others' beats were held up too: past one beat's
    worth, every silence starts that much later (never after `now`). `last_ok`: when the store
    last answered us."""
    blind = now - last_ok - beat_every
    if blind <= beat_every:
        return dict(seen)
    return {k: (value, min(now, since + blind)) for k, (value, since) in seen.items()}


def account(
    seen: Mapping[int, Heard],
    watched: Iterable[tuple[int, str]],
    beats: Mapping[str, int | None],
    now: float,
    last_ok: float,
    beat_every: float = BEAT_EVERY,
) -> dict[int, Heard]:
    """The liveness thread's view after one beat: `seen` by group rank, excused for the time we
    were blind, then each watched node's (group rank, node id) entry updated from `beats` (the
    counters read, by node id; entries of nodes not watched, our own among them, are ignored)."""
    out = excuse_blindness(seen, now, last_ok, beat_every)
    for g, node_id in watched:
        out[g] = heard(out.get(g), beats[node_id], now)
    return out


def missing_lost(
    seen: Mapping[str, Heard],
    beats: Mapping[str, int | None],
    now: float,
    limit: float = LOST_SILENCE,
) -> tuple[dict[str, Heard], dict[str, float]]:
    """The closer's view of the expected nodes that have not arrived (`beats`: their counters, by
    node id): their entries updated, and those lost (by how long each was silent): the round
    ended and such a node neither came nor beat for `limit` seconds since we first looked."""
    out, lost = dict(seen), {}
    for node_id, value in beats.items():
        entry = out.get(node_id)
        now_heard = heard(entry, value, now)
        if now_heard != entry:
            out[node_id] = now_heard
        elif now - entry[1] >= limit:
            lost[node_id] = now - entry[1]
    return out, lost


def anyone_silent(seen: Mapping[int, Heard], now: float, limit: float) -> bool:
    """Whether a watched node has been silent for `limit` (else there is nothing to judge, and
    our workers' heartbeats need not be read)."""
    return any(now - since >= limit for _, since in seen.values())


class Stepping(Protocol):
    """What `pace` reads of a worker's heartbeat (worker/heartbeat.py's Beat)."""

    beats: int
    first: float
    last: float


def pace(workers: Sequence[Stepping | None]) -> tuple[float | None, float | None]:
    """Our workers' progress: the latest step any of them made, and the longest time between
    steps of one of them (None for each when no worker has stepped, or stepped twice)."""
    stepped = [b for b in workers if b is not None and b.beats]
    progress = max((b.last for b in stepped), default=None)
    step = max(((b.last - b.first) / (b.beats - 1) for b in stepped if b.beats > 1), default=None)
    return progress, step


CLOSED = "our worker died of a closed connection"  # judge's `died_of` unless told
# the in-place path's evidence instead (daemon/inplace.py `_waits`): nobody died, they wait
WAITING = "our ranks unwound from a failed collective and wait for a generation nobody announced"


def judge(
    seen: Mapping[int, Heard],
    now: float,
    peer_timeout: float,
    progress: float | None,
    step: float | None,
    lost_silence: float = LOST_SILENCE,
    beat_every: float = BEAT_EVERY,
    died_at: float | None = None,
    unreachable: Mapping[int, tuple[float, str]] | None = None,
    gone: Mapping[int, tuple[float, str]] | None = None,
    died_of: str = CLOSED,
) -> tuple[int, str] | None:
    """The first watched node (by `seen`'s order) that is lost, and why: silent for
    --peer-timeout, or silent for `lost_silence` (and two and a half of our steps) while our
    workers made no step since it went quiet (their collectives wait on it), or, where one of our
    workers died of a closed connection at `died_at` (monotonic; `died_of` says what that evidence
    was: on the in-place path, our ranks unwound and waiting), silent for two beats since
    before then (its last beat heard at most two beats after that death: the read that would have
    seen a later one), or silent for a beat with its daemon's address not answering a probe
    made after it went quiet (`unreachable`: group rank -> (when that probe began, its verdict)),
    or at once where its daemon's held connection ended with no word (`gone`, links.py: the
    daemon died; group rank -> (when, why)).
    A daemon stopped for a few seconds (its workers still training) or a starved one (its beats
    late, not missing) is never lost."""
    for g, (_, since) in seen.items():
        silent = now - since
        if g in (gone or {}):
            return g, f"{gone[g][1]} {max(0.0, now - gone[g][0]):.2f}s ago"
        if silent >= peer_timeout:
            return g, f"went silent for {silent:.1f}s (--peer-timeout {peer_timeout:g})"
        probed = (unreachable or {}).get(g)
        if probed is not None and probed[0] > since and silent >= beat_every:
            return g, f"went silent for {silent:.2f}s and {probed[1]}"
        if died_at is not None and silent >= 2 * beat_every and since <= died_at + 2 * beat_every:
            return g, f"went silent for {silent:.1f}s, and {died_of}"
        if (
            progress is not None
            and step is not None
            and silent >= max(lost_silence, 2.5 * step)
            and progress < since + 2 * beat_every
        ):
            return (
                g,
                f"went silent for {silent:.1f}s while our workers waited on it (no step since)",
            )
    return None
