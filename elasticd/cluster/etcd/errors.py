"""How an etcd call fails: as the caller sees it (`Refused`, `NoAnswer`, `Misconfigured`, each a
kv.Unreachable) and, inside a call, one attempt on one member (`Failed`, which the call fails over
on); the one printable line a member's words become (`one_line`). `NoAnswer.causes` are the kinds of
the endpoints' last failures, which stores.py turns into the operator's hint.
"""

from __future__ import annotations

import http.client

from elasticd.cluster import kv


class Refused(kv.Unreachable):
    """The cluster answered and refused (authentication, permission, a malformed or too large
    request): sending it again, to this member or another, would not help."""

    def __init__(self, message: str):
        super().__init__(message, refused=True)


class NoAnswer(kv.Unreachable):
    """No member answered within the call's deadline. `causes`: what the endpoints' last attempts
    failed of (refused, timeout, dns, tls, leader, reply, dropped, other), for the operator's
    hint."""

    def __init__(self, message: str, causes: frozenset[str] = frozenset()):
        super().__init__(message)
        self.causes = causes


class Misconfigured(NoAnswer):
    """Every endpoint failed in a way that retrying cannot heal (a host name that does not
    resolve, a certificate that does not verify): connect() says so at once."""


class Failed(Exception):
    """One attempt on one endpoint failed. `applied_maybe`: the request may have reached etcd;
    `cause`: what kind of failure (see NoAnswer); `lasting`: waiting will not heal it."""

    def __init__(
        self,
        reason: str,
        applied_maybe: bool,
        reauth: bool = False,
        cause: str = "other",
        lasting: bool = False,
    ):
        super().__init__(reason)
        self.reason = reason
        self.applied_maybe = applied_maybe
        self.reauth = reauth
        self.cause = cause
        self.lasting = lasting


def cause_of(e: BaseException) -> str:
    """The kind of a failed attempt's exception (NoAnswer.causes)."""
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(
        e, ConnectionError | EOFError | http.client.IncompleteRead | http.client.RemoteDisconnected
    ):
        return "dropped"
    if isinstance(e, OSError):
        return "other"
    return "reply"  # what came is not an HTTP reply, or too large


def one_line(e: object) -> str:
    """One short printable line (a member's words land in logs and on terminals)."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, ConnectionRefusedError):
        text = "connection refused"
    elif isinstance(e, TimeoutError):
        text = "timed out"
    return "".join(c if c.isprintable() else "?" for c in " ".join(text.split())[:200])
