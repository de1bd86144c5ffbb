"""The path where torch cannot re-form a group in place (2.13 and older): `--in-place auto` says
at start that this job restarts its group, and a rank's kill -9 does restart the whole group, as
before in-place recovery existed. CI runs this file in its torch 2.13.0 environment (.ci/run);
under a torch that can re-form a group, tests/e2e/test_inplace.py covers the other path."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch
import torch.distributed as dist

from harness import leftover_processes, wait_until

pytestmark = pytest.mark.skipif(
    hasattr(dist, "_reconfigure"),
    reason=f"torch {torch.__version__} re-forms a group in place: tests/e2e/test_inplace.py",
)


def test_without_reconfigure_in_place_auto_says_so_and_restarts_the_group(daemons):
    d = daemons(
        "entrypoints.train", "--nproc-per-node", "2", "--in-place", "auto",
        "--restart-backoff", "0",
        args=["--steps", "40", "--log-every", "1", "--step-delay", "0.05"],
    )  # fmt: skip
    wait_until(lambda: re.search(r"^step 5/40", d.log_text(0, 1), re.M), 90, what="step 5")
    before = d.worker_pids()
    os.kill(before[1], signal.SIGKILL)
    assert d.wait(120) == 0, d.stderr()[-3000:]
    paths = [e for e in d.events() if e.get("event") == "recovery_path"]
    assert [e["path"] for e in paths] == ["restart"], paths
    assert f"torch {torch.__version__} lacks _reconfigure" in paths[0]["why"], paths
    # the whole group was started again: both ranks in a second attempt, no in-place event
    assert len(d.attempt_dirs()) == 2
    assert not [e for e in d.events() if "in_place" in str(e.get("event"))]
    assert not leftover_processes()
