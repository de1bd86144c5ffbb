"""The only way other threads and signal handlers reach the agent loop: they append to a queue
and poke a wake-up pipe (also signal.set_wakeup_fd's, so any handled signal, SIGCHLD included,
wakes the loop); the loop waits on that pipe and drains the queue from its own thread.
"""

from __future__ import annotations

import collections
import os
import select
import signal
from collections.abc import Sequence


class Inbox:
    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def post(self, item: tuple) -> None:
        """Thread- and signal-safe: deque.append is atomic, the pipe write wakes the loop."""
        self._items.append(item)
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass

    def wake_on_signals(self) -> None:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def wait(self, timeout: float, also: Sequence = ()) -> None:
        """Sleep until something is posted, a signal comes, one of `also` is readable, or `timeout`.
        The wake-up pipe is emptied only when it woke us: a timeout (the loop's every tick) costs
        no read."""
        try:
            ready = select.select([self._wake_r, *also], [], [], max(0.0, timeout))[0]
        except InterruptedError:
            ready = [self._wake_r]
        if self._wake_r not in ready:
            return
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def take(self):
        """The items posted so far, oldest first (removed as they are yielded)."""
        while self._items:
            yield self._items.popleft()
