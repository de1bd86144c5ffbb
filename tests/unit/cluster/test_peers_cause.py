"""The cause a lost node's failure carries (Peers.lost_neighbour): it names what was seen - the
node whose daemon died (its held connection closed, links.py), or, on the in-place path, our
ranks waiting unwound - never a worker's death that did not happen."""

import dataclasses
import time
from types import SimpleNamespace

from elasticd.cluster import silence
from elasticd.cluster.peers import Peers
from elasticd.cluster.rounds import Member, Round
from elasticd.config import Config
from elasticd.lifecycle.states import RestartCause

GONE = "its daemon died (our connection to it closed)"


def peers(rnd: Round, quiet: float, gone: dict | None = None) -> Peers:
    """A Peers' judging state as its threads leave it: node b watched, its beat last seen
    `quiet` s ago; `gone`, what the links saw (no threads, no sockets)."""
    p = Peers.__new__(Peers)
    p.cfg, p.node = dataclasses.replace(Config(), peer_timeout=10.0), "a"
    now = time.monotonic()
    p._seen = (rnd, {1: (7, now - quiet)})
    p._probed = (None, set(), {}, {})
    p.links = SimpleNamespace(gone=gone or {})
    return p


def two_nodes() -> Round:
    return Round(1, 0, [Member("a", 2, "10.0.0.1"), Member("b", 2, "10.0.0.2")], world_size=4)


def test_a_daemon_that_died_is_named_in_the_cause():
    rnd = two_nodes()
    got = peers(rnd, 0.05, {"b": (time.monotonic() - 0.01, GONE)}).lost_neighbour(
        rnd, time.monotonic(), lambda: []
    )
    assert got.kind is RestartCause.NODE_LOST and got.lost == ("b",)
    assert got.reason.startswith(f"lost: group rank 1 (ranks 2-3), node b: {GONE}"), got.reason
    assert "closed connection" not in got.reason and "went silent" not in got.reason


def test_ranks_waiting_in_place_are_said_as_such():
    """No link (a node cut off, its daemon alive): two beats of silence after our ranks began
    waiting for a generation; the cause says they wait, not that a worker died."""
    rnd = two_nodes()
    now = time.monotonic()
    got = peers(rnd, 0.6).lost_neighbour(
        rnd, now, lambda: [], died_at=now - 0.5, died_of=silence.WAITING
    )
    assert got is not None and got.lost == ("b",), got
    assert silence.WAITING in got.reason and "died of a closed connection" not in got.reason
    legacy = peers(rnd, 0.6).lost_neighbour(rnd, now, lambda: [], died_at=now - 0.5)
    assert silence.CLOSED in legacy.reason
