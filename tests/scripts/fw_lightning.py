"""A PyTorch Lightning script as its docs teach it, unchanged for elasticd or torchrun:
Trainer(strategy="ddp") on CPU, ModelCheckpoint (last.ckpt every --save-every steps) and
fit(ckpt_path="last"), so a restart resumes from Lightning's own checkpoint.

For the tests: `step N` on stdout per step; with --step-log, one line per step
(`rank step pid time`) appended there; with --observe, what Lightning's rank-zero helpers see
at the script's first line and which ranks ran a @rank_zero_only function (one JSON line each).
"""

import argparse
import json
import os
import sys
import time

AHEAD = "pytorch_lightning" in sys.modules  # imported before the script's first line (a spare)

from lightning_fabric.utilities.rank_zero import rank_zero_only  # noqa: E402

FIRST_LINE_RANK = getattr(rank_zero_only, "rank", None)  # what Lightning believes at import

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepLog(Callback):
    def __init__(self, path, step_time):
        self.path, self.step_time = path, step_time

    def on_train_batch_end(self, trainer, *_):
        step = trainer.global_step
        print(f"step {step}", flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"{trainer.global_rank} {step} {os.getpid()} {time.time():.6f}\n")
        if self.step_time:
            time.sleep(self.step_time)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--step-log", default="")
    p.add_argument("--observe", default="")
    args = p.parse_args()

    @rank_zero_only
    def only_on_rank_zero():
        with open(args.observe, "a") as f:
            f.write(json.dumps({"rank_zero_only_ran_on": int(os.environ["RANK"])}) + "\n")

    if args.observe:
        with open(args.observe, "a") as f:
            seen = {"rank": int(os.environ["RANK"]), "first_line_rank": FIRST_LINE_RANK}
            seen["ahead"] = AHEAD
            f.write(json.dumps(seen) + "\n")
        only_on_rank_zero()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        max_steps=args.steps,
        callbacks=[
            ModelCheckpoint(dirpath=args.out, save_last=True, every_n_train_steps=args.save_every),
            StepLog(args.step_log, args.step_time),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=16), ckpt_path="last")
    print(f"done rank={trainer.global_rank} step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
