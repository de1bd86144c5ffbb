"""Who the control server lets in, and how many connections each may hold: the daemon's rules,
pure where they can be (`admitted`, `over_limit`), so they are testable without sockets or users.

Admission is by the peer's kernel credentials (SO_PEERCRED): root, the daemon's own user, or
members of the operators group. Idle connections are capped per process, per user and for the
daemon's own workers together, so nobody can fill the table for the others: root and the daemon's
user are served whatever the workers and the operators group hold.
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Iterable
from typing import TYPE_CHECKING

import psutil

from elasticd.control.protocol import ControlError

if TYPE_CHECKING:
    from elasticd.control.server import Conn

# Connections open at once; a newcomer beyond a cap gets "busy" at once. Root and the daemon's
# user (outside the daemon's tree) are held only to their own caps, so the others cannot fill the
# table on them; the daemon's descendants (workers and what they start) share one small cap.
MAX_CONNECTIONS = 64  # from everyone but root and the daemon's user
PER_PROCESS = 8  # a client may ask a few things at once (a monitor, `stacks` from several threads)
PER_USER = 16
PER_WORKERS = 8


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
        return (
            f"permission denied: uid {uid} is not root, the daemon's user, "
            f"or in group {operators_group}"
        )
    return (
        f"permission denied: uid {uid} is not root or the daemon's user "
        "(set operators_group to admit a group)"
    )


def descends_from_us(pid: int) -> bool:
    """Whether `pid` is one of this daemon's descendants (its workers and whatever they start;
    the daemon is a child subreaper, so orphans stay in its tree)."""
    me = os.getpid()
    try:
        return any(p.pid == me for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def over_limit(new: Conn, others: list[Conn]) -> str | None:
    """Why `new` may not open another connection now (the words after "connections"), or None.

    Caps per process, per user (the daemon's descendants counted together as "workers"), and
    overall for everyone but root and the daemon's user: idle connections of one process, one
    user or the workers cannot keep the others, least of all the operator, from being served."""
    # pid 0: from another pid namespace, so not counted per process
    if new.pid and sum(c.pid == new.pid for c in others) >= PER_PROCESS:
        return f"from pid {new.pid} (at most {PER_PROCESS})"
    workers = new.bucket == "workers"
    cap = PER_WORKERS if workers else PER_USER
    if sum(c.bucket == new.bucket for c in others) >= cap:
        who = "the daemon's workers" if workers else new.bucket
        return f"from {who} (at most {cap})"
    if not _privileged(new) and sum(not _privileged(c) for c in others) >= MAX_CONNECTIONS:
        return f"(at most {MAX_CONNECTIONS} from workers and the operators group)"
    return None


def _privileged(conn: Conn) -> bool:
    """Root or the daemon's user, from outside the daemon's tree: the operators the caps protect."""
    return conn.bucket != "workers" and conn.uid in (0, os.geteuid())
