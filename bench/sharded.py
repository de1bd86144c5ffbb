"""Sharded (FSDP2) checkpoints: elasticd against what a user does today, side by side.

Today: torchrun --max-restarts and torch.distributed.checkpoint (`dcp.save`, or `dcp.async_save`
on a gloo group of its own) into a directory per step, resumed by `dcp.load` + `set_state_dict`
from the newest complete one. elasticd: `elasticd run` and CheckpointManager's sharded saves
(each rank writes its own shards in the background; the manifest last), resumed by load_latest +
restore. The job is bench/sharded_train.py: FSDP2 (fully_shard) on CPU/gloo, 4 square layers,
Adam, about --sizes MB of state (parameters + Adam's moments), at each of --worlds ranks.

Per world size and state size:
  costs     (one torchrun launch, every method in turn, median of --saves, the slowest rank's):
            the training stall per disk save, the save's whole time until durable (the
            background write, nothing else running), the load of the newest checkpoint into the
            live model, and elasticd's in-memory refresh (its own shards into its slots, the
            replica sent in the background; "n/a" where a run kept no state in memory)
  node lost (elasticd, even worlds) two `elasticd run` nodes on loopback, the one not hosting
            the store SIGKILLed whole at step 2E + E/2: seconds until the survivor's ranks step
            at half the world, steps lost, where from (memory: own shards + the replica), and
            the replica's bytes and background seconds per exchange
  recovery  kill -9 of the last rank once rank 0 logged step 2E + E/2 (saves every E steps):
            seconds until every rank logged a step in a new process, steps lost (the newest step
            logged before the kill - the step resumed from), and where the resume came from;
            `elasticd run` (elasticd's checkpoints) against `torchrun --max-restarts 3`
            (dcp.async_save)

    python bench/sharded.py                                  # 2 and 4 ranks, 100 MB
    python bench/sharded.py --worlds 4 --sizes 1000          # 1 GB at 4 ranks
    python bench/sharded.py --worlds 2 --sizes 1 --json      # seconds: the smoke test's size
    python bench/sharded.py --device cuda --worlds 1         # NCCL, a GPU per rank (bench/gpu.sh)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery import kill_tree, read_steps
from rendezvous import free_port, secret_file

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "sharded_train.py"
METHODS = ("dcp", "dcp-async", "elasticd")
SCRIPT_ARGS: list[str] = []  # what every run of the script gets: --device cuda with --device cuda
FIGURES = (("stall_s", "stall per save"), ("write_s", "save to durable"), ("load_s", "load"))


def _env() -> dict:
    # bench/ comes first on the script's sys.path: name this checkout's elasticd
    root = str(HERE.parent)
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    )


def torchrun(world: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        *extra,
        str(SCRIPT),
    ]


def elasticd_run(world: int, work: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "elasticd",
        "run",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        "3",
        "--log-dir",
        str(work / "logs"),
        "--socket",
        str(work / "ctl.sock"),
        "--no-tee",
        "--restart-grace",
        "3",
        *(() if "--in-place" in extra else ("--in-place", "off")),  # the restart, unless named
        *extra,
        str(SCRIPT),
    ]


def costs(world: int, mb: float, saves: int, work: Path, timeout: float) -> dict:
    out = work / "costs.json"
    cmd = torchrun(world) + ["--mode", "costs", "--mb", str(mb), "--saves", str(saves)]
    cmd += ["--dir", str(work / "costs"), "--out", str(out), *SCRIPT_ARGS]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent, env=_env()
    )
    if r.returncode != 0:
        raise RuntimeError(f"costs run failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(out.read_text())


def _first_new(out: Path, since: float, old: set[int], world: int) -> dict[int, tuple]:
    """rank -> (time, step) of its first step logged after `since` by a process not in `old`."""
    first: dict[int, tuple] = {}
    for pid, rank, _r, step, t in read_steps(out):
        if t > since and pid not in old and rank not in first:
            first[rank] = (t, step)
    return first if len(first) == world else {}


def _until(predicate, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(interval)
    return None


def recovery(
    launcher: str, world: int, mb: float, every: int, work: Path, timeout: float, bound: float
) -> dict:
    """One kill -9 of the last rank under a fresh `launcher`; its recovery within `bound` s."""
    work.mkdir()
    out, log = work / "steps.txt", work / "launcher.log"
    if launcher == "torchrun":
        cmd = torchrun(world, "--max-restarts", "3", "--monitor-interval", "0.1")
    else:
        cmd = elasticd_run(world, work, *IN_PLACE_FLAGS.get(launcher, ()))
    ckpt = "dcp-async" if launcher == "torchrun" else "elasticd"
    cmd += ["--mode", "train", "--ckpt", ckpt, "--mb", str(mb), "--every", str(every)]
    cmd += ["--dir", str(work / "ckpt"), "--out", str(out), *SCRIPT_ARGS]
    kill_at = 2 * every + every // 2
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=f, cwd=HERE.parent, env=_env(), start_new_session=True
        )
    try:
        rows = _until(
            lambda: [r for r in read_steps(out) if r[1] == world - 1 and r[3] >= kill_at], timeout
        )
        if not rows:
            return {"recovery_s": None, "steps_lost": None, "source": None, "why": "never reached"}
        if launcher != "torchrun":  # not while the daemon replaces its spares with learned ones
            _until(lambda: _spares_learned(log.read_bytes()), LEARNED_WAIT)
            # that wait trained on: kill at the same point of the save cycle as kill_at (half an
            # interval after a disk save, where the in-memory state is the newer one)
            past = max(r[3] for r in read_steps(out))
            rows = (
                _until(
                    lambda: [
                        r
                        for r in read_steps(out)
                        if r[1] == world - 1 and r[3] > past and r[3] % every == kill_at % every
                    ],
                    timeout,
                )
                or rows
            )
        old = {r[0] for r in read_steps(out)}
        t_kill = time.time()
        os.kill(rows[0][0], signal.SIGKILL)
        before = max(r[3] for r in read_steps(out) if r[0] in old)
        if launcher in IN_PLACE_FLAGS:
            return _in_place(work, out, t_kill, old, before, world, bound, proc)
        first = _until(
            lambda: _first_new(out, t_kill, old, world) or proc.poll() is not None, bound
        )
        if not isinstance(first, dict):
            why = f"exited {proc.returncode}" if first else f"not recovered in {bound:g} s"
            return {"recovery_s": None, "steps_lost": None, "source": None, "why": why}
        resumed = min(s for _t, s in first.values()) - 1
        said = re.findall(r"resumed from step \d+ \((\w+)\)", _text(Path(f"{out}.resumed")))
        return {
            "recovery_s": max(t for t, _s in first.values()) - t_kill,
            "steps_lost": before - resumed,
            "source": said[-1] if said else "start",
        }
    finally:
        kill_tree(proc)


# seconds to wait, before a kill, for the daemon's warm spares to be made again with the modules
# learned at the first step: a kill in a job's first seconds, as the spares are let go for the
# learned ones, waits for a spare's start (7 s once on this VM), in place or not
LEARNED_WAIT = 20.0


def _spares_learned(text: bytes) -> bool:
    """Whether the daemon's log says its spares were forked again after `preload_learned`."""
    at = text.find(b'"preload_learned"')
    return at >= 0 and b'"spares_bound"' in text[at:]


