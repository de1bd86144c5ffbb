"""The liveness rules (cluster/silence.py) as tables: who has been silent since when, and who is
lost, with the clock passed in."""

from dataclasses import dataclass

import pytest

from elasticd.cluster.silence import (
    WAITING,
    account,
    anyone_silent,
    excuse_blindness,
    heard,
    judge,
    missing_lost,
    pace,
)

T = 100.0


@pytest.mark.parametrize(
    ("seen", "value", "want"),
    [
        (None, 5, (5, T)),  # first reading: silent from now
        (None, None, (0, T)),  # first look, no counter yet: silent from now
        ((5, 90.0), 6, (6, T)),  # beating: its silence starts afresh
        ((5, 90.0), 5, (5, 90.0)),  # the same count: silent since 90
        ((5, 90.0), 4, (5, 90.0)),  # a lower count (a replay): no beat
        ((5, 90.0), None, (5, 90.0)),  # gone, or a value that does not verify: no beat
        ((0, 90.0), 1, (1, T)),  # coming back
    ],
)
def test_heard(seen, value, want):
    assert heard(seen, value, T) == want


@pytest.mark.parametrize(
    ("last_ok", "want"),
    [
        (T - 0.25, {1: (3, 90.0)}),  # the store answered a beat ago: nothing excused
        (T - 0.5, {1: (3, 90.0)}),  # one beat late: still nothing
        (T - 2.25, {1: (3, 92.0)}),  # 2 s blind: silences start 2 s later
        (T - 60.0, {1: (3, T)}),  # blind longer than the silence: never after now
    ],
)
def test_excuse_blindness(last_ok, want):
    assert excuse_blindness({1: (3, 90.0)}, T, last_ok, beat_every=0.25) == want


# (seen before, watched (group rank, node id), counters read, last_ok) -> seen after
ACCOUNT = [
    ("a first beat", {}, [(1, "b")], {"me": 7, "b": 3}, T - 0.25, {1: (3, T)}),
    ("a peer beating", {1: (3, 90.0)}, [(1, "b")], {"me": 7, "b": 4}, T - 0.25, {1: (4, T)}),
    ("a peer silent", {1: (3, 90.0)}, [(1, "b")], {"me": 7, "b": 3}, T - 0.25, {1: (3, 90.0)}),
    ("a peer gone", {1: (3, 90.0)}, [(1, "b")], {"me": 7, "b": None}, T - 0.25, {1: (3, 90.0)}),
    ("our own entry is not watched", {}, [(1, "b")], {"me": 99, "b": 3}, T - 0.25, {1: (3, T)}),
    ("two neighbours", {1: (3, 90.0), 2: (8, 95.0)}, [(1, "b"), (2, "c")],
     {"me": 1, "b": 3, "c": 9}, T - 0.25, {1: (3, 90.0), 2: (9, T)}),
    ("blind: silences excused, then beats", {1: (3, 90.0), 2: (8, 95.0)}, [(1, "b"), (2, "c")],
     {"me": 1, "b": 3, "c": 9}, T - 5.25, {1: (3, 95.0), 2: (9, T)}),
    ("a rank no longer watched keeps its entry", {3: (1, 50.0)}, [(1, "b")], {"b": 3},
     T - 0.25, {3: (1, 50.0), 1: (3, T)}),
]  # fmt: skip


@pytest.mark.parametrize("row", ACCOUNT, ids=[r[0] for r in ACCOUNT])
def test_account(row):
    _, seen, watched, beats, last_ok, want = row
    before = dict(seen)
    assert account(seen, watched, beats, T, last_ok, beat_every=0.25) == want
    assert seen == before  # pure: the caller's view is not changed


# (silence before, counters of the missing nodes) -> (silence after, lost with their silence)
MISSING = [
    ("first look", {}, {"a": 2, "b": None}, ({"a": (2, T), "b": (0, T)}, {})),
    ("beating: not lost", {"a": (2, T - 5)}, {"a": 3}, ({"a": (3, T)}, {})),
    ("silent less than the limit", {"a": (2, T - 1.0)}, {"a": 2}, ({"a": (2, T - 1.0)}, {})),
    ("silent for the limit: lost", {"a": (2, T - 1.25)}, {"a": 2}, ({"a": (2, T - 1.25)},
                                                                     {"a": 1.25})),
    ("gone for longer: lost", {"a": (2, T - 3)}, {"a": None}, ({"a": (2, T - 3)}, {"a": 3.0})),
    ("back after the limit: not lost", {"a": (2, T - 3)}, {"a": 3}, ({"a": (3, T)}, {})),
]  # fmt: skip


@pytest.mark.parametrize("row", MISSING, ids=[r[0] for r in MISSING])
def test_missing_lost(row):
    _, seen, beats, want = row
    assert missing_lost(seen, beats, T, limit=1.25) == want


@pytest.mark.parametrize(
    ("seen", "limit", "want"),
    [
        ({}, 1.25, False),
        ({1: (3, T - 1.0), 2: (4, T)}, 1.25, False),
        ({1: (3, T - 1.25), 2: (4, T)}, 1.25, True),
        ({1: (3, T - 1.0)}, 0.5, True),  # a --peer-timeout shorter than LOST_SILENCE
    ],
)
def test_anyone_silent(seen, limit, want):
    assert anyone_silent(seen, T, limit) is want


@dataclass
class Beat:
    beats: int
    first: float
    last: float


