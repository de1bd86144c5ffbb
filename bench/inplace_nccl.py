"""What a survivor's process sees on NCCL when a peer dies, and whether it can re-form its group in
place (`dist._reconfigure`, torch 2.14), measured against the cost of the process that replaces the
dead rank: the experiment issue 42's point 8 needs before elasticd builds in place on NCCL (today
an NCCL job falls back to the whole-group restart, with one line: worker/reconfigure.py `init`).

No launcher: this script is the parent and its own workers, so that nothing but NCCL and torch is
in the figures. Per trial, 2 ranks (one GPU each, or sharing the GPUs there are: each rank then a
host of its own to NCCL, NCCL_HOSTID, its traffic over sockets) form a group in the reconfigure
regime (`init_process_group(enable_reconfigure=True)`, then handles exchanged through a TCPStore,
as worker/reconfigure.py does) and all-reduce a tensor each step, reading it back (`.item()`) as
a training loop reads its loss. The parent SIGKILLs rank 1, announces generation 1 in the store
(as the daemon does), and starts a fresh rank 1 at once. What each trial reports:

- survivor: how it learned (the exception its collective raised, and when after the kill), or
  "stuck" if nothing ended its wait within --stuck-after s; with `--abort watcher` a thread of
  its own aborts the group as the generation is announced (what elasticd would do on NCCL,
  where a dead peer of the same host closes no socket the survivor reads); then the re-forming
  with the fresh rank (`_reconfigure`), its first all-reduce, and whether that summed right;
- replacement: its process start -> torch imported -> CUDA context -> group initialised ->
  formed -> first step: what the survivor did not pay again;
- exit codes: TORCH_NCCL_ASYNC_ERROR_HANDLING 3 (torch's default) ends a process whose NCCL
  communicator failed; 2 only aborts the communicator (--handling runs each value given).

    python bench/inplace_nccl.py                          # NCCL on a GPU node (bench/gpu.sh
                                                          # PARTS=inplace runs it)
    python bench/inplace_nccl.py --backend gloo --handling 3 --abort none   # the flow on CPU
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
import threading
import time
from datetime import timedelta

STEPS_BEFORE = 20  # steps every rank takes before the kill
STEPS_AFTER = 10  # steps after the re-forming, then the workers end


def say(**fields) -> None:
    """One JSON line to the parent: what happened, with this process's wall time."""
    print(json.dumps({"t": time.time(), **fields}), flush=True)


# --- a worker: one rank --------------------------------------------------------------------------


