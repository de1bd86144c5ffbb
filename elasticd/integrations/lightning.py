"""PyTorch Lightning under elasticd: its whole checkpoint (the dict Lightning itself builds for a
`.ckpt`: model, optimizers, LR schedulers, the fit loop's progress to the batch, callbacks'
states, precision plugin) kept in elasticd's in-memory state, and resumed after a crash through
Lightning's own restore (`ElasticdState`, a Lightning Callback), so a worker's `kill -9` costs at
most one refresh interval; and `ResumableDataLoader`, a DataLoader Lightning resumes mid-epoch:

    from elasticd.integrations.lightning import ElasticdState
    trainer = pl.Trainer(strategy="ddp", callbacks=[ElasticdState(), ...])
    trainer.fit(model, datamodule, ckpt_path="last")        # ckpt_path as before, or none

At `setup` (the process group is up, nothing restored yet) the callback reads the newest step held
in memory and hands it to Lightning's checkpoint connector as the checkpoint it restores, unless
the `ckpt_path` Lightning loads is newer (its `global_step`). From there Lightning restores what a
`.ckpt` holds, in its own order and with its own hooks (`on_load_checkpoint` included). Each
rank's RNG is set at `on_train_start`, after Lightning made the epoch's data iterator, where the
run that was interrupted drew its next batch. Refreshes happen at `on_train_batch_end` after an
optimizer step, where Lightning's `ModelCheckpoint` saves, at elasticd's cost budget.

Where Lightning resumes exactly: a sized dataloader that has `state_dict`/`load_state_dict` goes
on from the batch it reached (Lightning's own contract for mid-epoch resume); a plain DataLoader
starts its epoch's data again from the beginning (Lightning says so in a warning: the counters,
weights and optimizer are exact, the data order is not). `ResumableDataLoader` is a DataLoader
with that interface.

Not kept: `hyper_parameters` (and their name and type), which describe how the module was built,
not how far it trained, may hold any Python object, and are not used to restore a live module.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import structlog
import torch.utils.data
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from elasticd.integrations.keeper import Keeper

log = structlog.get_logger()

KEY = "lightning"
# What a Lightning checkpoint holds about how the module was built, not how far it trained.
_NOT_KEPT = ("hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters")


class ElasticdState(pl.Callback):
    """Keeps Lightning's whole resumable state in elasticd's memory and resumes from it (see the
    module's docstring). `every`: refresh every N optimizer steps; None: as often as keeps the
    refresh under `budget` of the step time (elasticd's default, 0.75%). Inert outside elasticd."""

    def __init__(self, every: int | None = None, budget: float = 0.0075):
        self._keeper = Keeper(KEY, every, budget)
        self._trainer: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        ckpt = self._keeper.load()
        if ckpt is not None:
            _restore_through_lightning(trainer, ckpt)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._keeper.restore_rng()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._keeper.refresh(trainer.global_step, self._checkpoint)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A ResumableDataLoader's place is the batches the fit loop finished, whatever a
        prefetch had drawn when the checkpoint was taken (memory or disk alike)."""
        loops = checkpoint.get("loops") or {}
        fit = loops.get("fit_loop") or {}
        done = ((fit.get("epoch_loop.batch_progress") or {}).get("current") or {}).get("processed")
        for loader in (fit.get("state_dict") or {}).get("combined_loader") or []:
            if isinstance(loader, dict) and ResumableDataLoader.KEY in loader and done is not None:
                loader[ResumableDataLoader.KEY] = int(done)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._keeper.close()

    def _checkpoint(self) -> dict[str, Any]:
        assert self._trainer is not None
        ckpt = self._trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in _NOT_KEPT:
            ckpt.pop(key, None)
        return ckpt


def _restore_through_lightning(trainer: pl.Trainer, ckpt: dict[str, Any]) -> None:
    """Make the checkpoint connector restore `ckpt` at its next resume_start (the one fit() makes
    right after the setup hooks): what it loads from `ckpt_path` first, and `ckpt` instead unless
    that one's global_step is newer. Lightning then restores module, callbacks, loops, optimizers
    and schedulers from it as from a file."""
    connector = trainer._checkpoint_connector
    original = connector.resume_start
    step = int(ckpt.get("global_step", -1))

    def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        del connector.resume_start  # once: later stages load as Lightning does
        original(checkpoint_path, weights_only)
        disk = connector._loaded_checkpoint
        if disk and int(disk.get("global_step", -1)) > step:
            log.info("lightning_disk_checkpoint_newer", path=str(checkpoint_path), memory_step=step)
            return
        connector._loaded_checkpoint = ckpt
        connector._ckpt_path = f"elasticd memory (global step {step})"

    connector.resume_start = resume_start


class ResumableDataLoader(torch.utils.data.DataLoader):
    """A DataLoader that Lightning resumes mid-epoch: `state_dict()` says how many batches of
    the epoch it gave, `load_state_dict()` makes its next iteration skip them (for a sized,
    single-process loader by drawing only the sampler's indices, no sample is loaded; with
    workers, by loading and dropping them). Lightning saves its state in the fit loop's and
    restores it before it makes the epoch's iterator; ElasticdState corrects it to the batches the
    loop finished."""

    KEY = "elasticd_batches"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live: Any = None
        self._skip = 0

    def __iter__(self) -> Any:
        it = super().__iter__()
        self._live = it
        skip, self._skip = self._skip, 0
        return _Skipping(it, skip) if skip else it

    def state_dict(self) -> dict[str, int]:
        return {self.KEY: int(self._live._num_yielded) if self._live is not None else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        batches = int(state.get(self.KEY, 0))
        try:
            whole = batches >= len(self)  # the epoch was done: the next starts from its first
        except TypeError:  # an IterableDataset without a length
            whole = False
        self._skip = 0 if whole else max(batches, 0)


class _Skipping:
    """A DataLoader's iterator that drops its first `skip` batches at the first next(): not
    before, since Lightning sets the sampler's epoch after making the iterator."""

    def __init__(self, it: Any, skip: int) -> None:
        self.it, self.skip = it, skip

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        if self.skip:
            skip, self.skip = self.skip, 0
            if isinstance(self.it, _SingleProcessDataLoaderIter):
                for _ in range(skip):
                    next(self.it._sampler_iter)
                self.it._num_yielded += skip
            else:
                for _ in range(skip):
                    next(self.it)
        return next(self.it)
