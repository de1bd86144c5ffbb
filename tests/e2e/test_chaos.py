"""bench/chaos.py, small: one fault of every kind against a checkpointing job; it must finish
with every fault survived, the fault-free run's final weights bit for bit, and no orphans."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import ROOT


def run_chaos(tmp_path, *args: str, timeout: float) -> tuple[dict, subprocess.CompletedProcess]:
    """bench/chaos.py with these arguments; its JSON report."""
    # PYTHONPATH: the script's folder, bench/, comes first on its sys.path, so this checkout's
    # elasticd must be named (else an installed one, maybe another copy, is what it imports)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            *args,
            *("--heartbeat-timeout", "2", "--settle-timeout", "1", "--fault-timeout", "20"),
            *("--side-by-side", "--workdir", str(tmp_path), "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1]), r


def survived_all(report: dict, r: subprocess.CompletedProcess, faults: int, kinds: str) -> None:
    """Every fault dealt and survived, the run bit-identical to the fault-free one, no orphans,
    every kind asked for dealt (and the kill after the final step)."""
    assert report["faults"] == faults and report["survived"] == faults, r.stdout
    assert report["bit_identical"], r.stdout
    assert report["orphans"] == 0, report["orphan_list"]
    assert set(report["per_kind"]) == {*kinds.split(","), "exit"}, report["per_kind"]


def test_a_fault_of_every_kind_survived_bit_identical_no_orphans(tmp_path):
    # seed 9 deals the fork server's kill last: until the daemon respawns it, every restart
    # after it waits for fresh interpreters importing torch (5-7 s here), correct but slow
    report, r = run_chaos(
        tmp_path,
        *("--faults", "12", "--seed", "9", "--steps-per-fault", "15"),
        *("--step-delay", "0.002", "--ckpt-every", "10"),
        timeout=150,
    )
    assert report["faults"] == 12 and report["survived"] == 12, r.stdout
    assert report["bit_identical"], r.stdout
    assert report["orphans"] == 0, report["orphan_list"]
    assert len(report["per_kind"]) == 12, report["per_kind"]  # every kind, and the kill at exit
    assert r.returncode == 0


def test_a_sharded_job_survives_kill_stop_and_term_bit_identical(tmp_path):
    """The same chaos against an FSDP2 job with its in-memory state on: kill -9, SIGSTOP past the
    heartbeat timeout, SIGTERM of a worker, a kill after the final step; every resume from the
    ranks' own shards in memory (its disk path: bench/chaos.py --sharded --disk)."""
    kinds = "kill9,stop,sigterm"
    report, r = run_chaos(
        tmp_path,
        *("--sharded", "--kinds", kinds, "--faults", "4", "--seed", "1"),
        *("--steps-per-fault", "10", "--step-delay", "0.002", "--ckpt-every", "5"),
        timeout=120,
    )
    survived_all(report, r, 4, kinds)
    # 3 restarts of both ranks resumed from memory, none from disk (the kill at exit restarts
    # nothing, or resumes from memory too)
    assert report["resumed_from"]["disk"] == 0, report["resumed_from"]
    assert report["resumed_from"]["memory"] >= 6, report["resumed_from"]
    assert report["steps_lost_max"] <= 1, r.stdout  # refreshed every step
    assert r.returncode == 0


def test_three_ranks_survive_every_restarting_fault_bit_identical(tmp_path):
    """The soak at 3 ranks, where the order of a sum over the ranks shows in its last bits (before
    a resume gave DDP its gradient buckets back, every resume here broke bit-identity)."""
    kinds = "kill9,segv,sigterm,stop,loader,both,restart,save"
    report, r = run_chaos(
        tmp_path,
        *("--nproc", "3", "--kinds", kinds, "--faults", "9", "--seed", "4"),
        *("--steps-per-fault", "15", "--step-delay", "0.002", "--ckpt-every", "10"),
        timeout=180,
    )
    assert report["ranks"] == 3, r.stdout
    survived_all(report, r, 9, kinds)
    assert r.returncode == 0
