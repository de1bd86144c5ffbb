"""How the agent loop waits: in one place (`Waits.idle`), woken by its inbox, doing at every wake-up
the chores the loop owes meanwhile (systemd's watchdog fed here only, so that a wedged loop starves
it); and how it makes a long blocking call (store connect, rendezvous join, exit barrier) on a
helper thread while it goes on waiting that way (`Waits.blocking`), which a stop request can leave
(`Interrupted`). `Waits.idle` waits for a deadline or a condition.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from elasticd.daemon.inbox import Inbox


class Interrupted(Exception):
    """A stop request left a blocking call."""


class Waits:
    def __init__(
        self,
        inbox: Inbox,
        interval: float,
        chores: Callable[[], None],
        waitables: Callable[[], Sequence],
        stopping: Callable[[], bool],
        notify: Callable[[], Any],
    ) -> None:
        self.inbox = inbox
        self.interval = interval  # monitor_interval: the longest the loop sleeps
        self.chores = chores  # feed the watchdog, take forked spares, answer the inbox
        self.waitables = waitables  # more to wake on (the fork server's connection)
        self.stopping = stopping  # a stop was requested
        self.notify = notify  # elasticd.daemon.systemd once serve() wires it, else None
        self._next_watchdog = 0.0

    def idle(
        self, until: float, done: Callable[[], bool] | None = None, *, stoppable: bool = True
    ) -> None:
        """The loop's one way to wait: until `done()` holds (checked before every wait), the
        monotonic deadline `until` passes or, if `stoppable`, a stop is requested; without
        `done`, until the first wake-up (the running loop looks at its workers after each). It
        wakes at least every `interval`, and at once for a signal (SIGCHLD too), a command, a
        helper thread's result or a spare, and each time feeds the watchdog and does the loop's
        chores. (The peers'
        liveness beats on a thread of its own, peers.py, whatever the loop does.)"""
        while not (done and done()) and (left := until - time.monotonic()) > 0:
            self.inbox.wait(min(left, self.interval), also=self.waitables())
            self._feed_watchdog()
            self.chores()
            if done is None or (stoppable and self.stopping()):
                return

    def _feed_watchdog(self) -> None:
        notify = self.notify()
        if notify is not None and time.monotonic() >= self._next_watchdog:
            interval = notify.watchdog_interval()
            if interval:
                notify.watchdog()
                self._next_watchdog = time.monotonic() + interval
            else:
                self._next_watchdog = float("inf")

    def blocking(self, fn, *args, stoppable: bool = True):
        """Run `fn(*args)` on a helper thread while the loop idles and, if `stoppable`, leave it
        (Interrupted) when a stop is requested. Workers are still spawned from the loop's thread:
        the parent-death signal the bootstrap arms fires when the thread that forked it exits."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def call():
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the loop
                box["error"] = e
            finally:
                done.set()
                self.inbox.post(("wake",))

        threading.Thread(target=call, name="elasticd-rendezvous", daemon=True).start()
        self.idle(math.inf, done.is_set, stoppable=stoppable)
        if stoppable and self.stopping():
            raise Interrupted()
        if "error" in box:
            raise box["error"]
        return box["value"]
