"""In-place recovery of a sharded (FSDP2) job (--in-place auto): kill -9 of one rank; the
survivors re-enter in their own processes with their shards from their in-memory slots, the
replacement gets its shards from the peers' replicas, and the run ends bit-identical to a
fault-free one. Needs a torch that can re-form a group in place (2.14 on)."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch
import torch.distributed as dist

from e2e.test_inplace import events
from harness import leftover_processes, script, wait_until

pytestmark = pytest.mark.skipif(
    not hasattr(dist, "_reconfigure"),
    reason=f"torch {torch.__version__} cannot re-form a group in place (needs torch>=2.14)",
)

STEPS = 40


def _run(daemons, tmp_path, name, delay, mesh):
    out = tmp_path / f"{name}-out"
    out.mkdir()
    d = daemons(
        script("fsdp_train.py"), "--nproc-per-node", "2", "--in-place", "auto",
        "--max-restarts", "3", "--checkpoint-dir", str(tmp_path / name),
        name=name, args=[str(STEPS), "5", delay, str(out), mesh],
    )  # fmt: skip
    return d, out


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_fsdp2_kill_9_of_one_rank_recovers_in_place_bit_identical(daemons, tmp_path, mesh):
    """The survivor re-enters in its process: its groups (the default one re-formed; the
    checkpoint writer's and, on a 2-D mesh, init_device_mesh's made again on it) and its shards
    from its own in-memory slot; the replacement resumes from the same step; the run ends where
    a fault-free one does."""
    clean, clean_out = _run(daemons, tmp_path, "clean", "0", mesh)
    hit, hit_out = _run(daemons, tmp_path, "hit", "0.05", mesh)
    wait_until(lambda: re.search(r"^step 17/", hit.log_text(1, 1), re.M), 120, what="step 17")
    before = hit.worker_pids()
    os.kill(before[1], signal.SIGKILL)
    assert hit.wait(180) == 0, hit.stderr()[-3000:]
    assert clean.wait(180) == 0, clean.stderr()[-3000:]
    replaced = events(hit, "replaced_in_place")
    assert len(replaced) == 1 and replaced[0]["ranks"] == [1], replaced
    assert replaced[0]["survivors"] == [before[0]]
    assert len(hit.attempt_dirs()) == 1 and not events(hit, "in_place_refused")
    log0 = hit.log_text(0, 1)
    assert "re_entered" in log0 and "in_place_fallback" not in log0, log0[-3000:]
    # the survivor's shards came from its own slot in memory, not from disk
    loaded = re.findall(r"checkpoint_loaded .*source=(\w+) step=(\d+)", log0)
    assert len(loaded) == 1 and loaded[0][0] == "memory" and int(loaded[0][1]) >= 15, loaded
    for r in range(2):
        a = torch.load(clean_out / f"final{r}.pt")
        b = torch.load(hit_out / f"final{r}.pt")
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), r
    assert not leftover_processes()
