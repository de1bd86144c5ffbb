"""Steady state: step time under elasticd vs torchrun on the same script, and the launcher's CPU.

Each launcher trains bench/step_logger.py with 2 workers (no sleep between steps) on two
workloads: `tiny`, the recovery benchmark's model (a few ms per step, dominated by process
wake-ups on a small machine), and `compute`, a 1024-wide MLP on a 128 batch (tens of ms of real
compute and an 8 MB gradient all-reduce per step). The median step interval of rank 0 after
--skip steps is compared, and the launcher process's own CPU time (not its workers') over those
same steps is divided by their wall time. Launchers alternate within each round so drift on the
machine hits all alike; the table gives the median over rounds and the median and range of the
per-round ratios to torchrun. The script checkpoints as in bench/recovery.py, so `elasticd`
includes its per-step in-memory state; `elasticd --no-memory-state` is the launcher alone.

    python bench/steady.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from recovery import HERE, launcher_cmd, read_steps

VARIANTS = {
    "elasticd": ("elasticd", ()),
    "elasticd --no-memory-state": ("elasticd", ("--no-memory-state",)),
    "torchrun": ("torchrun", ()),
}
WORKLOADS = {  # name: (environment, steps, steps skipped)
    "tiny": ({}, 1500, 100),
    "compute": ({"BENCH_WIDTH": "1024", "BENCH_DEPTH": "2", "BENCH_BATCH": "128"}, 300, 20),
}


def one_run(variant: str, workload: str, ckpt_every: int) -> tuple[float, float]:
    """Median step interval of rank 0 after the skipped steps, and the launcher's own CPU use
    (% of one core) over those same steps, start-up excluded."""
    kind, extra = VARIANTS[variant]
    knobs, steps, skip = WORKLOADS[workload]
    with tempfile.TemporaryDirectory(prefix=f"bench-steady-{kind}-") as tmp:
        workdir = Path(tmp)
        out = workdir / "steps.txt"
        env = dict(os.environ, BENCH_OUT=str(out), BENCH_STEPS=str(steps), BENCH_STEP_TIME="0",
                   BENCH_CKPT_DIR=str(workdir / "ckpt"), BENCH_CKPT_EVERY=str(ckpt_every), **knobs)
        with open(workdir / "launcher.log", "wb") as log:
            proc = subprocess.Popen(launcher_cmd(kind, 0, workdir, extra), env=env, stdout=log, stderr=log,
                                    cwd=HERE.parent, start_new_session=True)
        me = psutil.Process(proc.pid)
        samples = []  # (wall time, launcher CPU seconds)
        while proc.poll() is None:
            try:
                t = me.cpu_times()
                samples.append((time.time(), t.user + t.system))
            except psutil.Error:
                pass
            time.sleep(0.1)
        rows = sorted((s, t) for pid, rank, _r, s, t in read_steps(out) if rank == 0)
        gaps = [b[1] - a[1] for a, b in zip(rows, rows[1:]) if a[0] >= skip]
        begin = next(t for s, t in rows if s >= skip)
        window = [c for c in samples if begin <= c[0] <= rows[-1][1]]
        cpu = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]) if len(window) > 1 else float("nan")
        return statistics.median(gaps), cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--ckpt-every", type=int, default=500,
                   help="disk checkpoint cadence; elasticd also refreshes the in-memory state every step")
    args = p.parse_args()
    workloads = args.workloads.split(",")
    step = {(w, v): [] for w in workloads for v in VARIANTS}
    cpu = {(w, v): [] for w in workloads for v in VARIANTS}
    for r in range(args.rounds):
        for w in workloads:
            for variant in VARIANTS:
                s, c = one_run(variant, w, args.ckpt_every)
                step[w, variant].append(s)
                cpu[w, variant].append(c)
                print(f"  round {r + 1} {w} {variant}: step {1e3 * s:.3f} ms, launcher CPU {100 * c:.2f}% of a core",
                      flush=True)
    print()
    print(f"steady state, 2 workers, {os.cpu_count()} cores, torch CPU/gloo, {args.rounds} rounds "
          "(median over rounds; ratio: median and range of the per-round ratios to torchrun)")
    print(f"{'workload':<9} {'launcher':<28} {'step ms':>8} {'vs torchrun':>12} {'per-round range':>17} "
          f"{'launcher CPU':>13}")
    for w in workloads:
        base = step[w, "torchrun"]
        for variant in VARIANTS:
            ratios = [a / b for a, b in zip(step[w, variant], base)]
            print(f"{w:<9} {variant:<28} {1e3 * statistics.median(step[w, variant]):>8.3f} "
                  f"{statistics.median(ratios):>11.3f}x {min(ratios):>8.3f}-{max(ratios):.3f}x "
                  f"{100 * statistics.median(cpu[w, variant]):>12.2f}%")


if __name__ == "__main__":
    main()
