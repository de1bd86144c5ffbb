"""Bit-identical resume under elasticd, beyond two ranks: one worker SIGKILLed, on one node and
across nodes, DDP and FSDP2, from memory and from disk; the job ends with the model and optimizer
state of the same command run without a fault, bit for bit.

The job is tests/scripts/exact_job.py (AdamW, dropout, warm-up, a shuffled sampler, a numpy and a
Python draw per step, 50 samples: no world here divides them). The fault-free run and the faulty
one run side by side, two jobs of their own. The same property over many more combinations, with
forked ranks (every world from 1 to 8, epoch ends, FSDP2 from memory):
tests/unit/checkpoint/test_resume_property.py; here, what only the daemon does: its kill, its
restart and its memory directory, on one node and across nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import FAST, free_port, node_flags, script
from scripts.exact_job import first_difference

STEPS = 24


def _start(daemons, tmp: Path, name: str, nodes: int, nproc: int, cfg: dict) -> list:
    """The job on `nodes` daemons of `nproc` workers each; its out file is tmp/NAME.out."""
    env = {"EXACT_JOB": json.dumps({**cfg, "steps": STEPS, "out": str(tmp / f"{name}.out")})}
    flags = [
        *("--nproc-per-node", str(nproc), "--max-restarts", "3"),
        *("--checkpoint-dir", str(tmp / f"{name}.ckpt")),  # one directory: a shared filesystem
    ]
    if nodes == 1:
        return [daemons(script("exact_job.py"), *flags, *FAST, name=name, env=env)]
    port = free_port()
    return [
        daemons(
            script("exact_job.py"),
            *flags,
            *node_flags(port, str(nodes), job=name),
            name=f"{name}-node{i}",
            env=env,
        )
        for i in range(nodes)
    ]


def _finish(nodes: list) -> None:
    for d in nodes:
        assert d.wait(180) == 0, d.stderr()[-3000:]


@pytest.mark.parametrize(
    "nodes, nproc, sharded, memory, kill_at, kill_rank",
    [
        (1, 3, False, True, 7, 1),  # the case: 3 ranks, mid-epoch
        (1, 8, False, True, 1, 6),  # the first step: DDP has not rebuilt its buckets yet
        (3, 1, False, False, 8, 0),  # 3 nodes x 1 rank, from disk, rank 0 right after a save
        (2, 2, True, False, 9, 1),  # FSDP2 over 2 nodes, sharded checkpoints on disk
    ],
    ids=["3-memory", "8-first-step", "3x1-disk-after-save", "fsdp-2x2-disk"],
)
def test_one_worker_killed_resumes_bit_identical(
    daemons, tmp_path, nodes, nproc, sharded, memory, kill_at, kill_rank
):
    cfg = {"sharded": sharded, "memory": memory}
    clean = _start(daemons, tmp_path, "clean", nodes, nproc, cfg)
    faulty = _start(
        daemons,
        tmp_path,
        "faulty",
        nodes,
        nproc,
        {**cfg, "kill_at": kill_at, "kill_rank": kill_rank},
    )
    _finish(clean + faulty)
    assert (tmp_path / "faulty.out.killed").exists(), "the kill never happened"
    restarted = [e for d in faulty for e in d.events() if e.get("event") == "recovered"]
    assert restarted, "no restart after the kill"
    world = nodes * nproc
    clean_out, faulty_out = tmp_path / "clean.out", tmp_path / "faulty.out"
    same = clean_out.read_text() == faulty_out.read_text()
    assert same, first_difference(str(clean_out), str(faulty_out), world)
