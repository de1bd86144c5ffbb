"""The closing rule (cluster/closing_rule.py) as a table: each row is one look at a round's
arrivals (inputs) and the decision it must give."""

import json

import pytest

from elasticd.cluster import values
from elasticd.cluster.closing_rule import Limits, budget_spent, decide, missing, order

LIMITS = Limits(min_nodes=2, max_nodes=4, last_call=10.0, restart_wait=30.0)
NOW, DEADLINE = 1000.0, 2000.0


def rec(node: str, prev: int = -1, nproc: int = 1, link: int | None = None) -> dict:
    r = {"id": node, "nproc": nproc, "addr": f"{node}.host", "prev": prev}
    return r if link is None else {**r, "link": link}


def arrived(*records: dict) -> dict[str, dict]:
    """Records by arrival key, numbered in arrival order from 1."""
    return {f"arr/{i}": r for i, r in enumerate(records, 1)}


def member(node: str, nproc: int = 1, link: int = 0) -> list:
    return [node, nproc, f"{node}.host", link]


# (name, records, expected, gone, lost, reached_min, spends, limits) ->
# (close, why, member ids, lost, spends, reached_min, timed_out)
ROWS = [
    # a first round (nothing expected)
    ("first, one of MIN 2: wait", arrived(rec("a")), None, set(), set(), None, False, LIMITS,
     (False, "", [], [], False, None, False)),
    ("first, MIN reached now: wait for the last call", arrived(rec("a"), rec("b")), None, set(),
     set(), None, False, LIMITS, (False, "", [], [], False, NOW, False)),
    ("first, MIN reached 9.9 s ago: still waiting", arrived(rec("a"), rec("b")), None, set(),
     set(), NOW - 9.9, False, LIMITS, (False, "", [], [], False, NOW - 9.9, False)),
    ("first, last call over: close late", arrived(rec("a"), rec("b")), None, set(), set(),
     NOW - 10.0, False, LIMITS, (True, "late", ["a", "b"], [], False, NOW - 10.0, False)),
    ("first, MAX in: close at once", arrived(rec("a"), rec("b"), rec("c"), rec("d")), None,
     set(), set(), None, False, LIMITS,
     (True, "full", ["a", "b", "c", "d"], [], False, NOW, False)),
    ("first, the same node twice counts once", arrived(rec("a"), rec("a")), None, set(), set(),
     None, False, LIMITS, (False, "", [], [], False, None, False)),
    ("first, a node that arrived twice is one member", arrived(rec("a"), rec("a"), rec("b")),
     None, set(), set(), NOW - 10.0, False, LIMITS,
     (True, "late", ["a", "b"], [], False, NOW - 10.0, False)),
    ("first, more than MAX: the first MAX by arrival",
     arrived(rec("a"), rec("b"), rec("c"), rec("d"), rec("e")), None, set(), set(), None, False,
     LIMITS, (True, "full", ["a", "b", "c", "d"], [], False, NOW, False)),
    # a restarted round
    ("restart, every expected node came: close", arrived(rec("b", 1), rec("a", 0)), {"a", "b"},
     set(), set(), None, False, LIMITS, (True, "everyone", ["a", "b"], [], False, NOW, False)),
    ("restart, one expected still missing: wait", arrived(rec("a", 0), rec("b", 1)),
     {"a", "b", "c"}, set(), set(), None, False, LIMITS, (False, "", [], [], False, NOW, False)),
    ("restart, the missing one found lost: close", arrived(rec("a", 0), rec("b", 1)),
     {"a", "b", "c"}, set(), {"c"}, None, False, LIMITS,
     (True, "everyone", ["a", "b"], ["c"], False, NOW, False)),
    ("restart, the lost of the request: named lost", arrived(rec("a", 0), rec("b", 1)),
     {"a", "b"}, {"x"}, {"x"}, None, False, LIMITS,
     (True, "everyone", ["a", "b"], ["x"], False, NOW, False)),
    ("restart, lost outside the expected is not named", arrived(rec("a", 0), rec("b", 1)),
     {"a", "b"}, set(), {"z"}, None, False, LIMITS,
     (True, "everyone", ["a", "b"], [], False, NOW, False)),
    ("restart, everyone came but fewer than MIN: wait", arrived(rec("a", 0)), {"a"}, set(),
     set(), None, False, LIMITS, (False, "", [], [], False, None, False)),
    ("restart, past the last call, not the restart wait: wait",
     arrived(rec("a", 0), rec("b", 1)), {"a", "b", "c"}, set(), set(), NOW - 29.0, False, LIMITS,
     (False, "", [], [], False, NOW - 29.0, False)),
    ("restart, past the restart wait: close late", arrived(rec("a", 0), rec("b", 1)),
     {"a", "b", "c"}, set(), set(), NOW - 30.0, False, LIMITS,
     (True, "late", ["a", "b"], [], False, NOW - 30.0, False)),
    ("restart, past the restart wait, not the last call: wait",
     arrived(rec("a", 0), rec("b", 1)), {"a", "b", "c"}, set(), set(), NOW - 30.0, False,
     Limits(2, 4, last_call=40.0, restart_wait=30.0),
     (False, "", [], [], False, NOW - 30.0, False)),
    # group ranks: the previous round's order first, newcomers after by arrival
    ("order: previous ranks, then arrivals (10 after 9)",
     {f"arr/{i}": r for i, r in [(10, rec("n2")), (9, rec("n1")), (3, rec("b", 1)),
                                  (4, rec("a", 0))]},
     {"a", "b", "n1", "n2"}, set(), set(), None, False, LIMITS,
     (True, "full", ["a", "b", "n1", "n2"], [], False, NOW, False)),
    # the budget
    ("a failure that lost no node spends", arrived(rec("a", 0), rec("b", 1)), {"a", "b"}, set(),
     set(), None, True, LIMITS, (True, "everyone", ["a", "b"], [], True, NOW, False)),
    ("a node lost: the failure does not spend", arrived(rec("a", 0), rec("b", 1)),
     {"a", "b", "c"}, {"c"}, {"c"}, None, True, LIMITS,
     (True, "everyone", ["a", "b"], ["c"], False, NOW, False)),
    ("waiting spends nothing yet", arrived(rec("a", 0)), {"a", "b"}, set(), set(), None, True,
     LIMITS, (False, "", [], [], False, None, False)),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_decide(row):
    _, records, expected, gone, lost, reached_min, spends, limits, want = row
    d = decide(records, expected, gone, lost, reached_min, NOW, DEADLINE, limits, spends)
    got = (
        d.close,
        d.why,
        [m[0] for m in d.members],
        d.lost,
        d.spends,
        d.reached_min,
        d.timed_out,
    )
    assert got == want
    assert d.count == len({r["id"] for r in records.values()})


@pytest.mark.parametrize(
    ("now", "closes", "timed_out"),
    [(DEADLINE, False, False), (DEADLINE + 0.1, False, True)],
)
def test_the_deadline(now, closes, timed_out):
    d = decide(arrived(rec("a")), None, set(), set(), None, now, DEADLINE, LIMITS, False)
    assert (d.close, d.timed_out) == (closes, timed_out)


def test_a_closing_past_the_deadline_still_closes():
    d = decide(arrived(rec("a"), rec("b"), rec("c"), rec("d")), None, set(), set(), None,
               DEADLINE + 1, DEADLINE, LIMITS, False)  # fmt: skip
    assert d.close and d.timed_out  # the closer writes; it fails only if that write lost


def test_members_carry_nproc_address_and_link_port():
    assert order(arrived(rec("a", nproc=8, link=4321), rec("b", nproc=2)), 4) == [
        member("a", 8, link=4321),
        member("b", 2),
    ]


def test_a_member_says_the_group_its_workers_carry_into_the_round_in_place():
    """daemon/grow.py: each node whose workers go on says their group (round, generation); the
    members as every node reads them (cluster/values.py) keep it, and a form that is not two
    counts is no member."""
    a = {**rec("a", prev=0), "carries": [3, 2]}
    written = order(arrived(a, rec("b")), 4)
    assert written == [[*member("a"), [3, 2]], member("b")]
    found = values.members(json.dumps({"members": written}))["members"]
    assert [m.carries for m in found] == [(3, 2), None]
    for bad in ([3], [3, -1], ["3", 2], 5):
        assert values.record(json.dumps({**a, "carries": bad})) is None, bad
        assert values.members(json.dumps({"members": [[*member("a"), bad]]})) is None, bad
    assert values.record(json.dumps(a))["carries"] == [3, 2]


def test_a_member_whose_ranks_cannot_start_in_place_says_so():
    """A node on torch's own init (its torch has no reconfigure, or --in-place off) says
    "fresh" in its record: its member gets a sixth field after its carries (or null), which
    every node reads, so the group does not go on in place and nobody's ranks start in place."""
    a = {**rec("a", prev=0), "carries": [3, 2]}
    b = {**rec("b"), "fresh": True}
    written = order(arrived(a, b, {**rec("c"), "fresh": False}), 4)
    assert written == [[*member("a"), [3, 2]], [*member("b"), None, True], member("c")]
    found = values.members(json.dumps({"members": written}))["members"]
    assert [(m.carries, m.fresh) for m in found] == [((3, 2), False), (None, True), (None, False)]
    both = order(arrived({**a, "fresh": True}), 4)
    assert values.members(json.dumps({"members": both}))["members"][0].carries == (3, 2)
    for bad in ([*member("b"), None, False], [*member("b"), None, 1], [*member("b"), None]):
        assert values.members(json.dumps({"members": [bad]})) is None, bad
    assert values.record(json.dumps({**b, "fresh": "yes"})) is None


@pytest.mark.parametrize(
    "text, want",
    [
        ("10.0.0.1 29500", ("10.0.0.1", 29500, None)),
        ("10.0.0.1 29500 3 2", ("10.0.0.1", 29500, (3, 2))),  # a group that goes on in place
        ("10.0.0.1 29500 3", None),
        ("10.0.0.1 29500 3 x", None),
        ("10.0.0.1 0", None),
        ("host", None),
        ("", None),
        ("10.0.0.1 29500 3 2 1", None),
    ],
)
def test_the_round_s_worker_store_and_the_group_carried_on_it(text, want):
    assert values.master(text) == want


@pytest.mark.parametrize(
    ("expected", "ids", "lost", "want"),
    [
        (None, {"a"}, set(), []),
        ({"c", "a", "b"}, {"a"}, set(), ["b", "c"]),
        ({"c", "a", "b"}, {"a"}, {"c"}, ["b"]),
        ({"a"}, {"a", "z"}, set(), []),
    ],
)
def test_missing(expected, ids, lost, want):
    assert missing(expected, ids, lost) == want


@pytest.mark.parametrize(
    ("used", "max_restarts", "want"),
    [
        (1, 3, None),
        (3, 3, None),
        (4, 3, "restart budget spent (3 of --max-restarts 3 used) at: worker crashed"),
        (1, 0, "restart budget spent (0 of --max-restarts 0 used) at: worker crashed"),
    ],
)
def test_budget_spent(used, max_restarts, want):
    assert budget_spent(used, max_restarts, "worker crashed") == want


def test_budget_verdict_is_bounded():
    assert len(budget_spent(9, 1, "x" * 100_000)) == 8 * 1024