IN_PLACE_FLAGS = {"elasticd-in-place": ("--in-place", "auto")}


def _loaded(out: Path, since: float) -> dict[int, tuple]:
    """rank -> (pid, began, built, loaded): its script's (re)start, its model built, its state
    restored, after `since`."""
    got = {}
    for line in _text(Path(f"{out}.loaded")).splitlines():
        pid, rank, *times = line.split()
        if float(times[-1]) > since:
            got.setdefault(int(rank), (int(pid), *map(float, times)))
    return got


def _re_entered(work: Path, rank: int) -> dict[str, float] | None:
    """A survivor's re_entered timeline (worker/reconfigure.py): phase -> wall time."""
    for path in work.glob(f"logs/*/attempt1/rank{rank}.log"):
        m = re.search(r"re_entered +at=([\d.]+) .*phases=(\{[^}]*\})", _text(path))
        if m:
            return {k: float(m[1]) + v for k, v in ast.literal_eval(m[2]).items()}
    return None


def _in_place(work, out, t_kill, old, before, world, bound, proc) -> dict:
    """An in-place recovery: every rank stepping again (the survivors in their own processes),
    and its two parts apart. A survivor's: its own work, not its wait for the replacement
    (unwinding, aborting, collecting, re-forming once the handles are in, running the script
    again and restoring its shards from its own slot). The replacement's: the kill to its
    shards restored (the daemon seeing the exit, the spare's start, joining, loading)."""

    def back():
        loaded = _loaded(out, t_kill)
        if len(loaded) < world:
            return None
        first = {}
        for pid, rank, _r, step, t in read_steps(out):
            if rank not in first and pid == loaded[rank][0] and t > loaded[rank][-1]:
                first[rank] = (t, step)
        return (loaded, first) if len(first) == world else None

    got = _until(lambda: back() or proc.poll() is not None, bound)
    if not isinstance(got, tuple):
        why = f"exited {proc.returncode}" if got else f"not recovered in {bound:g} s"
        return {"recovery_s": None, "steps_lost": None, "source": None, "why": why}
    loaded, first = got
    survivors, replacement, parts = [], None, {}
    # every rank's load begins with a collective (the ranks agree on the step): a survivor's
    # own part of it starts once the last rank has built its model
    ready = max(built for _pid, _began, built, _done in loaded.values())
    for rank, (pid, began, built, done) in loaded.items():
        at = _re_entered(work, rank) if pid in old else None
        if at is None:
            replacement = done - t_kill if replacement is None else max(replacement, done - t_kill)
            continue
        # the survivor's own phases: seen and unwound (from the kill), re-formed once every
        # handle was in, the script run again up to its model built, its shards restored (once
        # every rank was there); not its waits for the replacement
        mine = {
            "unwind": at["collected"] - t_kill,
            "reform": at["reformed"] - at["handles"],
            "rerun": began - at["reformed"],
            "build": built - began,
            "load": done - ready,
        }
        if not survivors or sum(mine.values()) > max(survivors):
            parts = {k: round(v, 4) for k, v in mine.items()}
        survivors.append(sum(mine.values()))
    said = re.findall(r"resumed from step \d+ \((\w+)\)", _text(Path(f"{out}.resumed")))
    return {
        "recovery_s": max(t for t, _s in first.values()) - t_kill,
        "steps_lost": before - (min(s for _t, s in first.values()) - 1),
        "source": said[-1] if said else "start",
        "survivors_s": max(survivors) if survivors else None,
        "replacement_s": replacement,
        "kept": f"{len(survivors)}/{world - 1}",
        "survivor_phases": parts,
    }


