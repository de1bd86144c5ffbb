"""Steady state: step time under elasticd vs torchrun on the same script, and the launcher's CPU.

Each launcher trains bench/step_logger.py with 2 workers (--nproc; no sleep between steps) on two
workloads: `tiny`, the recovery benchmark's model (a few ms per step, dominated by process
wake-ups on a small machine), and `compute`, a 1024-wide MLP on a 128 batch (tens of ms of real
compute and an 8 MB gradient all-reduce per step); and, where there are GPUs, `gpu`: a 4096-wide
MLP on the local rank's GPU with NCCL (`--nproc` GPUs; run it without --paired, which splits CPUs,
not GPUs). Rank 0's mean step time after the first steps (wall time over steps: refreshes of the
in-memory state every N steps and checkpoint stalls count in full, as they do in a job's
throughput) is compared, and the launcher process's own CPU time (not its workers') over those
same steps is divided by their wall time. The script checkpoints as in bench/recovery.py, so
`elasticd` includes its in-memory state (default cadence); `elasticd --no-memory-state` is the
launcher alone; `elasticd synchronous refresh` (not run by default: it matters on a GPU) copies
GPU tensors into the in-memory state at once (CheckpointManager(memory_overlap=False)) instead
of beside the next step. `elasticd --in-place auto` (torch>=2.14; not run by default) is the
in-place recovery path in steady state, beside `elasticd` (the whole-group restart's,
--in-place off): each of its lines says the path the daemon took.

By default launchers run one at a time, alternating within each round so drift on the machine
hits all alike. With --paired each elasticd variant runs at the same time as torchrun, each
pinned to its own half of the CPUs, measured over the steps both ran, and then again with the
halves swapped: on a shared VM whose speed drifts by several percent from minute to minute this
cancels the drift, and the swap cancels the difference between the halves. The table gives the
median over rounds and the median and range of the per-round ratios to torchrun.

    python bench/steady.py --rounds 5
    python bench/steady.py --paired --rounds 5
    python bench/steady.py --variants "elasticd,elasticd --in-place auto"   # torch>=2.14
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from recovery import HERE, launcher_cmd, read_steps, recovery_path

VARIANTS = {  # name: (launcher, its arguments, the script's environment)
    "elasticd": ("elasticd", (), {}),
    "elasticd --no-memory-state": ("elasticd", ("--no-memory-state",), {}),
    # in-place recovery's path (torch>=2.14): the group made with enable_reconfigure, the
    # collective hook and re-entry's machinery, against "elasticd" (today's, --in-place off)
    "elasticd --in-place auto": ("elasticd", ("--in-place", "auto"), {}),
    "elasticd synchronous refresh": ("elasticd", (), {"BENCH_MEMORY_OVERLAP": "0"}),
    "torchrun": ("torchrun", (), {}),
}
DEFAULT_VARIANTS = "elasticd,elasticd --no-memory-state"
WORKLOADS = {  # name: (environment, steps, steps skipped)
    "tiny": ({}, 1500, 100),
    "compute": ({"BENCH_WIDTH": "1024", "BENCH_DEPTH": "2", "BENCH_BATCH": "128"}, 300, 20),
    "gpu": (
        {"BENCH_DEVICE": "cuda", "BENCH_WIDTH": "4096", "BENCH_DEPTH": "4", "BENCH_BATCH": "2048"},
        1000,
        150,
    ),
}
CPU_WORKLOADS = "tiny,compute"


@dataclasses.dataclass
class Run:
    proc: subprocess.Popen
    out: Path
    samples: list  # (wall time, launcher CPU seconds)


def launch(
    variant: str,
    workload: str,
    ckpt_every: int,
    workdir: Path,
    cpus: set[int] | None = None,
    nproc: int = 2,
) -> Run:
    """Start one launcher on the workload, pinned (with everything it starts) to `cpus`."""
    kind, extra, script_env = VARIANTS[variant]
    knobs, steps, _skip = WORKLOADS[workload]
    out = workdir / "steps.txt"
    env = dict(
        os.environ,
        BENCH_OUT=str(out),
        BENCH_STEPS=str(steps),
        BENCH_STEP_TIME="0",
        BENCH_CKPT_DIR=str(workdir / "ckpt"),
        BENCH_CKPT_EVERY=str(ckpt_every),
        **knobs,
        **script_env,
    )
    with open(workdir / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            launcher_cmd(kind, 0, workdir, extra, nproc),
            env=env,
            stdout=log,
            stderr=log,
            cwd=HERE.parent,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    return Run(proc, out, [])


def watch(runs: list[Run]) -> None:
    """Sample each launcher's own CPU time until every run has ended."""
    while any(r.proc.poll() is None for r in runs):
        for r in runs:
            try:
                t = psutil.Process(r.proc.pid).cpu_times()
                r.samples.append((time.time(), t.user + t.system))
            except psutil.Error:
                pass
        time.sleep(0.1)


