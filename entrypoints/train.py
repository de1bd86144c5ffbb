"""Real DDP training on synthetic data: what `elasticd run` trains with no arguments.

A small MLP learns a fixed random teacher network. No downloads; NCCL on GPUs when there is one
for every local worker, else gloo on CPU (`--device` forces either). Every optimizer step trains on
the same `--global-batch` samples whatever the world size (elasticd.global_batch: each rank
accumulates micro-batches of at most `--batch-size`), so a job that loses or gains nodes keeps its
trajectory; `--exact` makes it bit-identical across world changes. It checkpoints with
elasticd.checkpoint and resumes exactly where it stopped (model, optimizer, scheduler, RNG, data
position), so a crash costs at most `--checkpoint-every` steps, and `elasticd stop` (SIGTERM)
saves at the next step boundary and exits 0. It runs unchanged under torchrun too (it only reads
torchrun's environment).

    elasticd run                                   # this script, one worker per GPU or 2 on CPU
    elasticd run entrypoints.train -- --steps 500  # longer
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elasticd.checkpoint import CheckpointManager, capture, restore
from elasticd.global_batch import GlobalBatch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="micro-batch: the most samples one rank computes in one forward/backward",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=128,
        help="samples per optimizer step, whatever the world size (each rank accumulates "
        "micro-batches of at most --batch-size)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="bit-identical across world-size changes (elasticd.exact; slower past one rank)",
    )
    p.add_argument("--samples", type=int, default=8192, help="synthetic dataset size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="default: $ELASTICD_CHECKPOINT_DIR (set by elasticd), else ./checkpoints",
    )
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument(
        "--memory-every",
        type=int,
        default=None,
        help="under elasticd, refresh the in-memory state every N steps (default: as often as "
        "keeps it under 1%% of step time)",
    )
    p.add_argument(
        "--step-delay", type=float, default=0.0, help="sleep per step, to watch recovery"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: one GPU per local worker (NCCL) when there are enough, else CPU (gloo)",
    )
    return p.parse_args(argv)


def pick_device(choice: str, local_rank: int, local_world: int) -> torch.device:
    """A GPU per local rank with NCCL, or the CPU with gloo: never two ranks on one GPU, which
    NCCL refuses."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and gpus < local_world:
        raise SystemExit(
            f"--device cuda needs one GPU per local worker: {local_world} workers, {gpus} GPUs "
            "visible; give --nproc-per-node gpu or --device cpu"
        )
    if choice == "cuda" or (choice == "auto" and 0 < local_world <= gpus):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synthetic_dataset(n: int, dim: int = 32, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, 1, generator=g)
    y = torch.tanh(x @ teacher) + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main(argv=None) -> None:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(args.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    data = synthetic_dataset(args.samples)
    gb = GlobalBatch(data, args.global_batch, args.batch_size, seed=args.seed, exact=args.exact)
    loader = DataLoader(data, batch_sampler=gb)
    model = DDP(
        nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device),
        device_ids=[local_rank] if use_cuda else None,
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loss_fn = nn.MSELoss()

    ckpt_dir = args.checkpoint_dir or os.environ.get("ELASTICD_CHECKPOINT_DIR") or "checkpoints"
    mgr = CheckpointManager(
        ckpt_dir, keep=3, every_steps=args.checkpoint_every, memory_every=args.memory_every
    )
    state = mgr.load_latest()
    step = (
        restore(state, model=model, optimizer=opt, scheduler=sched, sampler=gb)["step"]
        if state
        else 0
    )
    if rank == 0:
        print(
            f"training: world size {world}, backend {dist.get_backend()}, "
            f"steps {step}->{args.steps}, "
            f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            + (f", resumed from step {step}" if state else ""),
            flush=True,
        )

    t0, seen, stopped = time.perf_counter(), 0, False
    loss = torch.zeros(())
    batches = iter(loader)  # after restore(): it deals from the restored position
    while step < args.steps and not stopped:
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)
        for mb, (x, y) in gb.micro_batches(model, batches):  # gradient accumulation
            part = loss_fn(model(x.to(device)), y.to(device))
            (part * mb.scale).backward()  # the step's gradient: the mean over the global batch
            loss += part.detach() * mb.size / max(1, gb.plan.samples(rank))  # this rank's mean
        opt.step()
        sched.step()  # the schedule counts optimizer steps
        step += 1
        seen += args.global_batch
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(
                f"step {step}/{args.steps} epoch {gb.epoch} loss {loss.item():.4f} "
                f"{seen / (time.perf_counter() - t0):.0f} samples/s",
                flush=True,
            )
        final = step >= args.steps
        snapshot = functools.partial(
            capture, model=model, optimizer=opt, scheduler=sched, sampler=gb, step=step
        )
        if final:
            mgr.save(step, snapshot, epoch=gb.epoch)
        else:
            mgr.maybe_save(step, snapshot, epoch=gb.epoch)  # at an optimizer step's boundary
        if mgr.should_stop():  # SIGTERM: elasticd stop / systemctl stop; maybe_save saved this step
            stopped = True
            if rank == 0:
                print(f"stopping at step {step} on request; checkpoint saved", flush=True)
        elif args.step_delay and not final:
            time.sleep(args.step_delay)
    mgr.close()
    if rank == 0 and not stopped:
        print(
            f"done: {step} steps in {time.perf_counter() - t0:.1f}s, final loss {loss.item():.4f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
