"""structlog setup: one event per line, JSON off a terminal, readable on one.

Every event carries the daemon's context (run id, node, restart count) from one process-wide dict
the agent loop updates, so events from the control thread carry it too. torch's stdlib logging
goes through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_context: dict[str, Any] = {}


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
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    shared = [
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_context,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
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
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger) and "__" not in name:
            logger.handlers.clear()
            logger.propagate = True


def get(name: str = "elasticd") -> Any:
    return structlog.get_logger(name)
