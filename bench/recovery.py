"""Recovery after `kill -9` of one worker: elasticd vs torchrun, same script, same machine, one run.

For each launcher: start it with --nproc workers (2) on bench/step_logger.py, wait until every
rank trains, then repeatedly kill -9 one rank (in turn) and time kill -> every rank has logged a
step after the kill. A trial that does not recover within --trial-timeout counts as a failure;
the launcher is then killed (with its whole tree) and started afresh for the next trial.
elasticd's own recovery timeline (its "recovered" events) is summarised per phase.

The script checkpoints through elasticd.checkpoint under both launchers (disk every --ckpt-every
steps; in memory where the launcher offers shared memory, i.e. under elasticd), so
"steps lost" = newest step logged before the kill - the step the new processes resumed from.
`elasticd` refreshes the in-memory state at its default cadence (as often as keeps the refresh
under 1% of a step), `elasticd-every-step` at every step whatever it costs.
The last launcher, `torchrun-snapshot`, runs the same script with the hand-written snapshot a
torchrun tutorial teaches (rank 0 torch.save every --ckpt-every steps, torch.load at start).
Every `elasticd` kind runs the whole-group restart (--in-place off) but `elasticd-in-place`,
elasticd with --in-place auto, its default (torch>=2.14; elsewhere it restarts as `elasticd`
does, and its daemon's recovery_path line says so): only the killed rank is replaced,
the others re-form the group in their own processes. Recovered, for every launcher, is every
rank having logged the first step the replacement logs (the same step number: the resumed run's
first), which a survivor that never left its process logs too; `kept` counts the trials where
every survivor did it under its old pid.

    python bench/recovery.py --trials 10
    python bench/recovery.py --device cuda --nproc 1      # NCCL, one worker per GPU
    python bench/recovery.py --nproc 3 --launchers elasticd-in-place,elasticd,torchrun  # torch 2.14
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

from elasticd.reporting.status_snapshot import STEPS

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "step_logger.py"


def read_steps(path: Path) -> list[tuple[int, int, int, int, float]]:
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 5:
            pid, rank, restart, step = map(int, parts[:4])
            rows.append((pid, rank, restart, step, float(parts[4])))
    return rows


CKPT_MODE = {"torchrun-snapshot": "handwritten"}
MEMORY_EVERY = {
    "elasticd-every-step": "1"
}  # elasticd's default cadence keeps refreshes under 1% of a step
EXTRA = {"elasticd-in-place": ("--in-place", "auto")}  # flags of a launcher kind


def launcher_cmd(
    kind: str, trials: int, workdir: Path, extra: tuple[str, ...] = (), nproc: int = 2
) -> list[str]:
    if kind.startswith("elasticd"):
        # the whole-group restart unless the kind names in place (EXTRA): auto is the default
        path = () if "--in-place" in extra else ("--in-place", "off")
        return [
            sys.executable,
            "-m",
            "elasticd",
            "run",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            str(trials + 5),
            "--log-dir",
            str(workdir / "logs"),
            "--socket",
            str(workdir / "ctl.sock"),
            "--no-tee",
            "--log-format",
            "json",
            "--restart-grace",
            "3",
            *path,
            *extra,
            str(SCRIPT),
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(trials + 5),
        "--monitor-interval",
        "0.1",
        str(SCRIPT),
    ]


def spawn(cmd: list[str], env: dict, log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """A launcher started in a session of its own, its stdout and stderr into `log`; `cwd`: the
    checkout whose elasticd `-m elasticd` runs (this one by default)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=out, cwd=cwd or HERE.parent, start_new_session=True
        )


def events(log: Path) -> list[dict]:
    """elasticd's JSON events (`--log-format json`) in a launcher's log."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found


def recovery_path(log: Path) -> str | None:
    """The recovery path elasticd's daemon said it took (`recovery_path`: in_place, restart)."""
    return next((e.get("path") for e in events(log) if e.get("event") == "recovery_path"), None)


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.Error:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=10)
    proc.wait(timeout=10)


def latest_pids(rows, since: float) -> dict[int, int]:
    out: dict[int, tuple[float, int]] = {}
    for pid, rank, _r, _s, t in rows:
        if t >= since and (rank not in out or t > out[rank][0]):
            out[rank] = (t, pid)
    return {r: pid for r, (t, pid) in out.items()}


