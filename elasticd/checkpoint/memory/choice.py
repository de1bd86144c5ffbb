"""Which step a resume from memory takes: one rule for both layouts. Every rank reports what it
holds, every rank runs this on the same reports, so all pick the same step without a leader.

The newest (step, lineage) first (ties: the one more of the job holds, then the larger lineage, so
that every rank picks the same), never one older than the newest disk checkpoint (the disk's is
taken then; equal: memory), and the first that the layout's own test accepts: who holds a step and
whether every rank can resume from it is the layout's to say (memory/state.py: choose, for a DDP
job's whole state, shards.choose for a sharded job's shards). (None, why) when none fits: the first
reason a newer step was passed over, which the resume's line says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def newest(
    held: dict[tuple[int, int], int], disk: int, fits: Callable[[int, int], tuple[T | None, str]]
) -> tuple[T | None, str]:
    """`held`: (step, lineage) -> how much of the job holds it (ranks, or old ranks' slots);
    `disk`: the newest disk checkpoint's step (-1: none); `fits(step, lineage)`: the layout's
    choice at that step, or (None, why not)."""
    if not held:
        return None, "no step held in memory"
    why = ""
    for (step, lineage), _count in sorted(
        held.items(), key=lambda kv: (kv[0][0], kv[1], kv[0][1]), reverse=True
    ):
        if step < disk:
            return None, why or f"disk checkpoint at step {disk} is newer"
        found, reason = fits(step, lineage)
        if found is not None:
            return found, ""
        why = why or reason
    return None, why
