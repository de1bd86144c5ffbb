"""bench/chaos.py, small: random faults of every kind against a checkpointing job; it must
finish with every fault survived, the fault-free run's final weights bit for bit, and no orphans."""

from __future__ import annotations

import json
import subprocess
import sys

from harness import ROOT


def test_ten_random_faults_survived_bit_identical_no_orphans(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--faults", "10", "--seed", "3",
                        "--steps-per-fault", "15", "--step-delay", "0.01", "--ckpt-every", "10",
                        "--heartbeat-timeout", "2", "--settle-timeout", "3", "--fault-timeout", "20",
                        "--side-by-side", "--workdir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=150, cwd=ROOT)
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["faults"] == 10 and report["survived"] == 10, r.stdout
    assert report["bit_identical"], r.stdout
    assert report["orphans"] == 0, report["orphan_list"]
    assert len(report["per_kind"]) >= 8, report["per_kind"]  # most kinds drawn with this seed
    assert r.returncode == 0
