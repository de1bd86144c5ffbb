"""Which recovery path a job is on (daemon/inplace.py) and what this torch can re-form in place
(worker/reconfigure.py), against the real torch.distributed of the interpreter that runs the
tests: torch 2.13 (the first CI run) lacks reconfigure, torch 2.14.1 (the second) has it."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from elasticd import names
from elasticd.config import Config
from elasticd.daemon import inplace
from elasticd.daemon.deadlines import Deadline
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.reporting.figures import Figures
from elasticd.worker import reconfigure

HAS = hasattr(dist, "_reconfigure")


def test_support_follows_what_torch_has():
    found = reconfigure.support()
    assert found.ok is HAS
    assert torch_version() in found.why
    if not HAS:
        assert "_reconfigure" in found.why and "torch>=2.14" in found.why


@pytest.mark.parametrize(
    "backend, ok",
    [("gloo", True), ("cpu:gloo,cuda:nccl", True), ("nccl", True), ("mpi", False)],
)
def test_backends(backend, ok):
    found = reconfigure.backend_support(backend)
    if not HAS:
        assert not found.ok and "torch>=2.14" in found.why
        return
    nccl = hasattr(getattr(dist, "ProcessGroupNCCL", None), "reconfigure")
    assert found.ok is (ok and (nccl or "nccl" not in backend)), found.why


@pytest.mark.parametrize(
    "changes, path, words",
    [
        ({"in_place": "off"}, "restart", "--in-place off"),
        ({"in_place": "auto", "no_python": True}, "restart", "--no-python"),
    ],
)
def test_the_path_where_the_job_rules_it_out(changes, path, words):
    chosen = inplace.choose(dataclasses.replace(Config(), **changes))
    assert (chosen.name, chosen.in_place) == (path, False)
    assert words in chosen.why


@pytest.mark.parametrize("nnodes", ["1", "2", "1:2"])
def test_the_path_where_torch_decides(nnodes):
    """Several nodes too: the generations and handles travel through the workers' store every
    node's workers share (inplace.store). By default: `--in-place auto`."""
    assert Config().in_place == "auto"
    chosen = inplace.choose(dataclasses.replace(Config(), nnodes=nnodes))
    assert chosen.in_place is HAS
    assert chosen.name == ("in_place" if HAS else "restart")
    assert ("has dist._reconfigure" if HAS else "lacks") in chosen.why


def torch_version():
    import torch

    return torch.__version__


@pytest.mark.parametrize(
    "deadline, seconds",
    [
        (None, inplace.STUCK_UNLEARNED),
        (Deadline(300.0, False), inplace.STUCK_UNLEARNED),  # not learned yet
        (Deadline(1.0, True, p99=0.02), inplace.STUCK_FLOOR),  # fast steps: the floor
        (Deadline(4.0, True, p99=0.5), 1.0),  # about a step: 2 x p99
        (Deadline(1.0, True, p99=0.4), 0.5),  # under half the hang deadline
    ],
)
def test_a_survivor_is_stuck_after_about_one_step(deadline, seconds):
    assert inplace.stuck_after(deadline) == pytest.approx(seconds)


def test_a_survivor_that_still_uses_cpu_is_not_taken_for_stuck():
    """Past `stuck_after`, a survivor starved on a loaded host still unwinds (it uses CPU as
    the host allows) where one blocked in a collective uses none: only the blocked one is killed
    as stuck, and the busy one too once half the hang deadline has passed (a script that caught
    the collective's error and spins on)."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleep = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
    )
    try:
        busy, blocked = (SimpleNamespace(pid=p.pid) for p in (spin, sleep))
        assert sleep.stdout.readline() == b"up\n"  # past its interpreter's start: idle from here
        time.sleep(0.05)
        forming = inplace.Forming(1, time.monotonic(), 0.3, (0, 1))
        inplace._sample_cpu(forming, [busy, blocked])
        time.sleep(0.2)
        now, deadline = time.monotonic(), Deadline(4.0, True, p99=0.1)
        assert inplace._still_unwinding(forming, [busy, blocked], now, deadline) == [busy]
        assert inplace._still_unwinding(forming, [busy], forming.since + 2.0, deadline) == []
        assert inplace._still_unwinding(forming, [busy], now, None) == [busy]
    finally:
        for p in (spin, sleep):
            p.kill()
            p.wait(10)


def _workers_store(formed: list[int]) -> tuple[dist.TCPStore, int]:
    """A real workers' store where the ranks `formed` gave their handle for generation 0."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for r in formed:
        host.set(names.in_place_key(0, r), b"handle")
    host.check([names.in_place_key(0, r) for r in formed])  # a round trip: set has no reply
    return host, host.port


