"""What the checkpoint tests run in separate processes: forked ranks joined by gloo on CPU.

Fork (not spawn): the test process has torch imported already, so a rank starts in milliseconds.
Every child runs with one intra-op thread, is joined with a deadline, and is killed if late.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch._dynamo  # DDP's constructor imports it: once here, not in every fork
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elasticd import checkpoint
from elasticd.checkpoint import CheckpointManager, capture, collectives, restore
from elasticd.sampler import ResumableDistributedSampler
from scripts.exact_job import exact_step

_fork = multiprocessing.get_context("fork")


def _child(target, rank: int, world: int, store: str | None, args: tuple) -> None:
    code = 0
    try:
        # gloo ranks on the CPU, GPU or not: without this torch picks CUDA where one exists
        # (FSDP2's default mesh, DCP's loader, Adam's graph-capture check)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(1)
        if store is not None:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
            )
            dist.init_process_group(
                "gloo",
                init_method=f"file://{store}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=30),
            )
        target(rank, world, *args)
        if store is not None:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the exit status
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start(target, world: int, tmp: Path, *args, distributed: bool = True) -> list:
    """Fork `world` ranks running target(rank, world, *args); gloo-initialized if distributed."""
    store = None
    if distributed:
        store = str(tmp / f"store-{time.monotonic_ns()}")
    procs = [
        _fork.Process(target=_child, args=(target, r, world, store, args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def join(procs, timeout: float) -> list[int]:
    """Exit codes; any rank still running at the deadline is SIGKILLed (and the test fails)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [p for p in procs if p.is_alive()]
    for p in late:
        p.kill()
        p.join(5)
    assert not late, f"ranks still running after {timeout}s: {[p.pid for p in late]}"
    return [p.exitcode for p in procs]


def run(
    target, world: int, tmp: Path, *args, timeout: float = 60, distributed: bool = True
) -> None:
    codes = join(start(target, world, tmp, *args, distributed=distributed), timeout)
    assert codes == [0] * world, f"exit codes {codes}"


# -- a deterministic training loop ----------------------------------------------------------------


