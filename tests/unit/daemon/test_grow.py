"""A node joining by reconfigure (daemon/grow.py): which ranks keep their processes and under
which numbers, which start; when a node carries its workers into the next round, and when it
cannot. Against a real workers' store (a c10d TCPStore) and real processes for the workers."""

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from elasticd import names
from elasticd.cluster.rounds import Member, Round
from elasticd.daemon import grow, inplace
from elasticd.lifecycle.states import Failure, RestartCause, Scale


def _round(number: int, *members: tuple, carried=None) -> Round:
    """A round of (node, nproc[, carries]) members."""
    ms = [Member(m[0], m[1], "127.0.0.1", carries=m[2] if len(m) > 2 else None) for m in members]
    return Round(number, 0, ms, world_size=sum(m.nproc for m in ms), carried=carried)


@pytest.mark.parametrize(
    "previous, members, mapping, starting",
    [
        # B lost and shrunk away in place, then C comes: A's ranks keep their numbers
        ([("a", 2)], [("a", 2, (0, 1)), ("c", 2)], {0: 0, 1: 1}, (2, 3)),
        # three nodes of one rank, B lost: A and C carry, D joins after them
        ([("a", 1), ("c", 1)], [("a", 1, (0, 1)), ("c", 1, (0, 1)), ("d", 1)],
         {0: 0, 1: 1}, (2,)),
        # B did not carry (it stopped its workers): its ranks start with the new node's
        ([("a", 1), ("b", 1)], [("a", 1, (0, 1)), ("b", 1), ("d", 1)], {0: 0}, (1, 2)),
        # B found lost by this closing: C's rank moves down
        ([("a", 1), ("b", 1), ("c", 1)], [("a", 1, (0, 1)), ("c", 1, (0, 1)), ("d", 2)],
         {0: 0, 2: 1}, (2, 3)),
        # a node carrying another group (never, but never kept either)
        ([("a", 1), ("b", 1)], [("a", 1, (0, 1)), ("b", 1, (0, 0))], {0: 0}, (1,)),
    ],
)  # fmt: skip
def test_the_kept_ranks_new_numbers_and_the_ranks_that_start(previous, members, mapping, starting):
    got = grow.larger(_round(0, *previous), _round(1, *members, carried=(0, 1)))
    assert got == (mapping, starting)


def _workers_store(formed: list[int]) -> dist.TCPStore:
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for r in formed:
        host.set(names.in_place_key(1, r), b"handle")
    host.check([names.in_place_key(1, r) for r in formed])
    return host


def _node(host, live, beats=3, group_rank=0):
    events = []
    workers = [
        SimpleNamespace(global_rank=r, exit_code=None, pid=p.pid, proc=p)
        for r, p in enumerate(live)
    ]
    rnd = _round(0, ("a", len(workers)))
    rnd = dataclasses.replace(
        rnd, group_rank=group_rank, master_addr="127.0.0.1", master_port=host.port,
        worker_store=host if group_rank == 0 else None,
    )  # fmt: skip
    agent = SimpleNamespace(
        recovery_path=inplace.Path(inplace.IN_PLACE, "test"),
        forming=None,
        round=rnd,
        in_place_kv=None,
        group=SimpleNamespace(
            workers=workers,
            generation=1,
            spec=SimpleNamespace(extra_env={names.ROUND_NUMBER: "0"}),
            beats=lambda: [SimpleNamespace(beats=beats) for _ in workers],
        ),
        rdzv=SimpleNamespace(carry=None),
        event=lambda name, **kw: events.append((name, kw)),
    )
    return agent, events


SCALE = Scale(1, "a", ("c",))


@pytest.fixture
def live():
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]  # fmt: skip
    yield procs
    for p in procs:
        p.kill()
        p.wait(10)


def test_a_node_carries_its_workers_and_the_store_it_hosts_into_the_next_round(live):
    host = _workers_store([0, 1])
    agent, events = _node(host, live)
    assert grow.carry(agent, SCALE)
    carry = agent.rdzv.carry
    assert (carry.round, carry.generation, carry.store) == (0, 1, host)
    assert agent.round.worker_store is None  # the round's close no longer stops it
    assert [e[0] for e in events] == ["carrying_in_place"]
    # another node's request for the same (a peer's restart of class scale) is carried too
    agent, _ = _node(host, live, group_rank=1)
    told = Failure(RestartCause.PEER, "peer asked for restart", failure_class="scale")
    assert grow.carry(agent, told) and agent.rdzv.carry.store is None


@pytest.mark.parametrize(
    "change, words",
    [
        ({"forming": True}, "a generation was forming"),
        ({"exited": True}, "a rank of this node has exited"),
        ({"beats": 0}, "a rank had not stepped yet"),
        ({"formed": [0]}, "rank(s) 1 did not form their group in place"),
    ],
)
def test_a_node_that_cannot_carry_its_workers_says_why_and_restarts(live, change, words):
    host = _workers_store(change.get("formed", [0, 1]))
    agent, events = _node(host, live, beats=change.get("beats", 3))
    if change.get("forming"):
        agent.forming = object()
    if change.get("exited"):
        agent.group.workers[1].exit_code = 1
    assert not grow.carry(agent, SCALE) and agent.rdzv.carry is None
    assert events[0][0] == "grow_in_place_refused" and words in events[0][1]["why"], events


def test_only_a_restart_for_nodes_waiting_to_join_carries_anything(live):
    host = _workers_store([0, 1])
    agent, events = _node(host, live)
    crash = Failure(RestartCause.CRASH, "rank 1 died", rank=1)
    assert not grow.carry(agent, crash) and not events
    agent.recovery_path = inplace.Path(inplace.RESTART, "--in-place off")
    assert not grow.carry(agent, SCALE) and not events


def test_a_round_that_does_not_go_on_with_the_carried_group_starts_afresh(live):
    """Group rank 0's node did not carry the group (the round's master says none): the carried
    workers stop and every node starts its workers afresh; a node that did not carry starts its
    workers into the group's next generation where the round goes on with it."""
    host = _workers_store([0, 1])
    agent, events = _node(host, live, group_rank=1)
    assert grow.carry(agent, SCALE)
    previous, fresh = agent.round, _round(1, ("x", 1), ("a", 2, (0, 1)))
    assert not grow.joined(agent, previous, fresh) and agent.rdzv.carry is None
    assert events[-1][0] == "grow_in_place_refused"
    assert grow.joining(fresh) is None
    assert grow.joining(dataclasses.replace(fresh, carried=(0, 1))) == (0, 2)


def test_a_member_whose_ranks_cannot_start_in_place_ends_the_carried_group(live):
    """A member marked fresh (its torch has no reconfigure, or --in-place off): group rank 0
    carries nothing, so the round goes on no group, and the carrying node's line names that node
    and why, not group rank 0's node (the words an operator acts on)."""
    host = _workers_store([0, 1])
    agent, events = _node(host, live, group_rank=1)
    assert grow.carry(agent, SCALE)
    old = Member("b", 1, "127.0.0.1", fresh=True)
    rnd = _round(1, ("x", 1), ("a", 2, (0, 1)))
    rnd = dataclasses.replace(rnd, members=[*rnd.members, old])
    assert not grow.joined(agent, agent.round, rnd)
    name, fields = events[-1]
    assert name == "grow_in_place_refused" and "node(s) b cannot start their ranks" in fields["why"]
    assert grow.joining(rnd) is None
