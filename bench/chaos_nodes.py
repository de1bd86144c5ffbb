"""Chaos across nodes: random faults against one exact-mode job of several daemons; does it come out
the same as an uninterrupted run?

--nodes daemons of --nproc ranks each (on loopback, separate nodes to each other, the rendezvous
store hosted by none of them: tests/scripts/store_server.py) train tests/scripts/global_train.py
under --ledger: DDP through elasticd.global_batch in exact mode (the same global batch and the same
bits at any world), AdamW, dropout, numpy and Python draws, the in-memory state every step. Each
fault comes once the whole world trains and the job is --steps-per-fault steps further; its kind
is drawn from a shuffled deck (each kind once per round):

    worker    kill -9 of one worker of a random node: replaced (in place or by a restart)
    stop      SIGSTOP of one worker, held: a hang, found and killed by its daemon
    stuck     one worker hangs in a data read that never returns (global_train.py's GB_STUCK_DIR),
              neither dead nor stopped: a hang judged on every node's stacks (in place: by an
              inquiry, restarting nothing), the rank killed by its daemon
    node      SIGKILL of a random node's daemon (its guard takes its workers): the others go on
              at the smaller world (in place where they can; where the node held group rank 0,
              and with it the workers' store, they restart); once they step, the node is started
              again, a new node to the job, and joins (in place at a step boundary, or by a
              restart)

Recovered: every rank of the expected world stepping again, as the bench's poll (20 ms) sees the
ranks' logs; a node fault's recovery is to the smaller world, its `rejoin` from the new daemon's
start to the full world again. At the end, every daemon alive exits 0 and the bench checks that
each step was trained whole on exactly the samples the uninterrupted run trained it on (a step
trained twice after a rollback, both times), that `elasticd ledger check` proves every epoch's
samples once, that the final weights and optimizer state hash the same as the uninterrupted
run's (global_train.py's `final` line) and that no process of any daemon is left.

    python bench/chaos_nodes.py --faults 20 --seed 1
    python bench/chaos_nodes.py --faults 6 --nodes 3 --nproc 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

from chaos import orphans, workers_of
from nodeloss import wait
from recovery import events, kill_tree
from rendezvous import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
KINDS = ("worker", "stop", "stuck", "node")
LINE = re.compile(r"^gstep (\d+) world (\d+) rank (\d+) round (\d+) samples ([\d,]*)$", re.M)
FINAL = re.compile(r"^final ([0-9a-f]{64})$", re.M)
MARK = "ELASTICD_CHAOS_NODES"  # in every daemon's environment, so in its workers': the leak check
RETURN_STEPS = 300  # a node's return: 5-8 s of a loaded 2-core VM's steps at the default delay
JOB = {"GB_EXACT": "1", "GB_GLOBAL": "10", "GB_MICRO": "4", "GB_SAMPLES": "64"}


class Cluster:
    """The store and the daemons of one run; each rank's step lines as the poll first saw them."""

    def __init__(self, work: Path, args, steps: int, nnodes: str | None, delay: float):
        """`nnodes` None: one standalone daemon (the uninterrupted run), no store."""
        self.work, self.args, self.steps, self.nnodes = work, args, steps, nnodes
        self.delay, self.no_delay = delay, work / "no-delay"
        self.stuck = work / "stuck"  # a file named by a worker's pid there: it hangs (`stuck`)
        self.stuck.mkdir(parents=True, exist_ok=True)
        self.tag = uuid.uuid4().hex
        self.daemons: dict[str, subprocess.Popen] = {}  # name -> daemon (every life of a node)
        self.seen: dict[tuple[int, int, int], float] = {}  # (round, step, rank) -> first seen
        self.worlds: dict[tuple[int, int], int] = {}
        self.text: dict[Path, str] = {}  # each rank log's whole lines read so far
        self.read: dict[Path, int] = {}  # and their length in bytes
        self.store = None
        if nnodes is None:
            return
        self.port = free_port()
        self.secret = work / "secret"
        self.secret.write_bytes(os.urandom(24).hex().encode())
        self.secret.chmod(0o600)
        self.store = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "store_server.py"), "127.0.0.1", str(self.port),
             "chaos", str(self.secret)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.store.stdout.readline().strip() == "serving", "the store did not start"

    def start(self, name: str) -> Path:
        out = self.work / name
        out.mkdir()
        a = self.args
        nodes = () if self.nnodes is None else (
            "--nnodes", self.nnodes, "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", "chaos", "--rdzv-secret-file", str(self.secret),
            "--peer-timeout", "3", "--last-call-timeout", "1",
        )  # fmt: skip
        cmd = [
            sys.executable, "-m", "elasticd", "run", "--log-dir", str(out / "logs"),
            "--socket", str(out / "sock"), "--log-format", "json", "--no-tee", "--ledger",
            "--nproc-per-node", str(a.nproc), *nodes, "--in-place", a.in_place,
            "--restart-grace", "1", "--stop-grace", "3", "--max-restarts", str(4 * a.faults + 10),
            "--heartbeat-timeout", str(a.heartbeat_timeout),
            "--checkpoint-dir", str(out / "ckpt"),
            str(SCRIPTS / "global_train.py"), "--", str(self.steps), str(self.delay),
        ]  # fmt: skip
        env = dict(os.environ, **JOB, **{MARK: self.tag}, PYTHONUNBUFFERED="1")
        env["GB_NO_DELAY_FILE"] = str(self.no_delay)
        env["GB_STUCK_DIR"] = str(self.stuck)
        with open(out / "stderr.txt", "wb") as err:
            self.daemons[name] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                cwd=ROOT, env=env, start_new_session=True,
            )  # fmt: skip
        return out

    def poll(self) -> None:
        """Read the rank logs' new whole lines; note each new step with the time first seen."""
        now = time.time()
        for path in self.work.glob("*/logs/*/attempt*/**/rank*.log"):
            try:
                with open(path, "rb") as f:
                    f.seek(self.read.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self.read[path] = self.read.get(path, 0) + len(whole)
            new = whole.decode(errors="replace")
            self.text[path] = self.text.get(path, "") + new
            for step, world, rank, tag, _ in LINE.findall(new):
                key = (int(tag), int(step), int(rank))
                if key not in self.seen:
                    self.seen[key] = now
                    self.worlds[(int(tag), int(step))] = int(world)

    def stepping(self, world: int, since: float) -> float | None:
        """When every rank of a `world`-rank group first logged one step seen after `since`."""
        self.poll()
        ranks: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        for (tag, step, rank), t in self.seen.items():
            if t > since and self.worlds[(tag, step)] == world:
                ranks[(tag, step)][rank] = t
        done = [max(r.values()) for r in ranks.values() if len(r) == world]
        return min(done) if done else None

    def newest_step(self) -> int:
        self.poll()
        return max((s for _, s, _ in self.seen), default=0)

    def alive(self) -> dict[str, subprocess.Popen]:
        return {n: p for n, p in self.daemons.items() if p.poll() is None}

    def workers(self, name: str) -> list[int]:
        """A live daemon's workers' pids."""
        return sorted(workers_of(events(self.work / name / "stderr.txt")).values())

    def leftovers(self) -> list[str]:
        return orphans({self.tag}, MARK)

    def logs(self) -> str:
        self.poll()
        return "".join(self.text.values())

    def close(self) -> None:
        for p in self.daemons.values():
            if p.poll() is None:
                kill_tree(p)
        if self.store:
            self.store.kill()
            self.store.wait(10)


def trained(logs: str) -> dict[tuple[int, int], dict]:
    """(round, step) -> {"world": W, "ranks": {rank: samples}}."""
    out: dict[tuple[int, int], dict] = defaultdict(lambda: {"world": 0, "ranks": {}})
    for step, world, rank, tag, samples in LINE.findall(logs):
        entry = out[(int(tag), int(step))]
        entry["world"] = int(world)
        entry["ranks"][int(rank)] = [int(i) for i in samples.split(",") if i]
    return out


def samples_check(run: dict, expected: dict[int, Counter]) -> tuple[list[str], int]:
    """(the steps trained wrong, the steps trained whole more than once): a step's record that
    every rank of its world logged must hold exactly the uninterrupted run's samples, a part
    (a step a fault cut short) none other, and every step must be trained whole once at least."""
    wrong, whole = [], Counter()
    for (_, step), e in sorted(run.items(), key=lambda kv: kv[0][1]):
        got = Counter(i for s in e["ranks"].values() for i in s)
        if got - expected.get(step, Counter()):
            wrong.append(f"step {step}: samples {sorted(got - expected.get(step, Counter()))}")
        elif sorted(e["ranks"]) == list(range(e["world"])):
            if got != expected[step]:
                wrong.append(f"step {step}: {sorted(got.elements())} != uninterrupted")
            whole[step] += 1
    wrong += [f"step {s}: never trained whole" for s in sorted(set(expected) - set(whole))]
    return wrong, sum(n - 1 for n in whole.values())


def ledger_ok(work: Path) -> bool:
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "ledger", "check",
         *(str(p) for p in sorted(work.glob("*/logs")))],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    return r.returncode == 0 and "exactly once: yes" in r.stdout


