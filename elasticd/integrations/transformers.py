"""The transformers Trainer under elasticd: the model, optimizer, LR scheduler, TrainerState
(global step, epoch, log history, stateful callbacks) and every rank's RNG kept in elasticd's
in-memory state, and resumed after a crash through the Trainer's own `resume_from_checkpoint`, so a
worker's `kill -9` costs at most one refresh interval. One line in the script:

    from elasticd.integrations.transformers import resume
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume(trainer))       # resume(trainer, fallback=path)

`resume(trainer)` adds a callback that refreshes the state at `on_step_end` (after the optimizer
step, where the Trainer saves its own checkpoints) at elasticd's cost budget, and reads the newest
step held in memory (a collective: every rank calls it, after the Trainer is built, so the process
group is up). When there is one, it writes it as a Trainer checkpoint directory in the run's
shared-memory directory (this rank's own: weights, optimizer, scheduler, trainer_state.json and
this rank's `rng_state_<rank>.pth`, each in the Trainer's format) and returns its path; the
Trainer then restores everything as from its own checkpoint, fast-forwards its dataloader past
the batches already trained (`skip_first_batches`) and sets the RNG after that, exactly as it
would. None (or `fallback`, a checkpoint directory of your own, when it is newer) otherwise.

Exact at an unchanged world size (tested). Not kept: a mixed-precision GradScaler's state
(fp16 on CUDA: the scale restarts from its initial value), DeepSpeed and FSDP states (the
Trainer loads those through their own engines).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import structlog
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import ExportableState

from elasticd import names
from elasticd.checkpoint.collectives import rank
from elasticd.integrations.keeper import Keeper

log = structlog.get_logger()

KEY = "transformers"
# The Trainer's own file names (transformers.trainer: WEIGHTS_NAME, OPTIMIZER_NAME, ...)
WEIGHTS, OPTIMIZER, SCHEDULER, STATE = (
    "pytorch_model.bin",
    "optimizer.pt",
    "scheduler.pt",
    "trainer_state.json",
)


class ElasticdState(TrainerCallback):
    """Refreshes the Trainer's resumable state in elasticd's memory; made by resume()."""

    def __init__(self, trainer: Trainer, every: int | None = None, budget: float = 0.0075):
        self.keeper = Keeper(KEY, every, budget)
        self.trainer = trainer
        self.resume_dir: str | None = None  # the directory resume() wrote, removed once read

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._forget()  # the Trainer has read it all: weights, optimizer, scheduler, RNG

    def on_step_end(
        self,
        args,
        state: TrainerState,
        control: TrainerControl,
        model=None,
        optimizer=None,
        lr_scheduler=None,
        **kwargs,
    ) -> None:
        self.keeper.refresh(
            state.global_step, lambda: self._state(state, model, optimizer, lr_scheduler)
        )

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._forget()
        self.keeper.close()

    def _state(self, state: TrainerState, model, optimizer, scheduler) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "trainer_state": _state_json(self.trainer, state),
        }

    def _forget(self) -> None:
        if self.resume_dir is not None:
            shutil.rmtree(self.resume_dir, ignore_errors=True)
            self.resume_dir = None


def resume(
    trainer: Trainer,
    fallback: str | None = None,
    *,
    every: int | None = None,
    budget: float = 0.0075,
) -> str | None:
    """The checkpoint to pass as `trainer.train(resume_from_checkpoint=...)`: the state elasticd
    holds in memory, written as a Trainer checkpoint, unless `fallback` is newer (its global
    step); `fallback` when nothing is held; None outside elasticd. Adds the refreshing callback
    (`every` N optimizer steps; None: under `budget` of the step time)."""
    callback = ElasticdState(trainer, every, budget)
    trainer.add_callback(callback)
    kept = callback.keeper.load()
    if kept is None:
        return fallback
    step = json.loads(kept["trainer_state"])["global_step"]
    if fallback is not None and _global_step(fallback) > step:
        log.info("transformers_disk_checkpoint_newer", path=fallback, memory_step=step)
        return fallback
    callback.keeper.restore_rng()  # this rank's generators, which _save_rng_state writes below
    callback.resume_dir = _write_checkpoint(trainer, kept)
    return callback.resume_dir


def _state_json(trainer: Trainer, state: TrainerState) -> str:
    """TrainerState as the Trainer saves it (save_to_json), with its stateful callbacks' states
    as of now (as _save_checkpoint updates them), leaving the live state untouched."""
    saved = dataclasses.asdict(state)
    callbacks = dict(saved.get("stateful_callbacks") or {})
    exported = [
        cb
        for cb in trainer.callback_handler.callbacks + [trainer.control]
        if isinstance(cb, ExportableState)
    ]
    for cb in exported:
        name = cb.__class__.__name__
        if isinstance(callbacks.get(name), list):
            callbacks[name] = [*callbacks[name], cb.state()]
        else:
            callbacks[name] = cb.state()
    saved["stateful_callbacks"] = callbacks
    return json.dumps(saved, indent=2, sort_keys=True) + "\n"


def _global_step(checkpoint: str) -> int:
    try:
        with open(os.path.join(checkpoint, STATE)) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def _write_checkpoint(trainer: Trainer, kept: dict[str, Any]) -> str:
    """`kept` as a Trainer checkpoint directory, this rank's own, in the run's shared-memory
    directory (the daemon removes it with the run, should this process die before reading it)."""
    parent = os.environ.get(names.MEMORY_DIR) or None
    path = tempfile.mkdtemp(prefix=f"transformers-rank{rank()}-", dir=parent)
    torch.save(kept["model"], os.path.join(path, WEIGHTS))
    torch.save(kept["optimizer"], os.path.join(path, OPTIMIZER))
    if kept["scheduler"] is not None:
        torch.save(kept["scheduler"], os.path.join(path, SCHEDULER))
    with open(os.path.join(path, STATE), "w") as f:
        f.write(kept["trainer_state"])
    trainer._save_rng_state(path)  # the Trainer's own format, from the generators just restored
    return path
