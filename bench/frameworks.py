"""Recovery of the frameworks people train with, elasticd vs torchrun on the same unchanged
scripts (tests/scripts/*_train.py: Lightning, the transformers Trainer, Accelerate; 2 CPU workers,
gloo): `kill -9` of rank 1 → both ranks have logged a training step again (each rank appends
`rank step pid time` per step; a step by a process started after the kill counts).

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD python bench/frameworks.py --trials 5

Each launcher runs the script once per framework, trials back to back (--warmup s apart); a
trial not recovered within --trial-timeout counts as a failure and the launcher is started
afresh. elasticd's own recovery timeline (its "recovered" events) is summarised per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery import kill_tree, timeline

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("lightning", "transformers", "accelerate")
NPROC = 2


def script(framework: str) -> Path:
    return ROOT / "tests" / "scripts" / f"{framework}_train.py"


def command(launcher: str, framework: str, work: Path, trials: int, step_time: float) -> list:
    args = ["--steps", "100000", "--save-every", "50", "--out", str(work / "out")]
    args += ["--step-time", str(step_time), "--step-log", str(work / "steps.txt")]
    if launcher == "elasticd":
        head = [sys.executable, "-m", "elasticd", "run", "--log-dir", str(work / "logs")]
        head += ["--socket", str(work / "ctl.sock"), "--no-tee", "--log-format", "json"]
        head += ["--in-place", "off"]  # the whole-group restart, as its figures were measured
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        head += ["--monitor-interval", "0.1"]
    head += ["--nproc-per-node", str(NPROC), "--max-restarts", str(trials + 5)]
    return [*head, str(script(framework)), *args]


def read_steps(path: Path) -> list[tuple[int, int, int, float]]:
    """(rank, step, pid, time) per line the workers wrote whole."""
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        parts = line.split()
        if len(parts) == 4:
            rows.append((int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])))
    return rows


def latest_pids(path: Path, since: float) -> dict[int, int]:
    return {rank: pid for rank, _step, pid, t in read_steps(path) if t >= since}


def wait_training(path: Path, since: float, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = latest_pids(path, since)
        if len(pids) == NPROC:
            return pids
        time.sleep(0.05)
    return {}


def wait_learned(log: Path, timeout: float) -> None:
    """Until the fork server has imported what the workers imported (daemon/learning.py): the
    spares a restart takes after that are the ones measured."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if '"preload_learned"' in log.read_text(errors="replace"):
            return
        time.sleep(0.2)


def one_trial(steps: Path, pids: dict[int, int], timeout: float) -> float | None:
    """kill -9 rank 1; seconds until every rank stepped in a process started since."""
    t_kill = time.time()
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new: dict[int, float] = {}
        for rank, _step, pid, t in read_steps(steps):
            if t > t_kill and pid not in pids.values():
                new.setdefault(rank, t)
        if len(new) == NPROC:
            return max(new.values()) - t_kill
        time.sleep(0.01)
    return None


def run(launcher: str, framework: str, args: argparse.Namespace) -> dict:
    times, failures = [], 0
    with tempfile.TemporaryDirectory(prefix=f"bench-{launcher}-{framework}-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        log = open(work / "launcher.log", "wb")
        proc = None
        for trial in range(args.trials):
            if proc is None:
                proc = subprocess.Popen(
                    command(launcher, framework, work, args.trials, args.step_time),
                    env=env,
                    stdout=log,
                    stderr=log,
                    cwd=ROOT,
                    start_new_session=True,
                )
                wait_training(work / "steps.txt", time.time(), 120)
                if launcher == "elasticd":
                    wait_learned(work / "launcher.log", 240)
            time.sleep(args.warmup)
            pids = wait_training(work / "steps.txt", time.time() - 1.0, 5)
            took = one_trial(work / "steps.txt", pids, args.trial_timeout) if pids else None
            print(f"  {launcher} {framework} trial {trial + 1}: {took}", flush=True)
            if took is None:
                failures += 1
                kill_tree(proc)
                proc = None
            else:
                times.append(took)
        if proc is not None:
            kill_tree(proc)
        log.close()
        phases = timeline(work / "launcher.log")
    return {"times": times, "failures": failures, "trials": args.trials, "timeline": phases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--trial-timeout", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=8.0, help="seconds of training per trial")
    p.add_argument("--step-time", type=float, default=0.02, help="sleep per step, seconds")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--launchers", default="elasticd,torchrun")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = {}
    for framework in args.frameworks.split(","):
        for launcher in args.launchers.split(","):
            results[f"{launcher}/{framework}"] = run(launcher, framework, args)
    if args.json:
        print(json.dumps(results))
    print(f"kill -9 of rank 1 → both ranks training again ({os.cpu_count()} cores, gloo)")
    for key, r in results.items():
        t = r["times"]
        med = f"{statistics.median(t):.2f} s ({min(t):.2f}–{max(t):.2f})" if t else "-"
        print(f"{key:<24} {med:>24}  recovered {r['trials'] - r['failures']}/{r['trials']}")
        if r["timeline"]:
            print("    timeline: " + ", ".join(f"{k} {v:.3f}" for k, v in r["timeline"].items()))


if __name__ == "__main__":
    main()
