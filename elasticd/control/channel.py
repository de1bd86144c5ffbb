"""The control socket: a Unix-socket JSON server (one thread) and the client the CLI uses.

Protocol (version 1): one JSON object per connection, ended by a newline or EOF; one JSON object
back on one line; then the connection closes.

    {"version": 1, "command": "status"}            -> {"ok": true, "version": 1, "status": {...}}
    {"version": 1, "command": "stop", "timeout": S} -> whatever the daemon's `command` callback says
    {"version": 1, "command": "stacks"}             -> {"ok": true, "version": 1, "stacks": [...]}
    anything else                                   -> {"ok": false, "version": 1, "error": "..."}

The server only *reads* the immutable snapshot the agent loop publishes and hands commands to the
loop through the `command` callback (which must only enqueue): it never changes daemon state, so
the loop stays the single writer. A command the loop must carry out before it can answer (stacks)
gets a Deferred: the connection waits, without holding up the server's thread, until the loop
gives the reply or the Deferred's timeout passes. Admission is by the peer's kernel credentials
(SO_PEERCRED): root, the daemon's own user, or members of the operators group. One thread
multiplexes every connection with `selectors`, each with a hard deadline, so a slow or hostile
client neither wedges the server nor delays another client. Every malformed request gets an
error reply (never a dropped connection), and idle connections are capped per process, per user
and for the daemon's own workers together (`_over_limit`), so nobody can fill the table for the
others: root and the daemon's user are served whatever the workers and the operators group hold.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import pwd
import reprlib
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import structlog

from elasticd import names
from elasticd.config import ConfigError
from elasticd.config_values import check_value
from elasticd.daemon import supervise

log = structlog.get_logger("elasticd.control")

VERSION = 1
MAX_REQUEST = 64 * 1024  # bytes; a status request is ~40
MAX_REPLY = 16 * 1024 * 1024  # the client's cap on what it reads back
READ_TIMEOUT = (
    1.0  # seconds a connection may take to send its whole request (the CLI sends it at once)
)
WRITE_TIMEOUT = 2.0  # seconds it may take to read its reply
# Connections open at once; a newcomer beyond a cap gets "busy" at once. Root and the daemon's
# user (outside the daemon's tree) are held only to their own caps, so the others cannot fill the
# table on them; the daemon's descendants (workers and what they start) share one small cap.
MAX_CONNECTIONS = 64  # from everyone but root and the daemon's user
PER_PROCESS = 8  # a client may ask a few things at once (a monitor, `stacks` from several threads)
PER_USER = 16
PER_WORKERS = 8
ACCEPT_PER_TURN = 8  # connections taken from the backlog before serving those already open
_UCRED = struct.Struct("=iII")  # struct ucred: pid_t pid, uid_t uid, gid_t gid
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 for the NUL


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


def default_socket_path() -> Path:
    """Where the daemon listens and the CLI looks when no --socket is given.

    $ELASTICD_SOCKET; else systemd's RuntimeDirectory (first entry); else /run/elasticd for root;
    else a per-user directory, so an unprivileged daemon needs no setup: $XDG_RUNTIME_DIR/elasticd,
    else /tmp/elasticd-UID (or, where someone else took that name first, see _tmp_dir).
    """
    if os.environ.get(names.SOCKET):
        return Path(os.environ[names.SOCKET])
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return Path(runtime) / "control.sock"
    if os.geteuid() == 0:
        return Path("/run/elasticd/control.sock")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "elasticd" / "control.sock"
    return _tmp_dir() / "control.sock"


TMP = Path("/tmp")


def _tmp_dir() -> Path:
    """/tmp/elasticd-UID, unless it is there and not this user's private directory (another user
    made it first, or a symlink, or others may write to it): then this user's own
    /tmp/elasticd-UID-XXXXXXXX, an existing one or else a new random name. Only this user can
    have made such a directory, so the daemon and the CLI agree on it, and a squatter can neither
    keep the daemon from starting nor pose as it."""
    primary = TMP / f"elasticd-{os.geteuid()}"
    if not os.path.lexists(primary) or _private(primary):
        return primary
    ours = _tmp_fallbacks()
    return ours[0] if ours else primary.with_name(f"{primary.name}-{secrets.token_hex(4)}")


def _tmp_fallbacks() -> list[Path]:
    """This user's private /tmp/elasticd-UID-* directories, by name."""
    prefix = f"elasticd-{os.geteuid()}-"
    try:
        found = sorted(n for n in os.listdir(TMP) if n.startswith(prefix))
    except OSError:
        return []
    return [TMP / n for n in found if _private(TMP / n)]