@pytest.mark.parametrize(
    ("workers", "want"),
    [
        ([], (None, None)),
        ([None, Beat(0, 0.0, 0.0)], (None, None)),  # no worker has stepped
        ([Beat(1, 50.0, 50.0)], (50.0, None)),  # one step: no pace yet
        ([Beat(3, 50.0, 60.0), Beat(2, 55.0, 58.0), None], (60.0, 5.0)),
    ],
)
def test_pace(workers, want):
    assert pace(workers) == want


# (silence by group rank, peer timeout, our workers' progress and step) -> (rank, why) or None
JUDGE = [
    ("all beating", {1: (3, T - 0.5)}, 10.0, T, 0.1, None),
    ("silent for --peer-timeout", {1: (3, T - 10.0)}, 10.0, None, None,
     (1, "went silent for 10.0s (--peer-timeout 10)")),
    ("silent less than --peer-timeout, no workers' steps", {1: (3, T - 5.0)}, 10.0, None, None,
     None),
    ("silent, our workers stuck since", {1: (3, T - 2.0)}, 10.0, T - 2.0, 0.1,
     (1, "went silent for 2.0s while our workers waited on it (no step since)")),
    ("silent, our workers still step", {1: (3, T - 2.0)}, 10.0, T - 0.1, 0.1, None),
    ("silent, too short for LOST_SILENCE", {1: (3, T - 1.0)}, 10.0, T - 1.0, 0.1, None),
    ("silent, too short for our slow steps", {1: (3, T - 2.0)}, 10.0, T - 2.0, 1.0, None),
    ("silent long enough for our slow steps", {1: (3, T - 2.5)}, 10.0, T - 2.5, 1.0,
     (1, "went silent for 2.5s while our workers waited on it (no step since)")),
    ("stuck, but our last step came after it went quiet", {1: (3, T - 2.0)}, 10.0, T - 1.5,
     0.1, None),
    ("the first lost in order", {1: (3, T - 0.1), 2: (4, T - 11.0), 3: (5, T - 12.0)}, 10.0,
     None, None, (2, "went silent for 11.0s (--peer-timeout 10)")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("since", "died_at", "want"),
    [
        (T - 0.6, T - 0.3, (1, "went silent for 0.6s, and our worker died of a closed connection")),
        (T - 0.4, T - 0.3, None),  # two beats not missed yet
        (T - 0.6, None, None),  # no death: LOST_SILENCE's rule
        (T - 0.6, T - 1.2, None),  # it beat after our worker died (+ two beats): not its going
        (T - 0.7, T - 1.1, (1, "went silent for 0.7s, and our worker died of a closed connection")),
    ],
)
def test_judge_with_a_death_of_a_closed_connection(since, died_at, want):
    got = judge({1: (3, since)}, T, 10.0, T - 0.5, 0.02, 1.25, 0.25, died_at=died_at)
    assert got == want


def test_judge_says_the_in_place_evidence_for_what_it_is():
    """On the in-place path nobody died: the ranks unwound and wait for a generation; the cause
    says so, not "our worker died of a closed connection"."""
    got = judge({1: (3, T - 0.6)}, T, 10.0, T - 0.5, 0.02, 1.25, 0.25, died_at=T - 0.3,
                died_of=WAITING)  # fmt: skip
    assert got == (1, f"went silent for 0.6s, and {WAITING}")
    assert "closed connection" not in got[1] and "wait for a generation" in got[1]


@pytest.mark.parametrize("row", JUDGE, ids=[r[0] for r in JUDGE])
def test_judge(row):
    _, seen, peer_timeout, progress, step, want = row
    got = judge(seen, T, peer_timeout, progress, step, lost_silence=1.25, beat_every=0.25)
    assert got == want


@pytest.mark.parametrize(
    ("since", "probed", "want"),
    [
        # silent a beat, and the probe made since then went unanswered: lost at once
        (T - 0.3, (T - 0.1, "x refused"), (1, "went silent for 0.30s and x refused")),
        (T - 0.31, (T - 0.1, "y"), (1, "went silent for 0.31s and y")),
        (T - 0.2, (T - 0.1, "no answer"), None),  # not a beat yet
        (T - 0.3, (T - 0.4, "no answer"), None),  # it beat after that probe: the probe is stale
        (T - 0.3, None, None),  # it answered (or was never probed): slow, not lost
    ],
)  # fmt: skip
def test_judge_with_an_unanswered_probe(since, probed, want):
    unreachable = {} if probed is None else {1: probed}
    got = judge({1: (3, since)}, T, 10.0, None, None, 1.25, 0.25, unreachable=unreachable)
    assert got == want


@pytest.mark.parametrize(
    ("since", "gone", "want"),
    [
        # its daemon's held connection ended with no word: lost at once, silent or not
        (T - 0.01, {1: (T - 0.02, "it died")}, (1, "it died 0.02s ago")),
        (T - 0.3, {1: (T - 0.1, "its daemon died")}, (1, "its daemon died 0.10s ago")),
        (T - 0.3, {2: (T - 0.1, "another's")}, None),  # another node's going
        (T - 0.3, {}, None),  # nothing ended: silent a beat is slow, not lost
    ],
)  # fmt: skip
def test_judge_with_a_daemon_gone(since, gone, want):
    got = judge({1: (3, since)}, T, 10.0, None, None, 1.25, 0.25, gone=gone)
    assert got == want
