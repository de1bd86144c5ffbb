"""sd_notify over `$NOTIFY_SOCKET`, without libsystemd: READY, STATUS, WATCHDOG, STOPPING,
EXTEND_TIMEOUT_USEC; and the watchdog interval (`watchdog_interval()`).

Every function is a no-op returning False outside systemd (no $NOTIFY_SOCKET), so the daemon calls
them unconditionally. Sending never raises: a lost notification must not take the daemon down
(the first failure is logged as a warning, later ones are silent).

For the agent loop (the module has no thread of its own, on purpose):
  * `ready(...)` once the control socket serves (Type=notify waits for it);
  * `status(...)` on state changes (what `systemctl status` shows);
  * `watchdog()` every `watchdog_interval()` seconds, ONLY from the main loop, so a wedged loop
    starves systemd's watchdog (WatchdogSec) and gets the daemon restarted; a helper thread
    feeding it would keep a dead loop looking alive;
  * `stopping()` then `extend_timeout(s)` when a stop begins, repeated while it lasts;
  * `child_env(env)` for every worker's environment: the notify socket and watchdog belong to
    the daemon (NotifyAccess=main would drop a worker's messages anyway, with log noise).
"""

from __future__ import annotations

import math
import os
import socket

import structlog

from elasticd import names

log = structlog.get_logger("elasticd.systemd")

SEND_TIMEOUT = 1.0  # seconds; a datagram to a wedged systemd must not stall the loop for long
# The service manager's per-process variables: never inherited by workers.
PRIVATE_ENV = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)

_warned = False
_MAX_USEC = 2**64 - 2  # systemd's USEC_INFINITY (2**64 - 1) would mean "no timeout at all"


def _address(value: str) -> str | bytes:
    """$NOTIFY_SOCKET as a socket address: a path, or '@name' for the abstract namespace."""
    return b"\0" + os.fsencode(value[1:]) if value.startswith("@") else value


def notify(*lines: str) -> bool:
    """Send `lines` ("KEY=VALUE") as one datagram to $NOTIFY_SOCKET; True if it was sent.

    Newlines inside a line become spaces, so a status text cannot smuggle in other assignments.
    """
    global _warned
    target = os.environ.get("NOTIFY_SOCKET")
    if not target or not lines:
        return False
    message = "\n".join(line.replace("\n", " ") for line in lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.settimeout(SEND_TIMEOUT)
            s.sendto(message, _address(target))
        return True
    except (OSError, ValueError) as e:
        if not _warned:
            _warned = True
            log.warning(
                "sd_notify_failed",
                socket=target,
                error=str(e),
                note="later failures are not logged",
            )
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

    None when there is no watchdog, the value is unusable, or WATCHDOG_PID names another process
    (the variables leaked to us from a parent that owns them).
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


def ready(status: str | None = None) -> bool:
    """Startup is done: systemd marks the unit active (Type=notify)."""
    return notify("READY=1", f"STATUS={status}") if status else notify("READY=1")


def status(text: str) -> bool:
    """Free-form one-line status shown by `systemctl status`."""
    return notify(f"STATUS={text}")


def watchdog() -> bool:
    """Keep-alive ping; call from the agent's main loop only (see the module docstring)."""
    return notify("WATCHDOG=1")


def stopping(status: str | None = None) -> bool:
    """A stop has begun: systemd shows 'deactivating' and stops expecting READY."""
    return notify("STOPPING=1", f"STATUS={status}") if status else notify("STOPPING=1")


def extend_timeout(seconds: float) -> bool:
    """Ask for `seconds` more before systemd's current start/stop timeout fires (counted from now).

    Resend before it runs out to keep extending; systemd never extends past what is asked.
    Clamped, never raising: negative or nan asks for nothing more, inf or a huge value for the
    most a uint64 of microseconds holds (a stop must not crash the daemon on its way out).
    """
    try:
        usec = float(seconds) * 1_000_000
    except OverflowError:  # an int beyond any float
        usec = math.inf
    usec = 0 if math.isnan(usec) else int(min(max(usec, 0.0), _MAX_USEC))
    return notify(f"EXTEND_TIMEOUT_USEC={usec}")


def child_env(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` without the service manager's per-process variables (see PRIVATE_ENV),
    and with the user's TORCH_CPP_LOG_LEVEL where the daemon set its own (logs.quiet_torch_cpp)."""
    out = {k: v for k, v in env.items() if k not in PRIVATE_ENV and k != USER_CPP_LOG_LEVEL}
    if USER_CPP_LOG_LEVEL in env:
        user = env[USER_CPP_LOG_LEVEL]
        if user:
            out["TORCH_CPP_LOG_LEVEL"] = user
        else:
            out.pop("TORCH_CPP_LOG_LEVEL", None)
    return out


USER_CPP_LOG_LEVEL = names.USER_CPP_LOG_LEVEL


def quiet_torch_cpp() -> None:
    """Before the daemon imports torch: torch's C++ warnings off (a store call to a dead host
    prints a C++ stack per call, and the daemon says what happened in one line itself). What the
    user had set is kept aside for the workers (child_env)."""
    if USER_CPP_LOG_LEVEL not in os.environ:
        os.environ[USER_CPP_LOG_LEVEL] = os.environ.get("TORCH_CPP_LOG_LEVEL", "")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
