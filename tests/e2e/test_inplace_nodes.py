"""In-place recovery over several nodes (--in-place auto, two daemons on loopback as nodes): a
rank killed on one node is replaced alone on that node; every other rank, on both nodes,
re-enters in its own process. The generation is announced and the handles exchanged, signed,
in the round's workers' store that both nodes' workers share (daemon/inplace.py `store`); the
node that did not fail follows the generation (`in_place_followed`). Needs torch>=2.14 (.ci/run's
second environment)."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch
import torch.distributed as dist

from e2e.test_inplace import events
from harness import alive, free_port, leftover_processes, node_flags, wait_until

pytestmark = pytest.mark.skipif(
    not hasattr(dist, "_reconfigure"),
    reason=f"torch {torch.__version__} cannot re-form a group in place (needs torch>=2.14)",
)

ARGS = ["--steps", "60", "--checkpoint-every", "5", "--log-every", "1", "--samples", "1024"]
ARGS += ["--hidden", "32", "--memory-every", "1", "--step-delay", "0.05"]
FLAGS = ("--nproc-per-node", "2", "--in-place", "auto", "--max-restarts", "3")


def two_nodes(daemons, tmp_path, job="job"):
    """Two nodes of 2 ranks each, one job; returned as (the node of rank 0, the other)."""
    port = free_port()
    nodes = [
        daemons(
            "entrypoints.train",
            *FLAGS,
            *node_flags(port, "2", job=job),
            "--checkpoint-dir",
            str(tmp_path / f"ckpt{i}"),
            name=f"n{i}",
            args=ARGS,
        )  # fmt: skip
        for i in range(2)
    ]
    wait_until(lambda: all(len(n.worker_pids()) == 2 for n in nodes), 90, what="4 workers")
    return sorted(nodes, key=lambda n: min(n.worker_pids()))


def test_a_rank_killed_on_one_node_is_replaced_there_alone(daemons, tmp_path):
    host, other = two_nodes(daemons, tmp_path)
    victim = max(other.worker_pids())
    wait_until(lambda: re.search(r"^step 12/60", host.log_text(0, 1), re.M), 90, what="step 12")
    before = {**host.worker_pids(), **other.worker_pids()}
    os.kill(before[victim], signal.SIGKILL)
    survivors = {r: p for r, p in before.items() if r != victim}
    node = {r: host if r in host.worker_pids() else other for r in survivors}
    wait_until(
        lambda: all("re_entered" in node[r].log_text(r, 1) for r in survivors),
        60,
        what="every survivor re-entered",
    )
    assert all(alive(p) for p in survivors.values()), "a survivor left its process"
    for n in (host, other):
        assert n.wait(120) == 0, n.stderr()[-3000:]
    replaced = events(other, "replaced_in_place")
    assert len(replaced) == 1 and replaced[0]["ranks"] == [victim], replaced
    followed = events(host, "in_place_followed")
    assert len(followed) == 1 and followed[0]["ranks"] == [victim], followed
    assert followed[0]["generation"] == replaced[0]["generation"] == 1
    assert not events(host, "replaced_in_place")
    for n in (host, other):
        assert [e["path"] for e in events(n, "recovery_path")] == ["in_place"]
        assert not events(n, "in_place_refused") and len(n.attempt_dirs()) == 1
        assert not [e for e in events(n, "state") if e.get("new") == "RESTARTING"]
    for r in survivors:
        assert "in_place_fallback" not in node[r].log_text(r, 1), r
    # rank 0 (it prints it) resumed from the in-memory state it held: the step in flight lost
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", host.log_text(0, 1))]
    assert len(resumed) == 1 and resumed[0] >= 11, resumed
    assert not leftover_processes()
