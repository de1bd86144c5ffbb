"""Recovery with the framework integrations (elasticd.integrations) and without: `kill -9` of
rank 1 mid-training under `elasticd run` (2 gloo CPU workers), timed from the kill to every rank
logging a step again, and the steps lost (the newest step logged before the kill less the step
resumed from). The jobs are the tests' scripts (tests/scripts/*_train.py): without the
integration they resume from their own disk checkpoint (every --disk steps), with it from
elasticd's memory at its default cadence. Each run is killed once the fork server has learned
the workers' imports (as bench/frameworks.py), as far past a disk save as --kill-at is.

    python bench/integrations.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frameworks import wait_learned

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "lightning": "lightning_train.py",
    "transformers": "transformers_train.py",
    "accelerate": "accelerate_train.py",
}
STEP = re.compile(rb"^\[rank(\d)\]: step (\d+)", re.M)
RESUMED = re.compile(rb"^\[rank0\]: resumed at (\d+)", re.M)


def rank1_pid(stderr: Path) -> int | None:
    pid = None
    for line in stderr.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"RUNNING"' in line:
            event = json.loads(line)
            if event.get("event") == "state" and event.get("pids"):
                pid = event["pids"].get("1")
    return pid


def trial(framework: str, every: int, disk: int, kill_at: int, work: Path) -> dict:
    out, err = work / "out.txt", work / "err.txt"
    cmd = [sys.executable, "-m", "elasticd", "run", "--nproc-per-node", "2", "--in-place", "off"]
    cmd += ["--log-dir", str(work / "logs"), "--socket", str(work / "s.sock")]
    cmd += [str(ROOT / "tests" / "scripts" / SCRIPTS[framework])]
    cmd += ["--out", str(work / "out"), "--steps", "100000", "--save-every", str(disk)]
    cmd += ["--step-time", "0.03", *(["--memory-every", str(every)] if every >= 0 else [])]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=ROOT, start_new_session=True)
    try:
        # the spares a restart takes once the fork server learned the workers' imports, and
        # those bound to a rank have imported the rest (as bench/frameworks.py measures)
        wait_learned(err, 300)
        time.sleep(5)
        now = max((int(s) for _, s in STEP.findall(out.read_bytes())), default=0)
        target = now + 1 + (kill_at - now - 1) % disk  # as far past a disk save as kill_at is
        deadline = time.monotonic() + 300
        while not any(int(s) >= target for _, s in STEP.findall(out.read_bytes())):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{framework}: no step {target}")
            time.sleep(0.01)
        before = max(int(s) for _, s in STEP.findall(out.read_bytes()))
        seen = len(out.read_bytes())
        os.kill(rank1_pid(err), signal.SIGKILL)
        killed = time.monotonic()
        back = set()
        while back != {b"0", b"1"}:
            tail = out.read_bytes()[seen:]
            if RESUMED.search(tail):
                back = {r for r, _ in STEP.findall(tail[RESUMED.search(tail).end() :])}
            if time.monotonic() > killed + 120:
                raise RuntimeError(f"{framework}: not training again within 120 s")
            time.sleep(0.005)
        recovered = time.monotonic() - killed
        resumed = int(RESUMED.search(out.read_bytes()[seen:]).group(1))
        return {"recovery_s": recovered, "lost": before - resumed, "before": before}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--disk", type=int, default=50, help="disk checkpoint every N steps")
    p.add_argument("--kill-at", type=int, default=40)
    p.add_argument("--frameworks", default=",".join(SCRIPTS))
    args = p.parse_args()
    for framework in args.frameworks.split(","):
        for label, every in (("without", -1), ("with", 0)):
            rows = []
            for _ in range(args.trials):
                with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as d:
                    rows.append(trial(framework, every, args.disk, args.kill_at, Path(d)))
            rec = statistics.median(r["recovery_s"] for r in rows)
            lost = statistics.median(r["lost"] for r in rows)
            each = ", ".join(f"{r['recovery_s']:.2f}" for r in rows)
            print(
                f"{framework:12} {label:8} recovery {rec:.2f} s (median of {len(rows)}: {each}), "
                f"steps lost {lost:g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
