"""How the rendezvous fails, as the agent loop tells the cases apart: the job cannot form or go on
(`RendezvousFailed`, and its kinds: `StoreLost`, `BudgetSpent`, `Deterministic`), or the store does
not answer for now (`StoreUnreachable`: stop the workers, join again once it answers; `host_down`
when a c10d store's host refuses the connection: its daemon is down, and systemd may start it
again). `store_call` turns a store's kv.Unreachable into one of them, one line naming the store.
Torch-free.
"""

from __future__ import annotations

import functools

from elasticd.cluster import kv as kvmod


class RendezvousFailed(Exception):
    """The job cannot form or go on (join timeout, closed, store gone): one clear line."""


class StoreLost(RendezvousFailed):
    """The store refuses us for good (an etcd cluster that denies our credentials)."""


class BudgetSpent(RendezvousFailed):
    """The round that would have followed a failure found the job's restart budget spent."""


class Deterministic(BudgetSpent):
    """The round after a failure found it the same failure, at the same step, as the attempts
    before it (lifecycle/triage.py's repeat rule): restarting again would fail the same way."""


class StoreUnreachable(Exception):
    """The store did not answer in time (a partition, a lost etcd quorum), or its c10d host
    refused the connection (`host_down`: the node hosting it is down, its daemon may be started
    again with a fresh store): stop the workers, and join again once it answers."""

    def __init__(self, message: str, host_down: bool = False):
        super().__init__(message)
        self.host_down = host_down


def store_call(method):
    """A kv.Unreachable in a method of a part that has `etcd` and `endpoint` (the Rendezvous,
    the Run; or a function taking the Rendezvous first) becomes StoreLost (etcd refused us: for
    good) or StoreUnreachable (silence, or a c10d host that refuses the connection: down for
    now), each one line naming the store."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except kvmod.Unreachable as e:
            if e.refused and self.etcd:
                raise StoreLost(
                    f"the etcd cluster refused us ({e}): check the credentials and the user's "
                    "permissions on the elasticd/ prefix"
                ) from None
            if e.refused:
                raise StoreUnreachable(host_down_line(self.endpoint, e), host_down=True) from None
            raise StoreUnreachable(
                f"cannot reach the rendezvous store at {self.endpoint} ({e})"
            ) from None

    return wrapper


def host_down_line(endpoint: str, e: object) -> str:
    """What a node says when the c10d store's host refuses the connection."""
    return (
        f"the rendezvous store at {endpoint} refused the connection ({e}): the node hosting it "
        "is down"
    )