def clean_run(work: Path, args, steps: int) -> dict:
    """The same job uninterrupted on one daemon at the full world, without the sleep per step
    (it only gave the faults time: no number changes)."""
    one = argparse.Namespace(**{**vars(args), "nproc": args.nodes * args.nproc})
    c = Cluster(work, one, steps, None, 0.0)
    try:
        c.start("clean")
        code = c.daemons["clean"].wait(args.fault_timeout + steps * 0.1)
        logs = c.logs()
        run = trained(logs)
        expected = {
            s: Counter(i for r in e["ranks"].values() for i in r) for (_, s), e in run.items()
        }
        return {"code": code, "expected": expected, "final": FINAL.findall(logs)}
    finally:
        c.close()


def inject(c: Cluster, kind: str, rng: random.Random, full: int, a) -> dict:
    """One fault, and its recovery: seconds to the expected world stepping (None: not in time)."""
    alive = sorted(c.alive())
    name = rng.choice(alive)
    got: dict = {"kind": kind, "node": name, "at_step": c.newest_step()}
    if kind in ("worker", "stop", "stuck"):
        pids = c.workers(name)
        if not pids:
            got["skipped"] = "no worker of that node running"
            return got
        t = time.time()
        pid = rng.choice(pids)
        if kind == "stuck":  # at its next step
            (c.stuck / str(pid)).touch()
        else:
            os.kill(pid, signal.SIGKILL if kind == "worker" else signal.SIGSTOP)
        done = wait(lambda: c.stepping(full, t), a.fault_timeout)
        got["recovery_s"] = done and round(done - t, 3)
        return got
    t = time.time()
    c.daemons[name].send_signal(signal.SIGKILL)
    c.daemons[name].wait(10)
    smaller = full - a.nproc
    done = wait(lambda: c.stepping(smaller, t), a.fault_timeout)
    got["recovery_s"] = done and round(done - t, 3)
    if done:
        base = name.split(".")[0]  # a, a.1, a.2...: the lives of one node
        back = f"{base}.{sum(1 for n in c.daemons if n.split('.')[0] == base)}"
        t_back = time.time()
        c.start(back)
        joined = wait(lambda: c.stepping(full, t_back), a.fault_timeout + 30)
        got["rejoin_s"] = joined and round(joined - t_back, 3)
        got["back"] = back
    return got