def rank0_steps(run: Run) -> list[tuple[int, float]]:
    return sorted((s, t) for _pid, rank, _r, s, t in read_steps(run.out) if rank == 0)


def window(run: Run, skip: int) -> tuple[float, float]:
    """From the wall time of step `skip` to the last step."""
    rows = rank0_steps(run)
    return next(t for s, t in rows if s >= skip), rows[-1][1]


def measure(run: Run, begin: float, end: float) -> tuple[float, float]:
    """Mean step time of rank 0 within [begin, end] (its steps' wall time over their number), and
    the launcher's own CPU use there (share of one core)."""
    times = [t for _s, t in rank0_steps(run) if begin <= t <= end]
    w = [c for c in run.samples if begin <= c[0] <= end]
    cpu = (w[-1][1] - w[0][1]) / (w[-1][0] - w[0][0]) if len(w) > 1 else float("nan")
    return (times[-1] - times[0]) / (len(times) - 1), cpu


def cadence(workdir: Path) -> str:
    """The in-memory cadence rank 0 settled on (its last `memory_cadence` event), for the log."""
    found = ""
    for log in sorted((workdir / "logs").glob("**/rank0*.log")):  # its stdout and stderr
        for line in log.read_text(errors="replace").splitlines():
            if (
                "memory_cadence" in line
            ):  # a console line or a JSON one, as the script's logging is set up
                e = dict(re.findall(r'"?(every|refresh_ms)"?[=:] ?([0-9.]+)', line))
                found = (
                    f" (in-memory state every {e.get('every')} steps, "
                    f"refresh {e.get('refresh_ms')} ms)"
                )
    return found


def path_note(variant: str, workdir: Path) -> str:
    """Which recovery path an --in-place variant's daemon took: a torch without reconfigure
    takes the restart's, and its figures are not the in-place path's."""
    if "--in-place" not in VARIANTS[variant][1]:
        return ""
    return f" [recovery path: {recovery_path(workdir / 'launcher.log')}]"


def one_run(variant: str, workload: str, ckpt_every: int, nproc: int) -> tuple[float, float, str]:
    """One launcher alone on the machine, start-up excluded."""
    with tempfile.TemporaryDirectory(prefix="bench-steady-") as tmp:
        run = launch(variant, workload, ckpt_every, Path(tmp), nproc=nproc)
        watch([run])
        note = cadence(Path(tmp)) + path_note(variant, Path(tmp))
        return (*measure(run, *window(run, WORKLOADS[workload][2])), note)


