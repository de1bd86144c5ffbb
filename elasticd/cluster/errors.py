"""How the rendezvous fails, as the agent loop tells the cases apart: the job cannot form or go on
(`RendezvousFailed`, and its kinds), or the store is silent for now (`StoreUnreachable`: stop the
workers, join again once it answers). `store_call` turns a store's kv.Unreachable into one of
them, one line naming the store. Torch-free.
"""

from __future__ import annotations

import functools

from elasticd.cluster import kv as kvmod


class RendezvousFailed(Exception):
    """The job cannot form or go on (join timeout, closed, store gone): one clear line."""


class StoreLost(RendezvousFailed):
    """The store's host answers that nothing listens there any more: the job's store is gone."""


class BudgetSpent(RendezvousFailed):
    """The round that would have followed a failure found the job's restart budget spent."""


class Deterministic(BudgetSpent):
    """The round after a failure found it the same failure, at the same step, as the attempts
    before it (daemon/triage.py's repeat rule): restarting again would fail the same way."""


class StoreUnreachable(Exception):
    """The store did not answer in time (a partition, a lost etcd quorum): stop the workers, and
    join again once it answers."""


def store_call(method):
    """A kv.Unreachable in a Rendezvous method (or a function taking the Rendezvous first)
    becomes StoreLost (refused: the store is gone for good) or StoreUnreachable (silence), each
    one line naming the store."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except kvmod.Unreachable as e:
            if e.refused and self.cfg.etcd:
                raise StoreLost(
                    f"the etcd cluster refused us ({e}): check the credentials and the user's "
                    "permissions on the elasticd/ prefix"
                ) from None
            if e.refused:
                raise StoreLost(
                    f"lost the rendezvous store at {self.endpoint} ({e}): the node hosting it "
                    "stopped; start the job again on every node"
                ) from None
            raise StoreUnreachable(
                f"cannot reach the rendezvous store at {self.endpoint} ({e})"
            ) from None

    return wrapper
