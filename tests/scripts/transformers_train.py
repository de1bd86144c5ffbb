"""A tiny GPT-2 (built from a config, nothing downloaded) trained by the transformers Trainer under
elasticd, with its state kept in memory (elasticd.integrations.transformers): DDP on CPU, dropout,
AdamW with a linear schedule, a disk checkpoint every DISK steps in OUT.trainer/, resumed from
memory unless that one is newer. Prints "step N" after every optimizer step and "resumed at N" as
training begins; rank 0 saves the final weights and optimizer state to OUT.

    transformers_train.py OUT [MAX_STEPS [DISK [EVERY]]]   (EVERY 0: elasticd's budget decides;
                                                            -1: without the integration)
"""

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from elasticd.integrations.transformers import resume

out = sys.argv[1]
max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
disk = int(sys.argv[3]) if len(sys.argv) > 3 else 20
every = int(sys.argv[4]) if len(sys.argv) > 4 else 1


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (512, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Print(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print(f"resumed at {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.03)  # room to kill a worker mid-training
        print(f"step {state.global_step}", flush=True)


torch.manual_seed(0)
config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
model = GPT2LMHeadModel(config)
args = TrainingArguments(
    output_dir=out + ".trainer",
    max_steps=max_steps,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    warmup_steps=5,
    save_steps=disk,
    logging_steps=10,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Print()])
last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
kept = resume(trainer, fallback=last, every=every or None) if every >= 0 else last
trainer.train(resume_from_checkpoint=kept)
if trainer.is_world_process_zero():
    state = {"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
    torch.save({**state, "step": trainer.state.global_step}, out)
