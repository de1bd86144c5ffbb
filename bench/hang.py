"""Hang detection: a SIGSTOPped rank and a rank in an endless loop, elasticd vs torchrun.

For each launcher and fault: start 2 workers on bench/step_logger.py, let them train, inject the
fault into one rank, and time fault -> every rank has taken a step in new processes (resumed).
torchrun has no hang detection, so its trials end at --bound and are reported as not recovered.

    python bench/hang.py --trials 3 --heartbeat-timeout 2
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from recovery import kill_tree, latest_pids, launcher_cmd, read_steps, spawn


def one_trial(kind: str, fault: str, hb_timeout: float, bound: float) -> float | None:
    with tempfile.TemporaryDirectory(prefix=f"bench-hang-{kind}-") as tmp:
        workdir = Path(tmp)
        out, flag = workdir / "steps.txt", workdir / "hang"
        env = dict(os.environ, BENCH_OUT=str(out), BENCH_HANG_FLAG=str(flag))
        extra = ("--heartbeat-timeout", str(hb_timeout))
        proc = spawn(launcher_cmd(kind, 3, workdir, extra), env, workdir / "launcher.log")
        try:
            start = time.time()
            deadline = time.monotonic() + 120
            while len(latest_pids(read_steps(out), start)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(3.0)  # train a little (and let elasticd's warm spares get ready)
            pids = latest_pids(read_steps(out), time.time() - 1)
            t_fault = time.time()
            if fault == "sigstop":
                os.kill(pids[1], signal.SIGSTOP)
            else:
                flag.with_name("hang.1").touch()
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline:
                new = {}
                for pid, rank, _r, _s, t in read_steps(out):
                    if t > t_fault and pid not in pids.values():
                        new.setdefault(rank, t)
                if len(new) == 2:
                    return max(new.values()) - t_fault
                time.sleep(0.02)
            return None
        finally:
            kill_tree(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument(
        "--bound", type=float, default=30.0, help="give up on a trial after this many seconds"
    )
    p.add_argument("--launchers", default="elasticd,torchrun")
    args = p.parse_args()
    rows = []
    for fault in ("sigstop", "loop"):
        for kind in args.launchers.split(","):
            times = []
            for i in range(args.trials):
                t = one_trial(kind, fault, args.heartbeat_timeout, args.bound)
                print(
                    f"  {kind} {fault} trial {i + 1}: "
                    + (f"{t:.2f}s" if t is not None else f"not recovered within {args.bound:g}s"),
                    flush=True,
                )
                times.append(t)
            rows.append((fault, kind, times))
    print()
    print(
        f"hang -> every rank stepping again, 2 workers, {os.cpu_count()} cores, torch CPU/gloo; "
        f"elasticd --heartbeat-timeout {args.heartbeat_timeout:g}s; bound {args.bound:g}s"
    )
    print(f"{'fault':<8} {'launcher':<10} {'median s':>9} {'recovered':>10}")
    for fault, kind, times in rows:
        ok = [t for t in times if t is not None]
        med = f"{statistics.median(ok):.2f}" if ok else f">{args.bound:g}"
        print(f"{fault:<8} {kind:<10} {med:>9} {f'{len(ok)}/{len(times)}':>10}")


if __name__ == "__main__":
    main()
