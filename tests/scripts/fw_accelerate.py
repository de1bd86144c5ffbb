"""An Accelerate script in the docs' shape, unchanged for elasticd or torchrun: a plain loop
with Accelerator.prepare, save_state every --save-every steps and load_state at start when a
state exists (the step is kept beside it, as the docs suggest).

For the tests: `step N` on stdout per step; with --step-log, one line per step
(`rank step pid time`) appended there. With --save-on-sigterm, the usual preemption handler:
SIGTERM asks for a save at the next step (save_state, a collective), then the loop ends.
"""

import argparse
import os
import signal
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--step-log", default="")
    p.add_argument("--save-on-sigterm", action="store_true")
    args = p.parse_args()
    stop = []
    if args.save_on_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    loader = DataLoader(data, batch_size=16, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = 0
    marker = os.path.join(args.out, "step.txt")
    if os.path.exists(marker):
        accelerator.load_state(os.path.join(args.out, "state"))
        with open(marker) as f:
            step = int(f.read())
        accelerator.print(f"resumed at step {step}")
    while step < args.steps:
        for x, y in accelerator.skip_first_batches(loader, step % len(loader)):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            print(f"step {step}", flush=True)
            if args.step_log:
                with open(args.step_log, "a") as f:
                    rank = accelerator.process_index
                    f.write(f"{rank} {step} {os.getpid()} {time.time():.6f}\n")
            if args.save_on_sigterm:  # every rank stops at the same step: the save is collective
                asked = torch.tensor([1.0 if stop else 0.0])
                stopping = accelerator.reduce(asked, reduction="sum").item() > 0
            else:
                stopping = False
            if step % args.save_every == 0 or stopping:
                accelerator.save_state(os.path.join(args.out, "state"))
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    with open(marker + ".tmp", "w") as f:
                        f.write(str(step))
                    os.replace(marker + ".tmp", marker)
            if stopping:
                print(f"saved at stop, step {step}", flush=True)
                return
            if args.step_time:
                time.sleep(args.step_time)
            if step >= args.steps:
                break
    accelerator.wait_for_everyone()
    print(f"done rank={accelerator.process_index} step={step}", flush=True)


if __name__ == "__main__":
    main()
