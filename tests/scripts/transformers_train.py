"""A transformers Trainer script, the same under elasticd and torchrun: a tiny GPT-2 built from
GPT2Config in code (nothing downloaded), 2 CPU processes over gloo (the Trainer reads torchrun's
environment), dropout, AdamW with a linear warm-up, a checkpoint every --save-every steps in --out
and resume_from_checkpoint from the newest. With --memory-every N, the line that keeps its state
in elasticd's memory (elasticd.integrations.transformers.resume, every N steps, 0: as elasticd's
budget decides), resumed from memory unless the disk checkpoint is newer.

For the tests: `resumed at N` as training begins and `step N` after every optimizer step; with
--step-log, one line per step (`rank step pid time`) appended there; with --final, rank 0 saves
the final weights and optimizer state there.
"""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: the model is built here

import torch
import train_args
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (512, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Log(TrainerCallback):
    def __init__(self, path, step_time):
        self.path, self.step_time = path, step_time

    def on_train_begin(self, args, state, control, **kwargs):
        print(f"resumed at {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.step_time)  # room to kill a worker mid-training
        print(f"step {state.global_step}", flush=True)
        if self.path:
            with open(self.path, "a") as f:
                rank = args.process_index
                f.write(f"{rank} {state.global_step} {os.getpid()} {time.time():.6f}\n")


def main():
    p = train_args.parser()
    args = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=5,
        save_steps=args.save_every,
        save_strategy="steps",
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    log = Log(args.step_log, args.step_time)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[log])
    last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    if args.memory_every is not None:
        from elasticd.integrations.transformers import resume

        last = resume(trainer, fallback=last, every=args.memory_every or None)
    trainer.train(resume_from_checkpoint=last)
    if args.final and trainer.is_world_process_zero():
        state = {"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
        torch.save({**state, "step": trainer.state.global_step}, args.final)
    print(f"done rank={training.process_index} step={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
