"""The README's loop (DDP, AdamW, dropout, a shuffling ResumableDistributedSampler,
CheckpointManager every step) with a failure for `elasticd replay` to judge
(tests/e2e/test_replay.py):

--bad-sample N: a data bug. The step whose batch holds sample N raises, on whichever rank was
dealt it, from the data alone: a replay of that step reproduces it.
--bug-at S: a bug in the code: every rank raises at step S.
--flaky-rank R --flaky-step S: a transient. Rank R raises at step S in the job's first attempt
only (TORCHELASTIC_RESTART_COUNT 0, a world above one): a replay does not reproduce it.
--bad-node ADDR --bad-node-step S: a fault of one machine's (a bad GPU, bad memory). The rank on
the node that has address ADDR (in its network namespace: tests/e2e/test_replay_nodes.py)
raises at step S, every attempt, and so does a replay there; a replay on another node completes
the step.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elasticd.checkpoint import CheckpointManager, capture, restore
from elasticd.sampler import ResumableDistributedSampler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bad-sample", type=int, default=-1)
    p.add_argument("--bug-at", type=int, default=-1)
    p.add_argument("--every", type=int, default=1000, help="disk checkpoints' cadence")
    p.add_argument("--flaky-rank", type=int, default=-1)
    p.add_argument("--flaky-step", type=int, default=-1)
    p.add_argument("--bad-node", default="")
    p.add_argument("--bad-node-step", type=int, default=-1)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.arange(64), torch.randn(64, 8), torch.randn(64, 1))
    sampler = ResumableDistributedSampler(data, shuffle=True, seed=3, batch_size=4)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(every_steps=args.every, memory_every=1)
    state = mgr.load_latest()
    step = restore(state, model=model, optimizer=opt, sampler=sampler)["step"] if state else 0
    flaky = (
        dist.get_world_size() > 1
        and dist.get_rank() == args.flaky_rank
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    )
    epoch = sampler.epoch
    while step < args.steps:
        for index, x, y in loader:
            if args.bad_sample in index.tolist():
                bad = args.bad_sample
                raise ValueError(f"sample {bad} has a malformed label at step {step + 1}")
            if step + 1 == args.bug_at:
                raise KeyError(f"no schedule for step {step + 1}")
            if flaky and step + 1 == args.flaky_step:
                raise ConnectionError(f"a flaky read of the dataset at step {step + 1}")
            if step + 1 == args.bad_node_step and _has_address(args.bad_node):
                raise RuntimeError(f"illegal memory access at step {step + 1}")
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            sampler.advance(len(index))
            step += 1
            mgr.maybe_save(
                step, lambda: capture(model=model, optimizer=opt, sampler=sampler, step=step)
            )
            if step >= args.steps:
                break
        epoch += 1
        sampler.set_epoch(epoch)
    mgr.close()
    print("done", flush=True)


def _has_address(addr: str) -> bool:
    """Whether this machine (its network namespace) has `addr`: the faulty one's."""
    if not addr:
        return False
    with socket.socket() as s:
        try:
            s.bind((addr, 0))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    main()
