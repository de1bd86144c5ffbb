"""The control socket's client, in the CLI's process (`elasticd status`, `stop`, `stacks`): one
request, one reply (`request`), every failure one ControlError line that says what to do;
`ensure_ok` turns an error reply into one. It imports nothing
of the daemon's side, so the CLI stays quick and torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from elasticd.control.protocol import (
    MAX_REPLY,
    MAX_REQUEST,
    ControlError,
    NoDaemon,
    PermissionDenied,
    ProtocolError,
)


def request(path: str | os.PathLike, payload: dict, timeout: float = 5.0) -> dict:
    """Send one request and return the daemon's reply object, {"ok": false, ...} replies included.

    Raises NoDaemon when nothing listens at `path`, PermissionDenied when the socket file refuses
    this user, ProtocolError when the peer does not answer in `timeout` seconds with one JSON
    object.
    """
    where = os.fspath(path)
    data = json.dumps(payload).encode() + b"\n"
    if len(data) > MAX_REQUEST:
        raise ProtocolError(f"request larger than {MAX_REQUEST} bytes")
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(where)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            raise NoDaemon(
                f"no elasticd listens at {where}: start it, or point --socket / "
                "ELASTICD_SOCKET at the daemon's socket"
            ) from None
        except PermissionError:
            raise PermissionDenied(
                f"permission denied connecting to {where}: run as root, the daemon's user, "
                "or a member of its operators group"
            ) from None
        except (TimeoutError, BlockingIOError):
            raise ProtocolError(
                f"the daemon at {where} did not accept the connection within {timeout:g}s "
                "(its backlog is full)"
            ) from None
        except OSError as e:
            raise ControlError(f"cannot connect to {where}: {e.strerror or e}") from None
        # The daemon may have answered and closed already (a refused user): still read its reply.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
        buf = bytearray()
        try:
            while b"\n" not in buf and len(buf) <= MAX_REPLY:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                s.settimeout(remaining)
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError:
            raise ProtocolError(
                f"the daemon at {where} did not answer within {timeout:g}s"
            ) from None
        except ConnectionResetError:
            pass  # whatever complete line arrived is still good
        except OSError as e:
            raise ProtocolError(f"reading from {where}: {e.strerror or e}") from None
    line = bytes(buf).split(b"\n", 1)[0]
    if not line:
        raise ProtocolError(f"the daemon at {where} closed the connection without a reply")
    try:
        reply = json.loads(line)
    except ValueError:
        raise ProtocolError(
            f"the peer at {where} sent a reply that is not JSON (is it elasticd?)"
        ) from None
    if not isinstance(reply, dict):
        raise ProtocolError(f"the peer at {where} sent a reply that is not a JSON object")
    return reply


def ensure_ok(reply: dict) -> dict:
    """`reply` if it says ok; else ControlError with the daemon's message (PermissionDenied for
    refusals)."""
    if reply.get("ok"):
        return reply
    message = str(reply.get("error") or "the daemon refused the request")
    raise (PermissionDenied if message.startswith("permission denied") else ControlError)(message)
