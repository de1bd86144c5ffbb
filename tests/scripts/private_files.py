"""Leaves every kind of file elasticd makes, for a test of their modes: disk checkpoints, the
in-memory state, a heartbeat; a stack dump when asked while it waits; and, on the first attempt,
an error file (it raises once FLAG exists). `private_files.py FLAG`."""

import os
import sys
import time

import torch

import elasticd
from elasticd.checkpoint import CheckpointManager, capture

model = torch.nn.Linear(2, 1)
mgr = CheckpointManager(
    every_steps=2, memory_every=1
)  # ELASTICD_CHECKPOINT_DIR, ELASTICD_MEMORY_DIR
for step in range(1, 5):
    elasticd.heartbeat(step)
    mgr.maybe_save(step, lambda step=step: capture(model=model, step=step))
mgr.close()
print("saved", flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("the first attempt fails, for its error file")
