"""A DistributedSampler that resumes mid-epoch, even at a different world size.

`ResumableDistributedSampler` yields exactly what `torch.utils.data.DistributedSampler` yields
for the same seed, epoch and world size, so swapping it in changes nothing. It adds a position:

    sampler = ResumableDistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler)
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
round-robin over the new world size, so every sample of the epoch is trained on exactly once.

Padding (drop_last=False): like DistributedSampler, the rest is padded by repeating samples from
the start of the epoch's order until every rank has the same count, so up to W-1 samples are seen
twice in that epoch. With drop_last=True up to W-1 samples at the end of the order are skipped
instead. With an unchanged world size both rules reproduce DistributedSampler's epoch exactly.
Later epochs use the new world size as DistributedSampler would.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ResumableDistributedSampler", "STATE_FORMAT"]

STATE_FORMAT = 1


def _world_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """From the arguments, else torch.distributed when initialized, else torchrun's env, else
    1/0."""
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
    world size); `len()` is what is left of the current epoch for this rank.
    """

    def __init__(
        self,
        dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
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
        self.consumed = 0  # leading positions of this epoch's global order already trained on

    # -- the epoch's order --------------------------------------------------------------------
    def _order(self) -> list[int]:
        """The epoch's global order, unpadded: what DistributedSampler pads or cuts."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def _remaining_count(self) -> int:
        """Positions left for the whole world, after padding or cutting to a multiple of it."""
        left = max(0, len(self.dataset) - self.consumed)  # type: ignore[arg-type]
        w = self.num_replicas
        return (left // w) * w if self.drop_last else math.ceil(left / w) * w

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        n = len(order)
        rest = order[min(self.consumed, n) :]
        total = self._remaining_count()
        if total > len(rest):  # pad from the start of the order, as DistributedSampler does
            pad = total - len(rest)
            rest += (order * math.ceil(pad / n))[:pad]
        else:
            rest = rest[:total]
        return iter(rest[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self._remaining_count() // self.num_replicas

    # -- progress -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless it is the epoch already in progress (after
        load_state_dict), which keeps its position so the usual loop resumes mid-epoch."""
        if epoch != self.epoch:
            self.consumed = 0
        self.epoch = epoch

    def advance(self, n_local: int) -> None:
        """Record that this rank trained on `n_local` more samples of the current epoch (call
        after each step with the batch's length). Every rank advances alike (DDP lockstep), so
        the world consumed `n_local * num_replicas` positions."""
        if n_local < 0:
            raise ValueError(f"advance() takes a count of samples, got {n_local}")
        self.consumed += n_local * self.num_replicas

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
            "world_size": int(self.num_replicas),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
            "dataset_len": int(n),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch at its next sample, at this sampler's world size and rank.

        seed and shuffle are taken from the state (the saved epoch's order must be rebuilt);
        drop_last stays as constructed. A dataset of a different length cannot be resumed."""
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
        self.consumed = min(int(state["consumed"]), n)
