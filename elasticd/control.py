"""The control socket: a Unix-socket JSON server (one thread) and the client the CLI uses.

One JSON request per connection, with a `version`; one JSON reply, then the connection closes.
The server only reads the immutable snapshot the agent loop publishes and hands commands to the
loop's inbox: it never changes daemon state itself. Admission is by peer credentials
(SO_PEERCRED): root, the daemon's own user, or members of the operators group.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import socket
import struct
import threading
from pathlib import Path
from typing import Callable

from elasticd import logs

log = logs.get("elasticd.control")

VERSION = 1
MAX_REQUEST = 64 * 1024
READ_TIMEOUT = 2.0
_UCRED = struct.Struct("3i")  # pid, uid, gid


class ControlError(Exception):
    """A control-socket problem, said in one line."""


class NoDaemon(ControlError):
    """Nothing listens at the socket path."""


def default_socket_path() -> Path:
    """$ELASTICD_SOCKET; systemd's RuntimeDirectory; /run/elasticd for root; else per user."""
    if os.environ.get("ELASTICD_SOCKET"):
        return Path(os.environ["ELASTICD_SOCKET"])
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]) / "control.sock"
    if os.geteuid() == 0:
        return Path("/run/elasticd/control.sock")
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base, "elasticd", "control.sock") if base else Path(f"/tmp/elasticd-{os.geteuid()}/control.sock")


def member_of(uid: int, gid: int, group: str | None) -> bool:
    if not group:
        return False
    try:
        g = grp.getgrnam(group)
    except KeyError:
        return False
    if gid == g.gr_gid:
        return True
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    return name in g.gr_mem or g.gr_gid in os.getgrouplist(name, gid)


def admitted(uid: int, gid: int, daemon_uid: int, operators_group: str | None) -> bool:
    """Root, the daemon's user, or a member of the operators group."""
    return uid == 0 or uid == daemon_uid or member_of(uid, gid, operators_group)


class ControlServer:
    def __init__(self, path, snapshot: Callable[[], dict], command: Callable[[dict], dict],
                 operators_group: str | None = None):
        self.path = Path(path)
        self.snapshot = snapshot
        self.command = command
        self.operators_group = operators_group
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, mode=0o700)
        if self.path.exists() or self.path.is_symlink():
            try:
                request(self.path, {"version": VERSION, "command": "status"}, timeout=1.0)
            except NoDaemon:
                self.path.unlink()  # stale: its daemon is gone
            except ControlError:
                raise ControlError(f"another elasticd is running at {self.path}: stop it, or pass --socket") from None
            else:
                raise ControlError(f"another elasticd is running at {self.path}: stop it, or pass --socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # Bind under a private name in the same directory with a tight umask, fix the mode, then
        # rename into place: the socket is never reachable at its public path with looser rights.
        # (umask is process-wide, but only this thread binds while the loop has not spawned yet.)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        old = os.umask(0o177)
        try:
            sock.bind(str(tmp))
        except OSError as e:
            sock.close()
            raise ControlError(f"cannot create the control socket {self.path} ({e.strerror}): pass a writable --socket") from None
        finally:
            os.umask(old)
        mode = 0o600
        if self.operators_group:
            try:
                os.chown(tmp, -1, grp.getgrnam(self.operators_group).gr_gid)
                mode = 0o660
            except (KeyError, PermissionError) as e:
                sock.close()
                tmp.unlink()
                raise ControlError(f"operators group {self.operators_group!r} cannot own the socket ({e}): "
                                   "create the group or fix --operators-group") from None
        os.chmod(tmp, mode)
        os.rename(tmp, self.path)
        sock.listen(16)
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="elasticd-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    self._handle(conn)
                except Exception as e:  # noqa: BLE001 - one bad client must not end the server
                    log.warning("control_request_failed", error=str(e))

    def _handle(self, conn: socket.socket) -> None:
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        # Read the (bounded) request even from a refused peer: closing with unread data would
        # reset the connection and the peer would never see why it was refused.
        conn.settimeout(READ_TIMEOUT)
        data = b""
        try:
            while b"\n" not in data and len(data) <= MAX_REQUEST:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        except (TimeoutError, OSError):
            return _reply(conn, {"ok": False, "error": "request not received in time"})
        if not admitted(uid, gid, os.geteuid(), self.operators_group):
            log.warning("control_refused", uid=uid, pid=pid)
            group = f"in group {self.operators_group}" if self.operators_group else "in the operators group"
            return _reply(conn, {"ok": False, "error": f"permission denied: uid {uid} is not root, the daemon's user, or {group}"})
        if len(data) > MAX_REQUEST:
            return _reply(conn, {"ok": False, "error": f"request larger than {MAX_REQUEST} bytes"})
        try:
            req = json.loads(data)
            if not isinstance(req, dict):
                raise ValueError
        except ValueError:
            return _reply(conn, {"ok": False, "error": "request is not a JSON object"})
        if req.get("version") != VERSION:
            return _reply(conn, {"ok": False, "error": f"unsupported protocol version {req.get('version')!r}; this daemon speaks {VERSION}"})
        cmd = req.get("command")
        if cmd == "status":
            return _reply(conn, {"ok": True, "version": VERSION, "status": self.snapshot()})
        if cmd == "stop":
            return _reply(conn, {"version": VERSION, **self.command(req)})
        return _reply(conn, {"ok": False, "error": f"unknown command {cmd!r}; use status or stop"})


def _reply(conn: socket.socket, obj: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(obj, default=str).encode() + b"\n")


def request(path, payload: dict, timeout: float = 5.0) -> dict:
    """One request, one reply. NoDaemon when nothing listens; ControlError for anything else."""
    path = str(path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            try:
                s.connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                raise NoDaemon(f"no daemon listens at {path}") from None
            except PermissionError:
                raise ControlError(f"permission denied opening {path}: run as the daemon's user, root, "
                                   "or a member of its operators group") from None
            s.sendall(json.dumps(payload).encode() + b"\n")
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        raise ControlError(f"the daemon at {path} did not answer within {timeout:g}s") from None
    except OSError as e:
        raise ControlError(f"control socket {path}: {e.strerror or e}") from None
    try:
        return json.loads(data)
    except ValueError:
        raise ControlError(f"the daemon at {path} sent an unreadable reply") from None
