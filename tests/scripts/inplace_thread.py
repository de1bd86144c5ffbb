"""A torchrun script that starts a thread of its own (not a daemon thread) which runs until the
training loop ends: when a collective fails and the script unwinds, the thread still runs, so the
survivor cannot re-enter in place (tests/e2e/test_inplace.py). Prints `step N` per step."""

import argparse
import threading
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100)
args = p.parse_args()

dist.init_process_group("gloo")
done = threading.Event()
ticker = threading.Thread(target=done.wait, name="ticker")
ticker.start()
w = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(1, args.steps + 1):
    w.grad = torch.ones(4)
    dist.all_reduce(w.grad)
    opt.step()  # the heartbeat beats at every optimizer step
    print(f"step {step}", flush=True)
    time.sleep(0.05)
done.set()  # only where the loop ended: an error leaves the thread running
dist.destroy_process_group()
