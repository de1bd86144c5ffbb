"""What one node's launcher and workers hold in memory while training, elasticd beside torchrun.

Each launcher runs bench/step_logger.py (DDP, --nproc workers, a disk checkpoint every 50 steps)
on its own; --settle seconds after the workers' first step every process of the launcher's tree
is read with psutil: RSS (what `top` shows: shared pages counted in every process), USS (the
process's own pages) and PSS (each shared page split among the processes that map it, so that
the sum over processes is what the node really holds). elasticd's tree has its daemon, the death
guard, the fork server, the warm spares and the workers; torchrun's its agent and the workers.
The ratio is each elasticd launcher's PSS sum over torchrun's.

`elasticd` is today's recovery path (--in-place off); `elasticd-in-place` runs with --in-place
auto (torch>=2.14: the workers' group made with enable_reconfigure, the collective hook and the
re-entry machinery loaded), and says which path the daemon took (`recovery_path`), so a torch
without reconfigure is not mistaken for the in-place figures.

    python bench/memory.py                    # 2 workers, 20 s in
    python bench/memory.py --nproc 1 --json
    python bench/memory.py --launchers elasticd,elasticd-in-place,torchrun
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from recovery import kill_tree, recovery_path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "step_logger.py"
LAUNCHERS = {  # name: elasticd's recovery path flag (None: torchrun)
    "elasticd": ("--in-place", "off"),
    "elasticd-in-place": ("--in-place", "auto"),
    "torchrun": None,
}


def _kinds(procs: list[psutil.Process], launcher: int) -> dict[int, str]:
    """pid -> what the process is. Workers show the script's command line (as torchrun's do); the
    fork server and the spares it forked show the fork server's, and the server is the oldest of
    them (it forks every spare)."""
    kinds, forked = {}, []
    for p in procs:
        try:
            line = " ".join(p.cmdline())
            p.create_time()  # read once: cached for the sort below
        except psutil.Error:
            continue  # gone meanwhile (a spare swapped, a zombie not yet reaped): not measured
        if p.pid == launcher:
            kinds[p.pid] = "launcher"
        elif "elasticd.daemon.guard" in line:
            kinds[p.pid] = "guard"
        elif "elasticd.worker.forkserver" in line:
            forked.append(p)
        else:
            kinds[p.pid] = "worker"
    forked.sort(key=lambda p: p.create_time())
    for i, p in enumerate(forked):
        kinds[p.pid] = "spare" if i else "fork server"
    return kinds


def _first_step(out: Path, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.stat().st_size:
            return
        time.sleep(0.2)
    raise SystemExit(f"bench/memory.py: no step logged within {timeout:.0f}s (exit {proc.poll()})")


def measure(launcher: str, nproc: int, settle: float, work: Path, timeout: float) -> dict:
    """{kind: [{pid, rss, uss, pss}]} of the launcher's tree, and the sums, in bytes."""
    out = work / f"{launcher}.steps"
    env = dict(
        os.environ,
        BENCH_OUT=str(out),
        BENCH_CKPT_DIR=str(work / f"{launcher}-ckpt"),
        BENCH_CKPT_EVERY="50",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
    )
    ours = LAUNCHERS[launcher] is not None
    if ours:
        cmd = [sys.executable, "-m", "elasticd", "run", "--nproc-per-node", str(nproc)]
        cmd += ["--log-dir", str(work / "logs"), "--socket", str(work / "ctl.sock"), "--no-tee"]
        cmd += ["--log-format", "json", *LAUNCHERS[launcher]]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(nproc)]
    with open(work / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            [*cmd, str(SCRIPT)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=HERE.parent,
            start_new_session=True,
        )
    try:
        _first_step(out, timeout, proc)
        time.sleep(settle)
        root = psutil.Process(proc.pid)
        deadline = time.monotonic() + timeout
        while True:  # elasticd's steady state holds a warm spare: one being swapped is waited
            # for, until a spare is both seen and measured (one swapped in between is gone)
            procs = [root, *root.children(recursive=True)]
            kinds = _kinds(procs, proc.pid)
            rows: dict[str, list] = {}
            for p in procs:
                try:
                    m = p.memory_full_info()
                except psutil.Error:
                    continue  # gone meanwhile
                if not m.rss:  # it exited since the listing: a zombie maps nothing (all zeros)
                    continue
                if p.pid in kinds:
                    row = {"pid": p.pid, "rss": m.rss, "uss": m.uss, "pss": m.pss}
                    rows.setdefault(kinds[p.pid], []).append(row)
            if not ours or "spare" in rows or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        total = {k: sum(r[k] for rs in rows.values() for r in rs) for k in ("rss", "uss", "pss")}
        return {"processes": rows, "total": total, "path": recovery_path(work / "launcher.log")}
    finally:
        kill_tree(proc)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def report(got: dict) -> str:
    lines = ["memory of one node while training (MiB; PSS: shared pages split among their users)"]
    for launcher, m in got.items():
        t = m["total"]
        sums = ", ".join(f"{k.upper()} {_mib(t[k])}" for k in ("pss", "uss", "rss"))
        path = f" (recovery path: {m['path']})" if m["path"] else ""
        lines.append(f"{launcher}{path}: {sums}")
        for kind, rows in m["processes"].items():
            each = ", ".join(f"{_mib(r['pss'])} ({_mib(r['uss'])} own)" for r in rows)
            lines.append(f"  {kind:<12} PSS {each}")
    base = got.get("torchrun")
    for launcher, m in got.items():
        if base is not None and launcher != "torchrun":
            ratio = m["total"]["pss"] / base["total"]["pss"]
            lines.append(f"ratio {launcher}/torchrun, PSS summed over each tree: {ratio:.2f}x")
    if "elasticd" in got and "elasticd-in-place" in got:
        extra = got["elasticd-in-place"]["total"]["pss"] - got["elasticd"]["total"]["pss"]
        lines.append(f"elasticd-in-place - elasticd, PSS: {extra / 2**20:+.0f} MiB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--settle", type=float, default=20.0, help="seconds after the first step")
    p.add_argument("--timeout", type=float, default=120.0, help="bound on the first step")
    p.add_argument("--launchers", default="elasticd,torchrun", help=", ".join(LAUNCHERS))
    p.add_argument("--json", action="store_true", help="the figures as JSON on the last line")
    args = p.parse_args()
    unknown = [x for x in args.launchers.split(",") if x not in LAUNCHERS]
    if unknown:
        p.error(f"unknown launcher {unknown[0]!r}: choose from {', '.join(LAUNCHERS)}")
    got = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for launcher in args.launchers.split(","):
            work = Path(tmp) / launcher
            work.mkdir()
            got[launcher] = measure(launcher, args.nproc, args.settle, work, args.timeout)
    print(report(got), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(got))


if __name__ == "__main__":
    main()
