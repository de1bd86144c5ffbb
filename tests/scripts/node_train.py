"""The node-loss tests' job: DDP (or FSDP2 with NODE_TRAIN_FSDP=1) through elasticd.checkpoint
(disk every 100 steps, in memory as the library's cadence decides) and the resumable sampler.
Every step prints `step N world W t WALL samples I,J,...` (the sample indices this rank drew),
and a resume prints `resumed at step N` first, so a test can tell the steps lost and that every
sample of an epoch was seen exactly once.

NODE_TRAIN_WHOLE=1: the sampler is told the batch size and the DataLoader drops partial batches
(drop_last=True), and each step also prints `step N epochs E,F,...`, the epoch of each of its
samples (`sampler.trained()`: the last global batch of an epoch the world changed in may hold the
next epoch's first samples). NODE_TRAIN_MEMORY_EVERY=K: the in-memory state every K steps (1: a
stop held at a step resumes from that very step). NODE_TRAIN_HOLD="S1,S2,...:PREFIX": after step
Si the rank waits (at most 60 s) until the file PREFIXSi exists, or a stop is asked, so a test can
act at that very step."""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from elasticd.checkpoint import CheckpointManager, capture, restore
from elasticd.checkpoint.stop import stop_requested
from elasticd.sampler import ResumableDistributedSampler


class Indexed(Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def hold(step: int) -> None:
    at, _, prefix = os.environ.get("NODE_TRAIN_HOLD", "").partition(":")
    if str(step) in at.split(","):
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{prefix}{step}") and not stop_requested():
            if time.monotonic() > deadline:
                sys.exit(f"held at step {step} for 60 s: the test never released it")
            time.sleep(0.02)


def main() -> None:
    total, delay = int(sys.argv[1]), float(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Indexed(int(os.environ.get("NODE_TRAIN_SAMPLES", "1024")))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    if os.environ.get("NODE_TRAIN_FSDP"):  # sharded with FSDP2 instead of replicated
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))  # gloo on CPU, GPU or not
        for layer in (net[0], net[2], net):
            fully_shard(layer, mesh=mesh)
        model = net
    else:
        model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    whole = bool(os.environ.get("NODE_TRAIN_WHOLE"))
    sampler = ResumableDistributedSampler(
        data, num_replicas=world, rank=rank, seed=7, batch_size=4 if whole else None
    )
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=whole)
    every = os.environ.get("NODE_TRAIN_MEMORY_EVERY")
    mgr = CheckpointManager(keep=2, every_steps=100, memory_every=int(every) if every else None)
    state = mgr.load_latest()
    step = restore(state, model=model, optimizer=opt, sampler=sampler)["step"] if state else 0
    print(f"resumed at step {step} world {world}", flush=True)
    while step < total:
        sampler.set_epoch(sampler.epoch)
        for x, y, idx in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sampler.advance(len(x))
            step += 1
            if whole:
                epochs = ",".join(map(str, sampler.trained()[1]))
                print(f"step {step} epochs {epochs}", flush=True)
            mgr.maybe_save(
                step, lambda: capture(model=model, optimizer=opt, sampler=sampler, step=step)
            )
            print(
                f"step {step} world {world} t {time.time():.3f} epoch {sampler.epoch} samples "
                f"{','.join(str(int(i)) for i in idx)}",
                flush=True,
            )
            hold(step)
            if step >= total or mgr.should_stop():
                break
            time.sleep(delay)
        else:
            sampler.set_epoch(sampler.epoch + 1)
            continue
        break  # the last step, or a stop (SIGTERM): saved, so leave the epoch loop too
    mgr.close()
    dist.destroy_process_group()
    sys.exit(0 if step >= total else 143)


if __name__ == "__main__":
    main()
