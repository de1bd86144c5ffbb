"""Daemons meeting on a real 3-member etcd cluster (`--rdzv-backend etcd`): no node is special.

Any node may go (the one holding group rank 0 included) and the others go on; an etcd member
may go and training does not notice; a lost quorum stops the workers with one line and they
start again once it is back."""

from __future__ import annotations

import secrets
import signal
import time

from etcd_cluster import own_cluster_fixture  # noqa: F401 (the fixture)
from harness import script, wait_until
from test_nodeloss import LOADED_MARGIN, RECOVERY_GOAL, _when, holds_rank0, resumed_at, stepping_alone, steps


def _nodes(daemons, cluster, n: int, steps_: int, extra=()):
    job = "etcd-" + secrets.token_hex(3)
    flags = ("--nproc-per-node", "1", "--nnodes", f"1:{n}", "--rdzv-backend", "etcd",
             "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", job, "--last-call-timeout", "60", *extra)
    nodes = []
    for i in range(n):
        nodes.append(daemons(script("node_train.py"), *flags, name=f"n{i}", args=[str(steps_), "0.02"]))
        wait_until(lambda d=nodes[-1]: any(e.get("event") == "rendezvous_store" for e in d.events()), 60,
                   what="the node at the store")
    return nodes


def _together(nodes, at_least: int) -> bool:
    return all(any(w == len(nodes) and s >= at_least for s, w, *_ in steps(n)) for n in nodes)


def test_etcd_member_and_rank0_node_lost_the_others_go_on(daemons, own_cluster):
    nodes = _nodes(daemons, own_cluster, 3, steps_=260)
    wait_until(lambda: _together(nodes, 30), 120, what="three nodes training")
    # an etcd member (the leader, the hardest case) killed mid-training: nobody restarts
    t_member = time.time()
    own_cluster.members[own_cluster.leader()].kill()
    time.sleep(4)
    assert not [e for n in nodes for e in n.events() if e.get("new") == "RESTARTING" and _when(e) > t_member]
    # the node holding group rank 0 killed: the other two go on at world size 2
    victim = next(n for n in nodes if holds_rank0(n))
    survivors = [n for n in nodes if n is not victim]
    attempt = {id(n): len(n.attempt_dirs()) for n in survivors}
    t_kill = time.time()
    victim.kill()
    firsts = [wait_until(lambda n=n: next((s for s in steps(n) if s[1] == 2 and s[2] > t_kill), None), 30,
                         what="a survivor stepping at world size 2") for n in survivors]
    recovery = max(f[2] for f in firsts) - t_kill
    lost = max(max(s for s, *_ in steps(n, attempt[id(n)])) - resumed_at(n, 2) for n in survivors)
    print(f"etcd: rank-0 node lost, survivors stepping again {recovery:.2f}s later, {lost} step(s) lost")
    assert recovery < RECOVERY_GOAL + LOADED_MARGIN, recovery
    assert 0 <= lost <= 2, lost
    for n in survivors:
        assert n.wait(120) == 0, n.stderr()[-3000:]
        assert "Traceback" not in n.stderr()


def test_lost_quorum_stops_the_workers_and_they_start_again_when_it_returns(daemons, own_cluster):
    nodes = _nodes(daemons, own_cluster, 2, steps_=100000, extra=("--peer-timeout", "4"))
    wait_until(lambda: _together(nodes, 20), 120, what="two nodes training")
    pids = [n.worker_pids() for n in nodes]
    stopped = [m for m in own_cluster.members if m is not own_cluster.members[own_cluster.leader()]]
    t_lost = time.time()
    for m in stopped:
        m.stop()
    for n, before in zip(nodes, pids):
        said = wait_until(lambda n=n: [e for e in n.events() if e.get("event") == "store_unreachable"
                                       and _when(e) > t_lost], 4 + 10, what="the node saying the store is gone")
        assert "etcd" in said[0]["why"], said[0]
        wait_until(lambda before=before, n=n: not set(before.values()) & set(n.worker_pids().values())
                   or not n.worker_pids(), 15, what="its workers stopped")
    t_back = time.time()
    for m in stopped:
        m.start()
    for n in nodes:
        wait_until(lambda n=n: stepping_after(n, t_back), 60, what="training again once the quorum is back")
    for n in nodes:
        n.proc.send_signal(signal.SIGTERM)
    for n in nodes:
        assert n.wait(60) == 0, n.stderr()[-3000:]
        assert "Traceback" not in n.stderr()


def stepping_after(d, t: float) -> bool:
    return any(tt > t for _, _, tt, *_ in steps(d))


def test_etcd_gone_for_good_ends_the_job_with_one_line_after_join_timeout(daemons, own_cluster):
    (node,) = _nodes(daemons, own_cluster, 1, steps_=100000, extra=("--peer-timeout", "2", "--join-timeout", "6"))
    wait_until(lambda: stepping_alone(node, 0), 120, what="training")
    own_cluster.stop()
    assert node.wait(60) == 1, node.stderr()[-3000:]
    err = node.stderr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("elasticd: job failed") and "etcd" in last, last
    assert "Traceback" not in err