def _private(d: Path) -> bool:
    """A real directory (not a symlink) of this user that nobody else may write to."""
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _trusted(d: Path) -> bool:
    """May sockets in `d` be taken for daemons? Only where no one but this user or root can put
    them: a directory of either (through a symlink of either) that others may not write to."""
    try:
        link, st = os.lstat(d), os.stat(d)
    except OSError:
        return False
    owners = (0, os.geteuid())
    return (
        link.st_uid in owners
        and st.st_uid in owners
        and stat.S_ISDIR(st.st_mode)
        and not st.st_mode & 0o022
    )


SYSTEM_DIR = Path("/run/elasticd")  # the service's socket directory (the unit's RuntimeDirectory)


def second_socket_path(first: Path, run_id: str) -> Path:
    """Where a daemon listens when another daemon of this user holds the default socket (two jobs
    on one node): beside it, named after its run, so neither needs a flag."""
    return first.with_name(f"control-{run_id}.sock")


def find_daemons() -> list[Path]:
    """The daemons a CLI call without --socket may mean: $ELASTICD_SOCKET alone where it is set;
    else every live control.sock / control-RUN.sock in the default directory and, for a user
    other than root (an operator), in the service's directory; and in this user's own
    /tmp/elasticd-UID-* (see _tmp_dir). A socket file nobody listens on (a daemon that was
    SIGKILLed), or in a directory someone else could have put it in (_trusted), is left out."""
    if os.environ.get(names.SOCKET):
        return [Path(os.environ[names.SOCKET])]
    default = default_socket_path().parent
    dirs = dict.fromkeys(
        [default, *(_tmp_fallbacks() if default.parent == TMP else ()), SYSTEM_DIR]
    )
    found = []
    for d in filter(_trusted, dirs):
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        for name in entries:
            if name == "control.sock" or (name.startswith("control-") and name.endswith(".sock")):
                try:
                    request(d / name, {"version": VERSION, "command": names.STATUS}, timeout=2.0)
                except NoDaemon:
                    continue
                except ControlError:
                    pass  # something listens that refuses us or is slow: the caller will say so
                found.append(d / name)
    return found


# --- admission -------------------------------------------------------------------------------


def admitted(
    uid: int, gid: int, daemon_uid: int, operators_gid: int | None, groups: Iterable[int] = ()
) -> bool:
    """Root, the daemon's own user, or a member of the operators group (primary gid or `groups`).

    Pure, so the policy is testable without sockets or users; `peer_groups` does the lookup.
    """
    if uid == 0 or uid == daemon_uid:
        return True
    if operators_gid is None:
        return False
    return gid == operators_gid or operators_gid in groups


def peer_groups(uid: int, gid: int) -> frozenset[int]:
    """The groups the user database gives `uid` (primary + supplementary); {gid} for unknown uids.

    SO_PEERCRED carries only the peer's primary gid, so supplementary membership comes from
    pwd/grp (NSS), the same source `id USER` uses.
    """
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return frozenset({gid})
    try:
        return frozenset(os.getgrouplist(name, gid))
    except OSError:
        return frozenset({gid})


def resolve_group(group: str | None) -> int | None:
    """The gid of an operators group given by name (or number); ControlError when unknown."""
    if not group:
        return None
    try:
        return grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ControlError(
            f"operators group {group!r} does not exist: create it (groupadd {group}) "
            "or unset operators_group"
        ) from None


def refusal(uid: int, operators_group: str | None) -> str:
    """The error a refused peer reads."""
    if operators_group:
        return f"permission denied: uid {uid} is not root, the daemon's user, or in group {operators_group}"
    return (
        f"permission denied: uid {uid} is not root or the daemon's user "
        "(set operators_group to admit a group)"
    )


