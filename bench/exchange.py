"""A sharded (FSDP2) resume from memory at another world size: the bytes each rank receives and
the time of load_latest() + restore(), on forked gloo ranks on CPU, each rank a node of its own
(its own memory directory in /dev/shm). The job trains one step of 4 square layers with Adam
(about --mb MB of state), refreshes the in-memory state and stops dead; then the next world
resumes from the slots: 1 -> 2 (a node joins: the new rank receives its shards) and 3 -> 2 (the
third node lost: its shards from the replica node 0 keeps).

    PYTHONPATH=. python bench/exchange.py --mb 75
    PYTHONPATH=<an older tree> python bench/exchange.py --mb 75   # the same, with its code

Bytes received are those memory.exchange counts (n/a where the code has no exchange).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


def sharded_job(rank: int, world: int, store: str, mems: list[str], mb: float, out: str):
    """This rank of the job, each rank a node of its own: (model, Adam, CheckpointManager
    refreshing the in-memory state every step into mems[rank], the model's width)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticd.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    url = f"file://{store}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    n = int(math.sqrt(mb * 1e6 / 4 / 3 / 4))  # 4 layers, fp32, parameters + 2 moments
    net = nn.Sequential(*[nn.Linear(n, n, bias=False) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world,))  # gloo on CPU, GPU or not
    for layer in (*net, net):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    mgr = CheckpointManager(
        str(Path(out).parent / "disk"),
        every_steps=0,
        handle_sigterm=False,
        memory_dir=mems[rank],
        memory_every=1,
    )
    return net, opt, mgr, n


def _rank(rank: int, world: int, store: str, mems: list[str], mb: float, out: str) -> None:
    from elasticd.checkpoint import capture, restore

    net, opt, mgr, n = sharded_job(rank, world, store, mems, mb, out)
    dist.barrier()
    t0 = time.perf_counter()
    state = mgr.load_latest()
    t1 = time.perf_counter()
    if state is not None:
        restore(state, model=net, optimizer=opt)
        ex = getattr(state["model"], "exchange", None)
        got = {"received": ex.received if ex is not None else None}
        got |= {"load_s": t1 - t0, "restore_s": time.perf_counter() - t1, "file": mgr.loaded.file}
        Path(f"{out}.{rank}").write_text(json.dumps(got))
        dist.barrier()
        os._exit(0)
    net(torch.randn(4, n)).sum().backward()
    opt.step()
    mgr.maybe_save(1, lambda: capture(model=net, optimizer=opt, step=1))
    mgr.wait()
    mgr._memory.ring.wait()  # the replica landed
    dist.barrier()
    os._exit(0)


def _world(world: int, mems: list[str], mb: float, out: str, work: Path) -> None:
    store = str(work / f"store-{time.monotonic_ns()}")
    run_ranks(world, _rank, world, store, mems, mb, out)


def run_ranks(world: int, target, *args) -> None:
    """Fork `world` ranks running target(rank, *args); each must exit 0 within 600 s."""
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=target, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise SystemExit(f"a rank failed: {p.exitcode}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=75.0)
    args = ap.parse_args(argv)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    for before, after in ((1, 2), (3, 2)):
        with tempfile.TemporaryDirectory(dir=shm) as tmp:
            work = Path(tmp)
            mems = [str(work / f"mem{i}") for i in range(max(before, after))]
            for m in mems:
                os.mkdir(m)
            _world(before, mems, args.mb, str(work / "first"), work)
            _world(after, mems, args.mb, str(work / "second"), work)
            got = [json.loads(Path(f"{work / 'second'}.{r}").read_text()) for r in range(after)]
            print(
                f"{before} -> {after}, {args.mb:g} MB: received "
                f"{[g['received'] for g in got]} bytes; load_latest "
                f"{max(g['load_s'] for g in got):.2f} s, restore "
                f"{max(g['restore_s'] for g in got):.2f} s (slowest rank); {got[0]['file']}"
            )
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
