"""Chaos: N random faults against one checkpointing job under elasticd; does it come out the same?

The job (bench/chaos_train.py: AdamW, dropout, LR warm-up, a DataLoader worker, a numpy draw per
step, elasticd.checkpoint on disk and in memory) runs once without faults and once with N faults,
one every --steps-per-fault steps (once the previous fault is recovered from and the warm spares
are back), drawn from a shuffled deck of the kinds (every kind once per round). Faults:

    kill9 / segv / sigterm     kill -9, SIGSEGV, SIGTERM of one worker (SIGTERM: the library saves
                               at the next step and the unfinished job exits 143)
    stop                       SIGSTOP of one worker, held past --heartbeat-timeout
    stop_short                 SIGSTOP held half the heartbeat timeout, at most 0.15 s (under a
                               stopped rank's deadline that elasticd learns, 2 x p99 of a step and
                               0.2 s at least, with the silence since its last beat), then SIGCONT
                               (a debugger's pause): the job should go on without a restart
    loader                     kill -9 of one worker's DataLoader process
    both                       kill -9 of every worker at once
    spare / forkserver         kill -9 of a warm spare / of the fork server: no restart expected
    restart                    kill -9 of a worker, then of a new worker as soon as the restart
                               spawned it
    save                       kill -9 of rank 0 right after it logged a disk-checkpoint step (its
                               background save in flight)
    exit                       (always the last) kill -9 of a worker once it logged the final step,
                               during its final save, exit and the exit barrier

It reports faults survived (the job finished, every fault recovered from within --fault-timeout),
recovery per fault (fault -> every rank stepping again, from the workers' own step log: for
restarting faults, stepping in new processes), wall time against the fault-free run, steps lost
(the newest step logged before the restart - the step resumed from), unexpected restarts, orphans
(processes still carrying the daemon's token after it exited) and whether the final checkpoint's
model + optimizer state hashes the same as the fault-free run's.

    python bench/chaos.py --faults 40 --seed 1
    python bench/chaos.py --faults 10 --seed 3 --steps-per-fault 40 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KINDS = (
    "kill9",
    "segv",
    "stop",
    "stop_short",
    "loader",
    "both",
    "spare",
    "forkserver",
    "sigterm",
    "restart",
    "save",
)
NO_RESTART = {
    "spare",
    "forkserver",
    "stop_short",
}  # faults the job should ride out in the same processes
TOKEN = "ELASTICD_AGENT"
IN_PLACE = ("replaced_in_place", "in_place_unstuck")  # events naming ranks started in place
REPLACING = ("state", *IN_PLACE)


@dataclass
class Fault:
    kind: str
    at_step: int
    victims: list[int] = field(default_factory=list)
    recovery_s: float | None = None  # None: not recovered within the timeout
    steps_lost: int | None = None
    restarted: bool = False
    path: str | None = None  # in_place / restart: how the job recovered (None: nothing restarted)
    why: str | None = None  # the daemon's in_place_refused line, when it fell back


class Job:
    """One `elasticd run` of bench/chaos_train.py with its step log and events."""

    def __init__(self, work: Path, args, steps: int, gated: bool):
        work.mkdir(parents=True)
        self.work, self.out, self.ckpt = work, work / "steps.txt", work / "ckpt"
        self.gate = work / "gate" if gated else None
        self.gate_at = 0  # the step the ranks may run up to (open_gate)
        self.open_gate(args.steps_per_fault + 1)
        self.stderr = work / "daemon.err"
        env = dict(
            os.environ,
            CHAOS_OUT=str(self.out),
            CHAOS_CKPT_DIR=str(self.ckpt),
            CHAOS_STEPS=str(steps),
            CHAOS_STEP_DELAY=str(args.step_delay),
            CHAOS_CKPT_EVERY=str(args.ckpt_every),
            CHAOS_GATE=str(self.gate or ""),
            CHAOS_SHARDED="1" if args.sharded else "0",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        )
        cmd = [
            sys.executable,
            "-m",
            "elasticd",
            "run",
            "--nproc-per-node",
            str(args.nproc),
            "--log-dir",
            str(work / "logs"),
            "--socket",
            str(work / "ctl.sock"),
            "--log-format",
            "json",
            "--no-tee",
            "--restart-grace",
            "2",
            "--max-restarts",
            str(3 * args.faults + 10),
            "--heartbeat-timeout",
            str(args.heartbeat_timeout),
            *(("--no-memory-state",) if args.disk else ()),  # the disk path
            "--in-place",
            args.in_place,
            str(HERE / "chaos_train.py"),
        ]
        self.nproc = args.nproc
        self.t0 = time.monotonic()
        with open(work / "daemon.out", "wb") as o, open(self.stderr, "wb") as e:
            self.proc = subprocess.Popen(
                cmd,
                stdout=o,
                stderr=e,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=env,
                start_new_session=True,
            )
        self.ended: float | None = None
        threading.Thread(target=self._reap, daemon=True).start()
        self.tokens: set[str] = set()
        self._pos, self.rows = 0, []  # (pid, rank, step, t)

    def marks(self) -> tuple[int, int, int]:
        """Where the daemon's restarts, in-place replacements and refusals stand (`path_since`)."""
        restarts = [e for e in self.events("state") if e.get("new") == "RESTARTING"]
        return len(restarts), len(self.events(*IN_PLACE)), len(self.events("in_place_refused"))

    def path_since(self, marks: tuple[int, int, int]) -> tuple[str | None, str | None]:
        """How the job recovered since `marks`: ("restart", the refusal's why if one) after a
        group restart, ("in_place", None) after ranks replaced in place, else (None, None)."""
        now = self.marks()
        if now[0] > marks[0]:
            refused = self.events("in_place_refused")[marks[2] :]
            return "restart", refused[0]["why"] if refused else None
        return ("in_place", None) if now[1] > marks[1] else (None, None)

    @property
    def hit(self) -> set[int]:
        """Survivors the daemon killed to start their rank again in place (in_place_unstuck)."""
        return {p for e in self.events("in_place_unstuck") for p in e["killed"]}

    def open_gate(self, step: int) -> None:
        """Let the ranks run up to (not including) `step`."""
        self.gate_at = step
        if self.gate:
            (self.work / "gate.new").write_text(str(step))
            os.replace(self.work / "gate.new", self.gate)

    def steps(self) -> list[tuple[int, int, int, float]]:
        """The step log so far (read incrementally)."""
        try:
            with open(self.out, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return self.rows
        end = chunk.rfind(b"\n") + 1
        self._pos += end
        for line in chunk[:end].decode().splitlines():
            pid, rank, step, t = line.split()
            self.rows.append((int(pid), int(rank), int(step), float(t)))
        return self.rows

    def events(self, *wanted: str) -> list[dict]:
        """The daemon's events of these names, in order."""
        out = []
        text = self.stderr.read_text(errors="replace")
        # only whole lines: the daemon may be writing the last one as we read
        for line in text[: text.rfind("\n") + 1].splitlines():
            if line.startswith("{") and any(f'"{name}"' in line for name in wanted):
                e = json.loads(line)
                if e.get("event") in wanted:
                    out.append(e)
        return out

    def workers(self) -> dict[int, int]:
        return workers_of(self.events(*REPLACING))

    def helpers(self) -> tuple[int | None, list[int]]:
        """(fork server pid, warm spare pids): the daemon's token-carrying children that are no
        worker; the fork server is the one whose stdin is its socket to the daemon (a forked
        spare's is its job pipe, and looks the same otherwise)."""
        workers = set(self.workers().values())
        server, spares = None, []
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return None, []
        for p in children:
            try:
                token = p.environ().get(TOKEN)
                if not token or p.pid in workers or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                self.tokens.add(token)
                if os.readlink(f"/proc/{p.pid}/fd/0").startswith("socket:"):
                    server = p.pid
                else:
                    spares.append(p.pid)
            except (psutil.Error, OSError):
                continue
        return server, spares

    def loader_of(self, pid: int) -> int | None:
        try:
            kids = psutil.Process(pid).children()
        except psutil.Error:
            return None
        return kids[0].pid if kids else None

    def note_tokens(self) -> None:
        for pid in self.workers().values():
            try:
                self.tokens.add(psutil.Process(pid).environ()[TOKEN])
            except (psutil.Error, KeyError):
                pass

    def _reap(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def wait(self, timeout: float) -> tuple[int | None, float]:
        """(exit status or None if it ran past `timeout` and was killed, wall seconds)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its guard ends the workers' tree
            self.proc.wait(10)
            code = None
        wait_for(lambda: self.ended, 5)
        return code, (self.ended or time.monotonic()) - self.t0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def workers_of(events: list[dict]) -> dict[int, int]:
    """rank -> pid of a daemon's latest attempt's workers, while they live, from its events: the
    last RUNNING's, with the ranks replaced in place since (--in-place auto: `replaced_in_place`,
    `in_place_unstuck` name the ranks and their new pids, in order)."""
    out: dict[int, int] = {}
    for e in events:
        if e.get("event") == "state":
            if e.get("new") == "RUNNING":
                out = {int(r): p for r, p in e["pids"].items()}
        elif e.get("event") in IN_PLACE:
            out.update(zip(e["ranks"], e["pids"]))
    return {r: p for r, p in out.items() if _alive(p)}


def orphans(tokens: set[str], key: str = TOKEN) -> list[str]:
    """Live processes whose environment's `key` is one of `tokens` (the daemon's token, after
    the daemon exited)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) in tokens and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        except psutil.Error:
            continue
    return found


