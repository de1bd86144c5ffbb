"""A sharded (FSDP2) job through the daemon: a worker SIGKILLed mid-run resumes from the disk
checkpoint every rank wrote its shards of, and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from elasticd import checkpoint
from harness import RESTART, script, wait_until

pytest.importorskip("torch.distributed.fsdp")

FLAGS = ("--nproc-per-node", "2", "--restart-grace", "1", "--max-restarts", "3", *RESTART)
STEPS = 40


def _run(daemons, tmp_path, name: str, delay: str, memory: tuple[str, ...]):
    out = tmp_path / f"{name}-out"
    out.mkdir()
    d = daemons(
        script("fsdp_train.py"),
        *FLAGS,
        *memory,
        "--checkpoint-dir",
        str(tmp_path / name),
        name=name,
        args=[str(STEPS), "5", delay, str(out)],
    )
    return d, out


@pytest.mark.parametrize("memory", [("--no-memory-state",), ()], ids=["no-memory", "memory-on"])
def test_fsdp2_worker_killed_resumes_from_its_shards_bit_identical(daemons, tmp_path, memory):
    """From the disk checkpoint (--no-memory-state), or from every rank's own shards in its
    in-memory slots (the default): then from a step past the last disk checkpoint, and the
    worker says it loaded from memory."""
    clean, clean_out = _run(daemons, tmp_path, "clean", "0", memory)
    assert clean.wait(180) == 0, clean.stderr()[-3000:]
    crashed, crashed_out = _run(daemons, tmp_path, "crashed", "0.05", memory)
    wait_until(lambda: re.search(r"^step 17/", crashed.log_text(1, 1), re.M), 120, what="step 17")
    os.kill(crashed.worker_pids()[1], signal.SIGKILL)
    wait_until(lambda: len(crashed.attempt_dirs()) > 1, 60, what="the restart")
    assert crashed.wait(180) == 0, crashed.stderr()[-3000:]
    out = crashed.stdout()
    resumed = [int(m) for m in re.findall(r"\[rank0\]: .*resumed from step (\d+)", out)]
    loaded = re.findall(r"\[rank0\]: .*checkpoint_loaded .*source=(\w+) step=(\d+)", out)
    assert len(resumed) == 1 and loaded == [(loaded[0][0], str(resumed[0]))], (resumed, loaded)
    if memory:
        assert loaded[0][0] == "disk" and resumed[0] in (10, 15), loaded  # every 5 steps
    else:  # the step killed at (17) or the refresh before: the cadence sets how far back
        assert loaded[0][0] == "memory" and 10 <= resumed[0] <= 17, loaded
        assert "memory_state_off" not in out
    newest = checkpoint.latest_info(tmp_path / "crashed")
    assert newest["step"] == STEPS and newest["file"].endswith(".dcp"), newest
    assert sorted(os.listdir(newest["path"])) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "state.pt",
    ]
    for r in range(2):
        a = torch.load(clean_out / f"final{r}.pt")
        b = torch.load(crashed_out / f"final{r}.pt")
        assert a.keys() == b.keys() and a
        for k in a:
            assert torch.equal(a[k], b[k]), k
