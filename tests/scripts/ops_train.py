"""DDP training with elasticd.checkpoint, for the operability tests: prints `step N` per step and
`resumed at step S` after loading; `--slow-rank R --slow S` makes rank R sleep S seconds per step
before its forward (a straggler: a slow data loader, a noisy neighbour)."""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from elasticd.checkpoint import CheckpointManager, capture, restore


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--memory-every", type=int, default=None, help="0: no in-memory state")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mgr = CheckpointManager(every_steps=args.checkpoint_every, memory_every=args.memory_every)
    state = mgr.load_latest()
    step = restore(state, model=model, optimizer=opt)["step"] if state else 0
    print(f"resumed at step {step}", flush=True)
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    while step < args.steps:
        if rank == args.slow_rank:
            time.sleep(args.slow)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        print(f"step {step}", flush=True)
        mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, step=step))
        if mgr.should_stop():
            break
        time.sleep(args.step_time)
    mgr.close()
    dist.barrier()
    print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
