"""The control socket's protocol, which the server (daemon) and the client (CLI) share: its version,
the size limits, the error reply and the errors either side raises (`VERSION`; `ControlError`,
`NoDaemon`, `PermissionDenied`, `ProtocolError`, `AlreadyRunning`).

Protocol (version 1): one JSON object per connection, ended by a newline or EOF; one JSON object
back on one line; then the connection closes.

    {"version": 1, "command": "status"}            -> {"ok": true, "version": 1, "status": {...}}
    {"version": 1, "command": "stop", "timeout": S} -> whatever the daemon's `command` callback says
    {"version": 1, "command": "stacks"}             -> {"ok": true, "version": 1, "stacks": [...]}
    anything else                                   -> {"ok": false, "version": 1, "error": "..."}

The commands and their fields are commands.py's `COMMANDS`; a request is judged by
commands.parse_request.
"""

from __future__ import annotations

VERSION = 1
MAX_REQUEST = 64 * 1024  # bytes; a status request is ~40
MAX_REPLY = 16 * 1024 * 1024  # the client's cap on what it reads back


class ControlError(Exception):
    """A control-socket problem, said in one line with the fix."""


class NoDaemon(ControlError):
    """Nothing listens at the socket path (missing file, connection refused)."""


class PermissionDenied(ControlError):
    """The socket file or its directory does not let this user connect."""


class ProtocolError(ControlError):
    """Something answered, but not in time or not with one JSON object."""


class AlreadyRunning(ControlError):
    """A live daemon answers at the path this server wanted."""


def error(message: str) -> dict:
    """The reply to a request that failed: `ok` false and one line saying why."""
    return {"ok": False, "version": VERSION, "error": message}
