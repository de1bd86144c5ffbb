"""bench/chaos.py, small: one fault of every kind against a checkpointing job; it must finish
with every fault survived, the fault-free run's final weights bit for bit, and no orphans."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import ROOT


def test_a_fault_of_every_kind_survived_bit_identical_no_orphans(tmp_path):
    # PYTHONPATH: the script's folder, bench/, comes first on its sys.path, so this checkout's
    # elasticd must be named (else an installed one, maybe another copy, is what it imports)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    # seed 9 deals the fork server's kill last: until the daemon respawns it, every restart
    # after it waits for fresh interpreters importing torch (5-7 s here), correct but slow
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            "--faults",
            "12",
            "--seed",
            "9",
            "--steps-per-fault",
            "15",
            "--step-delay",
            "0.002",
            "--ckpt-every",
            "10",
            "--heartbeat-timeout",
            "2",
            "--settle-timeout",
            "1",
            "--fault-timeout",
            "20",
            "--side-by-side",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env=env,
    )
    assert r.stdout.strip(), r.stderr[-3000:]
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["faults"] == 12 and report["survived"] == 12, r.stdout
    assert report["bit_identical"], r.stdout
    assert report["orphans"] == 0, report["orphan_list"]
    assert len(report["per_kind"]) == 12, report["per_kind"]  # every kind, and the kill at exit
    assert r.returncode == 0