def handles_of(dist, store, generation: int, rank: int, world: int, wait_s: float) -> list[str]:
    """Every rank's reconfigure handle of `generation`, in rank order (this rank's published)."""
    store.set(f"g{generation}/h{rank}", dist._get_reconfigure_handle())
    keys = [f"g{generation}/h{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=wait_s))
    return [store.get(k).decode() for k in keys]


def form(dist, store, generation: int, rank: int, world: int, wait_s: float) -> None:
    handles = handles_of(dist, store, generation, rank, world, wait_s)
    uuid = 1000 + generation
    dist._reconfigure(uuid=uuid, handles=handles, timeout=timedelta(seconds=wait_s)).wait()


def abort_groups(dist) -> str:
    """Abort the default group (what worker/reconfigure.py `Member.abort` does after a gloo
    group's sockets are shut): '' or why it could not."""
    try:
        dist.distributed_c10d._get_default_group().abort()
        return ""
    except Exception as e:  # noqa: BLE001 - reported, the trial goes on
        return f"{type(e).__name__}: {e}"[:300]


def watch(dist, store, generation: int) -> None:
    """--abort watcher: wait for the generation's announcement, then abort the group from this
    thread while the main thread may be blocked in NCCL."""
    store.wait([f"announce/{generation}"], timedelta(seconds=120))
    say(event="announced_seen", generation=generation)
    why = abort_groups(dist)
    say(event="watcher_aborted", error=why)


def worker(args) -> None:
    began = time.time()
    import torch
    import torch.distributed as dist

    imported = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    generation = int(os.environ["PROBE_GEN"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    cuda = args.backend == "nccl"
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the CUDA context
    context = time.time()
    dist.init_process_group(
        args.backend,
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.pg_timeout),
        enable_reconfigure=True,
    )
    initialised = time.time()
    form(dist, store, generation, rank, world, args.pg_timeout)
    say(
        event="formed",
        rank=rank,
        generation=generation,
        pid=os.getpid(),
        phases={
            "import": imported - began,
            "context": context - imported,
            "init": initialised - context,
            "form": time.time() - initialised,
        },
    )
    if args.abort == "watcher" and generation == 0:
        threading.Thread(target=watch, args=(dist, store, 1), daemon=True).start()
    steps = STEPS_AFTER if generation > 0 else STEPS_BEFORE + 100_000
    for step in range(1, steps + 1):
        try:
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
            total = t.item()
        except Exception as e:  # noqa: BLE001 - a peer's going, as a survivor's script sees it
            say(event="unwound", rank=rank, error=f"{type(e).__name__}: {e}"[:400])
            break
        say(event="step", rank=rank, generation=generation, step=step, ok=total == world)
        time.sleep(args.step_time)
    else:
        dist.destroy_process_group()
        time.sleep(0.05)  # torch's teardown: as the bootstrap waits
        return
    # the survivor: re-form in place with the fresh rank, as worker/reconfigure.py `reenter` does
    aborted = abort_groups(dist)
    say(event="aborted", error=aborted)
    store.wait(["announce/1"], timedelta(seconds=60))
    form(dist, store, 1, rank, world, args.pg_timeout)
    say(event="reformed", rank=rank)
    for step in range(1, STEPS_AFTER + 1):
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        say(event="step", rank=rank, generation=1, step=step, ok=t.item() == world)
        time.sleep(args.step_time)
    dist.destroy_process_group()
    time.sleep(0.05)


# --- the parent: one trial per (handling, abort) -----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank:
    """A worker process and the JSON lines it said (read on a thread of its own)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.started = time.time()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        self.lines: list[dict] = []
        self.other: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                self.other.append(line.rstrip())

    def first(self, event: str, **match) -> dict | None:
        for e in list(self.lines):
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    def wait_for(self, event: str, seconds: float, **match) -> dict | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if (found := self.first(event, **match)) is not None:
                return found
            if self.proc.poll() is not None:
                time.sleep(0.2)  # its last lines
                return self.first(event, **match)
            time.sleep(0.01)
        return None

    def end(self, seconds: float) -> int | None:
        try:
            return self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


def trial(args, handling: str, abort: str, gpus: int) -> dict:
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
    base = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=handling,
    )

    def start(rank: int, generation: int) -> Rank:
        env = dict(base, RANK=str(rank), PROBE_GEN=str(generation))
        if args.backend == "nccl" and gpus < 2:  # ranks sharing a GPU: a host each to NCCL
            env.update(NCCL_HOSTID=f"{socket.gethostname()}-probe{rank}-{generation}")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        argv = [sys.executable, __file__, "--worker", "--backend", args.backend]
        argv += ["--abort", abort, "--step-time", str(args.step_time)]
        argv += ["--pg-timeout", str(args.pg_timeout)]
        return Rank(argv, env)

    result: dict = {"handling": handling, "abort": abort}
    survivor, doomed = start(0, 0), start(1, 0)
    ranks = [survivor, doomed]
    try:
        if survivor.wait_for("step", 120, step=STEPS_BEFORE) is None:
            result["outcome"] = "the group never stepped: " + " | ".join(survivor.other[-3:])
            return result
        killed = time.time()
        os.kill(doomed.proc.pid, signal.SIGKILL)
        store.set("announce/1", "1")
        fresh = start(1, 1)
        ranks.append(fresh)
        unwound = survivor.wait_for("unwound", args.stuck_after)
        seen = survivor.first("announced_seen")
        result["watcher_saw_announcement_s"] = round(seen["t"] - killed, 4) if seen else None
        if unwound is None:
            code = survivor.proc.poll()
            result["outcome"] = (
                f"exited {code} without unwinding"
                if code is not None
                else (f"stuck: no error in {args.stuck_after:g} s")
            )
            return result
        result["unwound_s"] = round(unwound["t"] - killed, 4)
        result["error"] = unwound["error"]
        reformed = survivor.wait_for("reformed", 30)
        if reformed is None:
            code = survivor.proc.poll()
            result["outcome"] = f"did not re-form (exit {code})"
            return result
        result["reformed_s"] = round(reformed["t"] - killed, 4)
        first = survivor.wait_for("step", 30, generation=1, step=1)
        if first is not None:
            result["first_step_s"] = round(first["t"] - killed, 4)
        formed = fresh.wait_for("formed", 30)
        if formed is not None:
            result["replacement"] = {k: round(v, 4) for k, v in formed["phases"].items()}
            result["replacement"]["start_to_formed"] = round(formed["t"] - fresh.started, 4)
        codes = [r.end(30) for r in (survivor, fresh)]
        result["exit_codes"] = codes
        after = [e for e in survivor.lines if e.get("event") == "step" and e["generation"] == 1]
        result["summed_right"] = len(after) == STEPS_AFTER and all(e["ok"] for e in after)
        result["outcome"] = "re-formed in place" if codes == [0, 0] else f"exits {codes}"
        return result
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--handling", default="3,2", help="TORCH_NCCL_ASYNC_ERROR_HANDLING values")
    p.add_argument("--abort", default="none,watcher", help="none, watcher: comma-separated")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--stuck-after", type=float, default=20.0)
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    import torch

    gpus = torch.cuda.device_count() if args.backend == "nccl" else 0
    if args.backend == "nccl" and gpus == 0:
        sys.exit("bench/inplace_nccl.py: --backend nccl needs a GPU; --backend gloo runs on CPU")
    print(f"torch {torch.__version__}, {args.backend}, {gpus} GPUs", flush=True)
    if gpus:
        print("nccl", ".".join(map(str, torch.cuda.nccl.version())), flush=True)
    rows = []
    for handling in args.handling.split(","):
        for abort in args.abort.split(","):
            for _ in range(args.trials):
                row = trial(args, handling, abort, gpus)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\nhandling abort   outcome (unwound / re-formed / first step after the kill)")
    for handling in args.handling.split(","):
        for abort in args.abort.split(","):
            mine = [r for r in rows if r["handling"] == handling and r["abort"] == abort]
            done = [r for r in mine if "first_step_s" in r]
            med = statistics.median([r["first_step_s"] for r in done]) if done else None
            print(
                f"{handling:>8} {abort:<8} {len(done)}/{len(mine)} re-formed in place"
                + (f", first step {med:.3f} s after the kill (median)" if med else "")
                + "; " + "; ".join(sorted({r.get("outcome", "?") for r in mine}))
            )  # fmt: skip


if __name__ == "__main__":
    main()
