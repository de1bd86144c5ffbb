"""Where control sockets are: the path a daemon listens at (`default_socket_path`, or beside it
for a second daemon of the same user), and the daemons a CLI call without --socket may mean
(`find_daemons`). Both sides use it; a squatted /tmp/elasticd-UID gives way to the user's own
/tmp/elasticd-UID-XXXXXXXX, which the daemon and the CLI find alike.

The default path: `$ELASTICD_SOCKET`; else systemd's RuntimeDirectory; else /run/elasticd for
root; else `$XDG_RUNTIME_DIR/elasticd`; else under /tmp. `find_daemons` looks only in directories
that only this user or root can write.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from elasticd import names
from elasticd.control.client import request
from elasticd.control.protocol import VERSION, ControlError, NoDaemon


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
