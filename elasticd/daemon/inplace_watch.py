"""The in-place path's look-out for another node's recovery, on a thread of its own: one blocking
wait on the round's workers' store for the next generation's waiting counter
(names.in_place_waiting_key), which every rank that unwinds adds to and the daemon that announces
the generation creates first (inplace.announce_generation). `inplace.follow` reads the store only
once that key is there, instead of at every tick of the agent loop.

Why: a look at every tick was two requests (check, then read) about 10 times a second per daemon,
on group rank 0's store, which its workers use too: thousands a second at a thousand nodes. The
wait is one request held by the server, renewed every WAIT seconds; the server answers it the
moment the key is set, and the answer wakes the loop through its inbox, so the follower looks no
later than before (bench/store_load.py; docs/in-place.md#several-nodes).

A watch belongs to one round (its store); the loop drops it for the next round's, and the old
thread ends after its wait, at most WAIT later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from elasticd import logs, names
from elasticd.cluster.kv import Unreachable
from elasticd.lifecycle import supervise

log = logs.get("elasticd.agent")

WAIT = 30.0  # seconds one wait is held by the store before it is asked again
RETRY = 1.0  # seconds after an unreachable store before the next try
LOOK = "in_place_look"  # the inbox item that wakes the loop (Inbox.drain ignores it)


class Watch:
    """The wait for one round's next generations; the loop says which (`due`) and learns whether
    the store has word of it, and the thread tells the loop the moment it does."""

    def __init__(self, number: int, host: str, port: int, post: Callable[[tuple], None]):
        self.number, self.host, self.port = number, host, port
        self._post = post
        self.wanted: int | None = None  # the generation the loop waits for (it writes)
        self.seen = -1  # the latest generation whose waiting key was there (the thread writes)
        self.ended = False
        self._changed = threading.Event()
        self._thread = supervise.thread("in-place-watch", self._run)
        self._thread.start()

    def due(self, generation: int) -> bool:
        """Whether the store has word of `generation` (ranks wait for it, or it is announced):
        only then is it worth a read."""
        if self.wanted != generation:
            self.wanted = generation
            self._changed.set()
        return self.seen >= generation

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    def _run(self) -> None:
        from elasticd.cluster.tcpstore import TCPStoreKV, tcp_connector

        where = f"{self.host}:{self.port}"
        kv = TCPStoreKV(tcp_connector(self.host, self.port), where, WAIT)
        while not self.ended:
            gen = self.wanted
            if gen is None or gen <= self.seen:
                self._changed.wait(WAIT)
                self._changed.clear()
                continue
            try:
                there = kv.wait(names.in_place_waiting_key(gen), WAIT)
            except Unreachable as e:
                log.debug("in_place_watch_unreachable", store=where, error=str(e))
                self._changed.wait(RETRY)
                self._changed.clear()
                continue
            if there and not self.ended:
                self.seen = max(self.seen, gen)
                self._post((LOOK, gen))
        kv.close()