def run_launcher(
    kind: str,
    trials: int,
    trial_timeout: float,
    warmup: float,
    ckpt_every: int,
    nproc: int = 2,
    device: str = "cpu",
    keep: str | None = None,
) -> dict:
    times, lost, failures, kept, phases = [], [], 0, 0, []
    if keep:  # the launcher's logs and the ranks' kept for reading
        os.makedirs(keep, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as tmp:
        workdir = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=keep) if keep else tmp)
        out = workdir / "steps.txt"
        env = dict(
            os.environ,
            BENCH_OUT=str(out),
            BENCH_CKPT_DIR=str(workdir / "ckpt"),
            BENCH_CKPT_EVERY=str(ckpt_every),
            BENCH_CKPT_MODE=CKPT_MODE.get(kind, "elasticd"),
            BENCH_MEMORY_EVERY=MEMORY_EVERY.get(kind, ""),
            BENCH_DEVICE=device,
            # compiled modules cached, as an installed package has them (a checkout run with
            # PYTHONDONTWRITEBYTECODE compiles elasticd's modules in every new process)
            PYTHONPYCACHEPREFIX=str(workdir / "pycache"),
        )
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        log = open(workdir / "launcher.log", "wb")
        proc = None
        trial = 0
        while trial < trials:
            if proc is None or proc.poll() is not None:
                proc = subprocess.Popen(
                    launcher_cmd(kind, trials, workdir, EXTRA.get(kind, ()), nproc=nproc),
                    env=env,
                    stdout=log,
                    stderr=log,
                    cwd=HERE.parent,
                    start_new_session=True,
                )
                start = time.time()
                deadline = time.monotonic() + 120
                while (
                    len(latest_pids(read_steps(out), start)) < nproc and time.monotonic() < deadline
                ):
                    time.sleep(0.05)
            time.sleep(warmup)
            now = time.time()
            pids = latest_pids(read_steps(out), now - 1.0)
            if len(pids) < nproc:
                failures += 1
                trial += 1
                kill_tree(proc)
                proc = None
                continue
            victim_rank = trial % nproc
            victim = pids[victim_rank]
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            before = max((r[3] for r in read_steps(out) if r[0] in pids.values()), default=0)
            deadline = time.monotonic() + trial_timeout
            recovered = None
            while time.monotonic() < deadline:
                rows = [r for r in read_steps(out) if r[4] > t_kill and r[0] != victim]
                done = stepped_again(rows, set(pids.values()))
                if len(done) == nproc:
                    recovered = max(t for t, _pid in done.values()) - t_kill
                    first = min(s for p, _r, _x, s, _t in rows if p not in pids.values())
                    lost.append(before - (first - 1))
                    kept += all(pids[r] == pid for r, (_t, pid) in done.items() if r != victim_rank)
                    if kind in EXTRA:  # the in-place path: its phases, from the logs
                        found = in_place_phases(workdir, t_kill)
                        found["first_step.new"] = done[victim_rank][0] - t_kill
                        found["first_step"] = recovered
                        phases.append(found)
                    break
                time.sleep(0.01)
            trial += 1
            if recovered is None:
                failures += 1
                kill_tree(proc)
                proc = None
            else:
                times.append(recovered)
            print(
                f"  {kind} trial {trial}: "
                + (
                    f"{recovered:.3f}s, {lost[-1]} steps lost"
                    if recovered is not None
                    else "NOT RECOVERED"
                )
                + (
                    " (" + ", ".join(f"{k} {v:.3f}" for k, v in phases[-1].items()) + ")"
                    if recovered is not None and kind in EXTRA
                    else ""
                ),
                flush=True,
            )
        if proc is not None:
            kill_tree(proc)
        log.close()
        summary = timeline(workdir / "launcher.log")
    return {
        "times": times,
        "lost": lost,
        "failures": failures,
        "trials": trials,
        "kept": kept,
        "timeline": summary,
        "phases": phases,
    }


def stepped_again(rows, old: set[int]) -> dict[int, tuple[float, int]]:
    """rank -> (when, pid) each rank logged the first step a process started after the kill
    logged (the resumed run's first step; rows: after the kill, the victim's left out)."""
    firsts = [step for pid, _r, _x, step, _t in rows if pid not in old]
    if not firsts:
        return {}
    first, done = min(firsts), {}
    for pid, rank, _r, step, t in rows:
        if step == first:
            done.setdefault(rank, (t, pid))
    return done


PHASE_LINE = re.compile(r"\b(re_entered|joined_in_place)\b.*?\bat=([\d.]+).*?phases=(\{[^}]*\})")


