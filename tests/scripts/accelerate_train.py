"""docs/checkpoints.md's Accelerate recipe, as a test runs it: a plain loop with an Accelerator
(CPU, DDP over gloo), its model, optimizer, scheduler and dataloader prepared, the state kept by
elasticd.checkpoint (in memory every EVERY steps, on disk every DISK steps). Prints "step N" after
every optimizer step and "resumed at N" before the first; rank 0 saves the final weights and
optimizer state to OUT.

    accelerate_train.py OUT [MAX_STEPS [DISK [EVERY]]]   (EVERY 0: elasticd's budget decides;
                                                          -1: disk checkpoints only)
"""

import os
import sys
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration

from elasticd.checkpoint import CheckpointManager, capture, restore

out = sys.argv[1]
max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
disk = int(sys.argv[3]) if len(sys.argv) > 3 else 20
every = int(sys.argv[4]) if len(sys.argv) > 4 else 1
DEBUG = os.environ.get("DEBUG_STEPS")

# use_seedable_sampler: the shuffle is a function of the seed and the epoch, so a resumed epoch
# deals the same batches and skip_first_batches finds the place
seedable = DataLoaderConfiguration(use_seedable_sampler=True)
accelerator = Accelerator(cpu=True, dataloader_config=seedable)
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1))
# its own generator: making an epoch's iterator then draws nothing from the global RNG, so a
# restored RNG state stays what it was at the step saved until the next forward draws from it
loader = torch.utils.data.DataLoader(
    data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
)
model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)

mgr = CheckpointManager(every_steps=disk, memory_every=(every or None) if every >= 0 else 0)
state = mgr.load_latest()  # memory, or the disk checkpoint when it is newer
step = 0
if state is not None:
    objects = {"model": accelerator.unwrap_model(model), "optimizer": opt, "scheduler": sched}
    step = restore(state, **objects)["step"]
print(f"resumed at {step}", flush=True)
while step < max_steps:
    epoch, done = divmod(step, len(loader))
    epoch_loader = accelerator.skip_first_batches(loader, done) if done else loader
    epoch_loader.set_epoch(epoch)  # on the loader iterated: a skipping one counts its own epochs
    for x, y in epoch_loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        time.sleep(0.03)  # room to kill a worker mid-training
        digest = f" {x.sum():.5f} {loss.item():.6f}" if DEBUG else ""
        print(f"step {step}{digest}", flush=True)
        unwrapped = accelerator.unwrap_model(model)
        mgr.maybe_save(
            step, lambda: capture(model=unwrapped, optimizer=opt, scheduler=sched, step=step)
        )
        if step >= max_steps or mgr.should_stop():
            break
    if mgr.should_stop():
        break
mgr.close()
if accelerator.is_main_process:
    final = {"model": accelerator.unwrap_model(model).state_dict(), "optimizer": opt.state_dict()}
    torch.save({**final, "step": step}, out)
accelerator.end_training()
