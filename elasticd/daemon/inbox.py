"""The only way other threads and signal handlers reach the agent loop: they append to a queue
and poke a wake-up pipe (also signal.set_wakeup_fd's, so any handled signal, SIGCHLD included,
wakes the loop); the loop waits on that pipe and drains the queue from its own thread. What
arrives that way most often is a stop request (Stops): from a signal or the stop command.

`Stops` takes the stop requests (a handled signal or the stop command asks for a stop with a
grace; a second one forces it). `Inbox.drain` is what the loop does with each item: one stacks
dump answers every `stacks` request waiting.
"""

from __future__ import annotations

import collections
import os
import select
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elasticd import names


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

    def drain(self, stops: Stops, stacks: Callable[[], dict]) -> None:
        """The loop's side: act on everything posted so far. A stop goes to `stops`; `elasticd
        stacks` requests, however many came, are all answered by one dump, `stacks()`."""
        asking = []
        for kind, *rest in self.take():
            if not stops.take(kind, rest) and kind == names.STACKS:
                asking.append(rest[0])
        if asking:
            reply = stacks()
            for deferred in asking:
                deferred.give(reply)


@dataclass
class StopRequest:
    grace: float  # seconds the workers get to checkpoint and exit
    force: bool = False  # a second stop signal or command: cut the grace short, even mid-teardown


class Stops:
    """The stop requests that reach the loop: a handled signal (`signals`) or the stop command
    (names.STOP, with its timeout) asks for a stop with a grace; a second one forces it. A signal
    forces at once, from its handler, as a teardown in progress does not drain the inbox."""

    def __init__(
        self, inbox: Inbox, signals: Sequence[str], grace: float, event: Callable[..., None]
    ) -> None:
        self.inbox = inbox
        self.signals = signals
        self.grace = grace  # --stop-grace: a signal's, and a stop command's without a timeout
        self.event = event  # Agent.event: logged and shown in status
        self.request: StopRequest | None = None

    def install_signals(self) -> None:
        self.inbox.wake_on_signals()
        for name in (*self.signals, "SIGCHLD"):
            signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGCHLD:
            return  # the wake-up fd already woke the loop
        if self.request is not None:
            self.request.force = True  # a second signal: cut the grace short even mid-teardown
        self.inbox.post(("signal", signum))

    def take(self, kind: str, rest: list) -> bool:
        """Act on an item of the inbox if it asks for a stop (a signal or the stop command)."""
        if kind == "signal":
            self.ask(self.grace, f"signal {signal.Signals(rest[0]).name}")
        elif kind == names.STOP:
            timeout = rest[0] if rest and rest[0] is not None else self.grace
            self.ask(float(timeout), "stop command")
        else:
            return False
        return True

    def ask(self, grace: float, why: str) -> None:
        if self.request is not None:
            self.request.force = True
            self.event("stop_forced", why=why)
            return
        self.request = StopRequest(grace)
        self.event("stop_requested", why=why, grace=grace)

    def forced(self) -> bool:
        return self.request is not None and self.request.force
