"""A closed round as this node holds it (`Round`: its place, the members, the worker store it
hosts as group rank 0) and the node ids the rounds are made of. Torch-free: the worker store is
only held here (tcpstore.py makes it).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class Member:
    node_id: str
    nproc: int
    addr: str
    link: int = 0  # the port its daemon holds our connections on (links.py; 0: none)
    # (round, generation) of the process group its workers stand in, carried into this round in
    # place (daemon/grow.py): None where it started its workers afresh
    carries: tuple[int, int] | None = None
    # its ranks cannot start into a group that goes on in place (its torch has no reconfigure,
    # or --in-place off): a round with such a member starts every node's workers afresh
    fresh: bool = False


@dataclass
class Carry:
    """What a node brings into the next round in place: its workers' group, formed in round
    `round` and standing at `generation`; group rank 0's node brings the workers' store too,
    which it goes on hosting (the survivors are its clients)."""

    round: int
    generation: int
    store: dist.TCPStore | None = None


@dataclass
class Round:
    """One closed round: this node's place in it, its members, the nodes found lost as it formed."""

    number: int
    group_rank: int
    members: list[Member]
    lost: list[str] = field(default_factory=list)  # node ids of the previous round that never came
    # arrival numbers its members took (0: one each); a round shrunk in place keeps its first
    # count, so a lost node's arrival is never taken for a node waiting to join
    claimed: int = 0
    rank_base: int = 0
    world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    worker_store: dist.TCPStore | None = None  # held by group rank 0 for the round's workers
    # (round, generation) of the workers' group that goes on in place in this round, on the
    # store it was formed on (daemon/grow.py); None: every node starts its workers afresh
    carried: tuple[int, int] | None = None
    # the key of the MACs on the in-memory state the workers exchange (signing.state_key)
    state_key: bytes = field(default=b"", repr=False)

    def master_value(self) -> str:
        """The round's worker store as group rank 0 writes it (cluster/values.py's `master`)."""
        carried = "".join(f" {v}" for v in self.carried or ())
        return f"{self.master_addr} {self.master_port}{carried}"

    @property
    def group_world_size(self) -> int:
        return len(self.members)

    @property
    def fresh(self) -> list[str]:
        """The members whose ranks cannot start in place (`Member.fresh`): where there is one,
        no group goes on in place and every node's ranks start as torch's."""
        return [m.node_id for m in self.members if m.fresh]

    @property
    def node_id(self) -> str:
        return self.members[self.group_rank].node_id

    def neighbours(self, count: int) -> list[Member]:
        """The next `count` nodes after this one in group-rank order, around the ring: whom this
        node watches (and so every node is watched by `count` others)."""
        n = len(self.members)
        return [self.members[(self.group_rank + k) % n] for k in range(1, min(count, n - 1) + 1)]

    def close(self) -> None:
        self.worker_store = None  # dropping the last reference stops the server


def new_node_id() -> str:
    """Unique per daemon run: the host's name (as a key-safe string), the pid and a random tag."""
    host = (
        "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())[:64]
        or "node"
    )
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"
