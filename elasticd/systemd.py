"""sd_notify without libsystemd: READY, STATUS, WATCHDOG, STOPPING, EXTEND_TIMEOUT_USEC.

WATCHDOG=1 must be sent only from the agent's main loop, so a wedged loop starves systemd's
watchdog and gets the daemon restarted; this module has no thread of its own.
"""

from __future__ import annotations

import os
import socket

from elasticd import logs

log = logs.get("elasticd.systemd")
_warned = False


def notify(*lines: str) -> bool:
    """Send one datagram to $NOTIFY_SOCKET; False (and no error) when there is none."""
    global _warned
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or not lines:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError as e:
        if not _warned:
            _warned = True
            log.warning("sd_notify_failed", socket=os.environ.get("NOTIFY_SOCKET"), error=str(e))
        return False


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC (systemd's advice), if the watchdog is meant for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


def status(text: str) -> bool:
    return notify(f"STATUS={text}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def stopping() -> bool:
    return notify("STOPPING=1")


def extend_timeout(seconds: float) -> bool:
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")
