"""A sharded (FSDP2) job over nodes, each in a network namespace of its own. Two nodes, the one
holding rank 0 SIGKILLed whole (daemon and workers): the survivor resumes at world 1 from memory
only (its own shards plus its replica of the lost node's), no disk checkpoint existing yet, losing
at most about one refresh interval, and every sample of the epoch is trained on exactly once.
Three nodes, one lost (not rank 0's), then a new node joining: the two survivors resume from
memory (the lost node's shards from a replica, sent over the network), and the joining node's
rank receives its shards from their memory. The job is tests/scripts/node_train.py with
NODE_TRAIN_FSDP=1; the harness is test_nodeloss.py's."""

from __future__ import annotations

import re
import time

import pytest

from e2e.test_nodeloss import (
    _nodes,
    _start_store,
    holds_rank0,
    resumed_at,
    stepping_alone,
    steps,
    stop_nodes,
    training_together,
)
from harness import RESTART, wait_until
from netns import netns_fixture  # noqa: F401 (the netns fixture)

pytest.importorskip("torch.distributed.fsdp")

SAMPLES = 256


def _every(d) -> int:
    """The in-memory cadence the job's ranks agreed on last (1 until one is logged)."""
    got = re.findall(r"memory_cadence .*every=(\d+)", d.all_logs())
    return int(got[-1]) if got else 1


def test_fsdp2_node_killed_survivor_resumes_from_memory_at_the_smaller_world(
    daemons, netns, tmp_path
):
    """The node lost holds rank 0 (the other case: the three-node test below, and forked ranks
    in tests/unit/checkpoint/test_sharded_memory.py)."""
    lose_rank0 = True
    net = netns(3, subnet=34)
    store = _start_store(net)
    try:
        shared = ("--checkpoint-dir", str(tmp_path / "ckpt"))  # a sharded save needs one FS
        # an epoch of 256 samples: 32 steps at world 2; killed after about 15 of them, resumed
        # well before the first disk checkpoint (step 100), the survivor ends the epoch by step 64
        env = {"NODE_TRAIN_FSDP": "1", "NODE_TRAIN_SAMPLES": str(SAMPLES)}
        a, b = _nodes(daemons, net, ["a", "b"], steps=70, extra=shared, env=env)
        wait_until(lambda: training_together((a, b), 15), 90, what="both nodes training")
        victim, survivor = (a, b) if holds_rank0(a) == lose_rank0 else (b, a)
        attempt = len(survivor.attempt_dirs())
        every = max(_every(a), _every(b))
        t_kill = time.time()
        victim.kill()  # SIGKILL of the daemon: its guard takes the workers with it
        first = wait_until(
            lambda: stepping_alone(survivor, t_kill), 60, what="the survivor stepping alone"
        )
        last_before = max(s for s, *_ in steps(survivor, attempt))
        resume = resumed_at(survivor)
        logs = survivor.all_logs()
        print(
            f"FSDP2 node lost (rank 0: {lose_rank0}): survivor stepping again "
            f"{first[2] - t_kill:.2f}s after the kill, resumed at {resume} "
            f"(last step before {last_before}, refresh every {every})"
        )
        # from memory: nothing is on disk before step 100, and the worker says where from
        assert 0 < resume < 32 and not (tmp_path / "ckpt" / "manifest.json").exists()
        assert re.search(rf"checkpoint_loaded .*source=memory step={resume}\b", logs), logs[-3000:]
        assert re.search(r"memory_state_sharded .*from_replicas=\[\d\]", logs), logs[-3000:]
        assert 0 <= last_before - resume <= every + 1, (last_before, resume, every)
        assert survivor.wait(120) == 0, survivor.stderr()[-3000:]
        seen = [
            i
            for s, _, _, e, idx in steps(victim) + steps(survivor, attempt)
            if e == 0 and s <= resume
            for i in idx
        ]
        seen += [i for s, w, _, e, idx in steps(survivor) if e == 0 and w == 1 for i in idx]
        assert sorted(seen) == list(range(SAMPLES)), (len(seen), len(set(seen)))
    finally:
        store.kill()
        store.wait(10)


@pytest.mark.slow  # about 150 s on the 2-core box: three FSDP2 nodes, then a fourth starting
def test_fsdp2_three_nodes_one_lost_then_one_joins_all_from_memory(daemons, netns, tmp_path):
    net = netns(5, subnet=36)
    store = _start_store(net)
    try:
        # the restart's resume from memory across a node lost and one joined (in place, a sharded
        # job's survivors re-form alone: tests/e2e/test_inplace_sharded.py)
        shared = ("--checkpoint-dir", str(tmp_path / "ckpt"), *RESTART)
        env = {"NODE_TRAIN_FSDP": "1", "NODE_TRAIN_SAMPLES": "1024"}
        a, b, c = _nodes(daemons, net, ["a", "b", "c"], steps=100000, extra=shared, env=env)
        wait_until(lambda: training_together((a, b, c), 10), 120, what="three nodes training")
        victim = next(n for n in (a, b, c) if not holds_rank0(n))
        survivors = [n for n in (a, b, c) if n is not victim]
        victim.kill()
        wait_until(
            lambda: all(resumed_at(n, 2) > 0 for n in survivors), 90, what="two nodes resumed"
        )
        for n in survivors:  # every old rank's shards: the lost one's from a replica
            logs = n.all_logs()
            assert re.search(r"checkpoint_loaded .*source=memory", logs), logs[-3000:]
        assert any(
            re.search(r"memory_state_sharded .*exchanged=True .*world=2 world_was=3", n.all_logs())
            for n in survivors
        )
        (d,) = _nodes(
            daemons, net, ["d"], steps=100000, extra=shared, env=env, nnodes=3, ns=4
        )  # a new node, in a namespace of its own
        (grown,) = wait_until(
            lambda: [r for r in (resumed_at(d, 3),) if r >= 0], 120, what="the new node resumed"
        )
        logs = d.all_logs()
        assert grown > 0, logs[-3000:]
        assert re.search(rf"checkpoint_loaded .*source=memory step={grown}\b", logs), logs[-3000:]
        wait_until(lambda: training_together((*survivors, d), grown + 3), 60, what="3 training")
        stop_nodes((*survivors, d))
    finally:
        store.kill()
        store.wait(10)
