"""A constant global batch whatever the world: the user states the global batch G and the
micro-batch m a rank can hold; each (re)start reads the world W and derives each rank's
micro-batches per optimizer step (gradient accumulation), so a job that shrinks from 8 ranks to 6
trains on the same G samples per step, with the same loss scale, LR schedule and checkpoints.
`GlobalBatch` is the DataLoader's batch sampler, a step's passes (`micro_batches()`) and the
position a checkpoint keeps; the user's guide is docs/global-batch.md.

    gb = GlobalBatch(dataset, global_batch=256, micro_batch=32, seed=0)  # exact=True: bit-exact
    loader = DataLoader(dataset, batch_sampler=gb, num_workers=2)
    state = mgr.load_latest()
    step = restore(state, model=model, optimizer=opt, sampler=gb)["step"] if state else 0
    batches = iter(loader)                        # after restore(): it deals from the position
    while step < total_steps:
        for mb, (x, y) in gb.micro_batches(model, batches):
            (loss_fn(model(x), y) * mb.scale).backward()   # scale: the mean over the global batch
        opt.step(); sched.step(); opt.zero_grad()   # the schedule counts optimizer steps
        step += 1                                 # == gb.step
        mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, sampler=gb, step=step))

What is dealt. The data is one endless stream: the epochs' seeded orders one after the other
(epoch e's order is elasticd.sampler's, torch.randperm with a Generator seeded seed + e), and step
s's global batch is the next G positions of it. A global batch that crosses an epoch's end takes
the rest of that epoch and the start of the next, so no sample is skipped or seen twice in an
epoch and every batch is whole, whatever the world and however often it changed. The position
(epoch, consumed, step) travels in the checkpoint as the `sampler` of capture()/restore(): plain
ints, loadable with weights_only=True.

How it is split (elasticd.batch_split): in normal mode G is shared evenly over the ranks, each
running the same number of micro-batches; `micro_batches()` uses DDP's `no_sync()` for all but
the last, and `mb.scale` (size x W / G: DDP averages over ranks) makes the gradient the mean over
G for a loss that is a mean over its micro-batch. A world that does not divide G gets shares
differing by one sample, and rank 0 says so in one line. Exact mode (`exact=True`,
elasticd.exact) fixes the micro-batches by G and m alone, seeds each one's randomness by (step,
index) and sums the gradients in index order, for a bit-identical run across world changes.

With the ledger on (elasticd.ledger), a step's samples are recorded at its end, and the step
resumed from at `load_state_dict()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import structlog
import torch

from elasticd import exact as exact_mode
from elasticd import ledger
from elasticd.batch_split import Micro, Plan, split, split_exact
from elasticd.checkpoint.collectives import rank as this_rank
from elasticd.checkpoint.collectives import world as this_world

__all__ = ["GlobalBatch", "MicroBatch", "STATE_FORMAT"]

STATE_FORMAT = 1

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass of this rank in optimizer step `step` (0-based): micro-batch
    `index` of the step (-1 for a filler), `size` samples of the global batch (0 for a filler),
    `indices` the dataset indices the loader was given, `scale` the loss weight."""

    step: int
    index: int
    size: int
    scale: float
    indices: tuple[int, ...]


