"""The global-batch tests' job: DDP with a dropout layer, numpy and Python draws in every forward,
AdamW and a warm-up schedule, trained through elasticd.global_batch (exact mode with
GB_EXACT=1) and elasticd.checkpoint (in-memory state every step). Arguments: steps, seconds of
sleep per step. Environment: GB_GLOBAL, GB_MICRO (global and micro-batch), GB_SAMPLES, GB_DELAY1
(the sleep per step in a world of one, so that a test can bring a node back before the end),
GB_NO_DELAY_FILE (once this file exists, no sleep: a run whose faults are done ends quickly),
GB_STUCK_DIR (a rank that finds a file named by its pid there removes it and hangs in a data read
that never returns, neither dead nor stopped: bench/chaos_nodes.py's `stuck` fault).

Every rank prints, per optimizer step, `gstep S world W rank R round T samples I,J,...` (the
samples it trained on; T names the attempt's process group, the same on every rank of it), and
rank 0 ends with `final <sha256>` of the model's and optimizer's tensors, so a test can check each
step's global batch and compare the final state bit for bit."""

import hashlib
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from node_train import Indexed  # tests/scripts/ is this script's sys.path[0]
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from elasticd.checkpoint import CheckpointManager, capture, restore
from elasticd.global_batch import GlobalBatch


def digest(*states) -> str:
    h = hashlib.sha256()
    for state in states:
        for key in sorted(state, key=str):
            value = state[key]
            if isinstance(value, dict):
                h.update(digest(value).encode())
            elif isinstance(value, torch.Tensor):
                h.update(
                    value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                )
    return h.hexdigest()


def read_batch() -> None:
    """A data read that never returns (GB_STUCK_DIR): the rank sleeps, the others wait for it."""
    while True:
        time.sleep(3600)


def main() -> None:
    total, delay = int(sys.argv[1]), float(sys.argv[2])
    exact = os.environ.get("GB_EXACT") == "1"
    torch.set_num_threads(1)  # exact mode's condition: the same intra-op threads in every world
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        delay = float(os.environ.get("GB_DELAY1", delay))
    no_delay = os.environ.get("GB_NO_DELAY_FILE")
    tag = torch.tensor([int.from_bytes(os.urandom(7), "little") if rank == 0 else 0])
    dist.broadcast(tag, 0)
    data = Indexed(int(os.environ.get("GB_SAMPLES", "64")))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    gb = GlobalBatch(
        data,
        global_batch=int(os.environ.get("GB_GLOBAL", "10")),
        micro_batch=int(os.environ.get("GB_MICRO", "4")),
        seed=7,
        exact=exact,
    )
    loader = DataLoader(data, batch_sampler=gb)
    mgr = CheckpointManager(keep=2, every_steps=100, memory_every=1)
    state = mgr.load_latest()
    step = (
        restore(state, model=model, optimizer=opt, scheduler=sched, sampler=gb)["step"]
        if state
        else 0
    )
    print(f"resumed at step {step} world {world}", flush=True)
    batches = iter(loader)
    stuck = os.path.join(os.environ.get("GB_STUCK_DIR", ""), str(os.getpid()))
    while step < total:
        if os.environ.get("GB_STUCK_DIR") and os.path.exists(stuck):
            os.unlink(stuck)
            read_batch()
        trained = []
        for mb, (x, y, idx) in gb.micro_batches(model, batches):
            noise = torch.from_numpy(np.random.standard_normal(x.shape).astype("float32"))
            out = model(x + 0.01 * random.random() * noise)
            (F.mse_loss(out, y) * mb.scale).backward()
            if mb.size:
                trained += idx.tolist()
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        print(
            f"gstep {step} world {world} rank {rank} round {int(tag)} samples "
            f"{','.join(map(str, trained))}",
            flush=True,
        )
        mgr.maybe_save(
            step,
            lambda: capture(model=model, optimizer=opt, scheduler=sched, sampler=gb, step=step),
        )
        if mgr.should_stop():
            break
        if delay and not (no_delay and os.path.exists(no_delay)):
            time.sleep(delay)
    mgr.close()
    if rank == 0 and step >= total:
        print(f"final {digest(net.state_dict(), opt.state_dict()['state'])}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if step >= total else 143)


if __name__ == "__main__":
    main()
