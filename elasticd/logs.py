"""structlog setup: one event per line, JSON off a terminal, readable on one; stdlib (torch)
logs routed through it, the one escaping of worker-produced text (`printable`), and `Throttle`.

Every event carries the daemon's context (run id, node, restart count) from one process-wide dict
the agent loop updates, so events from the control thread carry it too. torch's stdlib logging
goes through the same renderer.

Text a worker produced (its output, error file, exception message) reaches the operator's
terminal only through `printable`, so it can neither drive the terminal (ESC/CSI/OSC sequences,
C1 controls) nor start a line that looks like one of the daemon's own.

`Throttle` says an event at most once per key per minute where someone outside (a client of the
metrics port, a worker) can repeat its cause, with how many were held back.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from typing import Any

import structlog

_context: dict[str, Any] = {}

# C0 controls but tab, DEL, C1 controls: what a terminal interprets instead of printing.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def printable(text: str, keep: str = "") -> str:
    """`text` with every control character shown escaped (ESC as `\\x1b`, CR as `\\r`) except
    tab and those in `keep` (a multi-line text keeps "\\n"). Backslashes stay as they are, so
    escaping twice changes nothing: callers need not know whether a text was escaped already."""

    def show(m: re.Match) -> str:
        c = m.group()
        return c if c in keep else _NAMED.get(c) or f"\\x{ord(c):02x}"

    return _CONTROL.sub(show, text)


def _printable_values(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """The console renderer prints string values raw (repr() escapes the others): escape them,
    keeping the lines of a traceback."""
    for k, v in event.items():
        if isinstance(v, str):
            event[k] = printable(v, keep="\n" if k == "exception" else "")
    return event


def bind(**values: Any) -> None:
    """Set daemon-wide context fields (run_id, node, restart, ...) on every later event."""
    _context.update(values)


def _add_context(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for k, v in _context.items():
        event.setdefault(k, v)
    return event


def setup(fmt: str = "auto", level: int = logging.INFO, stream=None) -> None:
    """fmt: 'json', 'console' or 'auto' (console on a TTY)."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    # JSON escapes every control character itself; the console renderer needs _printable_values.
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    escape = [] if fmt == "json" else [_printable_values]
    shared = [
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_context,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, *escape, renderer],
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                *escape,
                renderer,
            ],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    # torch's elastic pieces log at INFO what we already say ourselves; keep their warnings.
    logging.getLogger("torch").setLevel(logging.WARNING)


def adopt_torch() -> None:
    """Once torch is imported: its loggers write through our handler (one event per line, with
    the daemon's context), not through the stderr handlers torch's logging setup gives its
    registered loggers ("torch", "torch.distributed", ...; the "__" artifact loggers stay off)."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (
            name.split(".")[0] == "torch"
            and isinstance(logger, logging.Logger)
            and "__" not in name
        ):
            logger.handlers.clear()
            logger.propagate = True


def get(name: str = "elasticd") -> Any:
    return structlog.get_logger(name)


class Throttle:
    """At most one event per key every `interval` seconds, however often someone outside (a
    client of the metrics port, a worker) repeats its cause: `throttle(key)` is None while the
    key is held back, else how many were held back since the last one said."""

    def __init__(self, interval: float = 60.0) -> None:
        self.interval = interval
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, key: str) -> int | None:
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(key, 0.0):
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._next[key] = now + self.interval
            return self._held.pop(key, 0)
