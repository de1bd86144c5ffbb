"""The hang deadline learned from the job (daemon/deadlines.py) and the evidence that makes a
rank past it a hang (daemon/suspicion.py): warm-up, floor, ceiling, a tail; 10,000 heavy-tailed
steps as the loop observes them without one false alarm; stopped, busy and idle ranks."""

from __future__ import annotations

import json
import random

import pytest

from elasticd.daemon import deadlines, suspicion
from elasticd.daemon.deadlines import FLOOR, STOP_FLOOR, WARMUP, StepTimes
from unit.daemon.test_culprit import ALL_REDUCE, BACKWARD, SLEEP


def regular(gap: float, steps: int, ranks: int = 1) -> StepTimes:
    times = StepTimes()
    for r in range(ranks):
        for n in range(1, steps + 1):
            times.observe(r, n, n * gap)
    return times


def test_the_ceiling_rules_until_enough_steps_are_seen():
    d = regular(0.02, WARMUP - 1).deadline(300.0, 1)
    assert (d.seconds, d.learned) == (300.0, False)
    d = regular(0.02, WARMUP + 2).deadline(300.0, 1)
    assert (d.seconds, d.learned) == (FLOOR, True)  # 20 ms steps: the floor
    # three ranks of a node pool their samples, and need as many steps each
    assert not regular(0.02, WARMUP // 2, ranks=3).deadline(300.0, 3).learned


def test_slow_regular_steps_and_a_tail_set_it_and_the_flag_caps_it():
    d = regular(2.0, 200).deadline(300.0, 1)
    assert d.learned and 6.0 <= d.seconds <= 6.5, d  # 3 x the longest (2 s): 6 s
    assert "the job's deadline" in d.basis() and "over 199 steps" in d.basis()  # 199 gaps
    times = regular(0.02, 500)
    times.add(1.5)  # one 1.5 s stall (a data read): the next one is not a hang
    assert times.deadline(300.0, 1).seconds == pytest.approx(4.5)
    p99 = times.quantile(0.99)
    # over a 3 s ceiling the ceiling rules a silent rank; a stopped one's deadline stands
    assert times.deadline(3.0, 1) == deadlines.Deadline(3.0, False, p99, 1.5, 500, STOP_FLOOR)


def test_a_stopped_rank_s_deadline_is_two_p99_alone_never_under_its_floor():
    times = regular(0.02, 500)
    times.add(1.5)  # a stall in the tail: the deadline of a silent rank 4.5 s, not a stopped one's
    d = times.deadline(300.0, 1)
    p99 = times.quantile(0.99)
    assert d.seconds == pytest.approx(4.5) and d.for_stopped == max(STOP_FLOOR, 2 * p99), d
    assert "a stopped rank's deadline" in d.basis(stopped=True) and "2 x p99" in d.basis(True)
    slow = regular(0.4, 200).deadline(300.0, 1)  # 0.4 s steps: 2 x p99 over the floor
    assert 0.8 <= slow.for_stopped <= 1.0 < slow.seconds, slow
    # looked at every 0.1 s: a tick less, so that it is acted on within 2 x p99
    ticked = regular(0.4, 200).deadline(300.0, 1, tick=0.1)
    assert ticked.for_stopped == pytest.approx(slow.for_stopped - 0.1), ticked
    assert not regular(0.02, 10).deadline(300.0, 1).learned  # warming up: the ceiling for both
    assert regular(0.02, 10).deadline(300.0, 1).for_stopped == 300.0


def test_a_tail_over_the_ceiling_leaves_a_stopped_rank_s_deadline_standing():
    """3 x the longest gap over --heartbeat-timeout: a silent rank waits for the ceiling, a
    stopped one is still named at 2 x p99 (before, at the ceiling too: a tail is no excuse for a
    rank stopped by a signal)."""
    times = regular(0.3, 500)
    times.add(1.2)  # one 1.2 s stall: 3.6 s, over a 3 s ceiling
    d = times.deadline(3.0, 1, tick=0.1)
    assert not d.learned and d.seconds == 3.0, d
    assert d.for_stopped == pytest.approx(2 * times.quantile(0.99) - 0.1), d
    assert 0.5 < d.for_stopped < 0.7, d
    assert "a stopped rank's deadline" in d.basis(stopped=True), d.basis(stopped=True)
    assert d.basis() == "heartbeat timeout 3s"
    # steps of 2 s: 2 x p99 is over the ceiling too, which then rules both
    slow = regular(2.0, 200).deadline(3.0, 1)
    assert (slow.seconds, slow.for_stopped, slow.learned) == (3.0, 3.0, False), slow
    assert slow.basis(stopped=True) == "heartbeat timeout 3s"


def test_a_gap_across_a_recovery_in_place_is_not_a_step():
    """A survivor keeps its pid and its count across a recovery in place: the gap from its last
    beat before the fault to its first after is the recovery's, not a step's (the chaos soak:
    after a 1.5 s recovery 3 x the longest gap was over the ceiling for the rest of the job)."""
    times = regular(0.1, 100)
    times.observe(0, 101, 10.1 + 1.5, since=10.5)  # its last beat 10.0, the group re-formed 10.5
    assert times.longest == pytest.approx(0.1) and times.total == 99
    times.observe(0, 102, 11.7, since=10.5)  # the next gap began after: a step again
    assert times.total == 100 and times.longest == pytest.approx(0.1)


def test_several_beats_between_two_readings_count_as_that_many_steps_of_the_whole_gap():
    times = StepTimes()
    times.observe(7, 1, 10.0)
    times.observe(7, 5, 10.4)  # 4 steps in 0.4 s: each at most 0.4 s
    times.observe(7, 5, 10.4)  # the same reading again: nothing
    assert (times.total, times.longest) == (4, pytest.approx(0.4))


def _jitter_run(seed: int, steps: int = 10_000, tick: float = 0.1) -> tuple[int, float]:
    """DDP steps of three ranks in lockstep, each step 25 ms plus the slowest rank's
    log-normal sleep (median 10 ms, sigma 1), read every `tick` as the loop reads the heartbeats:
    the ticks at which a rank was silent past the deadline then, and the deadline at the end."""
    rng = random.Random(seed)
    times, t, now, alarms, n = StepTimes(), 0.0, 0.0, 0, 0
    ends = []
    for _ in range(steps):
        t += 0.025 + max(0.01 * rng.lognormvariate(0.0, 1.0) for _ in range(3))
        ends.append(t)
    last = 0.0
    while n < len(ends):
        now += tick
        while n < len(ends) and ends[n] <= now:
            last, n = ends[n], n + 1
        d = times.deadline(300.0, 3)
        if n and d.learned and now - last > d.seconds:
            alarms += 1
        for rank in range(3):
            times.observe(rank, n, last)
    return alarms, times.deadline(300.0, 3).seconds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ten_thousand_heavy_tailed_steps_raise_no_false_alarm(seed):
    alarms, seconds = _jitter_run(seed)
    assert alarms == 0
    assert FLOOR <= seconds < 3.0, seconds  # still far below the 300 s ceiling


# --- suspicion: the evidence past the deadline ---


def _watched(cpu_per_tick: int, state: str = "S", pid: int = 10) -> suspicion.Suspicion:
    s = suspicion.Suspicion()
    for i in range(30):  # 3 s of samples, every 0.1 s
        s.sample(pid, 100.0 + i * 0.1, (state, 1000 + i * cpu_per_tick))
    return s


def test_idle_and_busy_by_the_cpu_time_of_the_silence_latest_part():
    assert _watched(0).idle(10, 102.9, 2.0)
    assert not _watched(10).idle(10, 102.9, 2.0)  # a full CPU (100 ticks a second)
    assert not suspicion.Suspicion().idle(10, 102.9, 2.0)  # never sampled: not idle
    assert not _watched(0, state="R").idle(10, 102.9, 2.0)  # starved of a CPU it wants
    assert not _watched(0, state="D").idle(10, 102.9, 2.0)  # in a disk's I/O


def _judge(
    s: suspicion.Suspicion,
    texts: dict[int, str],
    other_cpu: int = 0,
    seqs: dict | None = None,
    across: bool = False,
):
    """Rank 1 (pid 10, as `s` sampled it) and rank 0 (pid 11: waiting, idle unless `other_cpu`)
    silent past the deadline, their stacks `texts`: the verdict and what the event said."""
    said = []
    silent = [suspicion.Silent(1, 10, 100.5, 42), suspicion.Silent(0, 11, 100.52, 42)]
    for i in range(30):
        s.sample(11, 100.0 + i * 0.1, ("S", 500 + i * other_cpu))
    rows = [
        {"rank": r, "text": t, "collectives": (seqs or {}).get(r, "")} for r, t in texts.items()
    ]
    verdict = s.judge(
        silent,
        102.9,
        lambda: rows,
        lambda first, why, basis: said.append(why),
        "deadline 1s",
        across,
    )
    return verdict, said


def test_a_stopped_rank_is_a_hang_and_named():
    verdict, said = _judge(_watched(0, state="T"), {0: BACKWARD})
    assert verdict == suspicion.Verdict(1, "stopped by a signal (state T)") and not said


def test_an_idle_rank_outside_the_collective_the_others_wait_in_is_a_hang():
    verdict, _ = _judge(_watched(0), {0: BACKWARD, 1: SLEEP})
    assert verdict.rank == 1 and "rank 1 was in `read_batch`" in verdict.why, verdict


def test_a_busy_rank_and_ranks_all_in_one_collective_are_left_alone_and_looked_at_later():
    s = _watched(10)
    verdict, said = _judge(s, {0: BACKWARD, 1: SLEEP}, other_cpu=10)
    assert verdict is None and said == ["busy: every silent rank uses the CPU"]
    verdict, said = _judge(_watched(10), {0: BACKWARD, 1: SLEEP})  # the waiter idle: stacks
    assert verdict is None and said[0].startswith("busy: its culprit uses the CPU (rank 1 was")
    first = suspicion.Silent(1, 10, 100.5, 42)
    assert not s.due(first, 104.0) and s.due(first, 105.5)  # the silence doubled (2.4 s -> 4.8)
    verdict, said = _judge(_watched(0), {0: ALL_REDUCE, 1: ALL_REDUCE})
    assert verdict is None and said[0].startswith("not a hang by the stacks: every rank waited")


def test_an_idle_silence_the_stacks_cannot_explain_is_judged_across_nodes_where_there_are():
    # every rank of this node waits in one collective (the culprit is elsewhere), or none is in
    # one (another node's wait on it): with ranks on other nodes, judged on every node's stacks
    for texts in ({0: ALL_REDUCE, 1: ALL_REDUCE}, {0: SLEEP, 1: SLEEP}):
        verdict, said = _judge(_watched(0), texts, across=True)
        assert verdict.across and verdict.rank == 1 and not said, verdict
        assert verdict.why.endswith("judged on every node's stacks"), verdict
    # busy ranks, or a culprit here that computes, are no question for the other nodes
    verdict, said = _judge(_watched(10), {0: ALL_REDUCE, 1: ALL_REDUCE}, other_cpu=10, across=True)
    assert verdict is None and said == ["busy: every silent rank uses the CPU"]
    verdict, said = _judge(_watched(10), {0: BACKWARD, 1: SLEEP}, across=True)
    assert verdict is None and said[0].startswith("busy: its culprit uses the CPU"), said
    # one proven here stays this node's
    verdict, _ = _judge(_watched(0), {0: BACKWARD, 1: SLEEP}, across=True)
    assert verdict.rank == 1 and not verdict.across


def _seq(enqueued: int, completed: int, op: str = "all_reduce") -> str:
    """A rank's collectives in the default group, compact (collective_seq.compact)."""
    ops = [[seq, "all_reduce" if seq < enqueued else op, "[[1]]", "Float"] for seq in (41, 42)]
    return json.dumps([["0", "default_pg", enqueued, completed, ops[: enqueued - 40]]])


def test_the_collectives_name_an_idle_rank_behind_and_a_desync_before_the_stacks():
    # rank 1 sleeps, last seq 41, while rank 0 waits in seq 42: never arrived
    verdict, _ = _judge(
        _watched(0), {0: BACKWARD, 1: SLEEP}, seqs={0: _seq(42, 41), 1: _seq(41, 41)}
    )
    assert verdict.rank == 1 and verdict.why.startswith("idle; rank 1 (its last seq 41"), verdict
    # rank 1 in all_gather at seq 42, rank 0 in all_reduce: a desync, though both wait
    seqs = {0: _seq(42, 41), 1: _seq(42, 41, "all_gather")}
    verdict, _ = _judge(_watched(0), {0: ALL_REDUCE, 1: ALL_REDUCE}, seqs=seqs)
    assert verdict.why.startswith("idle; desync at seq 42: rank 0 called all_reduce"), verdict


def test_a_rank_behind_that_computes_is_a_straggler_left_alone():
    verdict, said = _judge(
        _watched(10), {0: BACKWARD, 1: SLEEP}, seqs={0: _seq(42, 41), 1: _seq(41, 41)}
    )
    assert verdict is None and said[0].startswith("busy: rank 1 (its last seq 41"), said
    assert said[0].endswith("it uses the CPU (a straggler?)"), said