def train(
    rank: int,
    world: int,
    directory: str,
    total: int,
    out: str | None,
    crash_after: int | None,
    every_steps: int = 4,
    rng: bool = True,
    memory_dir: str | None = None,
) -> None:
    """Tiny regression with dropout, SGD+momentum, StepLR, python/numpy/torch RNG all in the
    gradients, a ResumableDistributedSampler and a DataLoader; resumes from `directory`.

    With crash_after it stops dead after that step (os._exit, no final save): a crash."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(44, 6, generator=g), torch.randn(44, 1, generator=g))
    model: nn.Module = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    if dist.is_initialized():
        model = DDP(model)
    torch.manual_seed(100 + rank)  # each rank's RNG differs: each must get its own back
    random.seed(rank)
    np.random.seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    sampler = ResumableDistributedSampler(data, num_replicas=world, rank=rank, seed=7)
    # generator=: iterator creation must not draw from the global RNG, or a resumed run (which
    # creates its iterator at a different point) diverges.
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    mgr = CheckpointManager(
        directory,
        keep=2,
        every_steps=every_steps,
        handle_sigterm=False,
        memory_dir=memory_dir,
        memory_every=1,
    )  # a tight loop: the cost budget would space the refreshes out
    step = 0
    state = mgr.load_latest()
    if state is not None:
        step = restore(
            state, model=model, optimizer=opt, scheduler=sched, sampler=sampler, rng=rng
        )["step"]
    epoch = sampler.epoch
    while step < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            step = exact_step(model, opt, sched, sampler, mgr, x, y, step)
            if step == crash_after:
                mgr.wait()
                if dist.is_initialized():
                    os._exit(0)
                return
            if step >= total:
                break
        epoch += 1
    mgr.close()
    if out is not None:
        inner = model.module if isinstance(model, DDP) else model
        loaded = mgr.loaded and {"file": mgr.loaded.file, "step": mgr.loaded.step}
        torch.save(
            {
                "model": inner.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "loaded": loaded,
            },
            f"{out}.{rank}.pt",
        )


# -- nodes lost and added --------------------------------------------------------------------------


def train_on_nodes(
    rank: int,
    world: int,
    nodes: list[dict],
    total: int,
    crash_after: int | None,
    out: str,
    every: int = 3,
    samples: int = 96,
    sharded: bool = False,
) -> None:
    """`train`'s loop for a job spread over simulated nodes: each node {"mem", "disk", "ranks"} has
    its own memory directory (the daemon's) and disk directory (no shared filesystem), and runs
    the global ranks listed, as local ranks 0, 1, ... Disk checkpoints every 5 steps, the
    in-memory state every `every`. Each sample's index is recorded per step (`out`.idx.RANK), the
    state right after loading (`out`.loaded.RANK) and at every refresh (`out`.sSTEP.RANK). With
    crash_after every rank stops dead after that step. `sharded`: the model is FSDP2's
    (fully_shard), its recorded states gathered whole (give every node the same disk)."""
    from elasticd.checkpoint import rng as rng_state

    node = next(n for n in nodes if rank in n["ranks"])
    os.environ.update(
        LOCAL_RANK=str(node["ranks"].index(rank)), LOCAL_WORLD_SIZE=str(len(node["ranks"]))
    )
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(samples, 6, generator=g),
        torch.randn(samples, 1, generator=g),
        torch.arange(samples),
    )
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))  # the default mesh is CUDA's where one exists
        for layer in (net[0], net[3], net):
            fully_shard(layer, mesh=mesh)
    model = net if sharded else DDP(net)
    torch.manual_seed(100 + rank)
    random.seed(rank)
    np.random.seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stepped = [0]  # the optimizer's steps, a resume's own among them (torch's zero-gradient one)
    opt.register_step_pre_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
    sampler = ResumableDistributedSampler(data, num_replicas=world, rank=rank, seed=7)
    loader = DataLoader(data, batch_size=2, sampler=sampler, generator=torch.Generator())
    mgr = CheckpointManager(
        node["disk"],
        keep=2,
        every_steps=5,
        handle_sigterm=False,
        memory_dir=node["mem"],
        memory_every=every,
    )

    def held(**extra) -> dict:
        if sharded:  # gathered whole, the optimizer keyed by parameter name (a collective)
            from torch.distributed.checkpoint import state_dict as sd

            full = sd.StateDictOptions(full_state_dict=True)
            msd, osd = sd.get_state_dict(model, opt, options=full)
        else:
            msd, osd = model.module.state_dict(), opt.state_dict()
        return {"model": msd, "optimizer": osd, "rng": rng_state.get_state(), **extra}

    step = 0
    state = mgr.load_latest()
    if state is not None:
        step = restore(state, model=model, optimizer=opt, sampler=sampler)["step"]
    loading_steps = stepped[0]
    torch.save(
        held(file=mgr.loaded and mgr.loaded.file, step=step, loading_steps=loading_steps),
        f"{out}.loaded.{rank}",
    )
    seen: list = []
    while step < total and not (crash_after and step >= crash_after):
        sampler.set_epoch(sampler.epoch)
        for x, y, i in loader:
            step = exact_step(model, opt, None, sampler, mgr, x, y, step)
            seen.append([step, sampler.epoch, i.tolist()])
            if step % every == 0:
                torch.save(held(), f"{out}.s{step}.{rank}")
            if step >= total or step == crash_after:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    mgr.wait()
    Path(f"{out}.idx.{rank}").write_text(repr(seen))
    if crash_after:
        # the step's in-memory exchange lands first (close saves nothing): its replica on the
        # next node is there, as the tests of "a crash after step N" read it (in flight, a
        # loaded machine's exit beat it now and then: CI, the tampered-replica test)
        mgr.close()
        os._exit(0)  # no final save, no teardown: a crash
    mgr.close()


def load_on_own_nodes(rank: int, world: int, mems: list[str], disk: str, out: str) -> None:
    """Every rank a node of its own with memory directory mems[rank]: what load_latest gives."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    mgr = CheckpointManager(disk, handle_sigterm=False, memory_dir=mems[rank], memory_every=1)
    state = mgr.load_latest()
    torch.save({"state": state, "file": mgr.loaded and mgr.loaded.file}, f"{out}.{rank}")


# -- crash-at-any-instant writer ------------------------------------------------------------------


def save_forever(directory: str) -> None:
    """Saves ~1 MiB checkpoints back to back until killed; each is internally consistent."""
    torch.set_num_threads(1)
    mgr = CheckpointManager(directory, keep=2, handle_sigterm=False)
    step = 0
    info = mgr.load_latest()
    if info is not None:
        step = info["step"]
    while True:
        step += 1
        mgr.save(step, {"step": step, "w": torch.full((256, 1024), float(step)), "tag": f"s{step}"})


def start_saver(directory: str):
    p = _fork.Process(target=save_forever, args=(directory,))
    p.start()
    return p


# -- disk full ------------------------------------------------------------------------------------


def fill_disk(rank: int, world: int, directory: str, result: str) -> None:
    """Saves step 1, then step 2 under RLIMIT_FSIZE (writes fail with EFBIG, as on a full disk),
    then step 3 with the limit lifted again."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of EFBIG
    mgr = CheckpointManager(directory, handle_sigterm=False)
    mgr.save(1, {"step": 1, "w": torch.ones(10)})
    mgr.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    stall = mgr.save(2, {"step": 2, "w": torch.ones(256, 1024)})  # 1 MiB: over the limit
    message = "no error"
    try:
        mgr.wait()
    except Exception as e:  # noqa: BLE001
        message = f"{type(e).__name__}: {e}"
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after_error = sorted(os.listdir(directory))
    latest = checkpoint.load_latest(directory)["step"]
    Path(result).write_text(
        repr({"message": message, "stall": stall, "files": after_error, "latest": latest})
    )
    mgr.save(3, {"step": 3, "w": torch.ones(256, 1024)})
    mgr.close()


# -- distributed load ------------------------------------------------------------------------------


def load_from(
    rank: int, world: int, dirs_per_scenario: list[list[str]], out: str, like_nccl: bool = False
) -> None:
    """For each scenario, this rank loads from its own directory; saves what it got.

    like_nccl: the default group claims another backend, so our traffic takes a gloo group."""
    os.environ["LOCAL_RANK"] = "0"  # every rank is a node of its own
    if like_nccl:
        dist.get_backend = lambda group=None: "nccl"
    got = []
    for dirs in dirs_per_scenario:
        mgr = CheckpointManager(dirs[rank], handle_sigterm=False)
        state = mgr.load_latest()
        got.append({"state": state, "file": mgr.loaded.file if mgr.loaded else None})
    if like_nccl:
        assert len(collectives._cpu_groups) == 1
    torch.save(got, f"{out}.{rank}.pt")


def gather_rng(rank: int, world: int, out: str) -> None:
    """capture() on every rank; rank 0's result carries every rank's RNG state."""
    torch.manual_seed(10 + rank)
    state = capture(step=3)
    expected = torch.rand(4)  # what this rank draws next
    torch.save({"state": state, "next": expected}, f"{out}.{rank}.pt")


# -- SIGTERM at one rank ---------------------------------------------------------------------------


def until_stopped(rank: int, world: int, directory: str, progress: str, out: str) -> None:
    """A loop that only saves when asked to stop; rank 1 reports its step for the test."""
    mgr = CheckpointManager(directory, every_steps=None, stop_timeout=30)
    w = torch.zeros(3)
    step = 0
    while step < 3000:
        t = torch.ones(3)
        dist.all_reduce(t)
        w += t
        step += 1
        mgr.maybe_save(step, lambda: capture(step=step, w=w))
        if mgr.should_stop():
            break
        if rank == 1:
            Path(progress).write_text(str(step))
        time.sleep(0.005)
    mgr.close()
    Path(f"{out}.{rank}").write_text(str(step))


def stuck_after_sigterm(rank: int, world: int, progress: str) -> None:
    """Reaches a few step boundaries, then blocks where no boundary comes (a hung collective)."""
    mgr = CheckpointManager(os.path.dirname(progress), stop_timeout=0.5)
    for step in range(5):
        mgr.maybe_save(step, {})
        time.sleep(0.01)
    Path(progress).write_text("blocked")
    time.sleep(30)


# -- in-memory state --------------------------------------------------------------------------


def refresh_memory_forever(rank: int, world: int, directory: str) -> None:
    """Resumes from the newest step in memory, as a restarted worker does, then refreshes the
    in-memory state back to back with 8 MiB of tensors that all equal the step, so that a SIGKILL
    at a random instant lands mid-copy most of the time."""
    from elasticd.checkpoint.memory import slots
    from elasticd.checkpoint.memory.writer import Writer

    held = slots.steps(directory, world=1, rank=0, local_rank=0)
    writer = Writer(directory, 0, keep=(held[0], 0) if held else None)
    w = torch.empty(2048, 1024)
    for step in range((held[0] if held else 0) + 1, 10**9):
        w.fill_(float(step))
        writer.write(
            step,
            {
                "model": {"w": w, "b": torch.full((3,), step)},
                "user": {"step": step},
                "rng": {"world_size": 1, "ranks": [{"torch": torch.full((5,), step)}]},
            },
            world=1,
            rank=0,
        )


def memory_on_full_tmpfs(rank: int, world: int, disk: str, mem: str, result: str) -> None:
    """Refreshes the in-memory state under RLIMIT_FSIZE (reserving a slot fails with EFBIG, as on
    a full tmpfs): it must turn itself off with a warning while disk checkpoints go on."""
    import resource

    import structlog

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(
        resource.RLIMIT_FSIZE, (32 * 1024, hard)
    )  # a disk checkpoint fits, a slot does not
    model = torch.nn.Linear(3, 1)
    with structlog.testing.capture_logs() as logs:
        mgr = CheckpointManager(disk, handle_sigterm=False, memory_dir=mem, every_steps=2)
        for step in range(1, 5):
            mgr.maybe_save(step, lambda: capture(model=model, step=step))
        mgr.close()
    Path(result).write_text(
        repr(
            {
                "memory_every": mgr.memory_every,
                "disk": checkpoint.latest_info(disk)["step"],
                "warnings": [e for e in logs if e["event"] == "memory_state_off"],
            }
        )
    )


def memory_cadence(rank: int, world: int, disk: str, mem: str, result: str) -> None:
    """Trains on 2 ms steps with a 32 MiB model, so only local rank 0's refresh (the whole state)
    is costly; the others hold their RNG only. The cadence the ranks settle on must be one."""
    import structlog

    model = torch.nn.Linear(2048, 4096, bias=False)
    with structlog.testing.capture_logs() as logs:
        mgr = CheckpointManager(disk, handle_sigterm=False, memory_dir=mem)
        for step in range(1, 121):
            time.sleep(0.002)
            mgr.maybe_save(step, lambda: capture(model=model, step=step))
        mgr.close()
    Path(f"{result}.{rank}").write_text(
        repr(
            {
                "every": mgr.memory_every,
                "events": [e for e in logs if e["event"] == "memory_cadence"],
            }
        )
    )
