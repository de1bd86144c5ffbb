"""Rendezvous to a running group, elasticd vs torchrun, for N simulated nodes on loopback; and
elasticd's restart propagation between nodes.

Rendezvous: N launchers (one per simulated node, 1 worker each, the trivial entrypoint
bench/trivial.py) start together against one c10d endpoint; the time is launch -> every rank has
returned from init_process_group. Both launchers pay the same interpreter and torch start-up
(elasticd without warm spares here, so that only the rendezvous differs).

Propagation: 2 elasticd nodes x 1 worker train bench/step_logger.py; one worker is SIGKILLed;
the time is the failing node's RESTARTING event -> the healthy node's RESTARTING event.

Start (`--start`): one node as users run it, `elasticd run --nproc-per-node 2` (warm spawn, its
defaults) against `torchrun --standalone --nproc-per-node 2`, on bench/trivial.py: launch ->
every rank past init_process_group, and launch -> the launcher's exit.

    python bench/rendezvous.py --nodes 2,4,8,16 --trials 3
    python bench/rendezvous.py --start --trials 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from recovery import HERE, kill_tree, latest_pids, read_steps

TRIVIAL = HERE / "trivial.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secret_file(workdir: Path) -> str:
    """The job secret every elasticd node is given, as a multi-node job should be (signed store)."""
    path = workdir / "job.secret"
    if not path.exists():
        path.write_bytes(os.urandom(32).hex().encode())
        path.chmod(0o600)
    return str(path)


def node_cmd(
    kind: str, n: int, port: int, workdir: Path, i: int, script: Path, extra=(), host="127.0.0.1"
) -> list[str]:
    if kind == "elasticd":
        return [
            sys.executable,
            "-m",
            "elasticd",
            "run",
            "--nnodes",
            str(n),
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            f"{host}:{port}",
            "--rdzv-id",
            "bench",
            "--no-warm-spawn",
            "--log-dir",
            str(workdir / f"logs{i}"),
            "--socket",
            str(workdir / f"ctl{i}.sock"),
            "--no-tee",
            "--log-format",
            "json",
            "--join-timeout",
            "300",
            "--rdzv-secret-file",
            secret_file(workdir),
            *extra,
            str(script),
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(n),
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{host}:{port}",
        "--rdzv-id",
        "bench",
        "--rdzv-conf",
        # off loopback, torchrun guesses whether it hosts the store by matching the endpoint
        # against its host name's addresses, which a network namespace's own address is not
        # among: node 0 then never hosts it and every node times out; say which node hosts it
        "join_timeout=300" + ("" if host == "127.0.0.1" else f",is_host={i == 0}".lower()),
        str(script),
    ]


def rendezvous_once(kind: str, n: int, timeout: float) -> float | None:
    with tempfile.TemporaryDirectory(prefix=f"bench-rdzv-{kind}-") as tmp:
        workdir = Path(tmp)
        out = workdir / "ready.txt"
        env = dict(os.environ, BENCH_OUT=str(out))
        port = free_port()
        logs = [open(workdir / f"node{i}.log", "wb") for i in range(n)]
        t0 = time.time()
        procs = [
            subprocess.Popen(
                node_cmd(kind, n, port, workdir, i, TRIVIAL),
                env=env,
                stdout=logs[i],
                stderr=logs[i],
                cwd=HERE.parent,
                start_new_session=True,
            )
            for i in range(n)
        ]
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    rows = [line.split() for line in out.read_text().splitlines()]
                except OSError:
                    rows = []
                if len(rows) >= n:
                    return max(float(r[1]) for r in rows) - t0
                time.sleep(0.05)
            return None
        finally:
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    kill_tree(p)
            for f in logs:
                f.close()


def start_once(kind: str, timeout: float) -> tuple[float, float] | None:
    """(launch -> every rank past init_process_group, launch -> the launcher's exit) for one
    2-worker node, or None if it failed."""
    with tempfile.TemporaryDirectory(prefix=f"bench-start-{kind}-") as tmp:
        workdir = Path(tmp)
        out = workdir / "ready.txt"
        if kind == "elasticd":
            cmd = [sys.executable, "-m", "elasticd", "run", "--log-dir", str(workdir / "logs")]
            cmd += ["--socket", str(workdir / "ctl.sock")]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", str(TRIVIAL)]
        with open(workdir / "launcher.log", "wb") as log:
            t0 = time.time()
            p = subprocess.Popen(
                cmd,
                env=dict(os.environ, BENCH_OUT=str(out)),
                stdout=log,
                stderr=log,
                cwd=HERE.parent,
                start_new_session=True,
            )
            try:
                code = p.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(p)
                return None
            ended = time.time() - t0
        rows = [line.split() for line in out.read_text().splitlines()] if out.exists() else []
        if code != 0 or len(rows) < 2:
            return None
        return max(float(r[1]) for r in rows) - t0, ended


def start_table(trials: int, timeout: float) -> None:
    times: dict[str, list[tuple[float, float]]] = {"elasticd": [], "torchrun": []}
    for trial in range(trials):
        for kind in times:  # alternate, so drift hits both alike
            t = start_once(kind, timeout)
            print(f"  start {kind} trial {trial + 1}: {t if t else 'FAILED'}", flush=True)
            if t:
                times[kind].append(t)
    print(f"\none node, 2 workers, {os.cpu_count()} cores, median of {trials}")
    for i, what in enumerate(("launch -> every rank past init_process_group", "launch -> exit")):
        med = {k: statistics.median(t[i] for t in v) for k, v in times.items() if v}
        if len(med) == 2:
            print(
                f"{what}: elasticd {med['elasticd']:.2f} s, torchrun {med['torchrun']:.2f} s, "
                f"{med['elasticd'] / med['torchrun']:.2f}x"
            )


def state_time(log: Path, new: str) -> float | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"new": "{new}"' in line:
            e = json.loads(line)
            return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
    return None


def propagation_once(timeout: float) -> float | None:
    with tempfile.TemporaryDirectory(prefix="bench-prop-") as tmp:
        workdir = Path(tmp)
        out = workdir / "steps.txt"
        env = dict(os.environ, BENCH_OUT=str(out))
        port = free_port()
        logs = [workdir / f"node{i}.log" for i in range(2)]
        procs = []
        for i in range(2):
            with open(logs[i], "wb") as f:
                procs.append(
                    subprocess.Popen(
                        node_cmd(
                            "elasticd",
                            2,
                            port,
                            workdir,
                            i,
                            HERE / "step_logger.py",
                            ("--max-restarts", "3"),
                        ),
                        env=env,
                        stdout=f,
                        stderr=f,
                        cwd=HERE.parent,
                        start_new_session=True,
                    )
                )
        try:
            deadline = time.monotonic() + timeout
            while len(latest_pids(read_steps(out), 0)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            pids = latest_pids(read_steps(out), time.time() - 1)
            if len(pids) < 2:
                return None
            os.kill(pids[1], signal.SIGKILL)
            while time.monotonic() < deadline:
                times = [state_time(log, "RESTARTING") for log in logs]
                if all(times):
                    return abs(times[0] - times[1])
                time.sleep(0.05)
            return None
        finally:
            for p in procs:
                kill_tree(p)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,4,8,16")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--start", action="store_true", help="one node's start and exit instead")
    args = p.parse_args()
    if args.start:
        start_table(args.trials, min(args.timeout, 120.0))
        return
    sizes = [int(x) for x in args.nodes.split(",")]
    table: dict[tuple[str, int], list[float | None]] = {}
    for n in sizes:
        for trial in range(args.trials):
            for kind in ("elasticd", "torchrun"):  # alternate, so drift hits both alike
                t = rendezvous_once(kind, n, args.timeout)
                table.setdefault((kind, n), []).append(t)
                print(
                    f"  {n} nodes {kind} trial {trial + 1}: "
                    + (f"{t:.2f}s" if t is not None else "FAILED"),
                    flush=True,
                )
    prop = [propagation_once(120) for _ in range(args.trials)]
    print()
    print(
        f"launch -> every rank past init_process_group, 1 worker per simulated node, loopback, "
        f"{os.cpu_count()} cores, median of {args.trials}"
    )
    print(f"{'nodes':>5} {'elasticd s':>11} {'torchrun s':>11} {'ratio':>7}")
    for n in sizes:
        med = {}
        for kind in ("elasticd", "torchrun"):
            ok = [t for t in table[(kind, n)] if t is not None]
            med[kind] = statistics.median(ok) if ok else float("nan")
        fails = sum(t is None for k in ("elasticd", "torchrun") for t in table[(k, n)])
        print(
            f"{n:>5} {med['elasticd']:>11.2f} {med['torchrun']:>11.2f} "
            f"{med['elasticd'] / med['torchrun']:>6.2f}x" + (f"  ({fails} failed)" if fails else "")
        )
    ok = [t for t in prop if t is not None]
    print(
        "restart propagation (failing node RESTARTING -> healthy node RESTARTING), elasticd: "
        + (
            f"median {statistics.median(ok):.3f}s, max {max(ok):.3f}s ({len(ok)}/{len(prop)})"
            if ok
            else "FAILED"
        )
    )


if __name__ == "__main__":
    main()