def _agent(worker, port: int) -> SimpleNamespace:
    return SimpleNamespace(
        group=SimpleNamespace(
            workers=[worker], beats=lambda: [SimpleNamespace(beats=3)], generation=0
        ),
        forming=None,
        cfg=SimpleNamespace(fatal_exit_codes={7}, max_restarts=3),
        round=SimpleNamespace(
            number=1, master_addr="127.0.0.1", master_port=port, world_size=2, group_world_size=1
        ),
        in_place_kv=None,
        rdzv=SimpleNamespace(budget=SimpleNamespace(seen=0)),
    )


@pytest.mark.parametrize(
    "code, words",
    [(143, "stopped on SIGTERM"), (7, "a fatal exit code"), (1, None)],
)
def test_a_rank_that_stopped_on_sigterm_restarts_the_group(code, words):
    """Exit 143 is the checkpoint library's stop (checkpoint/stop.py): every rank agreed to stop
    and exits too, so a spare started for the first would be wasted on a group that restarts
    (bench/chaos.py's sigterm: 9 s to a cold restart after it)."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    host, port = _workers_store([0, 1])
    try:
        agent = _agent(SimpleNamespace(exit_code=None, proc=live), port)
        why = Failure(RestartCause.CRASH, "r", rank=1, exit_code=code)
        refused = inplace._refused(agent, why)
        assert refused is None if words is None else words in refused
        live.kill()
        live.wait(10)  # every rank gone: the restart's
        assert inplace._refused(agent, why) is not None
    finally:
        live.kill()
        live.wait(10)
        del host


def test_a_spent_restart_budget_sends_a_failure_to_the_restart():
    """Recoveries in place spend the job's restart budget (cluster/budget.py): once it is spent
    (by restarts or recoveries, on any node), a failure goes to the restart, whose closing ends
    the job with the budget's verdict."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    host, port = _workers_store([0, 1])
    try:
        agent = _agent(SimpleNamespace(exit_code=None, proc=live), port)
        why = Failure(RestartCause.SIGNAL, "r", rank=1)
        agent.rdzv.budget.seen = 2
        assert inplace._refused(agent, why) is None
        agent.rdzv.budget.seen = 3
        assert "restart budget is spent (3 of --max-restarts 3" in inplace._refused(agent, why)
    finally:
        live.kill()
        live.wait(10)
        del host


