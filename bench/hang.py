"""Hang detection: a SIGSTOPped rank and a rank in an endless loop, elasticd vs torchrun.

For each launcher and fault: start 2 workers on bench/step_logger.py, let them train, inject the
fault into one rank, and time fault -> every rank has taken a step after the first step of a
process started since the fault (the resumed run's): in new processes after a restart, the
survivors in their own after a recovery in place (`elasticd-in-place`, --in-place auto, torch
2.14: the hung rank killed and replaced, the others re-entering).
torchrun has no hang detection, so its trials end at --bound and are reported as not recovered.

    python bench/hang.py --trials 3 --heartbeat-timeout 2
    python bench/hang.py --launchers elasticd-in-place,elasticd    # torch 2.14
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from recovery import EXTRA, kill_tree, latest_pids, launcher_cmd, read_steps, spawn


def one_trial(kind: str, fault: str, hb_timeout: float, bound: float) -> tuple[float, bool] | None:
    """Seconds from the fault to every rank stepping again, and whether rank 0 (never faulted)
    did so in its own process; None past `bound`."""
    with tempfile.TemporaryDirectory(prefix=f"bench-hang-{kind}-") as tmp:
        workdir = Path(tmp)
        out, flag = workdir / "steps.txt", workdir / "hang"
        env = dict(
            os.environ,
            BENCH_OUT=str(out),
            BENCH_HANG_FLAG=str(flag),
            PYTHONPYCACHEPREFIX=str(workdir / "pycache"),  # as an installed package has them
        )
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        extra = ("--heartbeat-timeout", str(hb_timeout), *EXTRA.get(kind, ()))
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
                rows = [r for r in read_steps(out) if r[4] > t_fault]
                fresh = [t for pid, _r, _x, _s, t in rows if pid not in pids.values()]
                if fresh:
                    again = {}
                    for pid, rank, _r, _s, t in rows:
                        if t >= min(fresh):
                            again.setdefault(rank, (t, pid))
                    if len(again) == 2:
                        return max(t for t, _p in again.values()) - t_fault, again[0][1] == pids[0]
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
            times, kept = [], 0
            for i in range(args.trials):
                got = one_trial(kind, fault, args.heartbeat_timeout, args.bound)
                t = got[0] if got else None
                print(
                    f"  {kind} {fault} trial {i + 1}: "
                    + (
                        f"{t:.2f}s" + (", rank 0 in its own process" if got[1] else "")
                        if got
                        else f"not recovered within {args.bound:g}s"
                    ),
                    flush=True,
                )
                times.append(t)
                kept += bool(got and got[1])
            rows.append((fault, kind, times, kept))
    print()
    print(
        f"hang -> every rank stepping again, 2 workers, {os.cpu_count()} cores, torch CPU/gloo; "
        f"elasticd --heartbeat-timeout {args.heartbeat_timeout:g}s; bound {args.bound:g}s"
    )
    print(f"{'fault':<8} {'launcher':<18} {'median s':>9} {'recovered':>10} {'kept':>5}")
    for fault, kind, times, kept in rows:
        ok = [t for t in times if t is not None]
        med = f"{statistics.median(ok):.2f}" if ok else f">{args.bound:g}"
        print(f"{fault:<8} {kind:<18} {med:>9} {f'{len(ok)}/{len(times)}':>10} {kept:>5}")


if __name__ == "__main__":
    main()
