"""A torchrun script in the usual tutorial shape, unmodified for elasticd.

init_process_group from the environment, DistributedSampler, DDP, and a snapshot file it resumes
from. Prints one `step N` line per step on every rank so tests can follow progress.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, loader, optimizer, snapshot_path, save_every):
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.loader = loader
        self.optimizer = optimizer
        self.snapshot_path = snapshot_path
        self.save_every = save_every
        self.step = 0
        if snapshot_path and os.path.exists(snapshot_path):
            snap = torch.load(snapshot_path, map_location="cpu", weights_only=True)
            self.model.load_state_dict(snap["model"])
            self.step = snap["step"]
            print(f"resumed from snapshot at step {self.step}", flush=True)
        self.model = DDP(self.model)

    def save(self):
        tmp = self.snapshot_path + ".tmp"
        torch.save({"model": self.model.module.state_dict(), "step": self.step}, tmp)
        os.replace(tmp, self.snapshot_path)

    def train(self, total_steps, step_time, stop_file=""):
        epoch = 0
        while self.step < total_steps:
            self.loader.sampler.set_epoch(epoch)
            for x, y in self.loader:
                self.optimizer.zero_grad()
                loss = F.mse_loss(self.model(x), y)
                loss.backward()
                self.optimizer.step()
                self.step += 1
                print(f"step {self.step} loss {loss.item():.4f}", flush=True)
                if self.rank == 0 and self.snapshot_path and self.step % self.save_every == 0:
                    self.save()
                if step_time:
                    time.sleep(step_time)
                total_steps = min(total_steps, _stop_step(stop_file))
                if self.step >= total_steps:
                    break
            epoch += 1


def _stop_step(path: str) -> float:
    """The step a test wrote into --stop-file for the job to end after (inf while there is none):
    it writes one a few steps ahead of every rank, so all ranks end at the same step."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return float("inf")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--snapshot", default="")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--stop-file", default="", help="a file holding the step to end after")
    args = p.parse_args()
    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
    model = torch.nn.Linear(8, 1)
    trainer = Trainer(
        model, loader, torch.optim.SGD(model.parameters(), lr=0.01), args.snapshot, args.save_every
    )
    trainer.train(args.steps, args.step_time, args.stop_file)
    dist.barrier()
    print(
        f"done world_size={dist.get_world_size()} rank={dist.get_rank()} "
        f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
