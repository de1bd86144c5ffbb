"""Steady state: step time under elasticd vs torchrun on the same script, and the launcher's CPU.

Each launcher trains bench/step_logger.py with 2 workers for --steps steps (no sleep between
steps); the median step interval of rank 0 after --skip warm-up steps is compared, and the
launcher process's own CPU time (not its workers') is divided by the wall time of the run.
Launchers alternate for --rounds rounds so drift on the machine hits both alike. The script
checkpoints as in bench/recovery.py, so elasticd's step time includes its per-step in-memory state.

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


def one_run(kind: str, steps: int, skip: int, ckpt_every: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix=f"bench-steady-{kind}-") as tmp:
        workdir = Path(tmp)
        out = workdir / "steps.txt"
        env = dict(os.environ, BENCH_OUT=str(out), BENCH_STEPS=str(steps), BENCH_STEP_TIME="0",
                   BENCH_CKPT_DIR=str(workdir / "ckpt"), BENCH_CKPT_EVERY=str(ckpt_every))
        t0 = time.monotonic()
        with open(workdir / "launcher.log", "wb") as log:
            proc = subprocess.Popen(launcher_cmd(kind, 0, workdir), env=env, stdout=log, stderr=log,
                                    cwd=HERE.parent, start_new_session=True)
        me = psutil.Process(proc.pid)
        cpu = 0.0
        while proc.poll() is None:
            try:
                t = me.cpu_times()
                cpu = t.user + t.system
            except psutil.Error:
                pass
            time.sleep(0.2)
        wall = time.monotonic() - t0
        rows = sorted((s, t) for pid, rank, _r, s, t in read_steps(out) if rank == 0)
        gaps = [b[1] - a[1] for a, b in zip(rows, rows[1:]) if a[0] >= skip]
        return statistics.median(gaps), cpu / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--skip", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ckpt-every", type=int, default=500,
                   help="disk checkpoint cadence; elasticd also refreshes the in-memory state every step")
    args = p.parse_args()
    step: dict[str, list[float]] = {"elasticd": [], "torchrun": []}
    cpu: dict[str, list[float]] = {"elasticd": [], "torchrun": []}
    for r in range(args.rounds):
        for kind in ("elasticd", "torchrun"):
            s, c = one_run(kind, args.steps, args.skip, args.ckpt_every)
            step[kind].append(s)
            cpu[kind].append(c)
            print(f"  round {r + 1} {kind}: step {1e3 * s:.3f} ms, launcher CPU {100 * c:.2f}% of a core", flush=True)
    print()
    print(f"steady state, 2 workers, {os.cpu_count()} cores, torch CPU/gloo, {args.steps} steps x {args.rounds} rounds")
    e, t = statistics.median(step["elasticd"]), statistics.median(step["torchrun"])
    print(f"median step time: elasticd {1e3 * e:.3f} ms, torchrun {1e3 * t:.3f} ms, ratio {e / t:.3f}x")
    print(f"launcher CPU (own process, % of one core): elasticd {100 * statistics.median(cpu['elasticd']):.2f}%, "
          f"torchrun {100 * statistics.median(cpu['torchrun']):.2f}%")


if __name__ == "__main__":
    main()
