"""The other nodes of the round, as the agent loop sees them through the store: their restart
requests, their liveness (and ours: the beat they watch), and nodes waiting to join.

A restart request is read every tick (a failure anywhere restarts every node within one);
liveness only has to beat --peer-timeout, so its round trips come every min(1 s, a tenth of it),
and the waiting count (torch's rendezvous state) once a second.
"""

from __future__ import annotations

from elasticd.config import Config
from elasticd.rendezvous import Rendezvous, Round
from elasticd.states import Failure, RestartCause, Scale

BEAT_EVERY = 1.0  # seconds between liveness beats to peers, and at most a tenth of --peer-timeout
WAITING_EVERY = 1.0  # seconds between reads of the nodes waiting to join


class Peers:
    def __init__(self, cfg: Config, rdzv: Rendezvous, node: str) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.node = node
        self._max_nodes = cfg.max_nodes  # parsed once: check() runs every tick
        self._next_beat = 0.0
        self._next_waiting_check = 0.0

    def new_round(self) -> None:
        """A new round tells its peers at once that we are alive."""
        self._next_beat = 0.0

    def beat(self, rnd: Round, now: float) -> int | None:
        """Beat this node's liveness when due; returns the group rank of a peer silent for --peer-timeout."""
        if now < self._next_beat:
            return None
        self._next_beat = now + min(BEAT_EVERY, self.cfg.peer_timeout / 10)
        return self.rdzv.beat_and_check_peers(rnd, now)

    def check(self, rnd: Round, now: float) -> Failure | Scale | None:
        """Why this node must restart because of the others, if it must."""
        if rnd.group_world_size > 1:
            reason = self.rdzv.restart_reason(rnd)
            if reason is not None:
                return Failure(RestartCause.PEER, f"peer asked for restart: {reason.get('summary', reason)}",
                               node=reason.get("node", "?"))
            lost = self.beat(rnd, now)
            if lost is not None:
                return Failure(RestartCause.NODE_LOST,
                               f"node with group rank {lost} went silent for {self.cfg.peer_timeout:g}s",
                               node=self.node)
        if rnd.group_world_size < self._max_nodes and now >= self._next_waiting_check:
            self._next_waiting_check = now + WAITING_EVERY
            waiting = self.rdzv.nodes_waiting()
            if waiting:
                return Scale(waiting, self.node)
        return None