def node_loss(world: int, mb: float, every: int, work: Path, timeout: float, bound: float) -> dict:
    """Two `elasticd run` nodes on loopback, world/2 ranks each; the node that does not host the
    store SIGKILLed whole (daemon, guard, workers) once its last rank logged step 2E + E/2: seconds
    until every survivor's rank logged a step at world/2, steps lost, where the resume came from;
    and the replica (each rank's slot sent to the other node) as the survivor's rank 0 last saw
    it: bytes and background seconds per exchange."""
    work.mkdir()
    out, port = work / "steps.txt", free_port()
    nodes = ("--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench")
    nodes += ("--rdzv-secret-file", secret_file(work), "--peer-timeout", "3")
    nodes += ("--last-call-timeout", "0.5")
    args = ["--mode", "train", "--ckpt", "elasticd", "--mb", str(mb), "--every", str(every)]
    args += ["--dir", str(work / "ckpt"), "--out", str(out), *SCRIPT_ARGS]
    procs = []
    try:
        for name in ("host", "other"):  # the host first: it binds the store, takes rank 0
            (work / name).mkdir()
            with open(work / name / "launcher.log", "wb") as f:
                cmd = elasticd_run(world // 2, work / name, *nodes) + args
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=f, stderr=f, cwd=HERE.parent, env=_env(), start_new_session=True
                    )
                )
            time.sleep(2)
        kill_at = 2 * every + every // 2
        rows = _until(
            lambda: [r for r in read_steps(out) if r[1] == world - 1 and r[3] >= kill_at], timeout
        )
        if not rows:
            return {"recovery_s": None, "steps_lost": None, "source": None, "why": "never reached"}
        # the replica's first exchanges run in the background: on a loaded machine they land
        # after the kill step; a node lost before any has landed would measure nothing
        replica = _until(lambda: _replica(Path(f"{out}.replica.0")), timeout) or {}
        old = {r[0] for r in read_steps(out)}
        t_kill = time.time()
        kill_tree(procs[1])
        before = max(r[3] for r in read_steps(out) if r[0] in old)
        first = _until(
            lambda: _first_new(out, t_kill, old, world // 2) or procs[0].poll() is not None, bound
        )
        if not isinstance(first, dict):
            why = f"exited {procs[0].returncode}" if first else f"not recovered in {bound:g} s"
            return {"recovery_s": None, "steps_lost": None, "source": None, "why": why}
        said = re.findall(r"resumed from step \d+ \((\w+)\)", _text(Path(f"{out}.resumed")))
        return {
            "recovery_s": max(t for t, _s in first.values()) - t_kill,
            "steps_lost": before - (min(s for _t, s in first.values()) - 1),
            "source": said[-1] if said else "start",
            **replica,
        }
    finally:
        for p in procs:
            kill_tree(p)


def _replica(path: Path) -> dict | None:
    """sharded_train.py's last replica figures, once an exchange has sent bytes (None before,
    or while the file is being rewritten)."""
    try:
        got = json.loads(_text(path) or "{}")
    except ValueError:
        return None
    return got if got.get("replica_bytes") else None


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def measure(args, world: int, mb: float, root: Path) -> dict:
    work = root / f"w{world}-{mb:g}"
    work.mkdir()
    scale = max(1.0, mb / 100)
    row: dict = {"world": world, "mb": mb}
    if not args.no_costs:
        row["costs"] = costs(world, mb, args.saves, work, args.timeout * scale)
        print(f"  {world} ranks, {mb:g} MB: costs {json.dumps(row['costs'])}", file=sys.stderr)
    for launcher in () if args.no_recovery or args.node_loss_only else args.launchers.split(","):
        trials = []
        for i in range(args.trials):
            got = recovery(
                launcher,
                world,
                mb,
                args.every,
                work / f"{launcher}{i}",
                args.timeout * scale,
                args.recovery_timeout * scale,
            )
            trials.append(got)
            print(f"  {world} ranks, {mb:g} MB: {launcher} {json.dumps(got)}", file=sys.stderr)
        done = [t for t in trials if t["recovery_s"] is not None]
        row[launcher] = {
            "recovery_s": statistics.median(t["recovery_s"] for t in done) if done else None,
            "steps_lost": statistics.median(t["steps_lost"] for t in done) if done else None,
            "source": ",".join(sorted({t["source"] for t in done})) or None,
            "recovered": f"{len(done)}/{len(trials)}",
            "failed": sorted({t["why"] for t in trials if "why" in t}),
        }
        for part in ("survivors_s", "replacement_s"):
            got = [t[part] for t in done if t.get(part) is not None]
            if launcher in IN_PLACE_FLAGS:
                row[launcher][part] = statistics.median(got) if got else None
        if launcher in IN_PLACE_FLAGS:
            row[launcher]["kept"] = ",".join(t["kept"] for t in done)
    if "elasticd" in args.launchers.split(",") and world % 2 == 0 and not args.no_recovery:
        got = node_loss(
            world,
            mb,
            args.every,
            work / "nodeloss",
            args.timeout * scale,
            (args.recovery_timeout + 10) * scale,  # + finding the node lost (peers.py)
        )
        print(f"  {world} ranks, {mb:g} MB: node lost {json.dumps(got)}", file=sys.stderr)
        row["node_loss"] = got
    return row


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _s(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else "n/a"


def _where() -> str:
    if SCRIPT_ARGS[1:] != ["cuda"]:
        return "CPU/gloo"
    import torch

    return f"CUDA/NCCL ({torch.cuda.get_device_name()})"


def table(rows: list[dict]) -> str:
    lines = [
        f"sharded checkpoints, FSDP2 on {_where()}, {os.cpu_count()} cores "
        "(seconds; the slowest rank's, median over saves)",
        f"{'ranks':>5} {'state':>8} {'figure':<16} {'dcp.save':>9} {'async_save':>10} "
        f"{'elasticd':>9} {'memory':>7} {'vs save':>8} {'vs async':>8}",
    ]
    for r in rows:
        c = r.get("costs")
        size = f"{r['mb']:g}MB"
        for key, name in FIGURES if c is not None else ():
            d, a, e = (c[m][key] for m in METHODS)
            mem = c["elasticd"]["refresh_s"] if key == "stall_s" else None
            lines.append(
                f"{r['world']:>5} {size:>8} {name:<16} {d:>9.3f} {a:>10.3f} {e:>9.3f} "
                f"{_s(mem) if key == 'stall_s' else '':>7} {_ratio(e, d):>8} {_ratio(e, a):>8}"
            )
        x = r.get("elasticd-in-place")
        if x is not None:
            ratios = " ".join(
                f"vs {other} {_ratio(x['recovery_s'], r[other]['recovery_s'])}"
                for other in ("elasticd", "torchrun")
                if other in r
            )
            lines.append(
                f"{r['world']:>5} {size:>8} {'kill -9 in place':<16} {_s(x['recovery_s'])} s "
                f"({x['recovered']} recovered, survivors kept {x['kept']}), survivors' part "
                f"{_s(x['survivors_s'])} s, replacement's {_s(x['replacement_s'])} s, "
                f"{x['steps_lost']} lost ({x['source'] or ', '.join(x['failed'])}) {ratios}"
            )
        for launcher in ("elasticd", "torchrun"):
            if launcher in r and not ("elasticd" in r and "torchrun" in r):
                x = r[launcher]
                lines.append(
                    f"{r['world']:>5} {size:>8} {'kill -9 resume':<16} {launcher} "
                    f"{_s(x['recovery_s'])} s ({x['recovered']} recovered), "
                    f"{x['steps_lost']} steps lost ({x['source'] or ', '.join(x['failed'])})"
                )
        if "elasticd" in r and "torchrun" in r:
            e, t = r["elasticd"], r["torchrun"]
            lines.append(
                f"{r['world']:>5} {size:>8} {'kill -9 resume':<16} "
                f"torchrun {_s(t['recovery_s'])} s ({t['recovered']} recovered"
                f"{''.join(f'; {w}' for w in t['failed'])}), {t['steps_lost']} steps lost; "
                f"elasticd {_s(e['recovery_s'])} s ({e['recovered']}), {e['steps_lost']} lost "
                f"({e['source']}); ratio {_ratio(e['recovery_s'], t['recovery_s'])}"
            )
        n = r.get("node_loss")
        if n is not None:
            lines.append(
                f"{r['world']:>5} {size:>8} {'node lost':<16} elasticd {_s(n['recovery_s'])} s "
                f"to {r['world'] // 2} ranks, {n['steps_lost']} steps lost "
                f"({n['source'] or n.get('why')}); replica {n.get('replica_bytes', 0) / 1e6:.1f} "
                f"MB per rank in {n.get('replica_ms', 0) / 1e3:.3f} s, in the background"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="ranks per run, comma-separated")
    p.add_argument("--sizes", default="100", help="state sizes in MB, comma-separated")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--every", type=int, default=10, help="steps between disk saves")
    p.add_argument("--timeout", type=float, default=120, help="per phase, for 100 MB (scaled)")
    p.add_argument("--trials", type=int, default=1, help="crashes per launcher, each a fresh job")
    p.add_argument(
        "--recovery-timeout", type=float, default=30, help="a crash not recovered by then fails"
    )
    p.add_argument("--launchers", default="elasticd,torchrun", help="whose recovery to time")
    p.add_argument("--no-costs", action="store_true", help="the recovery only")
    p.add_argument("--no-recovery", action="store_true", help="the costs only")
    p.add_argument("--node-loss-only", action="store_true", help="with --no-costs: that row only")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: a GPU per rank, NCCL"
    )
    p.add_argument("--workdir", default=None, help="kept afterwards (default: a temporary one)")
    args = p.parse_args(argv)
    SCRIPT_ARGS[:] = ["--device", args.device]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sharded-", dir=os.getcwd()) as tmp:
        tmp = args.workdir or tmp
        os.makedirs(tmp, exist_ok=True)  # a --workdir not there yet
        for world in (int(w) for w in args.worlds.split(",")):
            for mb in (float(m) for m in args.sizes.split(",")):
                rows.append(measure(args, world, mb, Path(tmp)))
    print(table(rows), flush=True)
    if args.json:
        print(json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
