"""A hang judged across nodes without a restart (the in-place path, daemon/hangs.py): the node
that declares it claims the round's next inquiry (`ask`: compare-set on `hang_ask/<i>`, so nodes
that declare one hang at once share it); every other node, woken by its waiter (`Waiter`), dumps
its ranks' stacks and publishes their summary for inquiry i (hang_summaries, keyed by i); the
asker judges and says the culprit (`say`: `hang_verdict/<i>`, its rank and node), or that the
silence asked about is no hang (a straggler: every node goes on); the culprit's node replaces it
in place and the others follow the generation it announces. Before, the request
that made the other nodes dump their stacks was a restart of every node. Values are sealed as
every other; one that is not of its form is no inquiry (an asker's is its node id) or no verdict
(the nodes waiting for it fall back to a restart at their deadline)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elasticd import names
from elasticd.cluster import kv as kvmod
from elasticd.cluster.errors import store_call
from elasticd.cluster.timing import BEAT_EVERY, WAIT_SLICE

if TYPE_CHECKING:
    from elasticd.cluster.rendezvous import Rendezvous
    from elasticd.cluster.rounds import Round

ASK, VERDICT = names.HANG_ASK, names.HANG_VERDICT
# seconds the nodes wait for an inquiry's verdict once it is asked: the asker gathers for
# hang_summaries' 3 s at most, then judges
VERDICT_WAIT = 5.0
CLAIMS = 3  # inquiries an asker tries to claim, past a forger's


@dataclasses.dataclass(frozen=True)
class Asked:
    round: int
    index: int
    node: str  # the asker's node id
    generation: int  # the group's generation in place the asker saw hung


@dataclasses.dataclass(frozen=True)
class Verdict:
    round: int
    index: int
    rank: int | None  # None: no verdict came (the asker died, or its value did not verify)
    node: str
    text: str
    # False: no hang (an inquiry about an idle silence nobody's stacks explain, `say`'s
    # `hang`): the nodes holding for it go on
    hang: bool = True


def _key(rdzv: Rendezvous, rnd: Round, name: str, index: int) -> str:
    return rdzv.round_key(rnd.number, f"{name}/{index}")


@store_call
def ask(rdzv: Rendezvous, rnd: Round, index: int, generation: int) -> tuple[int, bool]:
    """Claim the inquiry at `index` (the waiter's next) for this node, about a hang in the
    group's `generation`, or the one after a forger's claim: (its index, True), or (the index,
    False) where another node claimed it first (it asks about the same hang, and judges it)."""
    for i in range(index, index + CLAIMS):
        k = _key(rdzv, rnd, ASK, i)
        if rdzv.kv.compare_set(k, None, rdzv.seal(k, f"{rdzv.node_id} {generation}")):
            return i, True
        if rdzv.open(k, rdzv.kv.get(k), _asker) is not None:
            return i, False
    return index, False  # a forger's every one: no verdict comes, and the hang restarts


@store_call
def say(
    rdzv: Rendezvous,
    rnd: Round,
    index: int,
    rank: int | None,
    node: str,
    text: str,
    hang: bool = True,
) -> None:
    """The asker's verdict on inquiry `index`: the culprit's rank and node; or, not `hang`, that
    the silence asked about is none (`text` says why)."""
    k = _key(rdzv, rnd, VERDICT, index)
    value = json.dumps({"rank": rank, "node": node, "text": text[:2000], "hang": hang})
    rdzv.kv.set(k, rdzv.seal(k, value))


def _verdict(text: str) -> dict | None:
    value = json.loads(text)
    if not isinstance(value, dict) or not isinstance(value.get("node"), str):
        return None
    rank, said, hang = value.get("rank"), value.get("text"), value.get("hang", True)
    if (
        (rank is not None and not isinstance(rank, int))
        or not isinstance(said, str)
        or not isinstance(hang, bool)
    ):
        return None
    return value


class Waiter:
    """A thread per round, with its own store connection, blocked on the round's next inquiry,
    then (up to VERDICT_WAIT) on its verdict: each seen is set here (`asked`, `verdict`) and the
    loop woken. `next` is the inquiry an asker claims."""

    def __init__(self, rdzv: Rendezvous, wake: Callable[[], None]) -> None:
        self.rdzv = rdzv
        self._wake = wake
        self._kv: kvmod.KV | None = None
        self._round: Round | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.next = 0
        self.asked: Asked | None = None
        self.verdict: Verdict | None = None

    def new_round(self, rnd: Round) -> None:
        self._round = rnd
        self.next, self.asked, self.verdict = 0, None, None
        if rnd.group_world_size > 1:  # the last round's thread leaves at its wait's end
            self._kv = self.rdzv.kv.clone()  # (connects at its first call)
            self._thread = threading.Thread(
                target=self._run,
                args=(rnd, self._kv),
                name="elasticd-hang-inquiry-wait",
                daemon=True,
            )
            self._thread.start()

    def close(self) -> None:
        """Stop; the connection closed first, so that a wait in progress ends at once."""
        self._stop.set()
        self._round = None
        kv = self._kv
        if kv is not None:
            kv.close()
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join(timeout=WAIT_SLICE + 2 * getattr(kv, "timeout", 2.5))

    def _here(self, rnd: Round) -> bool:
        return self._round is rnd and not self._stop.is_set()

    def _run(self, rnd: Round, kv: kvmod.KV) -> None:
        try:
            self._wait(rnd, kv)
        finally:
            kv.close()

    def _wait(self, rnd: Round, kv: kvmod.KV) -> None:
        index = 0
        while self._here(rnd):
            try:
                there, asker = _read(self.rdzv, kv, rnd, ASK, index, _asker, WAIT_SLICE)
                if not there:
                    continue
                if asker is None:  # a forger's claim: no inquiry (an asker claims the next)
                    index = self._passed(rnd, index)
                    continue
                if not self._here(rnd):
                    return
                self.asked = Asked(rnd.number, index, *asker)
                self._wake()
                found = self._verdict(rnd, kv, index) or {"rank": None, "node": "", "text": ""}
                if not self._here(rnd):
                    return
                rank, node, text = found["rank"], found["node"], found["text"]
                hang = found.get("hang", True)
                self.verdict = Verdict(rnd.number, index, rank, node, text, hang)
                index = self._passed(rnd, index)
                self._wake()
            except kvmod.Unreachable:
                self._stop.wait(min(1.0, BEAT_EVERY * 2))  # the liveness thread judges the store

    def _passed(self, rnd: Round, index: int) -> int:
        """The next inquiry, where an asker claims (set only while this round is the one)."""
        if self._here(rnd):
            self.next = index + 1
        return index + 1

    def _verdict(self, rnd: Round, kv: kvmod.KV, index: int) -> dict | None:
        """Inquiry `index`'s verdict, waited for up to VERDICT_WAIT; None if none verified."""
        until = time.monotonic() + VERDICT_WAIT
        while self._here(rnd) and (left := until - time.monotonic()) > 0:
            there, found = _read(
                self.rdzv, kv, rnd, VERDICT, index, _verdict, min(WAIT_SLICE, left)
            )
            if found is not None:
                return found
            if there:  # a forger's: the asker's may replace it
                self._stop.wait(min(0.1, max(0.0, until - time.monotonic())))
        return None


def _read(
    rdzv: Rendezvous, kv: kvmod.KV, rnd: Round, name: str, index: int, parse, timeout: float
) -> tuple[bool, Any]:
    """Whether the key `name`/`index` is set (waited for up to `timeout`), and its value parsed
    (None: not of its form, or not set)."""
    k = _key(rdzv, rnd, name, index)
    if not kv.wait(k, timeout):
        return False, None
    return True, rdzv.open(k, kv.get(k), parse)


def _asker(text: str) -> tuple[str, int] | None:
    """An inquiry's value: (the asker's node id, the generation it saw hung)."""
    node, _, generation = text.partition(" ")
    return (node, int(generation)) if node and generation.isdigit() else None
