"""A hang judged across nodes without a restart (cluster/hang_inquiry.py): the node that declares
it claims the round's next inquiry, the others' waiters see it at once and then the asker's
verdict; two nodes that declare one hang together share one inquiry; a forger's claim or verdict
is none. Then daemon/hangs.py's side: a node asked gives its stacks and acts on the verdict, and
each wait ends in the restart at its deadline. Real Rendezvous (sealed values) over an in-process
store (kv.LocalKV); the agent's parts hangs.answer reads, as data."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest

from elasticd.cluster import hang_inquiry, hang_summaries, kv, rendezvous
from elasticd.cluster.errors import StoreUnreachable
from elasticd.cluster.rounds import Member, Round
from elasticd.daemon import culprit, hangs, inplace
from elasticd.daemon.culprit import Where
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.reporting.figures import Figures
from harness import rdzv_config


@pytest.fixture
def nodes():
    """Nodes a and b of one round over one store, and b's waiter (woken: an Event)."""
    cfg, store = rdzv_config("2"), kv.LocalKV()
    a = rendezvous.Rendezvous(cfg, store=store, begins_run=True)
    beating = threading.Event()

    def beat() -> None:  # the store's host beats, answering b, which joins its run
        count = 0
        while not beating.wait(0.05):
            count += 1
            a.beat(store, count)

    threading.Thread(target=beat, daemon=True).start()
    b = rendezvous.Rendezvous(cfg, store=store.clone(), begins_run=False)
    rnd = Round(0, 0, [Member(a.node_id, 1, "127.0.0.1"), Member(b.node_id, 1, "127.0.0.1")])
    woken = threading.Event()
    waiter = hang_inquiry.Waiter(b, woken.set)
    waiter.new_round(rnd)
    yield a, b, rnd, waiter, woken
    waiter.close()
    beating.set()


