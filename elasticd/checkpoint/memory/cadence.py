"""How often the in-memory state is refreshed (Cadence): a share of training time, measured, from
what refreshes cost against the step time (the budget: CheckpointManager's `memory_budget`).
Torch-free.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections import deque


@dataclasses.dataclass
class Cadence:
    """How often the in-memory state is refreshed: at every step that is a multiple of `every`.

    With a `budget` (a share of training time), `every` follows what refreshes cost here: the
    smallest N with (refresh time) / (N x step time) <= budget. A small state on long steps is
    refreshed every step; a big one on short steps is refreshed less often instead of slowing
    every step, and a crash then loses about refresh time / budget of work at most. Step time is
    measured between the training loop's calls, so checkpoint work is not counted as training.
    Every rank must refresh at the same steps (a resume needs a step all ranks hold): the caller
    agrees on the largest proposal() over the ranks and hands it to adopt() on all of them."""

    every: int = 1
    budget: float | None = None
    costs: deque = dataclasses.field(
        default_factory=lambda: deque(maxlen=WINDOW)
    )  # refreshes at this `every`
    steps: deque = dataclasses.field(default_factory=lambda: deque(maxlen=15))
    left: float | None = None  # when the caller went back to training
    measured: tuple[float, float] = (
        0.0,
        0.0,
    )  # (refresh, step) seconds that decided the last change

    def step_began(self) -> None:
        now = time.monotonic()
        if self.left is not None:
            self.steps.append(now - self.left)

    def step_ended(self) -> None:
        self.left = time.monotonic()

    def proposal(self) -> int:
        """This rank's N. A refresh that mapped a slot is not counted (the caller leaves it
        out); of the others the lower quartile stands for the cost, since a refresh is only ever
        slowed down by the rest of the machine (a preempted copy, workers warming up after a
        start). Refreshes are compared only at the same N: a refresh after N steps of training
        finds colder caches than one after a single step and costs more (10-15% more at N=3 than
        at N=1 for the recovery bench's model), and a few slow samples must not raise N (nor
        the start-up's, when every step is slow). Hence N is proposed from a full window of
        refreshes at the current N, or as soon as the last five cost four times the budget or
        more (a big state, or one that grew: no reason to wait)."""
        if self.budget is None or len(self.costs) < 5 or len(self.steps) < 5:
            return self.every
        allowed = self.budget * max(self.step_time(), 1e-6)  # refresh seconds per step
        recent = sorted(itertools.islice(reversed(self.costs), 5))[
            1
        ]  # the last five, one fast outlier aside
        if recent >= 4 * self.every * allowed:
            return math.ceil(recent / allowed - 1e-9)
        if len(self.costs) < self.costs.maxlen:
            return self.every
        return max(1, math.ceil(self.cost() / allowed - 1e-9))

    def cost(self) -> float:
        return sorted(self.costs)[len(self.costs) // 4] if self.costs else 0.0

    def step_time(self) -> float:
        return statistics.median(self.steps) if self.steps else 0.0

    def adopt(self, agreed: int) -> bool:
        """Take the agreed N when it is a quarter larger or smaller (no creeping or flapping
        between neighbours), and measure refreshes afresh at it. Returns whether `every`
        changed."""
        if 4 * agreed >= 5 * self.every or 5 * agreed <= 4 * self.every:
            self.measured = (self.cost(), self.step_time())
            self.every = agreed
            self.costs.clear()
            return True
        return False


WINDOW = 25  # refreshes at one cadence that settle it (see Cadence.proposal)
