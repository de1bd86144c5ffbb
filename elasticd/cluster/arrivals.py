"""A round's arrival records: the counter that numbers them (a hint only: it cannot be signed),
the record a node claims at its number, and the records found from the counter (or, once someone
raised it past any real number, by listing the round's keys); the nodes waiting to join.

The counter's key carries a tag derived from the secret, and is set back when it holds no number;
past MAX + 64 numbers the records are found by listing. A record is claimed create-only, and each
is read once: one that does not verify joins `bad`, never read again. `Arrivals` keeps what this
node has read of them (its own state, no one else's); `counter` serves the exit barrier too.
"""

from __future__ import annotations

import time

from elasticd.cluster import kv as kvmod
from elasticd.cluster import values
from elasticd.cluster.errors import RendezvousFailed
from elasticd.cluster.rounds import Round
from elasticd.cluster.sealed import Sealed
from elasticd.cluster.values import MAX_COUNT


class Arrivals:
    """One node's reading of the rounds' arrival records."""

    def __init__(self, sealed: Sealed, max_nodes: int) -> None:
        self.sealed = sealed
        self.cap = max_nodes + 64  # past this many numbers the counter is not believed
        self.bad: set[str] = set()  # records that failed verification: never read again
        self.waiting_seen: tuple[int, dict[str, str | None]] = (-1, {})  # per round: key -> id
        self.listed_at = 0.0  # when a round's records were last listed (counter raised too far)

    def forget(self) -> None:
        """A new round, or a new run: the keys held are of earlier ones, never read again."""
        self.bad.clear()

    def reset(self) -> None:
        """A new run: nothing read in the old one counts."""
        self.forget()
        self.waiting_seen, self.listed_at = (-1, {}), 0.0

    def claim(self, number: int, record: str) -> int:
        """Take an arrival number and write our record there, create-only: a number whose key
        holds anything already (a forger's value) is skipped, so no one can make our record go
        unread by writing there first. The number is only a hint for finding records."""
        s = self.sealed
        roll = s.arrivals_key(number)
        for _ in range(self.cap):
            index = counter(s, s.kv, roll, number, take=True)
            key = s.arrival_key(number, index)
            if s.kv.compare_set(key, None, s.seal(key, record)):
                return index
        raise RendezvousFailed(
            f"every arrival number of round {number} this node took was already written: "
            f"something other than the job's nodes writes to the store at {s.endpoint}"
        )

    def new_records(
        self, number: int, known: set[str], store: kvmod.KV | None = None, first: int = 1
    ) -> list[str]:
        """Keys of round `number`'s arrival records from number `first` on not yet read (nor
        rejected). From the counter while it is believable; past MAX + 64 numbers someone raised
        it, and the records are found by listing the round's keys (at most every half second)."""
        s = self.sealed
        store = store or s.kv
        arrived = counter(s, store, s.arrivals_key(number), number, take=False)
        if arrived <= self.cap:
            keys = [s.arrival_key(number, i) for i in range(first, arrived + 1)]
        else:
            now = time.monotonic()
            if now - self.listed_at < 0.5:
                return []
            self.listed_at = now
            prefix = s.arrival_key(number, 0)[:-1]
            keys = sorted(store.keys(prefix), key=lambda k: (len(k), k))
        return [k for k in keys if k not in known and k not in self.bad]

    def read_records(self, keys: list[str], store: kvmod.KV | None = None) -> dict[str, dict]:
        """The records at `keys` that verify; a key that holds one that does not joins `bad`."""
        found = {}
        for key, raw in zip(keys, (store or self.sealed.kv).multi_get(keys)):
            if raw is None:
                continue  # taken, not written yet
            rec = self.sealed.open(key, raw, values.record)
            if rec is None:
                self.bad.add(key)
            else:
                found[key] = rec
        return found

    def waiting_ids(self, store: kvmod.KV, rnd: Round) -> list[str]:
        """Nodes that arrived after the round closed and wait for the next one: records that
        verify, of nodes that are not members. Each record is read once (the liveness thread asks
        every second: a new arrival costs one read, none costs the counter's)."""
        if self.waiting_seen[0] != rnd.number:
            self.waiting_seen = (rnd.number, {})
        seen = self.waiting_seen[1]
        new = self.new_records(rnd.number, set(seen), store, first=first_late(rnd))[:16]
        if new:
            found = self.read_records(new, store)
            seen.update({k: found[k]["id"] if k in found else None for k in new})
        ids = {m.node_id for m in rnd.members}
        return sorted({i for i in seen.values() if i is not None and i not in ids})


def first_late(rnd: Round) -> int:
    """The arrival number of the first node to come after round `rnd` closed: its members claimed
    the numbers before it."""
    return (rnd.claimed or rnd.group_world_size) + 1


def counter(s: Sealed, store: kvmod.KV, key: str, number: int, take: bool) -> int:
    """A counter's next number (take) or its count. One that holds no number, or one below zero
    (someone wrote over it: its numbers would fall outside every reader's range), is set back
    above every arrival record of round `number` (the barrier's counter, to 0)."""
    for _ in range(2):
        try:
            value = store.take(key) if take else store.taken(key)
            if value >= int(take):
                return value
            raw = str(value).encode()
        except kvmod.BadCounter as e:
            raw = e.raw
            if kvmod.counts(raw):  # read after another node set it back (and took): take again,
                continue  # never set it back over their number (two nodes holding one number)
        s.rejected(key, "not a count")
        floor = 0
        if key == s.arrivals_key(number):
            prefix = s.arrival_key(number, 0)[:-1]
            floor = max(
                (int(k[len(prefix) :]) for k in store.keys(prefix) if k[len(prefix) :].isdigit()),
                default=0,
            )
        store.compare_set(key, raw, str(min(floor, MAX_COUNT)).encode())
    raise kvmod.Unreachable(f"store {s.endpoint}: {key} keeps being overwritten")
