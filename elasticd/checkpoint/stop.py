"""SIGTERM (`elasticd stop`) as a request to save at the next step boundary and stop (`StopState`,
one per process), with a watchdog thread, woken through the signal wakeup fd, that still ends a
rank that can never reach one."""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import socket
import threading
import time

from elasticd import names
from elasticd.worker import heartbeat


@dataclasses.dataclass
class StopState:
    """This process's stop request and step boundaries. SIGTERM is per process, so there is one,
    PROCESS, shared by the handler, its watchdog thread and every CheckpointManager."""

    requested: threading.Event = dataclasses.field(default_factory=threading.Event)
    boundary: float = 0.0  # monotonic time of the latest step boundary
    gaps: collections.deque[float] = dataclasses.field(  # the latest times between two
        default_factory=lambda: collections.deque(maxlen=20)
    )
    handler_pid: int = 0  # the process that installed the handler (a fork child installs anew)
    watchdog_fds: list[socket.socket] = dataclasses.field(
        default_factory=list
    )  # kept open for its life

    def at_boundary(self) -> None:
        now = time.monotonic()
        if self.boundary:
            self.gaps.append(now - self.boundary)
        self.boundary = now

    def forget_boundaries(self) -> None:
        """A forked child has not reached any boundary of its own yet."""
        self.boundary = 0.0
        self.gaps.clear()


PROCESS = StopState()
os.register_at_fork(after_in_child=PROCESS.forget_boundaries)


def request_stop() -> None:
    """What SIGTERM does: ask the loop to save at its next step boundary and stop."""
    PROCESS.requested.set()


def stop_requested() -> bool:
    """This process's own flag (not agreed across ranks; CheckpointManager.should_stop is)."""
    return PROCESS.requested.is_set()


def _abandoned() -> bool:
    """elasticd is restarting the group after a failure (a peer is dead or hung): the step in
    progress can never finish and the state since the last step is already in memory, so
    SIGTERM keeps its default meaning instead of waiting for a boundary that will not come."""
    return heartbeat.marked(os.environ.get(names.HEARTBEAT_FILE), "abandon")


def install_sigterm_handler(stop_timeout: float = 10.0) -> bool:
    """Turn SIGTERM into a stop request the loop honours at its next step boundary (save, exit 0).
    Not when elasticd marked the group abandoned (a restart after a failure): then it ends the
    process at once, as SIGTERM's default would.

    A rank that cannot reach a boundary (stuck in a collective with a dead peer) must still die
    promptly, as SIGTERM's default would: a watchdog thread woken by the signal itself
    (signal.set_wakeup_fd, which works while the main thread is blocked in C++) ends the process
    with status 143 when no step boundary follows within max(stop_timeout, 3 x the longest of
    the last 20 steps). A second SIGTERM ends it at once. Main thread only; returns False
    elsewhere or when something else (an asyncio loop) owns the wakeup fd, in which case only the
    flag is set."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if PROCESS.handler_pid == os.getpid():
        return True
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if PROCESS.requested.is_set() or _abandoned():  # second SIGTERM, or a restart: the default
            _default_action(previous, signum, frame)
            return
        PROCESS.requested.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    PROCESS.handler_pid = os.getpid()
    pair = _own_wakeup_fd()
    if pair is None:  # someone else's: go without the watchdog
        return True
    reader, writer = pair
    os.register_at_fork(after_in_child=_after_fork_in_child)
    threading.Thread(
        target=_watchdog,
        args=(reader, os.getpid(), stop_timeout),
        name="elasticd-sigterm-watchdog",
        daemon=True,
    ).start()
    PROCESS.watchdog_fds.extend([reader, writer])
    return True


def _default_action(previous, signum, frame) -> None:
    """SIGTERM's meaning before ours: the previous handler, or the default (the process ends)."""
    signal.signal(signal.SIGTERM, previous if callable(previous) else signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def _own_wakeup_fd() -> tuple[socket.socket, socket.socket] | None:
    """A socket pair whose write end is the signal wakeup fd, so a thread wakes on SIGTERM even
    while the main thread is blocked in C++; None (and the fd left as it was) where something
    else (an asyncio loop) owns the wakeup fd."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        old = -2
    if old != -1:  # someone else's; put it back
        if old >= 0:
            signal.set_wakeup_fd(old)
        reader.close()
        writer.close()
        return None
    return reader, writer


def _watchdog(reader: socket.socket, pid: int, stop_timeout: float) -> None:
    """Woken by every signal this process handles: after a SIGTERM, end the process unless a
    step boundary follows in time (see install_sigterm_handler)."""
    while True:
        try:
            got = reader.recv(64)
        except OSError:
            return
        if os.getpid() != pid or not got:
            return
        if signal.SIGTERM not in got:
            continue
        if _abandoned():  # the main thread may be blocked in C++ and never run the handler
            os._exit(128 + signal.SIGTERM)
        _await_boundary(time.monotonic(), stop_timeout)
        return  # the loop is alive and will save and stop by itself


def _await_boundary(signalled: float, stop_timeout: float) -> None:
    """Return once a step boundary follows `signalled`; end the process when none does within
    max(stop_timeout, 3 x the longest recent step)."""
    while PROCESS.boundary <= signalled:
        limit = max(stop_timeout, 3 * max(PROCESS.gaps, default=0.0))
        if time.monotonic() - signalled > limit:
            os.write(
                2,
                f"elasticd.checkpoint: SIGTERM and no step boundary within {limit:.0f}s; "
                "exiting\n".encode(),
            )
            os._exit(128 + signal.SIGTERM)
        time.sleep(0.05)


def _after_fork_in_child() -> None:
    """A forked DataLoader worker must not wake our watchdog."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
