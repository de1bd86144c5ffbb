"""elasticd's rendezvous: the nodes meet in numbered rounds over the control plane's key-value
store (kv.py: a c10d TCPStore we host on the endpoint's node, tcpstore.py, or etcd), and within
a round they ask each other to restart, beat and leave together.

Every node's store traffic is constant per period, whatever the number of nodes N (torch's c10d
rendezvous rewrites one pickled state of every participant on each node's keep-alive: O(N) bytes
per node per second, O(N^2) in all, plus compare-and-set retries):
- joining a round is a counter increment (the node's arrival number) and one record claimed at
  that number (create-only: a number whose key someone else filled is skipped); the first
  arrival closes the round (every arrival once MAX nodes are in, every expected node once a round
  restarts, or MIN nodes and --last-call-timeout) and writes the members in group-rank order in one
  value each node reads once; group ranks keep the previous round's order, so the node holding
  rank 0 keeps it while it lives;
- a restart request is one key per round that every node waits on (a blocking wait on a second
  connection: the store tells it, no polling), liveness one counter per node that a few
  neighbours in a ring read (peers.py), nodes waiting to join one counter read once a second;
- the exit barrier is a counter plus one key the last node sets once every node's verifies.

Nothing read from the store is trusted: every value is sealed with the job secret's HMAC over its
full key (signing.py), and every key names the run (a nonce each run draws), so a value of an
earlier run never verifies in this one; a value is parsed for its form. A value that fails is
garbage: never a decision and never a crash. Where a node must write a key that holds garbage it
writes over it (compare-and-set against what is there); an arrival record that failed is never
read again. The counters (arrivals, the barrier) cannot be signed: they are only hints (a counter
raised past any real number makes the closer list the round's records; one that holds no number
is set back). None of this stops denial of service: whoever reaches the store can delete, fill or
overwrite its keys, and the job then waits, restarts or fails; it cannot be steered (made to
restart for a reason, run a value, connect workers elsewhere) without the secret. A single-node
job has no store anyone can reach: its KV is a dict in the daemon (kv.LocalKV).

The protocol's parts, each owning its own state and seeing the store through the sealed view
(sealed.py: the store, the seal, the run's key names, the log of values that failed): the run
(run.py), the arrival records (arrivals.py), the restart budget (budget.py); joining a round
(joining.py), closing it (closing.py, its rule in closing_rule.py), the exit barrier
(barrier.py), the values' forms (values.py), opening the store (stores.py), the pacing
(timing.py). `Rendezvous` holds the parts, the node's identity and the last round it was a
member of; the liveness of the others (peers.py) keeps what it saw of their beats itself.
"""

from __future__ import annotations

import json
import time

from elasticd import logs, names
from elasticd.cluster import barrier, joining, signing, values
from elasticd.cluster import kv as kvmod
from elasticd.cluster.arrivals import Arrivals
from elasticd.cluster.budget import Budget
from elasticd.cluster.errors import (
    BudgetSpent,
    RendezvousFailed,
    StoreLost,
    StoreUnreachable,
    store_call,
)
from elasticd.cluster.rounds import Carry, Round, new_node_id
from elasticd.cluster.run import Run
from elasticd.cluster.sealed import Sealed
from elasticd.cluster.stores import local_address, open_store
from elasticd.cluster.timing import BEAT_EVERY, CLOCK_SKEW, HOST_DOWN_POLL, LOST_SILENCE
from elasticd.config import Config
from elasticd.lifecycle import triage

log = logs.get("elasticd.rendezvous")


__all__ = [
    "BudgetSpent",
    "Rendezvous",
    "RendezvousFailed",
    "Round",
    "StoreLost",
    "StoreUnreachable",
]