def state_hash(directory: Path) -> tuple[str | None, int | None]:
    """sha256 over the final checkpoint's model and optimizer tensors (and its step)."""
    import torch

    from elasticd import checkpoint
    from elasticd.checkpoint.disk import shard_files

    state = checkpoint.load_latest(directory)
    if state is None:
        return None, None
    h = hashlib.sha256()

    def walk(obj, prefix):
        if isinstance(obj, torch.Tensor):
            h.update(prefix.encode())
            h.update(obj.contiguous().numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{prefix}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{prefix}[{i}]")
        else:
            h.update(f"{prefix}={obj!r}".encode())

    parts = {"model": state["model"], "optimizer": state["optimizer"]}
    if isinstance(state["model"], shard_files.OnDisk):
        parts = sharded_tensors(state["model"])
    walk(parts, "")
    return h.hexdigest(), state["user"]["step"]


def sharded_tensors(on_disk) -> dict:
    """Every tensor of a sharded checkpoint, whole, read in this one process by DCP (the
    checkpoint's files verified first; its `.metadata` read as elasticd reads it)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from elasticd.checkpoint.disk import shard_files

    reader = shard_files.verified_reader(on_disk)
    md = reader.read_metadata()
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(out, storage_reader=shard_files.verified_reader(on_disk), no_dist=True)
    return out


def wait_for(predicate, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def stepping(job: Job, since: float, old: set[int], new_processes: bool) -> float | None:
    """When every rank had logged a step after `since` (in a process not in `old` if
    new_processes), or None."""
    first: dict[int, float] = {}
    for pid, rank, _s, t in job.steps():
        if t > since and not (new_processes and pid in old):
            first.setdefault(rank, t)
    return max(first.values()) if len(first) == job.nproc else None


def recovered(job: Job, since: float, old: set[int], marks: tuple, restart: bool) -> float | None:
    """`stepping` for a fault: a restarting fault is recovered when every rank steps in a new
    process; one recovered in place (no restart since `marks`), when every rank steps in a
    process that is neither dead nor hit (the survivors in their own)."""
    if restart and job.path_since(marks)[0] == "in_place":
        return stepping(job, since, {p for p in old if not _alive(p)} | job.hit, True)
    return stepping(job, since, old, restart)


def inject(
    job: Job, kind: str, args, rng: random.Random, hb: float
) -> tuple[float, list[int], float]:
    """Do the fault; returns (its time, the pids hit, the time after which steps count as
    recovered)."""
    workers = job.workers()
    rank = rng.randrange(job.nproc)
    if kind in ("kill9", "segv", "sigterm", "stop"):
        sig = {
            "kill9": signal.SIGKILL,
            "segv": signal.SIGSEGV,
            "sigterm": signal.SIGTERM,
            "stop": signal.SIGSTOP,
        }[kind]
        t = time.time()
        _signal(workers[rank], sig)
        return t, [workers[rank]], t
    if kind == "stop_short":
        t = time.time()
        _signal(workers[rank], signal.SIGSTOP)
        # under a stopped rank's deadline elasticd learns from the job too (daemon/deadlines.py
        # `Deadline.stopped`: 2 x p99, never under 0.2 s): past it, a stopped rank is a hang.
        # 0.5 s, before, was past it at this job's steps (p99 0.15-0.2 s): 1 in 10 restarted
        time.sleep(min(hb / 2, 0.15))
        _signal(workers[rank], signal.SIGCONT)
        return t, [workers[rank]], time.time()
    if kind == "loader":
        loader = wait_for(lambda: job.loader_of(workers[rank]), 5)
        t = time.time()
        _signal(loader, signal.SIGKILL)
        return t, [loader], t
    if kind == "both":
        t = time.time()
        for pid in workers.values():
            _signal(pid, signal.SIGKILL)
        return t, list(workers.values()), t
    if kind in ("spare", "forkserver"):
        server, spares = job.helpers()
        victim = server if kind == "forkserver" else (spares[0] if spares else None)
        t = time.time()
        _signal(victim, signal.SIGKILL)
        return t, [victim] if victim else [], t
    if kind == "restart":
        t = time.time()
        _signal(workers[rank], signal.SIGKILL)
        # the victim's rank started again (in a restart every rank is; in place, that one)
        new = wait_for(
            lambda: (w := job.workers()) and len(w) == job.nproc and w[rank] != workers[rank] and w,
            args.fault_timeout,
        )
        if new:
            _signal(new[rng.randrange(job.nproc)], signal.SIGKILL)
        return (
            t,
            [workers[rank], *(new or {}).values()],
            time.time(),
        )  # the spawned pair counts as old
    if kind == "save":
        last = job.steps()[-1][2]
        target = (last // args.ckpt_every + 1) * args.ckpt_every
        # room past the save's step to recover in: a loaded machine's ranks may be at the gate
        # already, and a save there was killed where the restarted ranks could not step on
        job.open_gate(max(job.gate_at, target + args.steps_per_fault))
        hit = wait_for(
            lambda: any(r == 0 and s == target for _p, r, s, _t in job.steps()),
            args.fault_timeout,
            0.002,
        )
        t = time.time()
        if hit:
            _signal(workers[0], signal.SIGKILL)
        return t, [workers[0]], t
    raise ValueError(kind)


def pick(rng: random.Random, job: Job, kinds: list[str], deck: list[str]) -> str:
    """The next kind from a shuffled deck of all kinds (so that every kind comes once per round),
    skipping a fork-server kill while there is none to kill."""
    server, _spares = job.helpers()
    while True:
        if not deck:
            deck += rng.sample(kinds, len(kinds))
        kind = deck.pop()
        if kind != "forkserver" or server is not None or kinds == ["forkserver"]:
            return kind


def chaos_run(args, steps: int) -> dict:
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    job = Job(Path(args.workdir) / "chaos", args, steps, gated=True)
    faults: list[Fault] = []
    deck: list[str] = []
    ok = wait_for(lambda: stepping(job, 0, set(), False), 120, 0.05)
    for i in range(args.faults):
        if ok is None:
            break
        target = (i + 1) * args.steps_per_fault
        job.open_gate(target + 1)  # the job waits at the fault's step while the spares come back
        job.note_tokens()
        wait_for(
            lambda: len(job.helpers()[1]) >= 2, args.settle_timeout, 0.05
        )  # bounded: without a fork
        wait_for(
            lambda: job.steps()[-1][2] >= target, args.fault_timeout, 0.005
        )  # server they take a while
        old = set(job.workers().values())
        attempts = len(job.events("state"))
        at = job.steps()[-1][2]
        if i == args.faults - 1 and args.exit_fault:
            job.open_gate(steps)
            hit = wait_for(
                lambda: next((p for p, _r, s, _t in job.steps() if s == steps), None),
                args.fault_timeout,
                0.002,
            )
            _signal(hit, signal.SIGKILL)
            fault = Fault("exit", steps, [hit] if hit else [], recovery_s=0.0 if hit else None)
            faults.append(fault)
            fault.restarted = (
                wait_for(lambda: len(job.events("state")) > attempts + 1, 5, 0.05) is not None
            )
            break
        job.open_gate(target + args.steps_per_fault)  # room to step while recovering
        kind = pick(rng, job, kinds, deck)
        t, victims, since = inject(job, kind, args, rng, args.heartbeat_timeout)
        fault = Fault(kind, at, [v for v in victims if v])
        old |= set(fault.victims)
        faults.append(fault)
        restart = kind not in NO_RESTART
        marks = job.marks()
        done = wait_for(lambda: recovered(job, since, old, marks, restart), args.fault_timeout)
        if kind == "stop":  # a stopped worker the daemon has not killed yet
            _signal(victims[0], signal.SIGCONT)
        if done is None:
            ok = None
            continue
        fault.recovery_s = round(done - t, 3)
        new_rows = [(p, s, tt) for p, _r, s, tt in job.steps() if tt > since and p not in old]
        fault.restarted = bool(new_rows)
        fault.path, fault.why = job.path_since(marks)
        if fault.restarted:  # the newest step before the first new process's step, - resumed
            first = min(tt for _p, _s, tt in new_rows)
            before = max(s for p, _r, s, tt in job.steps() if p in old and tt < first)
            fault.steps_lost = before - (min(s for _p, s, _t in new_rows) - 1)
    job.open_gate(steps)
    job.note_tokens()
    code, wall = job.wait(args.fault_timeout + steps * (args.step_delay + 0.05))
    time.sleep(0.5)  # the guard's sweep, if any, has finished
    digest, final = state_hash(job.ckpt)
    return {
        "code": code,
        "wall_s": wall,
        "faults": faults,
        "hash": digest,
        "final_step": final,
        "orphans": orphans(job.tokens),
        "resumed_from": resumed_from(job.work / "logs"),
        "unstuck": len(job.events("in_place_unstuck")),
        "fallbacks": fallbacks(job.work / "logs"),
    }


def resumed_from(logs: Path) -> dict[str, int]:
    """How many ranks' resumes came from memory and how many from disk: the checkpoint library's
    `checkpoint_loaded` lines in the workers' logs."""
    found = {"memory": 0, "disk": 0}
    for path in logs.rglob("*"):
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if "checkpoint_loaded" in line:
                source = re.search(r"source[\"=: ]+(memory|disk)", line)
                if source:
                    found[source.group(1)] += 1
    return found


def fallbacks(logs: Path) -> dict[str, int]:
    """The workers' own in_place_fallback lines (worker/reconfigure.py), by their reason."""
    found: dict[str, int] = {}
    for path in logs.rglob("*"):
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if "in_place_fallback" in line:
                    why = re.sub(r"\d+(\.\d+)?", "N", line.split("in_place_fallback", 1)[1])
                    found[why.strip()[:120]] = found.get(why.strip()[:120], 0) + 1
    return found


def clean_start(args, steps: int) -> Job:
    job = Job(Path(args.workdir) / "clean", args, steps, gated=False)
    wait_for(lambda: job.workers(), 60, 0.1)
    job.note_tokens()
    return job


def clean_finish(job: Job, args, steps: int) -> dict:
    code, wall = job.wait(120 + steps * (args.step_delay + 0.05))
    digest, final = state_hash(job.ckpt)
    return {
        "code": code,
        "wall_s": wall,
        "hash": digest,
        "final_step": final,
        "orphans": orphans(job.tokens),
    }


def summarize(args, steps: int, clean: dict, chaos: dict) -> dict:
    faults: list[Fault] = chaos["faults"]
    finished = chaos["code"] == 0 and chaos["final_step"] == steps
    survived = sum(f.recovery_s is not None for f in faults) if finished else 0
    rec = [f.recovery_s for f in faults if f.restarted and f.recovery_s and f.kind != "exit"]
    server = next((i for i, f in enumerate(faults) if f.kind == "forkserver"), len(faults))
    before, after = (
        [f.recovery_s for f in part if f.restarted and f.recovery_s and f.kind != "exit"]
        for part in (faults[:server], faults[server + 1 :])
    )
    per_kind = {}
    for f in faults:
        k = per_kind.setdefault(
            f.kind, {"n": 0, "survived": 0, "restarted": 0, "in_place": 0, "recovery_s": []}
        )
        k["n"] += 1
        k["survived"] += f.recovery_s is not None
        k["restarted"] += f.restarted
        k["in_place"] += f.path == "in_place"
        if f.recovery_s is not None and f.kind != "exit":
            k["recovery_s"].append(round(f.recovery_s, 3))
    lost = [f.steps_lost for f in faults if f.steps_lost is not None]
    whys: dict[str, int] = {}
    for f in faults:
        if f.path == "restart":
            why = f.why or "no refusal: a fault of every rank, or a rank's fallback"
            whys[why] = whys.get(why, 0) + 1
    return {
        "faults": len(faults),
        "requested": args.faults,
        "seed": args.seed,
        "steps": steps,
        "survived": survived,
        "finished": finished,
        "bit_identical": clean["hash"] is not None and clean["hash"] == chaos["hash"],
        "orphans": len(chaos["orphans"]) + len(clean["orphans"]),
        "orphan_list": chaos["orphans"] + clean["orphans"],
        "recovery_median_s": _med(rec),
        "recovery_max_s": _round(max(rec, default=None)),
        "before_forkserver_median_s": _med(before),
        "after_forkserver_median_s": _med(after),
        "single_kill9_median_s": _med(
            [f.recovery_s for f in faults if f.kind == "kill9" and f.recovery_s]
        ),
        "steps_lost_median": _med(lost),
        "steps_lost_max": max(lost, default=None),
        "unexpected_restarts": sum(f.restarted for f in faults if f.kind in NO_RESTART),
        "wall_s": round(chaos["wall_s"], 2),
        "clean_wall_s": round(clean["wall_s"], 2),
        "per_kind": per_kind,
        "resumed_from": chaos["resumed_from"],
        "in_place": args.in_place,
        "recovered_in_place": sum(f.path == "in_place" for f in faults),
        "group_restarts": sum(f.path == "restart" for f in faults),
        "restart_why": whys,
        "unstuck": chaos.get("unstuck", 0),
        "worker_fallbacks": chaos.get("fallbacks", {}),
        "fault_log": [asdict(f) for f in faults],
        "cores": os.cpu_count(),
        "ranks": args.nproc,
    }


def _med(xs):
    return round(statistics.median(xs), 3) if xs else None


def _round(x):
    return None if x is None else round(x, 3)


def table(r: dict) -> str:
    lines = [
        f"chaos: {r['faults']} faults (seed {r['seed']}), {r['ranks']} ranks, {r['steps']} steps, "
        f"{r['cores']} cores",
        f"{'fault':<12} {'n':>3} {'survived':>9} {'restarted':>10} {'in place':>9} "
        f"{'recovery median/max s':>22}",
    ]
    for kind, k in sorted(r["per_kind"].items()):
        rec = k["recovery_s"]
        rs = f"{statistics.median(rec):.2f}/{max(rec):.2f}" if rec else "-"
        lines.append(
            f"{kind:<12} {k['n']:>3} {k['survived']:>9} {k['restarted']:>10} "
            f"{k['in_place']:>9} {rs:>22}"
        )
    lines += [
        f"survived {r['survived']}/{r['faults']}, bit-identical {r['bit_identical']}, orphans "
        f"{r['orphans']}, "
        f"unexpected restarts {r['unexpected_restarts']}",
        f"recovery median {r['recovery_median_s']} s, max {r['recovery_max_s']} s; kill -9 of one "
        "worker median "
        f"{r['single_kill9_median_s']} s; before / after the fork server was killed "
        f"{r['before_forkserver_median_s']}"
        f" / {r['after_forkserver_median_s']} s",
        f"steps lost median {r['steps_lost_median']}, max {r['steps_lost_max']}; wall "
        f"{r['wall_s']} s vs "
        f"fault-free {r['clean_wall_s']} s",
    ]
    if r["in_place"] == "auto":
        lines.append(
            f"--in-place auto: {r['recovered_in_place']} recovered in place, "
            f"{r['group_restarts']} group restarts, {r['unstuck']} survivors unstuck; "
            f"restarts' why {r['restart_why']}; workers' fallbacks {r['worker_fallbacks']}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=40)
    p.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="ranks of the job: from 3 on, the order of a sum over ranks shows in its bits",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="also print one JSON object (last line)")
    p.add_argument(
        "--kinds", default=",".join(KINDS), help="the kinds drawn from (exit is always the last)"
    )
    p.add_argument("--no-exit-fault", dest="exit_fault", action="store_false")
    p.add_argument("--steps-per-fault", type=int, default=100)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--ckpt-every", type=int, default=20, help="disk checkpoint cadence in steps")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument(
        "--fault-timeout",
        type=float,
        default=30.0,
        help="a fault not recovered from within this fails",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=10.0,
        help="longest wait for the spares between faults",
    )
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--sharded",
        action="store_true",
        help="the job's model FSDP2 (fully_shard): its own shards in memory, sharded checkpoints",
    )
    p.add_argument(
        "--disk",
        action="store_true",
        help="resume from disk checkpoints only (the job runs with --no-memory-state)",
    )
    p.add_argument(
        "--in-place",
        choices=("auto", "off"),
        default="off",
        help="the faulted job's recovery path (the fault-free run's too): auto recovers a rank's "
        "fault in place where torch can re-form a group (2.14 on)",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the fault-free job at the same time (quicker; its wall time then means little)",
    )
    args = p.parse_args(argv)
    steps = (args.faults + 1) * args.steps_per_fault
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        args.workdir = args.workdir or tmp
        if args.side_by_side:
            job = clean_start(args, steps)
            chaos = chaos_run(args, steps)
            clean = clean_finish(job, args, steps)
        else:
            clean = clean_finish(clean_start(args, steps), args, steps)
            chaos = chaos_run(args, steps)
    r = summarize(args, steps, clean, chaos)
    print(table(r), flush=True)
    if args.json:
        print(json.dumps(r), flush=True)
    return (
        0
        if r["survived"] == r["faults"] == args.faults and r["bit_identical"] and not r["orphans"]
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
