"""The commands the control socket takes, by name (`COMMANDS`): which the server answers on its own
thread from the status snapshot, which it hands to the agent loop, and the checks of their fields;
and `parse_request`, which judges a request's bytes before any command sees them (never an
exception). Adding a command is an entry here (see `Command`).
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from elasticd import names
from elasticd.config import ConfigError
from elasticd.config_values import check_value
from elasticd.control.protocol import VERSION, error

if TYPE_CHECKING:
    from elasticd.control.server import ControlServer

log = structlog.get_logger("elasticd.control")


def _show(value: object) -> str:
    """A client's value quoted in an error reply: short, whatever its size or depth."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = 60
    r.maxlevel, r.maxlist, r.maxdict = 2, 4, 4
    text = r.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _status(server: ControlServer, req: dict) -> dict:
    """Served here, from the snapshot the loop last published."""
    try:
        return {"ok": True, "version": VERSION, "status": server.snapshot()}
    except Exception as e:  # noqa: BLE001
        log.error("control_snapshot_failed", error=repr(e))
        return error(f"internal error reading the status: {e!r}")


def _timeout_problem(timeout: object) -> str | None:
    """A request's `timeout`: null, or seconds the daemon honours as a stop grace (the same range:
    no nan, inf, 1e999)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return f"timeout {timeout!r} is not a number of seconds >= 0 or null"
    try:
        check_value("stop_grace", timeout, "timeout")
    except ConfigError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Command:
    """How the server handles a command: `serve(server, request)` answers it on the server's
    thread; without one, the request goes to the agent loop's `command` callback (which gives a
    reply or a Deferred). `fields` judge the request's own fields first: each gets the field's
    value (None when absent) and says what is wrong with it, or None."""

    serve: Callable[[ControlServer, dict], dict] | None = None
    fields: dict[str, Callable[[object], str | None]] = field(default_factory=dict)


# Every command the socket takes, by name: adding one is an entry here, plus its `serve`, or its
# case in the agent's callback (agent._accept_command).
COMMANDS: dict[str, Command] = {
    names.STATUS: Command(serve=_status),
    names.STOP: Command(fields={"timeout": _timeout_problem}),
    names.STACKS: Command(fields={"timeout": _timeout_problem}),
}


def parse_request(raw: bytes) -> tuple[dict, dict | None]:
    """(the request, None) when it is an object with our `version` and a known `command`; else
    ({}, the error reply saying what is wrong). Whatever the bytes (not UTF-8, not JSON, nested
    past the parser's depth, numbers too long to convert, wrong types): never an exception."""
    try:
        req = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return {}, error(f"request is not UTF-8 (byte {e.start}): send one JSON object")
    except json.JSONDecodeError as e:
        return {}, error(f"request is not a JSON object ({e.msg} at byte {e.pos})")
    except RecursionError:
        return {}, error("request is not a JSON object this daemon reads (nested too deeply)")
    except ValueError as e:  # e.g. an integer longer than Python converts
        return {}, error(f"request is not a JSON object this daemon reads ({str(e)[:100]})")
    if not isinstance(req, dict):
        return {}, error(f"request is not a JSON object (got {type(req).__name__})")
    if "version" not in req:
        return {}, error(f'request has no "version"; this daemon speaks protocol version {VERSION}')
    version = req["version"]
    if type(version) is not int or version != VERSION:
        return {}, error(
            f"unsupported protocol version {_show(version)}; this daemon speaks {VERSION}"
        )
    cmd = req.get("command")
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        return {}, error(f"unknown command {_show(cmd)}; known commands: {', '.join(COMMANDS)}")
    return req, None
