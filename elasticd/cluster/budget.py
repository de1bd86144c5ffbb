"""The job's restart budget, shared by every node: one signed counter in the store holding the
restarts spent and the round that last spent one, moved by compare-and-set, so that a round's
restart costs one however many of its closers try. A failure recovered in place (daemon/
inplace.py) spends from the same budget: `--max-restarts` bounds the failures a job survives,
whichever path recovered them. It only grows: this node remembers the highest
count it has seen, and a value that went down (a replay) or does not verify counts as that.
"""

from __future__ import annotations

from elasticd import names
from elasticd.cluster import kv as kvmod
from elasticd.cluster import values
from elasticd.cluster.errors import RendezvousFailed
from elasticd.cluster.sealed import Sealed


class Budget:
    def __init__(self, sealed: Sealed) -> None:
        self.sealed = sealed
        self.seen = 0  # the highest count this node has read or written

    def _key(self) -> str:
        return self.sealed.job_key(names.RESTARTS)  # of the current run: read at each call

    def used(self) -> int:
        """The budget spent so far (the highest seen, if the store does not answer now)."""
        try:
            return self.answered()
        except kvmod.Unreachable:
            return self.seen

    def answered(self) -> int:
        """The budget spent, read now: kvmod.Unreachable when the store does not answer."""
        found = self.sealed.read(self._key(), values.budget)
        self.seen = max(self.seen, found[0] if found else 0)
        return self.seen

    def spend(self, number: int) -> int:
        """Spend one restart for round `number` (its closer does, once however many closers
        try); the count after it."""
        return self._spend(number)

    def spend_in_place(self) -> int:
        """Spend one for a failure recovered in place; the count after it. One node announces
        each generation, so each recovery costs one; the round a restart last spent for stays."""
        return self._spend(None)

    def _spend(self, number: int | None) -> int:
        """One more spent, by compare-and-set: for round `number` (once per round), or for a
        recovery in place (None: every call)."""
        s, key = self.sealed, self._key()
        for _ in range(100):
            raw = s.kv.get(key)
            used, spent_for = s.open(key, raw, values.budget) or (0, -1)
            if number is not None and spent_for >= number:
                self.seen = max(self.seen, used)
                return used
            used = max(used, self.seen)
            mark = max(spent_for, 0) if number is None else number
            if s.kv.compare_set(key, raw, s.seal(key, f"{used + 1} {mark}")):
                self.seen = used + 1
                return used + 1
        raise RendezvousFailed(
            "the restart budget in the store changed 100 times while one was spent: something "
            "other than the job's nodes writes to the store"
        )

    def carry(self) -> None:
        """Raise a new run's budget to what this node saw spent in the old one: a store
        restarted empty must not give the job its restarts back."""
        s, key = self.sealed, self._key()
        for _ in range(100):
            if self.seen == 0:
                return
            raw = s.kv.get(key)
            used = (s.open(key, raw, values.budget) or (0, 0))[0]
            if used >= self.seen:
                return
            if s.kv.compare_set(key, raw, s.seal(key, f"{self.seen} 0")):
                return
