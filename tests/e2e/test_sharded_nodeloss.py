"""A sharded (FSDP2) job over two nodes, each in a network namespace of its own: one node is
SIGKILLed whole (daemon and workers), the one holding rank 0 or the other. The survivor resumes at
world 1 from memory only (its own shards plus its replica of the lost node's), no disk checkpoint
existing yet, losing at most about one refresh interval, and every sample of the epoch is trained
on exactly once. The job is tests/scripts/node_train.py with NODE_TRAIN_FSDP=1; the harness is
test_nodeloss.py's."""

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
    training_together,
)
from harness import wait_until
from netns import netns_fixture  # noqa: F401 (the netns fixture)

pytest.importorskip("torch.distributed.fsdp")

SAMPLES = 256


def _every(d) -> int:
    """The in-memory cadence the job's ranks agreed on last (1 until one is logged)."""
    got = re.findall(r"memory_cadence .*every=(\d+)", d.all_logs())
    return int(got[-1]) if got else 1


@pytest.mark.parametrize("lose_rank0", [False, True], ids=["other-node", "rank0-node"])
def test_fsdp2_node_killed_survivor_resumes_from_memory_at_the_smaller_world(
    daemons, netns, tmp_path, lose_rank0
):
    net = netns(3, subnet=34 + lose_rank0)
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
