"""A tiny watcher that outlives a SIGKILLed daemon just long enough to kill its workers' tree:
a process started with a pipe from the daemon, which kills every process carrying the daemon's
token when the pipe closes.

The bootstrap's parent-death signal takes the workers down with the daemon, but not what they
started (DataLoader workers, subprocesses). The daemon starts this guard with a pipe on its stdin;
the pipe closes however the daemon dies, and the guard then kills every process that carries the
daemon's ELASTICD_AGENT token, and exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

from elasticd import names


def sweep(token: str, rounds: int = 50, pause: float = 0.05) -> int:
    """Kill every process carrying `token` until none is left (bounded). Returns how many died."""
    me, killed = os.getpid(), 0
    for _ in range(rounds):
        found = []
        for p in psutil.process_iter():
            if p.pid == me:
                continue
            try:
                if p.environ().get(names.AGENT) == token and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    found.append(p)
            except psutil.Error:
                continue
        if not found:
            return killed
        killed += len(found)
        psutil.wait_procs(found, timeout=1)
        time.sleep(pause)
    return killed


def main() -> None:
    token = sys.argv[1]
    # Ctrl-C on the daemon's terminal or a SIGTERM to its process group must not end the guard.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    sweep(token)


if __name__ == "__main__":
    main()