class GlobalBatch:
    """The batch sampler and step driver of a constant global batch (module docstring).

    `dataset`: anything with len(); `global_batch`: samples per optimizer step; `micro_batch`:
    the most samples one rank computes in one forward/backward. Reads the world and rank from
    torch.distributed (else torchrun's environment) unless given."""

    def __init__(
        self,
        dataset,
        global_batch: int,
        micro_batch: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        exact: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.dataset_len = len(dataset)
        if self.dataset_len < 1:
            raise ValueError("GlobalBatch needs a dataset of at least one sample")
        self.world = this_world() if num_replicas is None else num_replicas
        self.rank = this_rank() if rank is None else rank
        self.seed, self.shuffle, self.exact = int(seed), bool(shuffle), bool(exact)
        self.plan: Plan = (split_exact if exact else split)(global_batch, micro_batch, self.world)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.mine: tuple[Micro, ...] = self.plan.ranks[self.rank]
        self.epoch = 0  # the epoch of the next position of the stream
        self.consumed = 0  # positions of that epoch's order already trained on
        self.step = 0  # optimizer steps taken
        self._orders: dict[int, list[int]] = {}
        self._sized = False  # the ledger told the dataset's size
        self._dealt_from: tuple[int, int] | None = None  # (stream position, step) of iter()
        self._stale = False  # a state was loaded since the loader's iterator was made
        self._sum: exact_mode.OrderedSum | None = None
        note = self.plan.note()
        if note and self.rank == 0:
            log.info("global_batch_split", world=self.world, note=note)

    # -- the stream -----------------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s order: elasticd.sampler's permutation (kept for two epochs)."""
        if epoch not in self._orders:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=g).tolist()
            else:
                order = list(range(self.dataset_len))
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def global_indices(self, epoch: int | None = None, consumed: int | None = None) -> list[int]:
        """The dataset indices of the global batch that starts at (epoch, consumed), by default
        the next step's: G positions of the stream, across epochs' ends."""
        epoch = self.epoch if epoch is None else epoch
        at = self.consumed if consumed is None else consumed
        out: list[int] = []
        while len(out) < self.global_batch:
            order = self._order(epoch)
            out += order[at : at + self.global_batch - len(out)]
            epoch, at = epoch + 1, 0
        return out

    def _after(self, epoch: int, consumed: int) -> tuple[int, int]:
        epoch_more, consumed = divmod(consumed + self.global_batch, self.dataset_len)
        return epoch + epoch_more, consumed

    def _position(self) -> int:
        return self.epoch * self.dataset_len + self.consumed

    def _lists(self, batch: list[int]) -> list[list[int]]:
        """This rank's index lists for one global batch, one per pass (a filler: its first
        sample)."""
        return [batch[m.offset : m.offset + m.size] if m.size else batch[:1] for m in self.mine]

    def __iter__(self) -> Iterator[list[int]]:
        """Batch sampler protocol: this rank's micro-batches, step after step, endlessly, from
        the current position. Make the DataLoader's iterator after restore()."""
        self._dealt_from = (self._position(), self.step)  # now, not at the first next()
        self._stale = False
        return self._deal(self.epoch, self.consumed)

    def _deal(self, epoch: int, consumed: int) -> Iterator[list[int]]:
        if not self.mine:  # exact mode, a world larger than the micro-batch count
            return
        while True:
            yield from self._lists(self.global_indices(epoch, consumed))
            epoch, consumed = self._after(epoch, consumed)

    # -- one optimizer step ---------------------------------------------------------------------
    def micro_batches(
        self, model: torch.nn.Module, batches: Iterator[Any]
    ) -> Iterator[tuple[MicroBatch, Any]]:
        """This step's passes: (MicroBatch, the loader's batch) for each; the caller runs the
        forward and `(loss * mb.scale).backward()`. Normal mode: DDP's gradient sync only on the
        last. Exact mode: each pass seeded by (step, index), the gradients summed in index order
        once the last is done. When the loop ends the step's gradients are ready for
        `optimizer.step()` and the position has moved on by one global batch."""
        self._check_dealt()
        if self.exact:
            yield from self._exact_passes(model, batches)
        else:
            yield from self._normal_passes(model, batches)
        self._finish_step()

    def _normal_passes(self, model, batches) -> Iterator[tuple[MicroBatch, Any]]:
        sync = getattr(model, "no_sync", None)
        if sync is None and self.world > 1:
            raise TypeError(
                f"GlobalBatch at a world of {self.world} needs a DistributedDataParallel model "
                f"(its all-reduce averages the ranks' gradients), got a {type(model).__name__}; "
                "or pass exact=True, which sums the gradients itself"
            )
        lists = self._lists(self.global_indices())
        for j, micro in enumerate(self.mine):
            last = j == len(self.mine) - 1
            with contextlib.nullcontext() if last or sync is None else sync():
                yield self._record(micro, lists[j]), next(batches)

    def _exact_passes(self, model, batches) -> Iterator[tuple[MicroBatch, Any]]:
        if self._sum is None:  # the first step: process-wide settings only once training
            exact_mode.check_model(model)
            exact_mode.deterministic()
            working = sum(1 for r in self.plan.ranks if r)
            self._sum = exact_mode.OrderedSum(list(model.parameters()), working)
        sync = getattr(model, "no_sync", contextlib.nullcontext)
        lists = self._lists(self.global_indices())
        self._sum.begin()
        for j, micro in enumerate(self.mine):
            with sync():
                exact_mode.seed_micro_batch(self.seed, self.step, micro.index)
                yield self._record(micro, lists[j]), next(batches)
            self._sum.after_backward()
        self._sum.finish()

    def _record(self, micro: Micro, indices: list[int]) -> MicroBatch:
        return MicroBatch(
            self.step, micro.index, micro.size, self.plan.scale(micro), tuple(indices)
        )

    def _check_dealt(self) -> None:
        """The loader's iterator must deal from this position: one made before restore()
        would train the first steps again."""
        if self._dealt_from is None:
            raise RuntimeError(
                "GlobalBatch.micro_batches(): the batches must come from "
                "iter(DataLoader(dataset, batch_sampler=this GlobalBatch))"
            )
        position, step = self._dealt_from
        expected = position + (self.step - step) * self.global_batch
        if expected != self._position() or self._stale:
            raise RuntimeError(
                "GlobalBatch.micro_batches(): the DataLoader's iterator was made before the "
                "position was restored (it deals older samples); make it after restore()"
            )

    def _finish_step(self) -> None:
        """The step is trained: the ledger (when on) records this rank's samples of it, and the
        stream moves on by one global batch."""
        if ledger.enabled():
            self._record_step()
        self.epoch, self.consumed = self._after(self.epoch, self.consumed)
        self.step += 1

    def _record_step(self) -> None:
        """This rank's samples of the step (fillers hold none), each with its epoch; steps
        counted from 1 as the sampler's (`step` finished steps before this one)."""
        if not self._sized:
            ledger.dataset_size(self.dataset_len)
            self._sized = True
        batch = self.global_indices()
        epochs, epoch, at = [], self.epoch, self.consumed
        while len(epochs) < self.global_batch:
            take = min(self.dataset_len - at, self.global_batch - len(epochs))
            epochs += [epoch] * take
            epoch, at = epoch + 1, 0
        mine = [(m.offset, m.offset + m.size) for m in self.mine if m.size]
        ledger.record(
            [e for a, b in mine for e in epochs[a:b]],
            self.step + 1,
            [i for a, b in mine for i in batch[a:b]],
        )

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools: loadable with torch.load(weights_only=True)."""
        return {
            "format": STATE_FORMAT,
            "kind": "global_batch",
            "epoch": int(self.epoch),
            "consumed": int(self.consumed),
            "step": int(self.step),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "dataset_len": int(self.dataset_len),
            "global_batch": int(self.global_batch),
            "micro_batch": int(self.micro_batch),
            "exact": bool(self.exact),
            "threads": int(torch.get_num_threads()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position, at this world. seed and shuffle come from the state
        (the stream must be the same); a dataset of another length cannot be resumed."""
        fmt = int(state.get("format", 1))
        if state.get("kind") != "global_batch" or fmt > STATE_FORMAT:
            raise ValueError(
                "this checkpoint's sampler state is not a GlobalBatch's of format "
                f"<= {STATE_FORMAT} (kind {state.get('kind')!r}, format {fmt}): restore it into "
                "what saved it"
            )
        if int(state["dataset_len"]) != self.dataset_len:
            raise ValueError(
                f"GlobalBatch state was saved for a dataset of {state['dataset_len']} samples, "
                f"this one has {self.dataset_len}: the stream cannot be resumed"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.step, self.seed = int(state["step"]), int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self._orders.clear()
        ledger.resumed(self.step)
        self._stale = self._dealt_from is not None
        threads = int(state.get("threads", 0))
        if self.exact and threads and threads != torch.get_num_threads() and self.rank == 0:
            log.warning(
                "exact_threads_changed",
                saved=threads,
                now=torch.get_num_threads(),
                action="results may differ in the last bit from here on (reductions split by "
                "thread); set torch.set_num_threads() to the same number in every world",
            )
