"""The exit barrier: the nodes of a round whose workers all succeeded leave together. Each node
writes its done key and takes a number of the round's done counter; the last to arrive checks
every node's done key, once (N nodes each reading N keys would be O(N^2)), and sets the one key
every node waits on. The others check only if that key is late (a forged count, a last node that
died), after BARRIER_GRACE. A restart request ends the wait too.
"""

from __future__ import annotations

import time

from elasticd import names
from elasticd.cluster import arrivals, values
from elasticd.cluster.rounds import Round
from elasticd.cluster.sealed import Sealed
from elasticd.cluster.timing import BARRIER_GRACE, LOOK_WAIT, WAIT_SLICE


def exit_barrier(s: Sealed, rnd: Round, timeout: float) -> bool:
    """Wait until every node of the round is done (or one asked for a restart). False on
    timeout."""
    if rnd.group_world_size == 1:
        return True
    job, n = s.scope, rnd.group_world_size
    mine = names.done_key(job, rnd.number, rnd.group_rank)
    s.kv.set(mine, s.seal(mine, "1"))
    done_count = s.round_key(rnd.number, names.DONE_COUNT)
    arrival = count = arrivals.counter(s, s.kv, done_count, rnd.number, take=True)
    all_done = s.round_key(rnd.number, names.ALL_DONE)
    started = time.monotonic()
    deadline = started + timeout
    while True:
        if count >= n and (arrival >= n or time.monotonic() - started >= BARRIER_GRACE):
            keys = [names.done_key(job, rnd.number, g) for g in range(n)]
            if all(s.open(k, raw, values.done) for k, raw in zip(keys, s.kv.multi_get(keys))):
                s.kv.set(all_done, s.seal(all_done, "1"))
                return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if s.kv.wait(all_done, min(WAIT_SLICE, left)) and s.open(
            all_done, s.kv.get(all_done), values.done
        ):
            return True
        restart = s.round_key(rnd.number, names.RESTART)
        if s.kv.wait(restart, LOOK_WAIT) and s.read(restart, values.reason) is not None:
            return True  # a node asked for a restart (looked for with a wait: see LOOK_WAIT)
        count = arrivals.counter(s, s.kv, done_count, rnd.number, take=False)
