"""A node that comes to join a round with room for it is seen by the round's nodes within a beat:
the arrival waiter (cluster/peers.py) blocks on the key the node claims its arrival record at,
where the once-a-second look at the waiting nodes (WAITING_EVERY) saw it up to a second later,
and a join in place waited for that look. Real Rendezvous and Peers over an in-process store
(kv.LocalKV), the late node claiming its number as cluster/joining.py does."""

from __future__ import annotations

import json
import threading
import time

from elasticd.cluster import kv, rendezvous
from elasticd.cluster.peers import WAITING_EVERY, Peers
from elasticd.cluster.rounds import Member, Round
from harness import rdzv_config


def _arrive(rz: rendezvous.Rendezvous, number: int) -> int:
    record = {"id": rz.node_id, "nproc": 1, "addr": "127.0.0.1", "prev": -1, "link": 0}
    return rz.arrivals.claim(number, json.dumps(record))


def test_a_node_that_comes_to_join_is_seen_within_a_beat():
    cfg = rdzv_config("1:2")
    store = kv.LocalKV()
    host = rendezvous.Rendezvous(cfg, store=store, begins_run=True)
    assert _arrive(host, 0) == 1  # the round's one member
    rnd = Round(0, 0, [Member(host.node_id, 1, "127.0.0.1")])
    rnd.claimed = 1
    host.last = rnd
    woken = threading.Event()
    peers = Peers(cfg, host, host.node_id, wake=woken.set)  # its liveness thread answers `late`
    try:
        late = rendezvous.Rendezvous(cfg, store=store.clone(), begins_run=False)
        t0 = time.monotonic()
        peers.new_round(rnd)  # its once-a-second look is due WAITING_EVERY from here
        time.sleep(0.1)
        assert _arrive(late, 0) == 2
        while peers.waiting != (0, [late.node_id]) and time.monotonic() < t0 + 5:
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert peers.waiting == (0, [late.node_id]) and woken.is_set()
        # the look alone sees it no sooner than WAITING_EVERY after new_round
        assert took < WAITING_EVERY - 0.1, took
    finally:
        peers.close()
