"""Real DDP training on synthetic data: what `elasticd run` trains with no arguments.

A small MLP learns a fixed random teacher network. No downloads; gloo on CPU, NCCL on GPUs, picked
automatically. It runs unchanged under torchrun too (it only reads torchrun's environment).

    elasticd run                                   # this script, one worker per GPU or 2 on CPU
    elasticd run entrypoints.train -- --steps 500  # longer
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--samples", type=int, default=8192, help="synthetic dataset size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def synthetic_dataset(n: int, dim: int = 32, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, 1, generator=g)
    y = torch.tanh(x @ teacher) + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main(argv=None) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    torch.manual_seed(args.seed)

    data = synthetic_dataset(args.samples)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = DDP(nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device),
                device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()

    if rank == 0:
        print(f"training: world size {world}, backend {dist.get_backend()}, {args.steps} steps, "
              f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
    step, epoch, t0, seen = 0, 0, time.perf_counter(), 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            seen += x.shape[0] * world
            if rank == 0 and (step % args.log_every == 0 or step == args.steps):
                elapsed = time.perf_counter() - t0
                print(f"step {step}/{args.steps} epoch {epoch} loss {loss.item():.4f} "
                      f"{seen / elapsed:.0f} samples/s", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    dist.barrier()
    if rank == 0:
        print(f"done: {step} steps in {time.perf_counter() - t0:.1f}s, final loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
