"""A small PyTorch Lightning job under elasticd, with its whole state kept in memory
(elasticd.integrations.lightning): DDP on CPU, dropout (RNG matters), Adam with a StepLR schedule,
a ResumableDataLoader shuffled by Lightning's DistributedSampler, a disk ModelCheckpoint every
DISK steps, `fit(ckpt_path="last")`. Prints "step N" after every optimizer step and "resumed at
N" when training starts; rank 0 saves the final weights and optimizer state to OUT.

    lightning_train.py OUT [MAX_STEPS [DISK [EVERY]]]   (EVERY 0: elasticd's budget decides;
                                                         -1: without the integration)
"""

import os
import sys
import time

import pytorch_lightning as pl
import torch

from elasticd.integrations.lightning import ElasticdState, ResumableDataLoader

out = sys.argv[1]
max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
disk = int(sys.argv[3]) if len(sys.argv) > 3 else 20
every = int(sys.argv[4]) if len(sys.argv) > 4 else 1
DEBUG = os.environ.get("DEBUG_STEPS")


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        time.sleep(0.03)  # room to kill a worker mid-training
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1))
        return ResumableDataLoader(data, batch_size=4, shuffle=True)


class Print(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        print(f"resumed at {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        digest = f" {batch_idx} {batch[0].sum():.6f} {outputs['loss']:.6f}" if DEBUG else ""
        print(f"step {trainer.global_step}{digest}", flush=True)


pl.seed_everything(0, verbose=False)
root = out + ".lightning"  # ModelCheckpoint's directory, one per run
trainer = pl.Trainer(
    accelerator="cpu",
    devices=int(os.environ["LOCAL_WORLD_SIZE"]),
    num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
    strategy="ddp",
    max_steps=max_steps,
    callbacks=[
        *([ElasticdState(every=every or None)] if every >= 0 else []),
        Print(),
        pl.callbacks.ModelCheckpoint(
            dirpath=root, every_n_train_steps=disk, save_last=True, save_top_k=0
        ),
    ],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=root,
)
model = Net()
trainer.fit(model, ckpt_path="last")
if trainer.global_rank == 0:
    opt = trainer.optimizers[0].state_dict()
    torch.save({"model": model.state_dict(), "optimizer": opt, "step": trainer.global_step}, out)