def paired_run(
    variant: str, workload: str, ckpt_every: int, swap: bool, nproc: int
) -> tuple[tuple, tuple]:
    """`variant` and torchrun at the same time, each on its own half of the CPUs (`swap`: the
    other way round), measured over the steps both ran in steady state: whatever the machine does
    meanwhile (a neighbour, the hypervisor) hits both."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(
            "--paired needs at least 2 CPUs (one half for each launcher); run without it"
        )
    halves = [set(cpus[: len(cpus) // 2]), set(cpus[len(cpus) // 2 :])]
    if swap:
        halves.reverse()
    with (
        tempfile.TemporaryDirectory(prefix="bench-steady-a-") as a,
        tempfile.TemporaryDirectory(prefix="bench-steady-b-") as b,
    ):
        runs = [
            launch(variant, workload, ckpt_every, Path(a), halves[0], nproc),
            launch("torchrun", workload, ckpt_every, Path(b), halves[1], nproc),
        ]
        watch(runs)
        skip = WORKLOADS[workload][2]
        spans = [window(r, skip) for r in runs]
        begin, end = max(s[0] for s in spans), min(s[1] for s in spans)
        if end - begin < 2.0:
            raise SystemExit(
                f"{workload}: the two runs overlapped only {end - begin:.1f} s in steady state; "
                "raise --steps-scale"
            )
        mine = (*measure(runs[0], begin, end), path_note(variant, Path(a)))
        return mine, measure(runs[1], begin, end)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--workloads", default=CPU_WORKLOADS, help="comma-separated: " + ", ".join(WORKLOADS)
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=500,
        help="disk checkpoint cadence; elasticd also refreshes the in-memory state (default "
        "cadence)",
    )
    p.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help="comma-separated elasticd variants to compare with torchrun: "
        + ", ".join(v for v in VARIANTS if v != "torchrun"),
    )
    p.add_argument("--nproc", type=int, default=2, help="workers per launcher (default 2)")
    p.add_argument(
        "--steps-scale",
        type=float,
        default=1.0,
        help="multiply each workload's step count (a fast machine needs more for --paired)",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="run each elasticd variant and torchrun at the same time on separate halves of the "
        "CPUs",
    )
    args = p.parse_args()
    workloads = args.workloads.split(",")
    for name, (knobs, steps, skip) in WORKLOADS.items():  # start-up steps stay as they are
        WORKLOADS[name] = (knobs, skip + max(1, round((steps - skip) * args.steps_scale)), skip)
    variants = [v for v in args.variants.split(",") if v != "torchrun"] + ["torchrun"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOADS)}")
    step = {(w, v): [] for w in workloads for v in variants}
    cpu = {(w, v): [] for w in workloads for v in variants}
    ratios = {(w, v): [] for w in workloads for v in variants}

    def record(r: int, w: str, variant: str, result: tuple[float, float], note: str = "") -> None:
        step[w, variant].append(result[0])
        cpu[w, variant].append(result[1])
        print(
            f"  round {r + 1} {w} {variant}{note}: step {1e3 * result[0]:.3f} ms, "
            f"launcher CPU {100 * result[1]:.2f}% of a core",
            flush=True,
        )

    for r in range(args.rounds):
        for w in workloads:
            if args.paired:
                for variant in variants[:-1]:
                    product = 1.0
                    for swap in (
                        False,
                        True,
                    ):  # each launcher on each half: the halves differ a little
                        mine, theirs = paired_run(variant, w, args.ckpt_every, swap, args.nproc)
                        side = f" on CPU half {int(swap)}"
                        record(r, w, variant, mine[:2], side + mine[2])
                        record(
                            r,
                            w,
                            "torchrun",
                            theirs,
                            f" beside {variant}, on CPU half {int(not swap)}",
                        )
                        product *= mine[0] / theirs[0]
                    ratios[w, variant].append(product**0.5)
                    ratios[w, "torchrun"].append(1.0)
                continue
            for variant in variants:
                *result, note = one_run(variant, w, args.ckpt_every, args.nproc)
                record(r, w, variant, result, note)
            for variant in variants:
                ratios[w, variant].append(step[w, variant][-1] / step[w, "torchrun"][-1])
    print()
    how = (
        "each beside torchrun at the same time on separate halves of the CPUs, both ways round; a "
        "round's ratio is the geometric mean of the two"
        if args.paired
        else "one launcher at a time, alternating"
    )
    print(
        f"steady state, {args.nproc} worker(s) per launcher, {os.cpu_count()} cores, torch "
        f"{'CUDA/NCCL (gpu), CPU/gloo (others)' if 'gpu' in workloads else 'CPU/gloo'}, "
        f"{args.rounds} rounds, {how} (median over rounds; ratio: median and range of the "
        "per-round ratios to torchrun)"
    )
    print(
        f"{'workload':<9} {'launcher':<28} {'step ms':>8} {'vs torchrun':>12} "
        f"{'per-round range':>17} "
        f"{'launcher CPU':>13}"
    )
    for w in workloads:
        for variant in variants:
            rs = ratios[w, variant]
            print(
                f"{w:<9} {variant:<28} {1e3 * statistics.median(step[w, variant]):>8.3f} "
                f"{statistics.median(rs):>11.3f}x {min(rs):>8.3f}-{max(rs):.3f}x "
                f"{100 * statistics.median(cpu[w, variant]):>12.2f}%"
            )


if __name__ == "__main__":
    main()