def in_place_phases(workdir: Path, t_kill: float) -> dict[str, float]:
    """One in-place trial's timeline, seconds after the kill: the daemon's (`seen`: the exit,
    `replaced`: its event's time), the survivors' phases (the last survivor's: `unwound`,
    `aborted`, `announced`, `collected`, `handles`, `reformed`) and the replacement's
    (`new.init`, `new.initialized`, `new.handles`, `new.reformed`), from the ranks' log lines
    (worker/reconfigure.py `timeline`)."""
    out: dict[str, float] = {}
    for e in events(workdir / "launcher.log"):
        if e.get("event") == "replaced_in_place":
            at = datetime.fromisoformat(e["timestamp"]).timestamp() - t_kill
            if at > 0:
                out["replaced"] = min(out.get("replaced", at), at)
                if e.get("failed_at"):
                    out["seen"] = e["failed_at"] - t_kill
    for path in (workdir / "logs").rglob("rank*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = PHASE_LINE.search(line)
            if not m or float(m[2]) < t_kill:
                continue
            prefix = "" if m[1] == "re_entered" else "new."
            for k, v in ast.literal_eval(m[3]).items():
                key = prefix + k
                out[key] = max(out.get(key, 0.0), float(m[2]) + v - t_kill)
    return out


def timeline(log: Path) -> dict[str, float]:
    """elasticd's recovery timeline ("recovered" events: seconds since the failure was detected),
    median per phase over the trials; empty for torchrun, which logs none."""
    recovered = [e for e in events(log) if e.get("event") == "recovered"]
    return {
        k: statistics.median(e[k] for e in recovered)
        for k in STEPS  # the recovery's phases, in order (elasticd/reporting/status_snapshot.py)
        if recovered and all(k in e for e in recovered)
    }


# an in-place recovery's phases in the order they happen (in_place_phases)
PHASES = (
    "unwound",
    "aborted",
    "seen",
    "replaced",
    "announced",
    "collected",
    "new.init",
    "new.initialized",
    "handles",
    "new.handles",
    "reformed",
    "new.reformed",
    "first_step.new",
    "first_step",
)


def p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank); nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--trial-timeout", type=float, default=30.0)
    p.add_argument(
        "--warmup",
        type=float,
        default=6.0,
        help="seconds of training between trials (elasticd refills its warm spares meanwhile)",
    )
    p.add_argument("--launchers", default="elasticd,elasticd-every-step,torchrun,torchrun-snapshot")
    p.add_argument("--ckpt-every", type=int, default=50, help="disk checkpoint cadence in steps")
    p.add_argument("--nproc", type=int, default=2, help="workers per launcher (default 2)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: each worker trains on its own GPU with NCCL (needs --nproc GPUs)",
    )
    p.add_argument("--keep", metavar="DIR", help="keep each launcher's logs in a folder under DIR")
    args = p.parse_args()
    results = {}
    for kind in args.launchers.split(","):
        print(f"{kind}:", flush=True)
        results[kind] = run_launcher(
            kind,
            args.trials,
            args.trial_timeout,
            args.warmup,
            args.ckpt_every,
            args.nproc,
            args.device,
            args.keep,
        )
    print()
    backend = "CUDA/NCCL" if args.device == "cuda" else "CPU/gloo"
    print(
        f"recovery after kill -9 of one of {args.nproc} workers ({os.cpu_count()} cores, torch "
        f"{backend}), "
        f"{args.trials} trials each, timeout {args.trial_timeout:g}s, disk checkpoint every "
        f"{args.ckpt_every} steps"
    )
    print(
        f"{'launcher':<20} {'median s':>9} {'p90 s':>7} {'min s':>7} {'max s':>7} "
        f"{'recovered':>10} {'steps lost (median/max)':>24} {'kept':>6}"
    )
    med = {}
    for kind, r in results.items():
        t, lost = r["times"], r["lost"]
        med[kind] = statistics.median(t) if t else float("nan")
        ok = f"{r['trials'] - r['failures']}/{r['trials']}"
        lost_s = f"{statistics.median(lost):g}/{max(lost)}" if lost else "-"
        print(
            f"{kind:<20} {med[kind]:>9.3f} {p90(t):>7.3f} {min(t, default=float('nan')):>7.3f} "
            f"{max(t, default=float('nan')):>7.3f} {ok:>10} {lost_s:>24} {r['kept']:>6}"
        )
    for kind, r in results.items():
        if r["phases"]:
            print(f"{kind} in-place timeline, seconds after the kill (median / p90 over trials):")
            for k in PHASES:
                got = [ph[k] for ph in r["phases"] if k in ph]
                if got:
                    print(
                        f"  {k:<18} {statistics.median(got):.3f} / {p90(got):.3f}  (n={len(got)})"
                    )
    for kind, r in results.items():
        if r["timeline"]:
            print(
                f"{kind} recovery timeline, median seconds after detection: "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["timeline"].items())
            )
    for mine in ("elasticd", "elasticd-in-place"):
        for other in ("elasticd", "torchrun", "torchrun-snapshot"):
            if mine != other and mine in med and other in med:
                print(f"ratio {mine}/{other} median recovery: {med[mine] / med[other]:.2f}x")


if __name__ == "__main__":
    main()
