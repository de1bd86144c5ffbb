"""A DistributedSampler that resumes mid-epoch, even at a different world size, each sample of
the epoch trained exactly once across the change: its state is the epoch and the position in it
(with the next epoch's positions carried and the optimizer steps).

`ResumableDistributedSampler` yields exactly what `torch.utils.data.DistributedSampler` yields
for the same seed, epoch and world size, so swapping it in changes nothing. It adds a position:

    sampler = ResumableDistributedSampler(dataset, seed=0, batch_size=B)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler, drop_last=True)
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)           # same epoch as the restored one: keeps the position
        for x, y in loader:
            train_step(x, y)
            sampler.advance(len(x))        # count what *training* consumed, not what was loaded

The count is explicit because a DataLoader prefetches: its sampler iterator runs ahead of the
optimizer, so "indices drawn" overstates progress. For a bit-exact resume also give the
DataLoader its own `generator=torch.Generator()`: otherwise creating an iterator draws from the
global torch RNG, which a resumed run does at a different point than the original.

How the position is kept. An epoch is one global order (the seeded permutation of the dataset),
padded or cut to a multiple of the world size W; rank r takes positions r, r+W, r+2W, ... DDP keeps
ranks in lockstep, so after every rank trained on k samples the consumed positions are exactly
the first k*W of that order. The state therefore needs one number, `consumed`: how many leading
positions of the epoch's order were trained on. It does not depend on W, which is what makes a
world-size change exact: on resume the rest of the order (positions consumed..N-1) is dealt out
over the new world size, so every sample of the epoch is trained on exactly once.

Without `batch_size`, the rest is dealt round-robin like a fresh DistributedSampler epoch: padded
by repeating samples from the start of the order (drop_last=False: up to W-1 seen twice) or cut
(drop_last=True: up to W-1 skipped), and a DataLoader with drop_last=True then drops each rank's
partial last batch. With `batch_size=B` the rest of an epoch the world changed in is dealt in whole
global batches of W*B (round-robin inside each, as DistributedSampler deals), never padded or cut:
when the rest is not a whole number of them, the last one is completed with the first positions of
the NEXT epoch's order, and that epoch starts with them consumed (`carry` in the state; it is
dealt in whole global batches too, until an epoch ends on a whole one). So every sample of such an
epoch is trained exactly once and no rank ever has a partial batch to drop. That last step holds
samples of two epochs while `epoch` still names the first: `trained()` gives each sample of the
last step its own epoch, the one to count it in (as the ledger does). An epoch that runs
from its start to its end at one world size is DistributedSampler's, in either mode.

With the ledger on (elasticd.ledger: `elasticd run --ledger`), `advance()` records which samples
this rank trained in which optimizer step, and `load_state_dict()` the step resumed from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from elasticd import ledger, names

__all__ = ["ResumableDistributedSampler", "STATE_FORMAT"]

STATE_FORMAT = 2  # 2: carry, fresh_world and step added (a format-1 state reads as carry 0)


def _world_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """From the arguments, else torch.distributed when initialized, else torchrun's env, else
    1/0. In `elasticd replay` (names.REPLAY_AS, "R/W"), the failed rank's: its samples."""
    replay_as = os.environ.get(names.REPLAY_AS, "")
    if replay_as:
        as_rank, as_world = map(int, replay_as.split("/"))
        num_replicas = as_world if num_replicas is None else num_replicas
        rank = as_rank if rank is None else rank
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = (
            dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", 1))
        )
    if rank is None:
        rank = dist.get_rank() if initialized else int(os.environ.get("RANK", 0))
    return num_replicas, rank


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler plus `advance()`, `state_dict()` and `load_state_dict()`.

    Subclassed only so `isinstance(s, DistributedSampler)` checks in other libraries still hold.
    `num_samples` / `total_size` keep DistributedSampler's meaning (a whole fresh epoch at this
    world size); `len()` is what is left of the current epoch for this rank. `batch_size`: the
    DataLoader's per-rank batch size, which makes a re-dealt epoch whole global batches.
    """

    def __init__(
        self,
        dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> None:
        num_replicas, rank = _world_and_rank(num_replicas, rank)
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.batch_size = batch_size
        # leading positions of this epoch's stream already trained on: its order, then (past the
        # end, whole global batches only) the next epochs' orders
        self.consumed = 0
        # the world this epoch is dealt at as DistributedSampler deals (it started fresh there),
        # or 0 once it is dealt in whole global batches
        self.fresh_world = num_replicas
        self.step = 0  # optimizer steps trained (advance() calls), all epochs: the ledger's step
        self._orders: dict[int, list[int]] = {}
        # the last deal: (epoch, world, rank, mode), (first position, indices, epochs)
        self._dealt: tuple[tuple, tuple[int, list[int], list[int]]] | None = None
        self._sized = False  # the ledger told the dataset's size (by a sampler that trains)
        self._advanced: tuple[int, int, int] | None = None  # the last advance: epoch, at, count

    # -- the epoch's order --------------------------------------------------------------------
    def _order(self, epoch: int | None = None) -> list[int]:
        """An epoch's global order, unpadded: what DistributedSampler pads or cuts."""
        epoch = self.epoch if epoch is None else epoch
        if epoch not in self._orders:
            n = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            kept = {e: o for e, o in self._orders.items() if e >= self.epoch}
            self._orders = {**kept, epoch: order}  # past epochs are never dealt again
        return self._orders[epoch]

    @property
    def whole_batches(self) -> bool:
        """True when the rest of this epoch is dealt in whole global batches."""
        return self.batch_size is not None and self.fresh_world != self.num_replicas

    def _remaining_count(self) -> int:
        """Positions left for the whole world: whole global batches, or padded or cut to a
        multiple of the world as DistributedSampler does."""
        left = max(0, len(self.dataset) - self.consumed)  # type: ignore[arg-type]
        if self.whole_batches:
            g = self.num_replicas * self.batch_size  # type: ignore[operator]
            return math.ceil(left / g) * g
        w = self.num_replicas
        return (left // w) * w if self.drop_last else math.ceil(left / w) * w

    def _deal(self, fresh: bool = True) -> tuple[int, list[int], list[int]]:
        """This rank's rest of the epoch from `consumed`: (the first position dealt, indices,
        the epoch of each). `fresh=False` (advance) takes the last deal of this epoch if any."""
        key = (self.epoch, self.num_replicas, self.rank, self.whole_batches)
        if self._dealt is not None and self._dealt[0] == key:
            start, indices, epochs = self._dealt[1]
            if not fresh or start == min(self.consumed, len(self._order())):
                return start, indices, epochs
        order, n, total = self._order(), len(self._order()), self._remaining_count()
        start, w = min(self.consumed, n), self.num_replicas
        positions = range(start + self.rank, start + total, w)
        if self.whole_batches:  # past the end: the next epochs' orders
            epochs = [self.epoch + p // n for p in positions]
            indices = [self._order(e)[p % n] for e, p in zip(epochs, positions)]
        else:  # past the end: padding from the start of the order, as DistributedSampler pads
            epochs = [self.epoch] * len(positions)
            indices = [order[p if p < n else (p - n) % n] for p in positions]
        self._dealt = (key, (start, indices, epochs))
        return start, indices, epochs

    def __iter__(self) -> Iterator[int]:
        return iter(self._deal()[1])

    def __len__(self) -> int:
        return self._remaining_count() // self.num_replicas

    # -- progress -----------------------------------------------------------------------------
    @property
    def carry(self) -> int:
        """Positions of the following epochs already trained (a whole global batch completed
        with them), which the next epoch starts with."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return max(0, self.consumed - n) if self.whole_batches else 0

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless it is the epoch already in progress (after
        load_state_dict), which keeps its position so the usual loop resumes mid-epoch; the
        next epoch starts past what the last global batch carried into it."""
        if epoch != self.epoch:
            carry = self.carry if epoch == self.epoch + 1 else 0
            self.consumed = carry
            self.fresh_world = 0 if carry else self.num_replicas
        self.epoch = epoch

    def advance(self, n_local: int) -> None:
        """Record that this rank trained on `n_local` more samples of the current epoch (call
        after each optimizer step with the batch's length, before saving). Every rank advances
        alike (DDP lockstep), so the world consumed `n_local * num_replicas` positions."""
        if n_local < 0:
            raise ValueError(f"advance() takes a count of samples, got {n_local}")
        self.step += 1
        self._advanced = (self.epoch, self.consumed, n_local)
        if ledger.enabled():
            self._tell_size()
            indices, epochs = self.trained()
            ledger.record(epochs, self.step, indices)
        self.consumed += n_local * self.num_replicas

    def trained(self) -> tuple[list[int], list[int]]:
        """This rank's samples of the last advance(), in the order dealt, and the epoch each
        belongs to: the epoch's own, except the next epoch's first positions that complete the
        last global batch of an epoch the world changed in (they count in that next epoch, which
        skips them). Label what a step trained with these, not with `epoch`: that batch holds
        samples of two epochs. Call it after advance(), before set_epoch()."""
        if self._advanced is None:
            return [], []
        epoch, before, n_local = self._advanced
        if epoch != self.epoch:
            raise RuntimeError("trained() tells the last advance(): call it before set_epoch()")
        start, indices, epochs = self._deal(fresh=False)
        at = (before - start) // self.num_replicas
        return indices[at : at + n_local], epochs[at : at + n_local]

    @property
    def epoch_done(self) -> bool:
        """True when the current epoch has nothing left for this world."""
        return self._remaining_count() == 0

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain ints/bools only: loadable with torch.load(weights_only=True)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return {
            "format": STATE_FORMAT,
            "epoch": int(self.epoch),
            "consumed": int(min(self.consumed, n)),  # padding consumed past the end counts as done
            "carry": int(self.carry),
            "fresh_world": int(self.fresh_world),
            "step": int(self.step),
            "world_size": int(self.num_replicas),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
            "dataset_len": int(n),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch at its next sample, at this sampler's world size and rank.

        seed and shuffle are taken from the state (the saved epoch's order must be rebuilt);
        drop_last and batch_size stay as constructed. A dataset of a different length cannot be
        resumed. At another world size than the epoch started at, the rest of the epoch is dealt
        in whole global batches (with batch_size)."""
        fmt = int(state.get("format", 1))
        if fmt > STATE_FORMAT:
            raise ValueError(
                f"sampler state format {fmt} is newer than this elasticd reads ({STATE_FORMAT})"
            )
        n = len(self.dataset)  # type: ignore[arg-type]
        if int(state["dataset_len"]) != n:
            raise ValueError(
                f"sampler state was saved for a dataset of {state['dataset_len']} samples, "
                f"this one has {n}: the epoch's order cannot be resumed"
            )
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self._orders, self._dealt, self._advanced = {}, None, None
        fresh = int(state.get("fresh_world", state.get("world_size", self.num_replicas)))
        self.fresh_world = fresh if fresh == self.num_replicas else 0
        carry = int(state.get("carry", 0)) if self.whole_batches else 0
        self.consumed = min(int(state["consumed"]), n) + carry
        self.step = int(state.get("step", 0))
        self._tell_size()
        ledger.resumed(self.step)

    def _tell_size(self) -> None:
        if not self._sized:
            ledger.dataset_size(len(self.dataset))  # type: ignore[arg-type]
            self._sized = True
