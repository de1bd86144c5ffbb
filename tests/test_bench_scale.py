"""bench/scale.py runs end to end at 16 simulated nodes: both systems, every phase bounded, one
JSON object with the keys the benchmark promises and values that make sense."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"nodes", "round_s", "torchrun_round_s", "propagation_s", "detection_s", "store_requests_per_s", "store_cpu"}


def test_scale_bench_at_16_nodes():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # short windows, two processes: about 15 s on an idle 2-core machine
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--nodes", "16", "--json", "--procs", "2",
                           "--window", "1", "--warmup", "0.5", "--torch-window", "1", "--timeout", "30"],
                          capture_output=True, text=True, timeout=90, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    r = json.loads(lines[0])
    assert set(r) == KEYS, r
    assert r["nodes"] == 16
    assert 0 < r["round_s"] < 10, (r, proc.stderr[-3000:])
    assert 0 <= r["propagation_s"] < 1, r
    assert 0.5 <= r["detection_s"] < 3, r  # evidence path: LOST_SILENCE (1.25 s) after the last beat seen
    assert r["torchrun_round_s"] is not None and r["torchrun_round_s"] > 0, (r, proc.stderr[-3000:])
    # 16 nodes beat 4 times a second (a set and a read of 3 counters: 3 requests) and wait on the restart key
    assert 100 < r["store_requests_per_s"] < 1000, r
    assert 0 <= r["store_cpu"] < 0.5, r
