"""The control socket's file, made by the daemon so that it is never reachable with looser rights
than its final ones, never replaces a live daemon's socket, and is removed only while it is still
ours: the directory checked (or made private, its group given to the operators), a stale socket
cleared and a live daemon's refused (`AlreadyRunning`), the socket bound in a fresh 0700 directory
and hard-linked into place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
from pathlib import Path

import structlog

from elasticd import names
from elasticd.control.client import request
from elasticd.control.paths import TMP
from elasticd.control.protocol import (
    VERSION,
    AlreadyRunning,
    ControlError,
    NoDaemon,
    PermissionDenied,
)

log = structlog.get_logger("elasticd.control")

_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 for the NUL
Identity = tuple[int, int]  # (st_dev, st_ino) of the socket file we linked


def check_length(path: Path) -> None:
    """A path a Unix socket can have, else ControlError."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ControlError(
            f"control socket path {path} is longer than {_SUN_PATH_MAX} bytes: "
            "choose a shorter --socket"
        )


def create(
    path: Path, gid: int | None, operators_group: str | None
) -> tuple[socket.socket, Identity]:
    """The listening socket at `path` (0660 and group `gid` when an operators group is given, else
    0600) and the identity of its file, for `remove`.

    Raises AlreadyRunning if a live daemon answers at the path, ControlError for anything else that
    needs the operator (unusable directory, a file in the way).
    """
    _prepare_parent(path, gid, operators_group)
    clear_stale(path)
    return _bind(path, gid, operators_group)


def remove(path: Path, identity: Identity) -> None:
    """Unlink the socket file, only if it is still the one we linked (not a successor's)."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(path)


def _prepare_parent(path: Path, gid: int | None, operators_group: str | None) -> None:
    """Make sure the directory exists and nobody but us (or root) can swap files in it."""
    parent = path.parent
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
    _say_if_squatted(parent)
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
    if gid is None:
        return
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    ours = created or (runtime and Path(runtime) == parent)
    if ours and st.st_uid == me:
        # systemd creates RuntimeDirectory as root:root 0750: hand the group to the operators
        # so they can reach the socket; the directory holds nothing but the socket.
        os.chown(parent, -1, gid)
        os.chmod(parent, (0o750 if created else stat.S_IMODE(st.st_mode)) | 0o010)
    elif not (st.st_mode & 0o001 or (st.st_mode & 0o010 and st.st_gid == gid)):
        log.warning(
            "control_socket_dir_closed_to_operators",
            directory=str(parent),
            operators_group=operators_group,
            fix=f"chgrp {operators_group} {parent} && chmod g+x {parent}",
        )


def _say_if_squatted(parent: Path) -> None:
    """A daemon listening in a /tmp/elasticd-UID-* directory says why (see paths._tmp_dir)."""
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
        fix=f"remove {primary} (someone else made it first), "
        "or set XDG_RUNTIME_DIR or ELASTICD_SOCKET",
    )


def clear_stale(path: Path) -> None:
    """Refuse if a live daemon answers at the path; remove a socket file nobody listens on."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlError(f"{path} exists and is not a socket: remove it or pass another --socket")
    try:
        request(path, {"version": VERSION, "command": names.STATUS}, timeout=1.0)
    except NoDaemon:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ControlError(
                f"stale socket {path} cannot be removed ({e.strerror}): "
                "remove it or pass another --socket"
            ) from None
        log.info("control_stale_socket_removed", path=str(path))
        return
    except PermissionDenied:
        raise ControlError(
            f"{path} is a socket this user may not connect to (another user's "
            "elasticd?): pass another --socket"
        ) from None
    except ControlError as e:  # it accepted us: something is alive there
        raise AlreadyRunning(
            f"another elasticd is running at {path} ({e}): stop it, "
            "or give this one another --socket"
        ) from None
    raise AlreadyRunning(
        f"another elasticd is running at {path}: stop it with "
        f"`elasticd stop --socket {path}`, or give this one another --socket"
    )


def _bind(
    path: Path, gid: int | None, operators_group: str | None
) -> tuple[socket.socket, Identity]:
    """Bind inside a fresh 0700 directory, set mode and group there, then hard-link into place.

    Why not a umask around bind(): umask is process-wide, so it would race with files other
    threads create. Why not fchmod before bind(): only Linux honours it. A private directory
    makes the socket unreachable by anyone else until it has its final mode; link() then
    publishes it atomically and, unlike rename(), fails if another daemon won the path
    meanwhile instead of silently replacing its socket.
    """
    mode = 0o660 if gid is not None else 0o600
    parent = path.parent
    private = parent / f".{secrets.token_hex(3)}"
    tmp = private / "s"
    try:
        os.mkdir(private, 0o700)
    except OSError as e:
        raise ControlError(
            f"cannot create the control socket in {parent} ({e.strerror}): pass a writable --socket"
        ) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec: workers never see it
    try:
        try:
            sock.bind(os.fspath(tmp))
        except OSError as e:
            raise ControlError(
                f"cannot create the control socket {path} ({e.strerror or e}): "
                "pass a writable, shorter --socket"
            ) from None
        if gid is not None:
            try:
                os.chown(tmp, -1, gid)
            except PermissionError:
                raise ControlError(
                    f"this user may not give the control socket to group "
                    f"{operators_group}: join the group or run as root"
                ) from None
        os.chmod(tmp, mode)
        sock.listen(64)
        sock.setblocking(False)
        identity = _publish(tmp, path)
    except BaseException:
        sock.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        with contextlib.suppress(OSError):
            os.rmdir(private)
    return sock, identity


def _publish(tmp: Path, path: Path) -> Identity:
    """Link the bound socket to `path` (a stale one in the way cleared, a live one refused) and
    give the identity of the file there."""
    for _ in range(3):
        try:
            os.link(tmp, path)
        except FileExistsError:
            clear_stale(path)  # raises if the newcomer is alive, else removes it; try again
            continue
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise ControlError(
                    f"cannot create the control socket {path} ({e.strerror})"
                ) from None
            os.rename(tmp, path)  # no hard links on this filesystem; the path was just checked
        st = os.lstat(path)
        return (st.st_dev, st.st_ino)
    raise ControlError(f"{path} keeps being recreated by another process: pass another --socket")
