"""How one optimizer step's global batch is split into micro-batches over the ranks: pure
functions of (global batch G, micro-batch m, world W), so the rules are table- and property-tested
(tests/unit/shared/test_global_batch.py) and every rank computes the same split alone.

A global batch is G consecutive positions of the epochs' seeded order (elasticd.global_batch).
It is cut into micro-batches, each at most m samples and a contiguous run of those positions,
numbered in position order; each rank computes its micro-batches one after the other (gradient
accumulation) and the gradients are summed over all of them. Two rules:

- Normal mode (`split`): G is shared as evenly as the world allows (ranks differ by at most one
  sample), and every rank runs the same number of forward/backward passes, `a = ceil(largest
  share / m)`: DDP's reducer and its buffer broadcast at every forward need the ranks in lockstep.
  A rank whose share is smaller than `a` (only with m = 1, or a world larger than G) fills the gap
  with *filler* passes: one sample computed with loss weight 0, so the step still trains on
  exactly G samples.
- Exact mode (`split_exact`): the micro-batches do not depend on W (K = ceil(G / m) of them,
  sizes differing by at most one), so each is the same samples, keyed by the same index, in every
  world; only who computes which changes: contiguous runs of indices, rank 0 first, counts
  differing by at most one. A world larger than K leaves ranks K..W-1 without a micro-batch: they
  only take part in the reduction (elasticd.exact's `OrderedSum`).

A `Plan` gives each micro-batch's loss weight (`Plan.scale`) and the one line an uneven split
says (`Plan.note`).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Micro", "Plan", "split", "split_exact"]


@dataclasses.dataclass(frozen=True)
class Micro:
    """One forward/backward pass of a rank: micro-batch `index` of the step, the positions
    `offset`..`offset+size-1` of the global batch. A filler (`size` 0) computes the global batch's
    first sample with loss weight 0 and trains on nothing."""

    index: int
    offset: int
    size: int

    @property
    def filler(self) -> bool:
        return self.size == 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """The split of one global batch for a world: `ranks[r]`, rank r's passes in order."""

    global_batch: int
    micro_batch: int
    world: int
    exact: bool
    ranks: tuple[tuple[Micro, ...], ...]

    def scale(self, micro: Micro) -> float:
        """The loss weight that makes the summed gradient the mean over the global batch, for a
        loss that is the mean over its micro-batch: size/G, times W in normal mode, where DDP's
        all-reduce averages (divides by W) what the ranks sum."""
        if micro.filler:
            return 0.0
        return micro.size * (1 if self.exact else self.world) / self.global_batch

    def samples(self, rank: int) -> int:
        return sum(m.size for m in self.ranks[rank])

    def note(self) -> str | None:
        """The one line that says the world does not divide the global batch evenly (None when
        it does): what each rank takes instead."""
        shares = [self.samples(r) for r in range(self.world)]
        counts = [sum(not m.filler for m in rk) for rk in self.ranks]
        fillers = [sum(m.filler for m in rk) for rk in self.ranks]
        if self.exact and len(set(counts)) == 1:
            return None
        if not self.exact and len(set(shares)) == 1 and not any(fillers):
            return None
        head = f"global batch {self.global_batch} over {self.world} ranks"
        if self.exact:
            k = sum(counts)
            idle = counts.count(0)
            what = (
                f"{k} micro-batches of at most {self.micro_batch}: "
                f"{_runs(counts, 'micro-batch', 'micro-batches')} per rank"
            )
            if idle:
                what += f"; {idle} rank(s) compute none and only join the gradient sum"
        else:
            what = f"{_runs(shares, 'sample', 'samples')} per rank"
            if any(fillers):
                what += (
                    f", {len(self.ranks[0])} pass(es) each; {sum(fillers)} filler pass(es) "
                    "of one sample at loss weight 0 keep DDP's ranks in step"
                )
        return f"{head} does not divide evenly: {what}; each step still trains on exactly " + (
            f"{self.global_batch} samples"
        )


def _runs(values: list[int], one: str, many: str) -> str:
    """[3, 3, 2] -> '3 samples (ranks 0-1), 2 (rank 2)'."""
    parts, start = [], 0
    for r in range(1, len(values) + 1):
        if r == len(values) or values[r] != values[start]:
            who = f"rank {start}" if r - start == 1 else f"ranks {start}-{r - 1}"
            unit = (one if values[start] == 1 else many) if not parts else ""
            parts.append(f"{values[start]}{' ' + unit if unit else ''} ({who})")
            start = r
    return ", ".join(parts)


def _check(global_batch: int, micro_batch: int, world: int) -> None:
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number of samples >= 1, got {value!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be >= 1, got {world!r}")


def _even(total: int, parts: int) -> list[int]:
    """`total` in `parts` sizes differing by at most one, the larger first."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def split(global_batch: int, micro_batch: int, world: int) -> Plan:
    """Normal mode: even shares, the same number of passes on every rank (see the module)."""
    _check(global_batch, micro_batch, world)
    shares = _even(global_batch, world)
    passes = math.ceil(shares[0] / micro_batch)
    ranks, index, offset = [], 0, 0
    for share in shares:
        work = min(share, passes)  # passes that carry samples; the rest are fillers
        mine = []
        for size in _even(share, work) if work else []:
            mine.append(Micro(index, offset, size))
            index, offset = index + 1, offset + size
        mine += [Micro(-1, 0, 0)] * (passes - work)
        ranks.append(tuple(mine))
    return Plan(global_batch, micro_batch, world, False, tuple(ranks))


def split_exact(global_batch: int, micro_batch: int, world: int) -> Plan:
    """Exact mode: micro-batches fixed by G and m alone, dealt in contiguous runs (module)."""
    _check(global_batch, micro_batch, world)
    k = math.ceil(global_batch / micro_batch)
    sizes = _even(global_batch, k)
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    counts = _even(k, world) if world <= k else [1] * k + [0] * (world - k)
    ranks, first = [], 0
    for count in counts:
        ranks.append(tuple(Micro(i, offsets[i], sizes[i]) for i in range(first, first + count)))
        first += count
    return Plan(global_batch, micro_batch, world, True, tuple(ranks))