def paths(c: Cluster) -> Counter:
    """How the daemons recovered: in place (shrunk, grown, replaced) or by a restart."""
    out = Counter()
    for name in c.daemons:
        for e in events(c.work / name / "stderr.txt"):
            ev = e.get("event")
            if ev in ("shrunk_in_place", "grown_in_place", "replaced_in_place", "in_place_unstuck"):
                out[ev] += 1
            elif ev == "state" and e.get("new") == "RESTARTING":
                out["restarts"] += 1
    return out


def chaos_run(work: Path, args, steps: int) -> dict:
    c = Cluster(work, args, steps, f"1:{args.nodes}", args.step_delay)
    full = args.nodes * args.nproc
    rng = random.Random(args.seed)
    faults, deck = [], []
    try:
        for i in range(args.nodes):
            c.start(chr(ord("a") + i))
            time.sleep(0.3)  # group ranks in the order started, mostly
        if not wait(lambda: c.stepping(full, 0), 120):
            return {"error": "the nodes never trained together", "faults": faults}
        for _ in range(args.faults):
            due = c.newest_step() + args.steps_per_fault
            if due >= steps - 2 * args.steps_per_fault or not wait(
                lambda d=due: c.newest_step() >= d, args.fault_timeout
            ):
                break
            if not deck:
                deck = list(args.kinds)
                rng.shuffle(deck)
            got = inject(c, deck.pop(), rng, full, args)
            faults.append(got)
            print(f"fault {len(faults)}: {got}", file=sys.stderr, flush=True)
            if got.get("recovery_s") is None and "skipped" not in got:
                break
            if got.get("back") and got.get("rejoin_s") is None:
                break
            wait(lambda: c.stepping(full, time.time()), args.fault_timeout)  # whole again
        c.no_delay.touch()  # the faults done: the rest of the run without the sleep per step
        codes = {}
        for name, p in c.daemons.items():
            try:
                codes[name] = p.wait(args.fault_timeout + steps * 0.1)
            except subprocess.TimeoutExpired:
                codes[name] = None
        logs = c.logs()
        wait(lambda: not c.leftovers(), 10)
        return {
            "faults": faults,
            "codes": codes,
            "run": trained(logs),
            "final": FINAL.findall(logs),
            "ledger": ledger_ok(work),
            "leftovers": c.leftovers(),
            "paths": paths(c),
        }
    finally:
        c.close()


