"""The benchmark's training script, the same for elasticd and torchrun.

A small DDP model trained on synthetic data (64 -> $BENCH_WIDTH (256) x $BENCH_DEPTH (1) -> 1, batch
$BENCH_BATCH (32)); BENCH_WIDTH=1024 BENCH_DEPTH=3 BENCH_BATCH=256 gives a step with real compute;
after every optimizer step each rank appends `pid rank restart step wall_time` to $BENCH_OUT
(O_APPEND lines, so concurrent ranks never tear).
When the file $BENCH_HANG_FLAG.<rank> appears, that rank deletes it and, by what the file says:
spins forever (empty), sleeps in `read_batch` outside any collective while the others wait in
DDP's all_reduce (`sleep`), or calls all_gather while the others wait in that all_reduce, a
desync (`all_gather`); gloo leaves both waiting. BENCH_JITTER=MEDIAN,SIGMA adds to every step
of every rank a sleep drawn from a log-normal distribution (seconds; a heavy tail), and
BENCH_STEPS ends the run after that many steps.
BENCH_DEVICE=cuda trains on the local rank's GPU with NCCL (one GPU per local rank) and waits for
each step's kernels before logging it, so the logged time is the step's, not its launch's.

With $BENCH_CKPT_DIR it checkpoints through elasticd.checkpoint, the same code under either
launcher: to disk every $BENCH_CKPT_EVERY steps, and, where the launcher offers a shared-memory
directory (elasticd's ELASTICD_MEMORY_DIR), in memory at the library's default cadence or every
$BENCH_MEMORY_EVERY steps (BENCH_MEMORY_OVERLAP=0: memory_overlap=False, GPU tensors copied at
once). It resumes from the newest.
With BENCH_CKPT_MODE=handwritten it does what a torchrun tutorial does instead: rank 0
torch.saves model, optimizer and step to one file every $BENCH_CKPT_EVERY steps (to a temporary
file renamed into place), and every rank torch.loads it at start.
"""

import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def read_batch():
    """A data read that never returns (the flag's `sleep`)."""
    while True:
        time.sleep(3600)


def inject(flag: str) -> None:
    """The fault the flag file names (see the docstring); it never returns."""
    with open(flag) as f:
        fault = f.read().strip()
    os.unlink(flag)
    if fault == "sleep":
        read_batch()
    if fault == "all_gather":  # the others are in the step's all_reduce: gloo waits for ever
        dist.all_gather([torch.zeros(4) for _ in range(dist.get_world_size())], torch.ones(4))
    while True:  # an endless loop in Python, as a stuck data pipeline would be
        pass


def main():
    cuda = os.environ.get("BENCH_DEVICE", "cpu") == "cuda"
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    width = int(os.environ.get("BENCH_WIDTH", "256"))  # bigger: a step with real compute
    depth = int(os.environ.get("BENCH_DEPTH", "1"))
    batch = int(os.environ.get("BENCH_BATCH", "32"))
    dims = [64] + [width] * depth
    layers = [m for a, b in zip(dims, dims[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    model = DDP(
        nn.Sequential(*layers, nn.Linear(width, 1)).to(device),
        device_ids=[device.index] if cuda else None,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 64, device=device), torch.randn(batch, 1, device=device)
    mgr, first, snapshot = None, 1, None
    every = int(os.environ.get("BENCH_CKPT_EVERY", "50"))
    if os.environ.get("BENCH_CKPT_DIR") and os.environ.get("BENCH_CKPT_MODE") == "handwritten":
        os.makedirs(os.environ["BENCH_CKPT_DIR"], exist_ok=True)
        snapshot = os.path.join(os.environ["BENCH_CKPT_DIR"], "snapshot.pt")
        if os.path.exists(snapshot):
            state = torch.load(snapshot, map_location="cpu", weights_only=True)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            first = state["step"] + 1
    elif os.environ.get("BENCH_CKPT_DIR"):
        from elasticd.checkpoint import CheckpointManager, capture, restore

        memory_every = (
            int(os.environ.get("BENCH_MEMORY_EVERY") or 0) or None
        )  # None: the library's default
        mgr = CheckpointManager(
            os.environ["BENCH_CKPT_DIR"],
            keep=2,
            every_steps=every,
            memory_every=memory_every,
            memory_overlap=os.environ.get("BENCH_MEMORY_OVERLAP") != "0",
        )
        state = mgr.load_latest()
        if state is not None:
            first = restore(state, model=model, optimizer=opt)["step"] + 1
    out = os.open(os.environ["BENCH_OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    step_time = float(os.environ.get("BENCH_STEP_TIME", "0.02"))
    steps = int(os.environ.get("BENCH_STEPS", "1000000"))
    hang_flag = os.environ.get("BENCH_HANG_FLAG", "")
    # BENCH_JITTER=MEDIAN,SIGMA: each step of each rank sleeps a log-normal extra (a heavy tail)
    jitter = [float(x) for x in os.environ.get("BENCH_JITTER", "").split(",") if x]
    rng = random.Random(rank)
    for step in range(first, steps + 1):
        if jitter:
            time.sleep(jitter[0] * rng.lognormvariate(0.0, jitter[1]))
        if hang_flag and os.path.exists(f"{hang_flag}.{rank}"):
            inject(f"{hang_flag}.{rank}")
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if mgr is not None:
            mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, step=step))
        elif snapshot and rank == 0 and step % every == 0:
            torch.save(
                {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                snapshot + ".tmp",
            )
            os.replace(snapshot + ".tmp", snapshot)
        os.write(out, f"{os.getpid()} {rank} {restart} {step} {time.time():.6f}\n".encode())
        time.sleep(step_time)
    if mgr is not None:
        mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
