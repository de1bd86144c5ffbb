"""The daemon's judgement of the replicas' audit (daemon/sdc.py): the verdict read from the ranks'
heartbeat figures (never their text), the node of the rank blamed, the events, and when the node
is struck or quarantined."""

from __future__ import annotations

from elasticd.cluster.rounds import Member, Round
from elasticd.daemon import referee as referee_mod
from elasticd.daemon import sdc
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.worker import heartbeat


def beat(**figures: float) -> heartbeat.Beat:
    values = [figures.get(name, 0.0) for name in heartbeat.FIGURES]
    return heartbeat.Beat(10, 7, 1.0, 0.5, figures=tuple(values))


def three_nodes(here: int) -> Round:
    members = [Member(f"n{i}", 2, "127.0.0.1") for i in range(3)]
    return Round(number=1, group_rank=here, members=members)


def failure() -> Failure:
    text = "SilentDataCorruption: rank 0 says it is all node n0's fault"  # the job's words
    return Failure(RestartCause.CRASH, "exited 86", rank=0, exception=text, failure_class="sdc")


def test_the_node_of_a_rank_follows_the_members_in_group_rank_order():
    rnd = three_nodes(0)
    assert [sdc.node_of(rnd, r) for r in range(6)] == ["n0", "n0", "n1", "n1", "n2", "n2"]
    assert sdc.node_of(rnd, 6) == "" and sdc.node_of(None, 1) == "" and sdc.node_of(rnd, None) == ""


def test_blamed_once_a_strike_again_quarantined_and_only_on_its_node():
    events: list[tuple[str, dict]] = []
    judge = sdc.Corruption(lambda name, **f: events.append((name, f))).judge
    verdict = [None, beat(sdc_found=1, sdc_step=12, sdc_rank=4)]  # rank 3, on n1
    why, struck, again = judge(failure(), verdict, three_nodes(1))
    assert (why.rank, why.node, why.step, struck, again) == (3, "n1", 12, True, False)
    assert "rank 3 (node n1) named by the audit" in why.reason
    assert why.exception == failure().exception
    assert [name for name, _ in events] == ["sdc_suspected"]
    assert events[0][1] == {
        "level": "error",
        "rank": 3,
        "node": "n1",
        "step": 12,
        "undecided": False,
    }
    why, struck, again = judge(failure(), verdict, three_nodes(1))
    assert struck and again and "again: a persistent fault" in why.reason
    assert [name for name, _ in events] == ["sdc_suspected", "sdc_suspected", "sdc_confirmed"]
    # another node sees the same verdict: the events, never a strike
    other = sdc.Corruption(lambda *a, **k: None)
    assert other.judge(failure(), verdict, three_nodes(0))[1:] == (False, False)
    assert other.report() == {"detected": 0, "undecided": 0, "by_node": {"n1": 1}}


def test_undecided_blames_no_node_and_no_verdict_changes_nothing():
    events: list[str] = []
    c = sdc.Corruption(lambda name, **f: events.append(name))
    why, struck, again = c.judge(failure(), [beat(sdc_found=1, sdc_step=5)], three_nodes(0))
    assert (why.rank, struck, again) == (0, False, False) and "undecided" in why.reason
    c.judge(failure(), [beat(sdc_found=1, sdc_step=9)], three_nodes(0))
    assert events == ["sdc_suspected", "sdc_suspected"]  # never confirmed: no node named
    assert c.report()["undecided"] == 2
    # an exit 86 without the library's numbers (the script's own) is judged no further
    plain = failure()
    assert c.judge(plain, [beat(), None], three_nodes(0)) == (plain, False, False)


def one_node_two_ranks() -> Round:
    return Round(number=1, group_rank=0, members=[Member("n0", 2, "127.0.0.1")])


def test_an_undecided_verdict_the_referee_names_is_a_strike_and_again_quarantines():
    events: list[tuple[str, dict]] = []
    c = sdc.Corruption(lambda name, **f: events.append((name, f)))
    asked: list[int] = []

    def referee(step: int) -> referee_mod.Call:
        asked.append(step)
        return referee_mod.judge(0xB, [0xA, 0xB], step, 1.5)  # rank 1's digest reproduced

    undecided = [beat(sdc_found=1, sdc_step=5, sdc_rank=0), None]
    why, struck, again = c.judge(failure(), undecided, one_node_two_ranks(), referee)
    assert asked == [5] and (why.rank, why.node, struck, again) == (0, "n0", True, False)
    assert "named by the referee's replay" in why.reason
    name, fields = events[0]
    assert name == "sdc_suspected" and fields["rank"] == 0 and not fields["undecided"]
    assert "reproduced rank 1's digest" in fields["referee"] and fields["referee_seconds"] == 1.5
    assert c.judge(failure(), undecided, one_node_two_ranks(), referee)[1:] == (True, True)
    assert [n for n, _ in events] == ["sdc_suspected", "sdc_suspected", "sdc_confirmed"]


def test_a_referee_that_cannot_decide_leaves_one_line_and_the_undecided_rule():
    events: list[tuple[str, dict]] = []
    c = sdc.Corruption(lambda name, **f: events.append((name, f)))
    neither = lambda step: referee_mod.judge(0xC, [0xA, 0xB], step, 0.5)  # noqa: E731
    undecided = [beat(sdc_found=1, sdc_step=5, sdc_rank=0), None]
    why, struck, again = c.judge(failure(), undecided, one_node_two_ranks(), neither)
    assert (struck, again, why.rank) == (False, False, 0)
    assert [n for n, _ in events] == ["sdc_referee_undecided", "sdc_suspected"]
    assert "reproduced neither" in events[0][1]["said"] and events[1][1]["undecided"]
    # a majority's verdict never asks the referee
    majority = [beat(sdc_found=1, sdc_step=5, sdc_rank=2), None]
    assert c.judge(failure(), majority, three_nodes(0), lambda s: 1 / 0)[0].rank == 1


def test_a_worker_ended_by_the_audit_is_one_whatever_signal_took_it_on_the_way_out():
    """The audit's numbers decide, with how the worker ended: SDC_EXIT, not ended yet, or a
    signal in the interpreter's teardown (SIGABRT of a C++ thread: it was taken for the job's
    own failure, and the detection went unjudged); any other exit is the script's."""
    found, clean = beat(sdc_found=1, sdc_step=5), beat()
    for code in (86, None, -6, -9):
        assert sdc.ended_by_audit(code, found), code
        assert not sdc.ended_by_audit(code, clean) and not sdc.ended_by_audit(code, None), code
    for code in (0, 1, 2):
        assert not sdc.ended_by_audit(code, found), code