class Rendezvous:
    """One per daemon: rounds, restart requests, the exit barrier, the job's budget and end.
    Its parts own their state: the sealed store (`sealed`), the run (`run`), the arrival records
    read (`arrivals`), the restart budget (`budget`); it keeps the node's identity and the last
    round it was a member of."""

    def __init__(self, cfg: Config, store: kvmod.KV | None = None, begins_run: bool | None = None):
        """`store`: one opened already (else open_store); `begins_run`: whether this node writes
        the run's nonce (by default: the store is new, hosted here or in-process)."""
        self.cfg = cfg
        self.server = None
        if store is None:
            store, self.server = open_store(cfg)
        self.is_host = self.server is not None
        self.sealed = Sealed(
            store, signing.Signer(signing.job_secret(cfg), cfg.rdzv_id), cfg.rdzv_id
        )
        self.addr = cfg.local_addr or local_address(cfg.rdzv_host, cfg.rdzv_port)
        self.node_id = new_node_id()
        self.link = 0  # the port our daemon's links listen on, for our arrival record (links.py)
        self.last: Round | None = None  # the last round this node was a member of
        self.partners: list[str] = []  # the other members of the last round this node was in
        self.carry: Carry | None = None  # what this node brings into its next round in place
        # whether this node's ranks can start into a group that goes on in place (False: its
        # torch has no reconfigure, or --in-place off; its arrival record says "fresh")
        self.in_place = True
        self.started = time.time()  # a job's end issued before this (less CLOCK_SKEW) is older
        self._unreachable_logs = logs.Throttle(5.0)
        begins = (
            self.is_host or store.endpoint == kvmod.LocalKV.endpoint
            if begins_run is None
            else begins_run
        )
        # a c10d store we do not host may be restarted by its host with a new run: followed, once
        # its host answers in it (Run.followed); the store's host answers in its own
        self.run = Run(self.sealed, cfg.join_timeout, self.started, begins, cfg.etcd)
        self.arrivals = Arrivals(self.sealed, cfg.max_nodes)
        self.budget = Budget(self.sealed)
        self.sealed.enter_run(self.run.join(self.answered))  # every key of this run under it
        log.info("rendezvous_run", run=self.run.id)

    def follow_run(self, deadline: float) -> None:
        """At every try to join a round, on a c10d store we do not host: take the run its host
        began, if that is no longer ours, once its host has answered us in it (Run.followed:
        an earlier run's record written back moves nothing, and a run whose host is gone is
        not joined). The store's host restarted (its daemon started again, by systemd or by
        hand) and hosts a fresh store: the same job (the run's record is sealed with the job's
        secret, for its id), in a new run, with none of the old run's keys: no rounds, no
        closing, no budget. This node joins it as a new member (its round numbers start again),
        carrying the restarts the job has spent into it. It never begins a run there itself:
        only the host does."""
        found = self.run.followed(deadline)
        if found == self.run.id:
            return
        log.warning(
            "rendezvous_store_restarted",
            endpoint=self.endpoint,
            previous_run=self.run.id,
            run=found,
            restarts_used=self.budget.seen,
        )
        self.run.id = found
        self.sealed.enter_run(found)
        self.last = None
        self.arrivals.reset()
        self.budget.carry()

    # --- the parts' views, for the agent and the liveness thread ---

    @property
    def kv(self) -> kvmod.KV:
        return self.sealed.kv

    @property
    def signer(self) -> signing.Signer:
        return self.sealed.signer

    @property
    def endpoint(self) -> str:
        return self.sealed.endpoint

    @property
    def etcd(self) -> bool:
        return self.cfg.etcd

    @property
    def scope(self) -> str:
        return self.sealed.scope

    @property
    def hosts_run(self) -> bool:
        return self.run.hosts

    def job_key(self, name: str) -> str:
        return self.sealed.job_key(name)

    def round_key(self, number: int, name: str) -> str:
        return self.sealed.round_key(number, name)

    def answered(self, call, deadline: float):
        """call(), or None after a pause when the store did not answer it (a partition, an etcd
        election: a second; a c10d host that refuses the connection, whose daemon systemd may be
        starting again: HOST_DOWN_POLL, so the nodes are back at its fresh store in time for
        its first round); RendezvousFailed once that goes on past the deadline."""
        try:
            return call()
        except StoreUnreachable as e:
            if time.monotonic() > deadline:
                why = (
                    f"{e}, and it did not come back within --join-timeout "
                    f"{self.cfg.join_timeout:g}s: start elasticd again on that node, or the job "
                    "again on every node"
                    if e.host_down
                    else f"{e}, for --join-timeout {self.cfg.join_timeout:g}s: check the "
                    "network and the store's host"
                )
                if self.run.unverified:  # the likelier cause, seen before the store went away
                    why += (
                        "; the job's run record there did not verify: give every node the same "
                        "--rdzv-secret-file"
                    )
                raise RendezvousFailed(why) from None
            pause = HOST_DOWN_POLL if e.host_down else 1.0
            held = self._unreachable_logs("host_down" if e.host_down else "silent")
            if held is not None:
                log.warning("store_unreachable", why=str(e), retry_in=pause, held_back=held)
            time.sleep(pause)
            return None

    # --- sealed values ---

    def seal(self, key: str, payload: str) -> bytes:
        return self.sealed.seal(key, payload)

    def open(self, key: str, raw: bytes | None, parse):
        """The parsed value, or None (Sealed.open)."""
        return self.sealed.open(key, raw, parse)

    # --- rounds ---

    @store_call
    def current_round(self) -> int:
        """Where a node joins: after its own last round, or the newest round any node entered."""
        key = self.job_key(names.ROUND)
        newest = self.open(key, self.kv.get(key), values.count) or 0
        return max(newest, self.last.number + 1 if self.last else 0)

    def enter(self, number: int) -> None:
        """Raise the job's round key to `number` (compare-and-set: it never goes down)."""
        key = self.job_key(names.ROUND)
        for _ in range(100):
            raw = self.kv.get(key)
            if (self.open(key, raw, values.count) or -1) >= number:
                return
            if self.kv.compare_set(key, raw, self.seal(key, str(number))):
                return

    def next_round(self, nproc: int) -> Round:
        """Join rounds until this node is a member of one (joining.py). Raises RendezvousFailed
        when the job has ended or --join-timeout passes; a store that stops answering is retried
        until then. The round carries the workers' state key (signing.state_key)."""
        rnd = joining.next_round(self, nproc)
        rnd.state_key = signing.state_key(self.signer.key, self.cfg.rdzv_id)
        return rnd

    def check_open(self) -> None:
        """RendezvousFailed when the job has ended (a closing sealed for this run, and not older
        than this daemon)."""
        key = self.job_key(names.CLOSED)
        closed = self.open(key, self.kv.get(key), values.closed)
        if closed is None:
            return
        issued, why = closed
        if issued < self.started - CLOCK_SKEW:
            # sealed for this run, yet older than us: never a verdict on us
            self.sealed.rejected(
                key, f"issued {self.started - issued:.0f}s before this daemon started"
            )
            return
        raise RendezvousFailed(
            f"the job has ended ({why}): nothing to join; give a new --rdzv-id to start a new job"
        )

    # --- within a round ---

    @store_call
    def request_restart(self, rnd: Round, reason: dict) -> bool:
        """Ask every node to restart this round. True when ours stands (we own the failure):
        there was none, or ours is of a failure that came before the one there, which it
        replaces (triage.comes_first: another node's rank that raised, where ours died of it).
        A value in the way that does not verify is a forger's: ours replaces it."""
        key = self.restart_key(rnd)
        sealed = self.seal(key, json.dumps(reason))
        if self.kv.compare_set(key, None, sealed):
            return True
        raw = self.kv.get(key)
        theirs = self.open(key, raw, values.reason)
        if theirs is not None:
            return triage.comes_first(reason, theirs) and self.kv.compare_set(key, raw, sealed)
        self.kv.set(key, sealed)
        return True

    def amend_restart(self, rnd: Round, ours: dict, amended: dict) -> bool:
        """Put `amended` in place of our restart request `ours` (a replay's verdict added,
        daemon/replay_verdict.py), where ours still stands: never over another node's."""
        key = self.restart_key(rnd)
        raw = self.kv.get(key)
        there = self.open(key, raw, values.reason)
        same = ("at", "rank", "node")
        if there is None or any(there.get(k) != ours.get(k) for k in same):
            return False
        return self.kv.compare_set(key, raw, self.seal(key, json.dumps(amended)))

    @store_call
    def note_replay(self, rnd: Round, name: str, value: dict) -> None:
        """A word of the replay on another node (daemon/replay_elsewhere.py): the failed node's
        `replay_ask` (where its bundle is), the other node's `replayed` (its verdict); for the
        referee of two replicas on two nodes, `referee_ask` and `refereed`."""
        key = self.round_key(rnd.number, name)
        self.kv.set(key, self.seal(key, json.dumps(value)))

    @store_call
    def replay_noted(self, rnd: Round, name: str, timeout: float) -> dict | None:
        """The other node's word `name` (note_replay), waited for up to `timeout` seconds; None
        where none came that verifies."""
        key = self.round_key(rnd.number, name)
        parse = {
            names.REPLAY_ASK: values.replay_ask,
            names.REFEREE_ASK: values.replay_ask,
            names.REPLAYED_ELSEWHERE: values.replay_answer,
            names.REFEREED: values.refereed,
        }[name]
        try:
            return joining.await_value(self, key, parse, time.monotonic() + timeout)
        except RendezvousFailed:
            return None  # none in time, or the job ended meanwhile: nothing more decided

    def restart_key(self, rnd: Round) -> str:
        return self.round_key(rnd.number, names.RESTART)

    def read_restart(self, store: kvmod.KV, rnd: Round) -> dict | None:
        key = self.restart_key(rnd)
        return self.open(key, store.get(key), values.reason)

    def beat(self, store: kvmod.KV, count: int) -> None:
        """This node's liveness counter; on the c10d store's host, also its answer to the
        challenges of nodes that would follow its run, and its run's record kept (run.py)."""
        key = names.alive_key(self.scope, self.node_id)
        store.set(key, self.seal(key, str(count)))
        if self.run.hosts:
            self.run.host_beat(store, count)

    def answer(self, store: kvmod.KV) -> None:
        """The c10d store's host, between its beats: challenges asked since, answered (run.py)."""
        if self.run.hosts:
            self.run.answer(store)

    def keep_master(self, store: kvmod.KV, rnd: Round) -> None:
        """Group rank 0, once a second: its worker store's address put back if someone wrote over
        it (or removed it), since it is written once and a node still meeting the round waits for
        it: garbage left there would hold that node until --join-timeout."""
        key = self.round_key(rnd.number, names.MASTER)
        raw = store.get(key)
        if self.open(key, raw, values.master) is None:
            store.compare_set(key, raw, self.seal(key, rnd.master_value()))

    def read_beats(self, store: kvmod.KV, node_ids: list[str]) -> dict[str, int | None]:
        keys = [names.alive_key(self.scope, n) for n in node_ids]
        return {
            n: self.open(k, raw, values.count)
            for n, k, raw in zip(node_ids, keys, store.multi_get(keys))
        }

    def closed_without_us(self, store: kvmod.KV, number: int) -> bool:
        """Whether round `number` closed (its members written, sealed) without this node."""
        key = self.round_key(number, names.MEMBERS)
        found = self.open(key, store.get(key), values.members)
        return found is not None and all(m.node_id != self.node_id for m in found["members"])

    def waiting_ids(self, store: kvmod.KV, rnd: Round) -> list[str]:
        """Nodes that arrived after the round closed and wait for the next one (arrivals.py)."""
        return self.arrivals.waiting_ids(store, rnd)

    @store_call
    def exit_barrier(self, rnd: Round, timeout: float) -> bool:
        """Wait until every node of the round is done (or one asked for a restart). False on
        timeout (barrier.py)."""
        return barrier.exit_barrier(self.sealed, rnd, timeout)

    # --- job-wide restart budget and end (shared by all nodes) ---

    def restarts_used(self) -> int:
        """The budget spent so far (the highest seen, if the store does not answer now)."""
        return self.budget.used()

    def close(self, job_finished: bool, why: str = "finished") -> None:
        """Best effort at exit: a finished or failed job is closed, so that nodes arriving later
        (or rejoining after a partition) leave with that line instead of waiting. The store's
        host of a job that failed (`why` other than "finished": the agent's words) then keeps
        its store up for the others to read it (`_linger`)."""
        if not job_finished:
            return
        key = self.job_key(names.CLOSED)
        try:
            self.kv.set(key, self.seal(key, f"{time.time():.3f} {why[: values.MAX_REASON]}"))
            if self.is_host and why != "finished":
                self._linger()
        except kvmod.Unreachable as e:
            log.warning("rendezvous_close_failed", error=str(e))

    def _linger(self) -> None:
        """Keep the store up while the other nodes of the last round still beat, until they have
        been quiet for LOST_SILENCE (gone, or stuck), at most --restart-grace plus --kill-timeout
        plus a few beats: each reads the closing at its next look, once its own teardown is
        done. A store that vanished at once would leave a node that had not read the verdict yet
        waiting --join-timeout for a host that might be started again. (A successful job's
        nodes leave the exit barrier together: no need.)"""
        members = self.last.members if self.last is not None else []
        others = [m.node_id for m in members if m.node_id != self.node_id]
        cfg = self.cfg
        now = time.monotonic()
        deadline, quiet_since, seen = now + cfg.restart_grace + cfg.kill_timeout + 2.0, now, {}
        while others and now < deadline and now - quiet_since < LOST_SILENCE:
            beats = self.read_beats(self.kv, others)
            if beats != seen:
                seen, quiet_since = beats, now
            time.sleep(BEAT_EVERY)
            now = time.monotonic()
