"""A PyTorch Lightning script as its docs teach it, the same under elasticd and torchrun:
Trainer(strategy="ddp") on CPU, a ModelCheckpoint (last.ckpt every --save-every steps in --out)
and fit(ckpt_path="last"), so a restart resumes from Lightning's own checkpoint. A small net with
dropout, Adam and a StepLR schedule, shuffled batches: the RNG, optimizer and scheduler all count
in a bit-identical resume. With --memory-every N, the lines that keep its whole state in
elasticd's memory (elasticd.integrations.lightning: ElasticdState every N steps, 0: as elasticd's
budget decides; a ResumableDataLoader).

For the tests: `resumed at N` as training starts and `step N` after every optimizer step; with
--step-log, one line per step (`rank step pid time`) appended there; with --final, rank 0 saves
the final weights and optimizer state there; with --observe, whether Lightning was imported before
the script's first line, what its rank-zero helpers saw there and which ranks ran a
@rank_zero_only function (one JSON line each).
"""

import json
import os
import sys
import time

AHEAD = "pytorch_lightning" in sys.modules  # imported before the script's first line (a spare)

from lightning_fabric.utilities.rank_zero import rank_zero_only  # noqa: E402

FIRST_LINE_RANK = getattr(rank_zero_only, "rank", None)  # what Lightning believes at import

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import train_args  # noqa: E402

DEBUG = os.environ.get("DEBUG_STEPS")


class Net(pl.LightningModule):
    def __init__(self, loader, step_time):
        super().__init__()
        self.loader, self.step_time = loader, step_time
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_time)  # room to kill a worker mid-training
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1))
        return self.loader(data, batch_size=4, shuffle=True)


class Log(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        print(f"resumed at {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        digest = f" {batch_idx} {batch[0].sum():.6f} {outputs['loss']:.6f}" if DEBUG else ""
        print(f"step {step}{digest}", flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"{trainer.global_rank} {step} {os.getpid()} {time.time():.6f}\n")


def observe(path):
    @rank_zero_only
    def only_on_rank_zero():
        with open(path, "a") as f:
            f.write(json.dumps({"rank_zero_only_ran_on": int(os.environ["RANK"])}) + "\n")

    with open(path, "a") as f:
        seen = {"rank": int(os.environ["RANK"]), "first_line_rank": FIRST_LINE_RANK}
        f.write(json.dumps({**seen, "ahead": AHEAD}) + "\n")
    only_on_rank_zero()


def main():
    p = train_args.parser()
    p.add_argument("--observe", default="")
    args = p.parse_args()
    if args.observe:
        observe(args.observe)
    callbacks = [
        Log(args.step_log),
        pl.callbacks.ModelCheckpoint(
            dirpath=args.out, every_n_train_steps=args.save_every, save_last=True, save_top_k=0
        ),
    ]
    loader = torch.utils.data.DataLoader
    if args.memory_every is not None:
        from elasticd.integrations.lightning import ElasticdState, ResumableDataLoader

        callbacks.insert(0, ElasticdState(every=args.memory_every or None))
        loader = ResumableDataLoader
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    model = Net(loader, args.step_time)
    trainer.fit(model, ckpt_path="last")
    if args.final and trainer.global_rank == 0:
        opt = trainer.optimizers[0].state_dict()
        final = {"model": model.state_dict(), "optimizer": opt, "step": trainer.global_step}
        torch.save(final, args.final)
    print(f"done rank={trainer.global_rank} step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
