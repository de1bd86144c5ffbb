"""A transformers Trainer script, unchanged for elasticd or torchrun: a tiny GPT-2 built from
GPT2Config in code (nothing downloaded), 2 CPU processes over gloo (the Trainer reads torchrun's
environment), a checkpoint every --save-every steps and resume_from_checkpoint from the newest.

For the tests: `step N` on stdout per step; with --step-log, one line per step
(`rank step pid time`) appended there.
"""

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=4096, length=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepLog(TrainerCallback):
    def __init__(self, path, step_time):
        self.path, self.step_time = path, step_time

    def on_step_end(self, args, state, control, **kwargs):
        print(f"step {state.global_step}", flush=True)
        if self.path:
            with open(self.path, "a") as f:
                rank = args.process_index
                f.write(f"{rank} {state.global_step} {os.getpid()} {time.time():.6f}\n")
        if self.step_time:
            time.sleep(self.step_time)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--step-log", default="")
    args = p.parse_args()
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        save_steps=args.save_every,
        save_strategy="steps",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(),
        callbacks=[StepLog(args.step_log, args.step_time)],
    )
    last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    trainer.train(resume_from_checkpoint=last)
    print(f"done rank={training.process_index} step={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