# --- server ----------------------------------------------------------------------------------


class Deferred:
    """A reply the agent loop gives later, from its own thread (`give`)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.reply: dict | None = None
        self._wake: Callable[[], None] = lambda: None

    def give(self, reply: dict) -> None:
        self.reply = reply
        self._wake()


@dataclass
class _Conn:
    sock: socket.socket
    uid: int
    deadline: float
    pid: int = 0
    bucket: str = ""  # "workers", or "uid N": whose connection cap it counts against
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytes = b""  # set once the reply is known; the connection then only writes
    waiting: Deferred | None = None  # a reply the loop has yet to give


class ControlServer:
    """Serves status and forwards commands on a Unix socket, from one daemon thread.

    `snapshot()` returns the latest published status dict (read-only here); `command(request)`
    enqueues the request for the agent loop and returns the immediate reply. Both run on the
    server thread and must be quick: neither may wait for the loop.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        snapshot: Callable[[], dict],
        command: Callable[[dict], dict],
        operators_group: str | None = None,
    ):
        self.path = Path(path)
        self.snapshot = snapshot
        self.command = command
        self.operators_group = operators_group or None
        self._gid: int | None = None
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we linked

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lifecycle --

    def start(self) -> None:
        """Create the socket (never reachable with looser rights than final) and start serving.

        Raises AlreadyRunning if a live daemon answers at the path, ControlError for anything
        else that needs the operator (unknown group, unusable directory, path too long).
        """
        if self._thread is not None or self._closed:
            raise RuntimeError("a ControlServer starts once; make a new one after close()")
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            raise ControlError(
                f"control socket path {self.path} is longer than {_SUN_PATH_MAX} bytes: "
                "choose a shorter --socket"
            )
        self._gid = resolve_group(self.operators_group)
        self._prepare_parent()
        self._clear_stale()
        self._listener = self._bind()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = supervise.thread("control", self._serve)
        self._thread.start()
        log.info(
            "control_socket_listening", path=str(self.path), operators_group=self.operators_group
        )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close every connection, unlink the socket (only if still ours). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._poke()
            self._thread.join(timeout)
            if self._thread.is_alive():  # a callback is stuck; the thread is a daemon thread
                log.warning("control_thread_did_not_stop", timeout=timeout)
        if self._listener is not None and not self.running:
            self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0 and not (self._thread and self._thread.is_alive()):
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self._identity is not None:
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._identity:  # not a successor's socket
                    os.unlink(self.path)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- socket creation --

    def _prepare_parent(self) -> None:
        """Make sure the directory exists and nobody but us (or root) can swap files in it."""
        parent = self.path.parent
        created = False
        if not os.path.lexists(parent):
            try:
                parent.mkdir(parents=True, mode=0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise ControlError(
                    f"cannot create the socket directory {parent} ({e.strerror}): "
                    "create it or pass a writable --socket"
                ) from None
            else:
                created = True
                os.chmod(parent, 0o700)  # exact, whatever the umask
        me = os.geteuid()
        st = os.lstat(parent)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            raise ControlError(
                f"socket directory {parent} is a symlink of uid {st.st_uid}, who could point it "
                "elsewhere: remove it, or pass another --socket"
            )
        try:
            st = os.stat(parent)
        except OSError as e:
            raise ControlError(
                f"socket directory {parent} cannot be used ({e.strerror}): pass another --socket"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ControlError(f"{parent} is not a directory: pass another --socket")
        self._say_if_squatted(parent)
        if st.st_uid not in (0, me):
            raise ControlError(
                f"socket directory {parent} belongs to uid {st.st_uid}, who could replace the "
                "socket: use a directory owned by this user or root"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise ControlError(
                f"socket directory {parent} is writable by others without the sticky bit, so "
                "they could replace the socket: use a private directory (chmod go-w)"
            )
        if self._gid is None:
            return
        runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        ours = created or (runtime and Path(runtime) == parent)
        if ours and st.st_uid == me:
            # systemd creates RuntimeDirectory as root:root 0750: hand the group to the operators
            # so they can reach the socket; the directory holds nothing but the socket.
            os.chown(parent, -1, self._gid)
            os.chmod(parent, (0o750 if created else stat.S_IMODE(st.st_mode)) | 0o010)
        elif not (st.st_mode & 0o001 or (st.st_mode & 0o010 and st.st_gid == self._gid)):
            log.warning(
                "control_socket_dir_closed_to_operators",
                directory=str(parent),
                operators_group=self.operators_group,
                fix=f"chgrp {self.operators_group} {parent} && chmod g+x {parent}",
            )

    @staticmethod
    def _say_if_squatted(parent: Path) -> None:
        """A daemon listening in a /tmp/elasticd-UID-* directory says why (see _tmp_dir)."""
        primary = TMP / f"elasticd-{os.geteuid()}"
        if parent.parent != TMP or not parent.name.startswith(f"{primary.name}-"):
            return
        try:
            owner = os.lstat(primary).st_uid
        except OSError:
            return
        log.warning(
            "control_socket_dir_taken",
            taken=str(primary),
            owner_uid=owner,
            directory=str(parent),
            fix=f"remove {primary} (someone else made it first), or set XDG_RUNTIME_DIR or ELASTICD_SOCKET",
        )

    def _clear_stale(self) -> None:
        """Refuse if a live daemon answers at the path; remove a socket file nobody listens on."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlError(
                f"{self.path} exists and is not a socket: remove it or pass another --socket"
            )
        try:
            request(self.path, {"version": VERSION, "command": names.STATUS}, timeout=1.0)
        except NoDaemon:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise ControlError(
                    f"stale socket {self.path} cannot be removed ({e.strerror}): "
                    "remove it or pass another --socket"
                ) from None
            log.info("control_stale_socket_removed", path=str(self.path))
            return
        except PermissionDenied:
            raise ControlError(
                f"{self.path} is a socket this user may not connect to (another user's "
                "elasticd?): pass another --socket"
            ) from None
        except ControlError as e:  # it accepted us: something is alive there
            raise AlreadyRunning(
                f"another elasticd is running at {self.path} ({e}): stop it, "
                "or give this one another --socket"
            ) from None
        raise AlreadyRunning(
            f"another elasticd is running at {self.path}: stop it with "
            f"`elasticd stop --socket {self.path}`, or give this one another --socket"
        )

    def _bind(self) -> socket.socket:
        """Bind inside a fresh 0700 directory, set mode and group there, then hard-link into place.

        Why not a umask around bind(): umask is process-wide, so it would race with files other
        threads create. Why not fchmod before bind(): only Linux honours it. A private directory
        makes the socket unreachable by anyone else until it has its final mode; link() then
        publishes it atomically and, unlike rename(), fails if another daemon won the path
        meanwhile instead of silently replacing its socket.
        """
        mode = 0o660 if self._gid is not None else 0o600
        parent = self.path.parent
        private = parent / f".{secrets.token_hex(3)}"
        tmp = private / "s"
        try:
            os.mkdir(private, 0o700)
        except OSError as e:
            raise ControlError(
                f"cannot create the control socket in {parent} ({e.strerror}): "
                "pass a writable --socket"
            ) from None
        sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM
        )  # close-on-exec: workers never see it
        try:
            try:
                sock.bind(os.fspath(tmp))
            except OSError as e:
                raise ControlError(
                    f"cannot create the control socket {self.path} ({e.strerror or e}): "
                    "pass a writable, shorter --socket"
                ) from None
            if self._gid is not None:
                try:
                    os.chown(tmp, -1, self._gid)
                except PermissionError:
                    raise ControlError(
                        f"this user may not give the control socket to group "
                        f"{self.operators_group}: join the group or run as root"
                    ) from None
            os.chmod(tmp, mode)
            sock.listen(64)
            sock.setblocking(False)
            self._publish(tmp)
        except BaseException:
            sock.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with contextlib.suppress(OSError):
                os.rmdir(private)
        return sock

    def _publish(self, tmp: Path) -> None:
        for _ in range(3):
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                self._clear_stale()  # raises if the newcomer is alive, else removes it; try again
                continue
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                    raise ControlError(
                        f"cannot create the control socket {self.path} ({e.strerror})"
                    ) from None
                os.rename(
                    tmp, self.path
                )  # no hard links on this filesystem; the path was just checked
            st = os.lstat(self.path)
            self._identity = (st.st_dev, st.st_ino)
            return
        raise ControlError(
            f"{self.path} keeps being recreated by another process: pass another --socket"
        )

    # -- serving --

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        conns: dict[int, _Conn] = {}
        listener = self._listener
        assert listener is not None
        sel.register(listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = min((c.deadline for c in conns.values()), default=now + 1.0) - now
                for key, events in sel.select(max(0.0, timeout)):
                    if key.fileobj is listener:
                        self._accept(sel, conns)
                    elif key.fileobj == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 64)
                    else:
                        conn = conns.get(key.fd)
                        if conn is not None:
                            self._safe_step(sel, conns, conn, events)
                now = time.monotonic()
                for conn in [
                    c for c in conns.values() if c.waiting and c.waiting.reply is not None
                ]:
                    self._respond(sel, conns, conn, {"version": VERSION, **conn.waiting.reply})
                for conn in [c for c in conns.values() if c.deadline <= now]:
                    if not (
                        conn.out or conn.waiting
                    ):  # its request may have come in this very turn
                        self._safe_step(sel, conns, conn, selectors.EVENT_READ)
                        if conn.out or conn.waiting or conn.sock.fileno() not in conns:
                            continue
                    if conn.out:
                        self._drop(sel, conns, conn)  # it does not read its reply; give up
                    elif conn.waiting:
                        self._respond(
                            sel,
                            conns,
                            conn,
                            _error(
                                f"the daemon did not answer within "
                                f"{conn.waiting.timeout:g}s; check its logs"
                            ),
                        )
                    else:
                        self._respond(
                            sel,
                            conns,
                            conn,
                            _error(f"request not received within {READ_TIMEOUT:g}s"),
                        )
        finally:  # a crash goes on to supervise.thread, which serves again with the same listener
            for conn in list(conns.values()):
                self._drop(sel, conns, conn)
            sel.close()

    def _poke(self) -> None:
        """Wake the server's select (from another thread); a full pipe already will."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"d")

    def _accept(self, sel: selectors.BaseSelector, conns: dict[int, _Conn]) -> None:
        """Take the waiting connections, a few per turn: a peer that keeps connecting must not
        keep the loop from reading the requests of those already in."""
        assert self._listener is not None
        for _ in range(ACCEPT_PER_TURN):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: keep serving the connections we have
                log.warning("control_accept_failed", error=e.strerror)
                return
            sock.setblocking(False)
            pid, uid, gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            conn = _Conn(sock, uid, time.monotonic() + READ_TIMEOUT, pid=pid)
            conns[sock.fileno()] = conn
            sel.register(sock, selectors.EVENT_READ)
            if not self._admit(uid, gid):
                log.warning("control_refused", uid=uid, gid=gid, pid=pid)
                self._respond(sel, conns, conn, _error(refusal(uid, self.operators_group)))
                continue
            conn.bucket = "workers" if _descends_from_us(pid) else f"uid {uid}"
            busy = _over_limit(conn, [c for c in conns.values() if c is not conn and c.bucket])
            if busy:
                conn.bucket = ""  # it holds no slot
                self._respond(
                    sel,
                    conns,
                    conn,
                    _error(f"busy: too many open control connections {busy}; retry"),
                )

    def _admit(self, uid: int, gid: int) -> bool:
        """Whether the peer's credentials let it in (see `admitted`)."""
        me = os.geteuid()
        if admitted(uid, gid, me, self._gid):
            return True
        return self._gid is not None and admitted(uid, gid, me, self._gid, peer_groups(uid, gid))

    def _safe_step(
        self, sel: selectors.BaseSelector, conns: dict[int, _Conn], conn: _Conn, events: int
    ) -> None:
        try:
            self._step(sel, conns, conn, events)
        except Exception as e:  # noqa: BLE001 - one client must not end the server
            log.warning("control_connection_failed", error=repr(e))
            self._drop(sel, conns, conn)

    def _step(
        self, sel: selectors.BaseSelector, conns: dict[int, _Conn], conn: _Conn, events: int
    ) -> None:
        if conn.out:
            if events & selectors.EVENT_WRITE:
                self._flush(sel, conns, conn)
            return
        try:
            chunk = conn.sock.recv(MAX_REQUEST + 1 - len(conn.inbuf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._drop(sel, conns, conn)
        conn.inbuf += chunk
        if len(conn.inbuf) > MAX_REQUEST:
            return self._respond(
                sel, conns, conn, _error(f"request larger than {MAX_REQUEST} bytes")
            )
        if chunk and b"\n" not in chunk:
            return  # more to come
        line = bytes(conn.inbuf).split(b"\n", 1)[0]
        if not line.strip():  # nothing at all before EOF: no request to answer
            return (
                self._drop(sel, conns, conn)
                if not conn.inbuf
                else self._respond(sel, conns, conn, _error("empty request"))
            )
        try:
            reply = self.handle(line)
        except Exception as e:  # noqa: BLE001 - a bug here must still answer, not drop the client
            log.error("control_request_failed", error=repr(e))
            reply = _error(f"internal error handling the request: {type(e).__name__}")
        if isinstance(
            reply, Deferred
        ):  # not readable meanwhile: a client's EOF must not spin the loop
            conn.waiting, conn.deadline = reply, time.monotonic() + reply.timeout
            sel.unregister(conn.sock)
            reply._wake = self._poke
            if reply.reply is not None:  # given before the wake-up was in place
                reply._wake()
            return
        self._respond(sel, conns, conn, reply)

    def handle(self, raw: bytes) -> dict | Deferred:
        """One request's reply, or the Deferred the loop will give it (the transport-free half of
        the server): its command's entry in COMMANDS says how."""
        req, error = parse_request(raw)
        if error:
            return error
        command = COMMANDS[req["command"]]
        for key, check in command.fields.items():
            problem = check(req.get(key))
            if problem:
                return _error(problem)
        return command.serve(self, req) if command.serve else self._forward(req)

    def _forward(self, req: dict) -> dict | Deferred:
        """Hand a request to the agent loop's `command` callback: its reply, or its Deferred."""
        cmd, timeout = req["command"], req.get("timeout")
        try:
            reply = self.command(req)
            if not isinstance(reply, (dict, Deferred)):
                raise TypeError(f"command callback returned {type(reply).__name__}, not dict")
        except Exception as e:  # noqa: BLE001
            log.error("control_command_failed", command=cmd, error=repr(e))
            return _error(f"internal error handing {cmd!r} to the daemon: {e!r}")
        if isinstance(reply, Deferred):
            log.info("control_command", command=cmd, timeout=timeout, deferred=True)
            return reply
        log.info("control_command", command=cmd, timeout=timeout, ok=bool(reply.get("ok")))
        return {"version": VERSION, **reply}

    def _respond(
        self, sel: selectors.BaseSelector, conns: dict[int, _Conn], conn: _Conn, reply: dict
    ) -> None:
        try:
            conn.out = json.dumps(reply, default=str).encode() + b"\n"
        except (TypeError, ValueError) as e:
            conn.out = (
                json.dumps(_error(f"internal error encoding the reply: {e}")).encode() + b"\n"
            )
        conn.deadline = time.monotonic() + WRITE_TIMEOUT
        if conn.waiting:
            conn.waiting = None
            sel.register(conn.sock, selectors.EVENT_WRITE)
        else:
            sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._flush(sel, conns, conn)

    def _flush(self, sel: selectors.BaseSelector, conns: dict[int, _Conn], conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._drop(sel, conns, conn)
        conn.out = conn.out[sent:]
        if not conn.out:
            self._drop(sel, conns, conn)

    def _drop(self, sel: selectors.BaseSelector, conns: dict[int, _Conn], conn: _Conn) -> None:
        conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn.sock)
        # Read what the peer already sent: closing with unread data would make its recv() fail
        # with ECONNRESET instead of reading our reply (Linux AF_UNIX semantics).
        with contextlib.suppress(OSError):
            for _ in range(MAX_REQUEST // 4096 + 1):
                if not conn.sock.recv(4096):
                    break
        conn.sock.close()


def _error(message: str) -> dict:
    return {"ok": False, "version": VERSION, "error": message}


def _show(value: object) -> str:
    """A client's value quoted in an error reply: short, whatever its size or depth."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = 60
    r.maxlevel, r.maxlist, r.maxdict = 2, 4, 4
    text = r.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- commands --------------------------------------------------------------------------------


def _status(server: ControlServer, req: dict) -> dict:
    """Served here, from the snapshot the loop last published."""
    try:
        return {"ok": True, "version": VERSION, "status": server.snapshot()}
    except Exception as e:  # noqa: BLE001
        log.error("control_snapshot_failed", error=repr(e))
        return _error(f"internal error reading the status: {e!r}")


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
        return {}, _error(f"request is not UTF-8 (byte {e.start}): send one JSON object")
    except json.JSONDecodeError as e:
        return {}, _error(f"request is not a JSON object ({e.msg} at byte {e.pos})")
    except RecursionError:
        return {}, _error("request is not a JSON object this daemon reads (nested too deeply)")
    except ValueError as e:  # e.g. an integer longer than Python converts
        return {}, _error(f"request is not a JSON object this daemon reads ({str(e)[:100]})")
    if not isinstance(req, dict):
        return {}, _error(f"request is not a JSON object (got {type(req).__name__})")
    if "version" not in req:
        return {}, _error(
            f'request has no "version"; this daemon speaks protocol version {VERSION}'
        )
    version = req["version"]
    if type(version) is not int or version != VERSION:
        return {}, _error(
            f"unsupported protocol version {_show(version)}; this daemon speaks {VERSION}"
        )
    cmd = req.get("command")
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        return {}, _error(f"unknown command {_show(cmd)}; known commands: {', '.join(COMMANDS)}")
    return req, None


def _descends_from_us(pid: int) -> bool:
    """Whether `pid` is one of this daemon's descendants (its workers and whatever they start;
    the daemon is a child subreaper, so orphans stay in its tree)."""
    me = os.getpid()
    try:
        return any(p.pid == me for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _over_limit(new: _Conn, others: list[_Conn]) -> str | None:
    """Why `new` may not open another connection now (the words after "connections"), or None.

    Caps per process, per user (the daemon's descendants counted together as "workers"), and
    overall for everyone but root and the daemon's user: idle connections of one process, one
    user or the workers cannot keep the others, least of all the operator, from being served."""
    if (
        new.pid and sum(c.pid == new.pid for c in others) >= PER_PROCESS
    ):  # 0: from another pid namespace
        return f"from pid {new.pid} (at most {PER_PROCESS})"
    workers = new.bucket == "workers"
    cap = PER_WORKERS if workers else PER_USER
    if sum(c.bucket == new.bucket for c in others) >= cap:
        who = "the daemon's workers" if workers else new.bucket
        return f"from {who} (at most {cap})"
    if not _privileged(new) and sum(not _privileged(c) for c in others) >= MAX_CONNECTIONS:
        return f"(at most {MAX_CONNECTIONS} from workers and the operators group)"
    return None


def _privileged(conn: _Conn) -> bool:
    """Root or the daemon's user, from outside the daemon's tree: the operators the caps protect."""
    return conn.bucket != "workers" and conn.uid in (0, os.geteuid())


# --- client ----------------------------------------------------------------------------------


def request(path: str | os.PathLike, payload: dict, timeout: float = 5.0) -> dict:
    """Send one request and return the daemon's reply object, {"ok": false, ...} replies included.

    Raises NoDaemon when nothing listens at `path`, PermissionDenied when the socket file refuses
    this user, ProtocolError when the peer does not answer in `timeout` seconds with one JSON object.
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
    """`reply` if it says ok; else ControlError with the daemon's message (PermissionDenied for refusals)."""
    if reply.get("ok"):
        return reply
    message = str(reply.get("error") or "the daemon refused the request")
    raise (PermissionDenied if message.startswith("permission denied") else ControlError)(message)
