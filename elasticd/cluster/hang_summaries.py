"""What each node saw of a hang, through the store: a short summary of its ranks' innermost frames
under the round's `hang/<node id>` key, written once by every node that declares or is told of a
hang (`publish`), and read by all until a deadline (`gather`), so that the culprit is named across
the job (daemon/hangs.py judges). One write and a few bounded reads per node per hang; the values
are sealed as every other, and one that is not of its form is left out (as a node that said
nothing)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from elasticd import names
from elasticd.cluster.errors import store_call

if TYPE_CHECKING:
    from elasticd.cluster.rendezvous import Rendezvous
    from elasticd.cluster.rounds import Round

T = TypeVar("T")
POLL = 0.1  # seconds between reads of the summaries still missing


def key(rdzv: Rendezvous, rnd: Round, node_id: str, inquiry: int | None = None) -> str:
    """A node's summary: of the hang that restarts the round, or of inquiry N (a round recovered
    in place lives through many hangs: cluster/hang_inquiry.py)."""
    where = node_id if inquiry is None else f"{inquiry}/{node_id}"
    return rdzv.round_key(rnd.number, f"{names.HANG}/{where}")


@store_call
def publish(rdzv: Rendezvous, rnd: Round, text: str, inquiry: int | None = None) -> None:
    k = key(rdzv, rnd, rdzv.node_id, inquiry)
    rdzv.kv.set(k, rdzv.seal(k, text))


@store_call
def gather(
    rdzv: Rendezvous,
    rnd: Round,
    parse: Callable[[str], T | None],
    deadline: float,
    inquiry: int | None = None,
) -> tuple[dict[str, T], list[str]]:
    """Every other member's summary, waiting for them until `deadline` (monotonic): what came,
    by node id, and the nodes that said nothing by then."""
    missing = [m.node_id for m in rnd.members if m.node_id != rdzv.node_id]
    found: dict[str, T] = {}
    while missing:
        keys = [key(rdzv, rnd, n, inquiry) for n in missing]
        for n, k, raw in zip(list(missing), keys, rdzv.kv.multi_get(keys)):
            value = rdzv.open(k, raw, parse)
            if value is not None:
                found[n] = value
                missing.remove(n)
        if not missing or time.monotonic() + POLL > deadline:
            break
        time.sleep(POLL)
    return found, missing
