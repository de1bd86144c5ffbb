"""The replay's verdict on a worker's exception, side by side: in a warm spare (the default), in
fresh interpreters (--no-warm-spawn: `elasticd replay`), and without a replay (--replay-timeout 0,
the repeat rule's second attempt).

tests/scripts/replay_job.py at 2 ranks under `elasticd run --ledger`: a data bug (a bad sample in
rank 1's batch at step 7) and a transient (rank 1 fails once at step 5). Per trial each variant
in turn; reported: from the failure (the daemon's RESTARTING) to its verdict event
(replay_verdict), the replay itself, and from launch to the job's end (exit 6 for the bug, 0 for
the transient).

Usage: python bench/replay.py [--trials N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from recovery import events, kill_tree, spawn  # noqa: E402

VARIANTS = {"warm": (), "cold": ("--no-warm-spawn",), "no replay": ("--replay-timeout", "0")}
JOBS = {
    "data bug": ("--bad-sample", "37"),
    "transient": ("--flaky-rank", "1", "--flaky-step", "5"),
}


def _at(e: dict) -> float:
    return datetime.datetime.fromisoformat(e["timestamp"]).timestamp()


def one(job: tuple[str, ...], flags: tuple[str, ...], tmp: Path, timeout: float) -> dict:
    """One run: its exit code, launch to end, failure to verdict and the replay's own seconds."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    cmd = [
        *(sys.executable, "-m", "elasticd", "run", "--nproc-per-node", "2", "--ledger"),
        *("--log-dir", str(tmp / "logs"), "--state-dir", str(tmp / "state"), "--no-tee"),
        *("--log-format", "json", "--max-restarts", "3", "--restart-grace", "1"),
        *flags,
        str(HERE.parent / "tests" / "scripts" / "replay_job.py"),
        "--",
        *job,
    ]
    t0 = time.time()
    proc = spawn(cmd, env, tmp / "daemon.log")
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    ended = time.time() - t0
    seen = events(tmp / "daemon.log")
    failed = next((e for e in seen if e.get("new") == "RESTARTING"), None)
    verdict = next((e for e in seen if e.get("event") == "replay_verdict"), None)
    return {
        "code": code,
        "end": ended,
        "verdict": verdict and verdict["verdict"],
        "warm": verdict and verdict.get("warm"),
        "to_verdict": _at(verdict) - _at(failed) if verdict and failed else None,
        "replay": verdict and verdict["seconds"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=180)
    args = p.parse_args()
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.trials):
        for job, job_args in JOBS.items():
            for variant, flags in VARIANTS.items():
                with tempfile.TemporaryDirectory(prefix="elasticd-bench-replay-") as tmp:
                    got = one(job_args, flags, Path(tmp), args.timeout)
                rows.setdefault((job, variant), []).append(got)
    fmt = lambda xs: ", ".join("-" if x is None else f"{x:.2f}" for x in xs)  # noqa: E731
    print("| job | variant | exit | verdict (warm) | failure to verdict, s | replay, s | end, s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (job, variant), got in rows.items():
        ends = [r["end"] for r in got]
        said = ", ".join(f"{r['verdict']} ({r['warm']})" for r in got)
        print(
            f"| {job} | {variant} | {sorted({r['code'] for r in got})} | {said} | "
            f"{fmt(r['to_verdict'] for r in got)} | {fmt(r['replay'] for r in got)} | "
            f"{fmt(ends)} (median {statistics.median(ends):.2f}) |"
        )
    print("end: from launch to the job's end (exit 6 for the data bug after its verdict)")


if __name__ == "__main__":
    main()