def summarize(args, clean: dict, chaos: dict) -> dict:
    faults = chaos["faults"]
    done = [f for f in faults if "skipped" not in f]
    ok = [f for f in done if f.get("recovery_s") is not None and f.get("rejoin_s", 0) is not None]
    killed = {f["node"] for f in done if f["kind"] == "node"}
    exits = {n: c for n, c in chaos.get("codes", {}).items() if n not in killed}
    wrong, twice = samples_check(chaos["run"], clean["expected"]) if "run" in chaos else (["-"], 0)
    by_kind = {k: [f["recovery_s"] for f in ok if f["kind"] == k] for k in args.kinds}
    rejoins = [f["rejoin_s"] for f in ok if "rejoin_s" in f]
    return {
        "nodes": args.nodes,
        "nproc": args.nproc,
        "in_place": args.in_place,
        "seed": args.seed,
        "faults": f"{len(ok)}/{args.faults}",
        "skipped": len(faults) - len(done),
        "recovery_s": {k: _med(v) for k, v in by_kind.items() if v},
        "recovery_max_s": max((f["recovery_s"] for f in ok), default=None),
        "rejoin_s": _med(rejoins),
        "exits": exits,
        "all_exited_0": bool(exits) and all(c == 0 for c in exits.values()),
        "clean_exit": clean["code"],
        "steps_wrong": wrong[:10],
        "steps_trained_twice": twice,
        "ledger_exactly_once": chaos.get("ledger", False),
        "bit_identical": bool(clean["final"]) and chaos.get("final") == clean["final"],
        "leftovers": chaos.get("leftovers", []),
        "paths": dict(chaos.get("paths", {})),
        "error": chaos.get("error"),
        "fault_log": faults,
    }


def _med(xs):
    return round(statistics.median(xs), 3) if xs else None


def table(r: dict) -> str:
    rows = [
        f"chaos across nodes: {r['nodes']} nodes x {r['nproc']} ranks, --in-place "
        f"{r['in_place']}, seed {r['seed']}",
        f"faults survived      {r['faults']}"
        + (f" ({r['skipped']} skipped)" if r["skipped"] else ""),
        "recovery median s    "
        + (", ".join(f"{k} {v}" for k, v in r["recovery_s"].items()) or "-")
        + f" (max {r['recovery_max_s']})",
        f"node back median s   {r['rejoin_s']}",
        f"recovered by         {r['paths']}",
        f"every daemon exit 0  {'yes' if r['all_exited_0'] else r['exits']}",
        f"every step exact     {'yes' if not r['steps_wrong'] else r['steps_wrong']}"
        f" ({r['steps_trained_twice']} trained again after a rollback)",
        f"ledger exactly once  {'yes' if r['ledger_exactly_once'] else 'NO'}",
        f"bit-identical        {'yes' if r['bit_identical'] else 'NO'}",
        f"processes left       {len(r['leftovers'])}",
    ]
    if r["error"]:
        rows.append(f"error                {r['error']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1, help="ranks a node")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS), help="the kinds drawn from")
    p.add_argument("--steps-per-fault", type=int, default=30)
    p.add_argument("--step-delay", type=float, default=0.03)
    p.add_argument("--steps", type=int, help="the job's length (default: room for the faults)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--fault-timeout", type=float, default=60.0, help="a fault not recovered "
                   "from within this fails the run")  # fmt: skip
    p.add_argument("--in-place", choices=("auto", "off"), default="auto")
    p.add_argument("--workdir", type=Path, help="keep the runs' directories here")
    p.add_argument("--json", action="store_true", help="also print one JSON object (last line)")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.nodes < 2 or set(args.kinds) - set(KINDS):
        p.error(f"--nodes is 2 at least and --kinds from {', '.join(KINDS)}")
    # a node's return takes seconds, the job stepping meanwhile: room for each (the rest of the
    # run goes without the sleep per step once the faults are done)
    returns = -(-args.faults * args.kinds.count("node") // len(args.kinds))
    steps = args.steps or (args.faults + 4) * args.steps_per_fault + RETURN_STEPS * returns
    with tempfile.TemporaryDirectory(prefix="elasticd-chaos-nodes-") as tmp:
        work = args.workdir or Path(tmp)
        (work / "clean").mkdir(parents=True)
        (work / "chaos").mkdir(parents=True)
        clean = clean_run(work / "clean", args, steps)
        chaos = chaos_run(work / "chaos", args, steps)
    r = summarize(args, clean, chaos)
    print(table(r))
    if args.json:
        print(json.dumps(r))
    good = (
        r["faults"] == f"{args.faults}/{args.faults}"
        and r["all_exited_0"]
        and not r["steps_wrong"]
        and r["ledger_exactly_once"]
        and r["bit_identical"]
        and not r["leftovers"]
    )
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
