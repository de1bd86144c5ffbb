"""A node lost (its daemon SIGKILLed; its guard kills its workers) -> the survivors stepping
again: elasticd's in-place recovery (--in-place auto, torch>=2.14: the survivors re-form the
group at the smaller world in their own processes) beside today's whole-group restart
(--in-place off: the survivor's workers are stopped and started again at the smaller world),
same job, same machine, one run.

Each trial: a rendezvous store hosted by no node (tests/scripts/store_server.py, so the lost
node never holds it), node A (group rank 0: it hosts the workers' store) and node B, --nproc
workers each, on tests/scripts/node_train.py (DDP, the in-memory state every step, a line per
step with its wall time and world). Once A's rank 0 trains at the full world, B's daemon is
SIGKILLed; recovered is A's rank 0 logging a step at the smaller world, timed from the kill.
`kept`: the trials where A's workers stepped again under their old pids. The in-place trials'
timeline, seconds after the kill (median over trials): `detected` (A's daemon saw B's daemon
gone: its held connection closed, `peer_daemon_gone`, cluster/links.py), `announced` (A's
daemon announced the smaller world, `shrunk_in_place`), the survivors' phases (the last one's:
`unwound`, `aborted`, `seen` the announcement, `collected`, `handles`, `reformed`;
worker/reconfigure.py) and `first_step`; `link` counts the trials whose cause names B's daemon
gone by the link, not by missed beats.

`--rejoin`: once A steps at the smaller world, a node comes back (B's daemon started again, a new
node to the job); `rejoin` is from its arrival at the store (`rendezvous_waiting`) to A's rank 0
stepping at the full world again, and `rejoin kept` the trials where A's workers took it in
their own processes (in place: daemon/grow.py, at a step boundary; restart: every worker started
again).

    python bench/nodeloss.py --trials 5 [--rejoin]
"""

from __future__ import annotations

import argparse
import json
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

from recovery import events, kill_tree
from rendezvous import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
STEP = re.compile(r"^step (\d+) world (\d+) t ([\d.]+)", re.M)
MODES = {"in-place": "auto", "restart": "off"}
PHASE_LINE = re.compile(r"\bre_entered\b.*?\bat=([\d.]+).*?phases=(\{[^}]*\})")
PHASES = ("detected", "announced", "unwound", "aborted", "seen", "collected", "handles")
PHASES += ("reformed", "first_step")


def steps(log_dir: Path) -> list[tuple[int, int, float]]:
    """(step, world, wall time) of every step rank 0 logged on this node, in every attempt."""
    rows = []
    for path in log_dir.glob("*/attempt*/rank0.log"):
        rows += [(int(a), int(b), float(c)) for a, b, c in STEP.findall(path.read_text())]
    return sorted(rows, key=lambda r: r[2])