def _until(check, seconds: float = 5.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if found := check():
            return found
        time.sleep(0.01)
    raise AssertionError("not within the time")


def test_an_inquiry_and_its_verdict_reach_the_other_node_at_once(nodes):
    a, b, rnd, waiter, woken = nodes
    assert hang_inquiry.ask(a, rnd, waiter.next, 3) == (0, True)
    t0 = time.monotonic()
    asked = _until(lambda: waiter.asked)
    assert asked == hang_inquiry.Asked(0, 0, a.node_id, 3) and woken.is_set()
    assert time.monotonic() - t0 < 0.5  # a blocking wait, not a poll
    # b answers under the inquiry's own key; a gathers it (a round lives through many hangs)
    hang_summaries.publish(b, rnd, "[]", 0)
    found, silent = hang_summaries.gather(a, rnd, lambda t: t, time.monotonic() + 1, 0)
    assert found == {b.node_id: "[]"} and not silent
    assert hang_summaries.gather(a, rnd, lambda t: t, time.monotonic(), 1) == ({}, [b.node_id])
    woken.clear()
    hang_inquiry.say(a, rnd, 0, 1, b.node_id, "rank 1 was in `read_batch`")
    verdict = _until(lambda: waiter.verdict)
    assert verdict == hang_inquiry.Verdict(0, 0, 1, b.node_id, "rank 1 was in `read_batch`")
    assert woken.is_set() and waiter.next == 1
    # the next hang is the next inquiry
    assert hang_inquiry.ask(b, rnd, waiter.next, 4) == (1, True)
    assert _until(lambda: waiter.asked.index == 1)


def test_two_nodes_declaring_one_hang_at_once_share_its_inquiry(nodes):
    a, b, rnd, waiter, _ = nodes
    assert hang_inquiry.ask(a, rnd, 0, 0) == (0, True)
    assert hang_inquiry.ask(b, rnd, 0, 0) == (0, False)  # b holds for a's verdict


def test_a_forgers_claim_is_no_inquiry_and_its_verdict_none(nodes, monkeypatch):
    a, b, rnd, waiter, _ = nodes
    monkeypatch.setattr(hang_inquiry, "VERDICT_WAIT", 0.5)
    a.kv.set(a.round_key(0, f"{hang_inquiry.ASK}/0"), b"forged")
    assert hang_inquiry.ask(a, rnd, 0, 0) == (1, True)  # the next one claimed
    asked = _until(lambda: waiter.asked)
    assert asked.index == 1 and asked.node == a.node_id
    a.kv.set(a.round_key(0, f"{hang_inquiry.VERDICT}/1"), b"forged")
    verdict = _until(lambda: waiter.verdict)  # none verified within VERDICT_WAIT
    assert verdict.index == 1 and verdict.rank is None and waiter.next == 2


# --- daemon/hangs.py's side: answering an inquiry, the verdict, and each fallback ---


def _agent(rdzv, rnd, worker_rank: int):
    """The parts of an Agent that hangs.answer reads: this node's one worker, its group's
    generation, the waiter's view (set by hand: its thread is tested above)."""
    worker = SimpleNamespace(global_rank=worker_rank, pid=4242, exit_code=None, log_path="r.log")
    group = SimpleNamespace(
        generation=0,
        quiet_from=0.0,
        workers=[worker],
        stacks=lambda state: {"stacks": []},
        idle=lambda now: set(),
    )
    seen = []
    return SimpleNamespace(
        status=SimpleNamespace(figures=Figures(0.0)),
        round=rnd,
        rdzv=rdzv,
        node="host",
        state=SimpleNamespace(value="RUNNING"),
        cfg=SimpleNamespace(no_python=False),
        peers=SimpleNamespace(inquiries=SimpleNamespace(next=0, asked=None, verdict=None)),
        group=group,
        hang_hold=None,
        hang_answered=(-1, -1),
        event=lambda name, **kw: seen.append((name, kw)),
        seen=seen,
    )


def test_a_node_asked_gives_its_stacks_and_replaces_its_rank_the_verdict_names(nodes):
    a, b, rnd, _, _ = nodes
    agent = _agent(b, rnd, worker_rank=1)
    agent.peers.inquiries.asked = hang_inquiry.Asked(0, 0, a.node_id, 0)
    assert hangs.answer(agent, time.monotonic()) is None  # answered, then held
    found, _ = hang_summaries.gather(a, rnd, lambda t: t, time.monotonic() + 1, 0)
    assert found == {b.node_id: "[]"} and agent.hang_hold is not None
    assert agent.group.quiet_from >= agent.hang_hold.until  # its own verdicts held meanwhile
    text = "rank 1 was in `read_batch`"
    agent.peers.inquiries.verdict = hang_inquiry.Verdict(0, 0, 1, b.node_id, text)
    told = hangs.answer(agent, time.monotonic())
    assert told.kind is RestartCause.HANG and (told.rank, told.pid) == (1, 4242), told
    assert text in told.reason and "hang inquiry 0" in told.reason
    assert hangs.name_culprit(told, agent) is told and agent.hang_hold is None  # named already
    assert agent.status.figures.hang_inquiries == {"hang": 1, "cleared": 0, "none": 0}
    assert hangs.answer(agent, time.monotonic()) is None  # not answered twice


def test_no_verdict_in_time_restarts_the_group(nodes):
    a, b, rnd, _, _ = nodes
    agent = _agent(b, rnd, worker_rank=1)
    agent.peers.inquiries.asked = hang_inquiry.Asked(0, 0, a.node_id, 0)
    hangs.answer(agent, time.monotonic())
    fallback = hangs.answer(agent, agent.hang_hold.until)
    assert fallback.kind is RestartCause.HANG and fallback.rank is None, fallback
    assert "no verdict on hang inquiry 0 came within 5s" in fallback.reason
    assert [n for n, _ in agent.seen][-1] == "hang_hold_expired"
    assert agent.status.figures.hang_inquiries["none"] == 1


def test_another_node_s_culprit_is_followed_or_past_the_handoff_restarted(nodes):
    a, b, rnd, _, _ = nodes
    agent = _agent(b, rnd, worker_rank=1)
    agent.peers.inquiries.asked = hang_inquiry.Asked(0, 0, a.node_id, 0)
    hangs.answer(agent, time.monotonic())
    agent.peers.inquiries.verdict = hang_inquiry.Verdict(0, 0, 0, a.node_id, "rank 0 ...")
    assert hangs.answer(agent, time.monotonic()) is None  # a's rank: a replaces it
    hold = agent.hang_hold
    assert hold.judged and hold.until - time.monotonic() <= hangs.HANDOFF
    fallback = hangs.answer(agent, hold.until)  # a announced no generation in time
    assert fallback.rank == 0 and fallback.node == a.node_id, fallback
    assert "did not replace it in place within 3s" in fallback.reason
    assert agent.status.figures.hang_inquiries == {"hang": 1, "cleared": 0, "none": 0}  # once
    agent.forming = None
    assert "another node's rank" in inplace._hang_refused(agent, fallback)
    # followed in time instead: the generation a announced ends the hold
    agent.hang_answered = (-1, -1)
    hangs.answer(agent, time.monotonic())
    agent.peers.inquiries.verdict = hang_inquiry.Verdict(0, 0, 0, a.node_id, "rank 0 ...")
    hangs.answer(agent, time.monotonic())
    agent.group.generation = 1
    assert hangs.answer(agent, time.monotonic()) is None and agent.hang_hold is None


# --- an idle silence no node's stacks explain (Failure.across): judged, and maybe no hang ---

WAITS = Where("all_reduce", "all_reduce", "c10d.py:1", "a", idle=True)


def _reading(idle: bool | None) -> Where:
    return Where(None, "read_batch", "train.py:18", "b", idle=idle)


def test_an_idle_culprit_proves_a_hang_a_busy_one_or_none_does_not():
    assert hangs._unproven({0: WAITS, 1: _reading(True)}) is None
    busy = hangs._unproven({0: WAITS, 1: _reading(False)})
    assert busy == (
        "not a hang: its culprit rank 1 (node b) was in `read_batch` (train.py:18) uses the CPU "
        "(a straggler?)"
    ), busy
    assert hangs._unproven({0: WAITS, 1: _reading(None)}).endswith("is not known to be idle")
    every = hangs._unproven({0: WAITS, 1: WAITS})
    assert every.startswith("not a hang by every node's stacks: every rank waited in all_reduce")
    odd = Where("all_gather", "all_gather", "c10d.py:2", "b", idle=False)
    assert hangs._unproven({0: WAITS, 1: odd}) is None  # a desync hangs, busy or not


def test_a_silence_judged_no_hang_tells_every_node_to_go_on(nodes):
    a, b, rnd, waiter, _ = nodes
    # b's rank 1 computes (a straggler) while a's rank 0 waits, idle, past a's deadline
    hang_summaries.publish(b, rnd, culprit.summary({1: _reading(False)}), 0)
    asker = _agent(a, rnd, worker_rank=0)
    asker.peers.inquiries = SimpleNamespace(next=0)
    why = Failure(RestartCause.HANG, "hung: no heartbeat", rank=0, pid=4242, across=True)
    assert hangs._inquire(why, asker, {0: WAITS}, time.monotonic()) is None
    cleared = [kw for n, kw in asker.seen if n == "hang_cleared"]
    assert cleared and "uses the CPU (a straggler?)" in cleared[0]["why"], asker.seen
    assert not [n for n, _ in asker.seen if n == "hang_culprit"] and asker.hang_hold is None
    verdict = _until(lambda: waiter.verdict)  # b's waiter: no hang
    assert not verdict.hang and verdict.rank is None and "straggler" in verdict.text, verdict
    # b, which answered and held its own verdicts, goes on as it was
    agent = _agent(b, rnd, worker_rank=1)
    agent.group.quiet_from = 7.0
    agent.peers.inquiries.asked = hang_inquiry.Asked(0, 0, a.node_id, 0)
    hangs.answer(agent, time.monotonic())
    assert agent.group.quiet_from > 7.0
    agent.peers.inquiries.verdict = verdict
    assert hangs.answer(agent, time.monotonic()) is None and agent.hang_hold is None
    assert agent.group.quiet_from == 7.0 and agent.seen[-1][0] == "hang_cleared", agent.seen
    for node in (asker, agent):  # each counts it once, for status and metrics
        assert node.status.figures.hang_inquiries == {"hang": 0, "cleared": 1, "none": 0}


def test_while_a_generation_forms_such_a_silence_is_left_to_the_ceiling(nodes):
    a, _, rnd, _, _ = nodes
    agent = _agent(a, rnd, worker_rank=0)
    agent.group.dumps, agent.group.suspects = [], SimpleNamespace(stopped=lambda pid: False)
    agent.recovery_path, agent.forming = SimpleNamespace(in_place=True), object()
    why = Failure(RestartCause.HANG, "hung: no heartbeat", rank=0, pid=4242, across=True)
    assert hangs.name_culprit(why, agent) is None  # no restart, no inquiry
    name, said = agent.seen[-1]
    assert name == "hang_deadline_passed" and "a generation forms" in said["why"], agent.seen


def test_an_unproven_silence_is_no_hang_where_the_store_does_not_answer(nodes, monkeypatch):
    a, _, rnd, _, _ = nodes
    asker = _agent(a, rnd, worker_rank=0)
    asker.peers.inquiries = SimpleNamespace(next=0)

    def unreachable(*args):
        raise StoreUnreachable("the rendezvous store did not answer within 2s")

    monkeypatch.setattr(hang_inquiry, "ask", unreachable)
    why = Failure(RestartCause.HANG, "hung: no heartbeat", rank=0, pid=4242, across=True)
    assert hangs._inquire(why, asker, {0: WAITS}, time.monotonic()) is None
    assert [n for n, _ in asker.seen] == ["hang_summaries_unreachable"], asker.seen
    proven = dataclasses.replace(why, across=False)  # a hang proven here stays one
    assert hangs._inquire(proven, asker, {0: WAITS}, time.monotonic()).kind is RestartCause.HANG
