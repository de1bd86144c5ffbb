"""Steady state: step time under elasticd vs torchrun on the same script, and the launcher's CPU.

Each launcher trains bench/step_logger.py with 2 workers for --steps steps (no sleep between
steps); the median step interval of rank 0 after --skip warm-up steps is compared, and the
launcher process's own CPU time (not its workers') over those same steps is divided by their wall time.
Launchers alternate for --rounds rounds so drift on the machine hits both alike. The script
checkpoints as in bench/recovery.py, so elasticd's step time includes its per-step in-memory state;
`elasticd --no-memory-state` shows the launcher alone.

    python bench/steady.py --steps 1500 --rounds 3
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


def one_run(variant: str, steps: int, skip: int, ckpt_every: int) -> tuple[float, float]:
    """Median step interval of rank 0 after `skip` steps, and the launcher's own CPU use (% of
    one core) over those same steps, start-up excluded."""
    kind, extra = VARIANTS[variant]
    with tempfile.TemporaryDirectory(prefix=f"bench-steady-{kind}-") as tmp:
        workdir = Path(tmp)
        out = workdir / "steps.txt"
        env = dict(os.environ, BENCH_OUT=str(out), BENCH_STEPS=str(steps), BENCH_STEP_TIME="0",
                   BENCH_CKPT_DIR=str(workdir / "ckpt"), BENCH_CKPT_EVERY=str(ckpt_every))
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
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--skip", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ckpt-every", type=int, default=500,
                   help="disk checkpoint cadence; elasticd also refreshes the in-memory state every step")
    args = p.parse_args()
    step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS:
            s, c = one_run(variant, args.steps, args.skip, args.ckpt_every)
            step[variant].append(s)
            cpu[variant].append(c)
            print(f"  round {r + 1} {variant}: step {1e3 * s:.3f} ms, launcher CPU {100 * c:.2f}% of a core",
                  flush=True)
    print()
    print(f"steady state, 2 workers, {os.cpu_count()} cores, torch CPU/gloo, {args.steps} steps x {args.rounds} rounds "
          f"(median per variant; launcher CPU over the steps after the first {args.skip})")
    base = statistics.median(step["torchrun"])
    print(f"{'launcher':<28} {'step ms':>8} {'vs torchrun':>12} {'launcher CPU % of a core':>25}")
    for variant in VARIANTS:
        m = statistics.median(step[variant])
        print(f"{variant:<28} {1e3 * m:>8.3f} {m / base:>11.3f}x {100 * statistics.median(cpu[variant]):>24.2f}%")


if __name__ == "__main__":
    main()