def test_a_rank_whose_group_did_not_form_in_place_restarts_the_group():
    """A rank whose init_process_group fell back (NCCL where torch cannot re-form it, an
    init_method of the script's) gave no handle: it cannot re-enter, so a fault restarts the
    whole group at once, as with --in-place off, rather than waiting for survivors that never
    come (a GPU job's survivors would sit in NCCL's collective until a timeout)."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    host, port = _workers_store([0])
    try:
        agent = _agent(SimpleNamespace(exit_code=None, proc=live), port)
        refused = inplace._refused(agent, Failure(RestartCause.CRASH, "r", rank=0, exit_code=1))
        assert refused is not None and "rank(s) 1 did not form their group in place" in refused
        host.set(names.in_place_key(0, 1), b"handle")
        host.check([names.in_place_key(0, 1)])
        assert (
            inplace._refused(agent, Failure(RestartCause.CRASH, "r", rank=0, exit_code=1)) is None
        )
    finally:
        live.kill()
        live.wait(10)
        del host


def test_an_attempt_that_replaced_a_rank_in_place_had_trained():
    """A second fault before the replacement's first step restarts the group (`_refused`), but
    the attempt trained (every rank had stepped, or nothing was replaced in place): no crash
    streak grows from it, no backoff doubles (bench/chaos.py --in-place auto waited 25.6 s)."""
    from elasticd.daemon.recovery import Recovery

    r = Recovery(Config())
    r.started()
    assert not r.trained([None, None])
    r.replaced_in_place()
    assert r.trained([None, None])
    r.crash_streak = 5
    r.backoff(r.trained([None]))
    assert r.crash_streak == 0
    r.started()  # the next attempt judged on its own
    assert not r.trained([None, None])


@dataclasses.dataclass
class _Spec:
    restart_count: int = 0  # what a replacement's TORCHELASTIC_RESTART_COUNT is


def _node(kv, generation=0, ranks=(0, 1)):
    """An agent on the in-place path holding `kv` as its round's workers' store."""
    events = []
    workers = [
        SimpleNamespace(global_rank=r, exit_code=None, pid=-1, heartbeat_path=Path("/none/hb"))
        for r in ranks
    ]
    agent = SimpleNamespace(
        recovery_path=inplace.Path(inplace.IN_PLACE, "test"),
        forming=None,
        round=SimpleNamespace(number=1, master_addr="127.0.0.1", master_port=1, state_key=b"k"),
        in_place_kv=(1, kv),
        in_place_waits=None,
        group=SimpleNamespace(
            workers=workers, generation=generation, quiet_from=0.0, beats=lambda: [], spec=_Spec()
        ),
        rdzv=SimpleNamespace(budget=SimpleNamespace(seen=0)),
        restart_count=0,
        event=lambda name, **kw: events.append((name, kw)),
        node="a",
        status=SimpleNamespace(figures=Figures(started=0.0)),
        publish=lambda: None,
        last_failure=None,
    )
    return agent, events


def test_a_generation_another_node_announced_is_followed_here():
    """Node B replaced rank 3: node A, whose ranks 0 and 1 run, takes generation 1 as its own
    (its survivors' silence counted from now, the ones that give no handle unstuck here); one
    that does not verify is not followed."""
    from elasticd.cluster.kv import LocalKV

    kv = LocalKV()
    b, _ = _node(kv, ranks=(2, 3))
    assert inplace.announce_generation(b, (3,)) == 1
    a, events = _node(kv)
    inplace._follow(a, 5.0)
    assert (a.group.generation, a.group.quiet_from) == (1, 5.0)
    assert (a.forming.generation, a.forming.running, a.forming.starting) == (1, (0, 1), (3,))
    assert events[0][0] == "in_place_followed"
    # counted here as a recovery another node asked for (status, metrics)
    assert a.status.figures.in_place["peer"] == 1
    assert "another node recovered rank(s) 3 in place" in a.last_failure.reason
    # the budget it spends, on both nodes: every rank's TORCHELASTIC_RESTART_COUNT, status's
    assert b.group.spec.restart_count == 1 and b.rdzv.budget.seen == 0  # spent by `_spend`
    assert (a.restart_count, a.rdzv.budget.seen, a.group.spec.restart_count) == (1, 1, 1)
    a.forming = None
    inplace._follow(a, 6.0)  # nothing announced past 1
    assert a.forming is None and a.group.generation == 1
    kv.set(names.in_place_key(2), reconfigure.sign(b"not the key", 2, -1, "2 3 1"))
    inplace._follow(a, 7.0)
    assert a.forming is None and a.group.generation == 1


class _Counting:
    """A real TCPStore client that counts the requests it sends (the store's load)."""

    calls: list = []

    def __init__(self, inner):
        self._inner = inner

    def __repr__(self):
        return repr(self._inner)  # tcpstore.bound_replies finds the socket there

    def __getattr__(self, name):
        fn = getattr(self._inner, name)

        def call(*args):
            _Counting.calls.append(name)
            return fn(*args)

        return call


@pytest.fixture
def served(monkeypatch):
    """A real workers' store on loopback, and every client of it counting its requests."""
    import queue

    from elasticd.cluster import tcpstore

    server = tcpstore.serve_store("127.0.0.1", 0, 5.0)
    real = tcpstore.tcp_connector
    monkeypatch.setattr(tcpstore, "tcp_connector", lambda h, p: lambda t: _Counting(real(h, p)(t)))
    _Counting.calls = []
    posted = queue.Queue()
    yield server, posted
    del server


def _store_node(server, posted):
    kv = inplace.store(SimpleNamespace(
        round=SimpleNamespace(number=1, master_addr="127.0.0.1", master_port=server.port),
        in_place_kv=None,
    ))  # fmt: skip
    agent, events = _node(kv)
    agent.round.master_port = server.port
    agent.in_place_watch = None
    agent.inbox = SimpleNamespace(post=posted.put)
    return agent, events


def test_a_node_reads_the_store_for_the_next_generation_only_once_it_has_word(served):
    """Before: two requests to the workers' store at every tick of the loop (about 20 a second
    per daemon). Now the round's watch holds one wait, and `follow` reads nothing until ranks
    wait for the generation or it is announced; then the loop is woken (its inbox) and follows."""
    server, posted = served
    a, events = _store_node(server, posted)
    b, _ = _store_node(server, posted)
    try:
        for tick in range(20):  # two seconds of a loop at the default --monitor-interval
            inplace.follow(a, float(tick))
        time.sleep(0.5)
        assert a.in_place_watch.due(1) is False and a.forming is None
        assert _Counting.calls.count("wait") == 1, _Counting.calls
        assert set(_Counting.calls) <= {"wait", "check"}, _Counting.calls  # no read per tick
        assert inplace.announce_generation(b, (3,)) == 1
        assert posted.get(timeout=5.0)[1] == 1  # the loop is woken
        inplace.follow(a, 30.0)
        assert (a.group.generation, a.forming.generation, a.forming.starting) == (1, 1, (3,))
        assert events[0][0] == "in_place_followed"
        a.forming = None
        inplace.follow(a, 31.0)  # the watch now waits for generation 2
        assert not a.in_place_watch.due(2)
    finally:
        a.in_place_watch.end()


def test_ranks_that_wait_unannounced_wake_the_watch_and_are_the_peers_evidence(served):
    """A rank that unwound adds to the waiting counter (worker/reconfigure.py): the watch wakes,
    `follow` reads it and dates the evidence; the announcing daemon's own 0 is no evidence."""
    server, posted = served
    a, _ = _store_node(server, posted)
    try:
        inplace.follow(a, 1.0)
        server.add(names.in_place_waiting_key(1), 1)
        assert posted.get(timeout=5.0)[1] == 1
        inplace.follow(a, 2.0)
        assert a.in_place_waits == 2.0 and a.forming is None
        server.set(names.in_place_waiting_key(1), b"0")
        inplace.follow(a, 3.0)
        assert a.in_place_waits is None
        a.in_place_waits = 2.0  # a restart: the next round's store has no word, nor evidence
        a.round.number = 2
        inplace.follow(a, 4.0)
        assert a.in_place_waits is None and a.in_place_watch.number == 2
    finally:
        a.in_place_watch.end()


def test_two_nodes_announcing_at_once_is_refused():
    """The roll is shared: a node that takes a generation past the one it knows (another node's
    recovery forms) refuses, and the restart follows."""
    from elasticd.cluster.kv import LocalKV

    kv = LocalKV()
    a, _ = _node(kv)
    b, _ = _node(kv, ranks=(2, 3))
    assert inplace.announce_generation(a, (1,)) == 1
    with pytest.raises(ValueError, match="another node's recovery"):
        inplace.announce_generation(b, (3,))


@pytest.mark.parametrize(
    "lost, world, mapping",
    [
        ({"b"}, 4, {0: 0, 1: 1, 4: 2, 5: 3}),  # a node after the lost one moves down
        ({"c"}, 4, {0: 0, 1: 1, 2: 2, 3: 3}),
        ({"a"}, 4, {2: 0, 3: 1, 4: 2, 5: 3}),
        ({"b", "c"}, 2, {0: 0, 1: 1}),
    ],
)
def test_the_smaller_world_and_each_survivor_s_new_number(lost, world, mapping):
    """Every survivor computes the same from the round's members, in their order."""
    members = [SimpleNamespace(node_id=n, nproc=2) for n in "abc"]
    assert inplace.smaller(members, lost) == (world, mapping)


def test_a_lost_node_that_held_the_workers_store_restarts_the_group():
    """The lost node hosted the workers' store (group rank 0): the survivors' handles have
    nowhere to go; fewer nodes than --nnodes' minimum left: the restart too."""
    from elasticd.cluster.kv import LocalKV, Unreachable

    agent, _ = _node(LocalKV())
    agent.round.members = [SimpleNamespace(node_id=n, nproc=2) for n in ("a", "b")]
    agent.cfg = SimpleNamespace(nnodes="1:2", max_restarts=3)
    agent.group.beats = lambda: [SimpleNamespace(beats=3)] * 2
    agent.rdzv = SimpleNamespace(budget=SimpleNamespace(seen=3, answered=lambda: 3))
    lost = lambda n: Failure(RestartCause.NODE_LOST, "lost", lost=(n,))  # noqa: E731
    assert "hosted the workers' store" in inplace._shrink_refused(agent, lost("a"))
    assert inplace._shrink_refused(agent, lost("b")) is None  # a node lost spends no budget

    def cut_off():
        raise Unreachable("store 10.0.0.1:29400: timed out")

    # the side of a partition that cannot reach the rendezvous store must not go on alone
    agent.rdzv.budget.answered = cut_off
    assert "this node may be the one cut off" in inplace._shrink_refused(agent, lost("b"))
    agent.cfg.nnodes = "2"
    assert "fewer than --nnodes 2" in inplace._shrink_refused(agent, lost("b"))


@pytest.mark.parametrize(
    "why, words",
    [
        (Failure(RestartCause.CRASH, "r", rank=1, exit_code=names.SDC_EXIT), "silent data"),
        (
            Failure(RestartCause.CRASH, "r", rank=1, exit_code=1, failure_class="sdc"),
            "silent data",
        ),
        (
            Failure(RestartCause.SIGNAL, "r", rank=1, consequences=("rank 2: exit 1 (+0.1 s)",)),
            "other ranks failed too: rank 2",
        ),
        (
            Failure(
                RestartCause.CRASH,
                "r",
                rank=1,
                exit_code=1,
                exception="ValueError: bad",
                signature="ValueError: bad (step 3)",
            ),  # fmt: skip
            "a failure of the rank's own (class user)",
        ),
        (
            Failure(
                RestartCause.SIGNAL,
                "r",
                rank=1,
                exit_code=-11,
                failure_class="user",
                signature="signal SIGSEGV (step 3)",
            ),  # fmt: skip
            "a failure of the rank's own",
        ),
        (Failure(RestartCause.SIGNAL, "killed by SIGKILL", rank=1, exit_code=-9), None),
        (
            Failure(
                RestartCause.CRASH,
                "r",
                rank=1,
                exit_code=1,
                exception="RuntimeError: [pair.cc:561] Connection closed by peer",
            ),  # fmt: skip
            None,
        ),
    ],
    ids=["sdc-exit", "sdc-class", "consequences", "own-error", "segv", "sigkill", "died-of-a-peer"],
)
def test_what_only_the_restart_judges_is_not_recovered_in_place(why, words):
    """The audit ends every rank at a disagreement (exit 86): the first reaped, recovered in
    place, made the next ranks' exits a second finding and quarantined a node for one flip. A
    failure with others after it, and a rank's own error (the replay and the repeat rule judge
    it: a class it judges, which has a signature), restart too; an outside kill, and a rank that
    died of a peer's going, are recovered in place."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    host, port = _workers_store([0, 1])
    try:
        refused = inplace._refused(_agent(SimpleNamespace(exit_code=None, proc=live), port), why)
        assert refused is None if words is None else words in refused, refused
    finally:
        live.kill()
        live.wait(10)
        del host