def wait(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    return None


def daemon(work: Path, name: str, port: int, secret: Path, mode: str, nproc: int, delay: float):
    out = work / name
    out.mkdir()
    cmd = [
        sys.executable, "-m", "elasticd", "run", "--log-dir", str(out / "logs"),
        "--socket", str(out / "sock"), "--log-format", "json",
        "--nproc-per-node", str(nproc), "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "job", "--rdzv-secret-file", str(secret), "--in-place", MODES[mode],
        "--peer-timeout", "3", "--last-call-timeout", "2", "--restart-grace", "1",
        "--stop-grace", "3", "--max-restarts", "5", "--checkpoint-dir", str(out / "ckpt"),
        str(SCRIPTS / "node_train.py"), "--", "100000", str(delay),
    ]  # fmt: skip
    env = dict(os.environ, NODE_TRAIN_MEMORY_EVERY="1", PYTHONUNBUFFERED="1")
    with open(out / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env,
            start_new_session=True,
        )  # fmt: skip
    return proc, out


def pids(stderr: Path) -> set[int]:
    """A's workers' pids: the latest RUNNING state's."""
    running = [e for e in events(stderr) if e.get("event") == "state" and e.get("new") == "RUNNING"]
    return set(running[-1]["pids"].values()) if running else set()


def phases(a_dir: Path, t_kill: float) -> dict[str, float]:
    """An in-place trial's timeline on node A, seconds after the kill (PHASES), and `link`: 1
    where the cause names B's daemon gone by its held connection."""
    out: dict[str, float] = {}
    for e in events(a_dir / "stderr.txt"):
        at = datetime.fromisoformat(e["timestamp"]).timestamp() - t_kill if "timestamp" in e else 0
        if e.get("event") == "peer_daemon_gone" and at > 0:
            out.setdefault("detected", at)
        elif e.get("event") == "shrunk_in_place":
            out["announced"] = at
            out["link"] = float("connection to it closed" in e.get("cause", ""))
    for path in (a_dir / "logs").rglob("rank*.log"):
        for m in PHASE_LINE.finditer(path.read_text(errors="replace")):
            if float(m[1]) < t_kill:
                continue
            for k, v in json.loads(m[2].replace("'", '"')).items():
                key = "seen" if k == "announced" else k
                out[key] = max(out.get(key, 0.0), float(m[1]) + v - t_kill)
    return out


def rejoined(a_dir: Path, start, full: int, timeout: float) -> dict[str, float]:
    """A node started again (`start(name)`): from its arrival at the store to A's rank 0
    stepping at the `full` world, and whether A's workers were the same processes after."""
    before = pids(a_dir / "stderr.txt")
    t_back = time.time()
    _, b_dir = start("b2")
    back = wait(
        lambda: [r for r in steps(a_dir / "logs") if r[1] == full and r[2] > t_back], timeout
    )
    arrived = [
        datetime.fromisoformat(e["timestamp"]).timestamp()
        for e in events(b_dir / "stderr.txt")
        if e.get("event") == "rendezvous_waiting"
    ]
    if not back or not arrived:
        return {}
    kept = float(pids(a_dir / "stderr.txt") == before)
    return {"rejoin": back[0][2] - arrived[0], "rejoin_kept": kept}


def trial(
    work: Path, mode: str, nproc: int, delay: float, warmup: float, timeout: float,
    rejoin: bool = False,
):  # fmt: skip
    """Seconds from B's kill to A's rank 0 stepping at the smaller world, whether A's workers
    kept their pids, and the timeline (`phases`, and with `rejoin` a node coming back,
    `rejoined`); None where it did not recover in time."""
    port = free_port()
    secret = work / "secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    secret.chmod(0o600)
    store = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "store_server.py"), "127.0.0.1", str(port), "job",
         str(secret)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    started = []
    try:
        assert store.stdout.readline().strip() == "serving"
        a, a_dir = daemon(work, "a", port, secret, mode, nproc, delay)
        started.append(a)
        at_store = lambda: any(  # noqa: E731
            e.get("event") == "rendezvous_store" for e in events(a_dir / "stderr.txt")
        )
        wait(at_store, 60)
        b, _ = daemon(work, "b", port, secret, mode, nproc, delay)
        started.append(b)
        full = 2 * nproc
        first = wait(lambda: [r for r in steps(a_dir / "logs") if r[1] == full], 90)
        if not first:
            return None
        time.sleep(warmup)
        before = pids(a_dir / "stderr.txt")
        t_kill = time.time()
        b.send_signal(signal.SIGKILL)
        after = wait(
            lambda: [r for r in steps(a_dir / "logs") if r[1] == nproc and r[2] > t_kill], timeout
        )
        if not after:
            return None
        kept = before and before <= {p.pid for p in psutil.Process(a.pid).children(True)}
        kept = bool(kept) and pids(a_dir / "stderr.txt") == before
        time.sleep(0.3)  # the last survivor's re_entered line
        timeline = phases(a_dir, t_kill) if mode == "in-place" else {}
        timeline["first_step"] = after[0][2] - t_kill
        if rejoin:

            def start(name: str):
                proc, out = daemon(work, name, port, secret, mode, nproc, delay)
                started.append(proc)
                return proc, out

            timeline.update(rejoined(a_dir, start, full, timeout))
        return after[0][2] - t_kill, kept, timeline
    finally:
        for p in started:
            kill_tree(p)
        store.kill()
        store.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--modes", default="in-place,restart")
    p.add_argument("--nproc", type=int, default=1, help="workers per node")
    p.add_argument("--delay", type=float, default=0.02, help="seconds of each step's sleep")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds trained before the kill")
    p.add_argument("--trial-timeout", type=float, default=30.0)
    p.add_argument("--rejoin", action="store_true", help="then a node comes back (`rejoined`)")
    args = p.parse_args()
    results: dict[str, list] = {}
    for n in range(args.trials):  # the modes in turn, so a load change hits both
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix="elasticd-nodeloss-") as d:
                got = trial(
                    Path(d), mode, args.nproc, args.delay, args.warmup, args.trial_timeout,
                    args.rejoin,
                )  # fmt: skip
            results.setdefault(mode, []).append(got)
            shown = got and (round(got[0], 3), got[1], {k: round(v, 3) for k, v in got[2].items()})
            print(f"trial {n + 1} {mode}: {shown}", file=sys.stderr, flush=True)
    print(f"{'mode':10} {'median s':>9} {'p90 s':>7} {'ok':>5} {'kept':>5}")
    medians = {}
    for mode, rows in results.items():
        ok = sorted(r[0] for r in rows if r)
        kept = sum(1 for r in rows if r and r[1])
        if ok:
            medians[mode] = statistics.median(ok)
            p90 = ok[min(len(ok) - 1, round(0.9 * (len(ok) - 1)))]
            print(f"{mode:10} {medians[mode]:9.3f} {p90:7.3f} {len(ok):>2}/{len(rows)} {kept:>5}")
        else:
            print(f"{mode:10} {'-':>9} {'-':>7}  0/{len(rows)} {kept:>5}")
    done = [r[2] for r in results.get("in-place", []) if r]
    if done:
        print("in-place timeline, seconds after the kill (median over trials):")
        print(", ".join(
            f"{k} {statistics.median(t[k] for t in done if k in t):.3f}"
            for k in PHASES if any(k in t for t in done)
        ))  # fmt: skip
        linked = sum(t.get("link", 0) for t in done)
        print(f"cause by the link (B's daemon's connection closed): {linked:.0f}/{len(done)}")
    if "in-place" in medians and "restart" in medians:
        print(f"restart / in-place: {medians['restart'] / medians['in-place']:.2f}x")
    if args.rejoin:
        print("a node back: its arrival -> A stepping at the full world again")
        for mode, rows in results.items():
            took = sorted(r[2]["rejoin"] for r in rows if r and "rejoin" in r[2])
            kept = sum(int(r[2].get("rejoin_kept", 0)) for r in rows if r)
            shown = f"{statistics.median(took):.3f} s median" if took else "-"
            print(f"{mode:10} {shown}, {len(took)}/{len(rows)} taken in, A's pids kept {kept}")


if __name__ == "__main__":
    main()
