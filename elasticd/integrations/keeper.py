"""What the framework integrations share (`Keeper`): a framework's whole state kept in elasticd's
in-memory state through a CheckpointManager that never writes to disk (the framework keeps its own
disk checkpoints), refreshed at the manager's cost budget, and read back after a crash.

The refresh builds the framework's state only on the rank that keeps the node's whole state (local
rank 0); the other local ranks keep only their RNG, as `capture()` does in a plain loop. Outside
elasticd (torchrun, one process) or under `--no-memory-state` with nothing to receive, a Keeper is
inert: the script runs as without it. A refresh is offered at most once per optimizer step (not
again for a gradient accumulation's further calls); reading back is a collective; each rank's RNG
is restored where the framework is about to draw its next batch (`restore_rng`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import structlog

from elasticd import names
from elasticd.checkpoint import CheckpointManager, capture, restore
from elasticd.checkpoint.training_state import REFRESH

log = structlog.get_logger()


class Keeper:
    """One framework's state in elasticd's memory: `load()` once the process group is up (every
    rank: a collective), `refresh(step, build)` at every optimizer step (every rank: it agrees the
    cadence), `restore_rng()` where the framework is about to draw its next batch."""

    def __init__(self, key: str, every: int | None = None, budget: float = 0.0075):
        self.key = key
        self.every, self.budget = every, budget
        self.manager: CheckpointManager | None = None
        self.state: dict[str, Any] | None = None  # what load() read: user values and RNG
        self.last_step: int | None = None

    @staticmethod
    def active() -> bool:
        """Under elasticd (its in-memory state on, or a node that can receive it)."""
        return names.AGENT in os.environ and bool(os.environ.get(names.CHECKPOINT_DIR))

    def open(self) -> bool:
        if self.manager is None and self.active():
            self.manager = CheckpointManager(
                handle_sigterm=False,  # a stop is the framework's business (it saves on its own)
                memory_every=self.every,
                memory_budget=self.budget,
            )
        return self.manager is not None

    def load(self) -> Any:
        """The framework's state at the newest step held in memory (None: nothing to resume).
        A collective: every rank calls it at the same point."""
        if not self.open():
            return None
        assert self.manager is not None
        state = self.manager.load_latest()
        if state is None or self.key not in state.get("user", {}):
            return None
        self.state = state
        self.last_step = self.manager.loaded.step if self.manager.loaded else None
        log.info("framework_state_from_memory", framework=self.key, step=self.last_step)
        return state["user"][self.key]

    def restore_rng(self) -> None:
        """Every generator of this rank as it was at the step resumed (a rank without its own
        state, after a world-size change, gets a derived seed: restore())."""
        if self.state is not None:
            restore(self.state)
            self.state = None

    def refresh(self, step: int, build: Callable[[], Any]) -> None:
        """Offer `step` to the in-memory state: kept when the cadence says so; `build()` is
        called only then, and only on the rank that keeps the node's whole state."""
        if self.manager is None or step == self.last_step:
            return  # no optimizer step since the last call (gradient accumulation)
        self.last_step = step
        self.manager.maybe_save(step, lambda: self._capture(build))

    def _capture(self, build: Callable[[], Any]) -> dict[str, Any]:
        refresh = REFRESH.get()
        if refresh is not None and not refresh.whole:
            return capture()  # this local rank keeps only its own RNG
        return capture(**{self.key: build()})

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
