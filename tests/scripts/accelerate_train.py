"""An Accelerate script, the same under elasticd and torchrun: a plain loop with
Accelerator.prepare (CPU, DDP over gloo) of a small net with dropout, AdamW, a StepLR schedule and
shuffled batches (a seedable sampler: the shuffle is a function of the seed and the epoch, so a
resumed epoch deals the same batches and skip_first_batches finds the place). Its state is kept as
the docs suggest, save_state every --save-every steps and load_state at start (the step beside it
in --out/step.txt); with --memory-every N, as docs/checkpoints.md's recipe keeps it instead:
elasticd.checkpoint's CheckpointManager, on disk every --save-every steps and in memory every N
(0: as elasticd's budget decides).

For the tests: `resumed at N` before the first step and `step N` after every optimizer step; with
--step-log, one line per step (`rank step pid time`) appended there; with --final, rank 0 saves
the final weights and optimizer state there. With --save-on-sigterm, the usual preemption
handler: SIGTERM asks for a save at the next step (save_state, a collective), then the loop ends.
"""

import os
import signal
import time

import torch
import train_args
from accelerate import Accelerator, DataLoaderConfiguration

DEBUG = os.environ.get("DEBUG_STEPS")


class SavedState:
    """Accelerate's own save_state / load_state in --out/state, the step in --out/step.txt."""

    def __init__(self, accelerator, out, every):
        self.accelerator, self.every = accelerator, every
        self.state, self.marker = os.path.join(out, "state"), os.path.join(out, "step.txt")

    def load(self, **objects):
        if not os.path.exists(self.marker):
            return 0
        self.accelerator.load_state(self.state)
        with open(self.marker) as f:
            return int(f.read())

    def after_step(self, step, stopping, **objects):
        if step % self.every and not stopping:
            return
        self.accelerator.save_state(self.state)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            with open(self.marker + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(self.marker + ".tmp", self.marker)

    def should_stop(self):
        return False

    def close(self):
        pass


class ElasticdState:
    """docs/checkpoints.md's recipe: elasticd.checkpoint keeps the state, in memory too."""

    def __init__(self, accelerator, every, memory_every):
        from elasticd.checkpoint import CheckpointManager

        self.accelerator = accelerator
        self.mgr = CheckpointManager(every_steps=every, memory_every=memory_every or None)

    def load(self, **objects):
        from elasticd.checkpoint import restore

        state = self.mgr.load_latest()  # memory, or the disk checkpoint when it is newer
        return 0 if state is None else restore(state, **objects)["step"]

    def after_step(self, step, stopping, **objects):
        from elasticd.checkpoint import capture

        self.mgr.maybe_save(step, lambda: capture(**objects, step=step))

    def should_stop(self):
        return self.mgr.should_stop()

    def close(self):
        self.mgr.close()


def main():
    p = train_args.parser()
    p.add_argument("--save-on-sigterm", action="store_true")
    args = p.parse_args()
    stop = []
    if args.save_on_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
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
    if args.memory_every is None:
        kept = SavedState(accelerator, args.out, args.save_every)
    else:
        kept = ElasticdState(accelerator, args.save_every, args.memory_every)
    unwrapped = accelerator.unwrap_model(model)
    step = kept.load(model=unwrapped, optimizer=opt, scheduler=sched)
    print(f"resumed at {step}", flush=True)
    while step < args.steps:
        epoch, done = divmod(step, len(loader))
        epoch_loader = accelerator.skip_first_batches(loader, done) if done else loader
        epoch_loader.set_epoch(epoch)  # on the loader iterated: a skipping one counts its own
        for x, y in epoch_loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            time.sleep(args.step_time)  # room to kill a worker mid-training
            digest = f" {x.sum():.5f} {loss.item():.6f}" if DEBUG else ""
            print(f"step {step}{digest}", flush=True)
            if args.step_log:
                with open(args.step_log, "a") as f:
                    rank = accelerator.process_index
                    f.write(f"{rank} {step} {os.getpid()} {time.time():.6f}\n")
            stopping = False
            if args.save_on_sigterm:  # every rank stops at the same step: the save is collective
                asked = torch.tensor([1.0 if stop else 0.0])
                stopping = accelerator.reduce(asked, reduction="sum").item() > 0
            kept.after_step(step, stopping, model=unwrapped, optimizer=opt, scheduler=sched)
            if stopping:
                print(f"saved at stop, step {step}", flush=True)
                return
            if step >= args.steps or kept.should_stop():
                break
        if kept.should_stop():
            break
    kept.close()
    if args.final and accelerator.is_main_process:
        final = {"model": unwrapped.state_dict(), "optimizer": opt.state_dict(), "step": step}
        torch.save(final, args.final)
    print(f"done rank={accelerator.process_index} step={step}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
