"""bench/chaos.py with --in-place auto (torch 2.14 on): the faults that kill or hang one rank
are recovered in place (the survivors in their own processes), a second fault during re-entry
(the `restart` kind kills the rank's replacement, or a survivor, as soon as it is started) and a
fault of every rank end in today's restart, each with one line; the run ends bit for bit where
the fault-free one does, with no orphans. CI runs this file in its second environment
(.ci/run); on torch 2.13 it skips."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from e2e.test_chaos import run_chaos, survived_all

pytestmark = pytest.mark.skipif(
    not hasattr(dist, "_reconfigure"),
    reason=f"torch {torch.__version__} cannot re-form a group in place (needs torch>=2.14)",
)


def test_chaos_in_place_stays_bit_identical_with_no_orphans(tmp_path):
    kinds = "kill9,segv,stop,restart,both"
    report, r = run_chaos(
        tmp_path,
        *("--in-place", "auto", "--nproc", "3", "--kinds", kinds, "--faults", "6"),
        *("--seed", "2", "--steps-per-fault", "12", "--step-delay", "0.002", "--ckpt-every", "6"),
        timeout=150,
    )
    survived_all(report, r, 6, kinds)
    # one rank's fault is recovered in place at least once (the kill, the segfault, the hang);
    # which ones is timing's: a survivor blocked where no abort reaches is killed and started
    # again in place (in_place_unstuck), and a second fault before every rank stepped restarts
    assert report["recovered_in_place"] >= 1, r.stdout
    # every rank killed at once is never recovered in place
    both = [f for f in report["fault_log"] if f["kind"] == "both"]
    assert all(f["path"] == "restart" for f in both), both
    assert r.returncode == 0
