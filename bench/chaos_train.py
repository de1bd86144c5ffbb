"""The chaos benchmark's job: every piece of state a resume must get back, and a step log.

A small DDP MLP (FSDP2's fully_shard with CHAOS_SHARDED=1) with dropout, AdamW and a linear LR
warm-up, fed by a DataLoader with one worker process over a ResumableDistributedSampler, and a
numpy draw in every step's loss, checkpointed through elasticd.checkpoint (disk every
$CHAOS_CKPT_EVERY steps, in memory every step where the launcher offers it) and resumed from the
newest. After every step each rank appends `pid rank step wall_time` to $CHAOS_OUT
(O_APPEND lines, so ranks never tear each other's). Rank 0 saves the last step, whose model and
optimizer state the benchmark hashes.

$CHAOS_GATE names a file holding a step number the ranks wait (beating) before, so that the
benchmark paces the job and its faults never run out of steps or land while the job waits.
SIGTERM (the library's stop request) saves at the next step boundary; an unfinished job then
exits 143, so the launcher restarts it rather than taking the stop for success.
"""

import functools
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elasticd
from elasticd.checkpoint import CheckpointManager, capture, restore
from elasticd.sampler import ResumableDistributedSampler


def main() -> None:
    total = int(os.environ["CHAOS_STEPS"])
    delay = float(os.environ.get("CHAOS_STEP_DELAY", "0.02"))
    gate = os.environ.get("CHAOS_GATE", "")
    limit = 0
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    if os.environ.get("CHAOS_SHARDED") == "1":  # FSDP2: every rank holds its own shards
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))  # gloo on CPU, GPU or not
        for layer in (model[0], model[3], model):
            fully_shard(layer, mesh=mesh)
    else:
        model = DDP(model)
    torch.manual_seed(100 + rank)  # each rank's RNG differs: each must get its own back
    np.random.seed(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))  # warm-up
    sampler = ResumableDistributedSampler(data, num_replicas=world, rank=rank, seed=7)
    loader = DataLoader(
        data,
        batch_size=8,
        sampler=sampler,
        num_workers=1,
        persistent_workers=True,
        generator=torch.Generator(),
    )  # iterators must not draw from the global RNG
    mgr = CheckpointManager(
        os.environ["CHAOS_CKPT_DIR"],
        keep=2,
        every_steps=int(os.environ["CHAOS_CKPT_EVERY"]),
        memory_every=1,
    )
    state = mgr.load_latest()
    step = (
        restore(state, model=model, optimizer=opt, scheduler=sched, sampler=sampler)["step"]
        if state
        else 0
    )
    out = os.open(os.environ["CHAOS_OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    stopped = False
    while step < total and not stopped:
        sampler.set_epoch(sampler.epoch)  # the epoch in progress keeps its position after a resume
        for x, y in loader:
            while gate and step >= limit:
                limit = int(open(gate).read())  # written whole by os.replace
                if step >= limit:
                    elasticd.heartbeat()
                    time.sleep(0.01)
            loss = F.mse_loss(model(x), y) * (1.0 + 0.1 * float(np.random.rand()))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            sampler.advance(len(x))
            step += 1
            snapshot = functools.partial(
                capture, model=model, optimizer=opt, scheduler=sched, sampler=sampler, step=step
            )
            if step == total:
                mgr.save(step, snapshot)
            else:
                mgr.maybe_save(step, snapshot)
            os.write(out, f"{os.getpid()} {rank} {step} {time.time():.6f}\n".encode())
            stopped = mgr.should_stop()
            if step == total or stopped:
                break
            time.sleep(delay)
        else:
            sampler.set_epoch(sampler.epoch + 1)
    mgr.close()
    dist.destroy_process_group()
    if step < total:
        sys.exit(143)


if __name__ == "__main__":
    main()
