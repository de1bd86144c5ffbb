"""The other nodes of the round, as the agent loop sees them through the store: their restart
requests, their liveness (and ours), nodes waiting to join, and whether the store still answers.

Threads, each with its own store connection, so the loop never blocks on the store:
- liveness: beats this node's counter every BEAT_EVERY seconds for as long as the daemon runs,
  reads the counters of the next WATCHED nodes in the ring of the round and, once a second, the
  nodes waiting to join (constant traffic per node, whatever the number of nodes); it also
  notices a store that stops answering;
- the restart waiter: blocks on the round's restart key (the store answers when it is set), so a
  request reaches every node at once without polling; the hang inquiries' waiter likewise
  (hang_inquiry.py: a hang judged across nodes in place, which restarts nothing);
- the arrival waiter, while the round has room for more nodes: blocks on the key the next node
  to come will claim its arrival record at, and then has the liveness thread's next beat read
  the nodes waiting to join (a join in place then starts within a beat, not the once-a-second
  look's second).

A node is lost when it has been silent for --peer-timeout, or silent for LOST_SILENCE (and for
more than two of our steps) with evidence that it is gone rather than slow: none of our workers
has stepped since it went quiet (their collectives wait on it); or silent for two beats since
about when one of our workers died of a closed connection (the agent asks, `died_at`: that death
and the silence together). The failure names the lost node in its first words (its id, group rank
and ranks), and a node told of it by another's restart request says the same (`told`). A daemon
stopped for a few seconds (its workers still training) or a starved one (its beats late, not
missing) is never lost.
A silent neighbour is also probed at its own address (probe.py): one that answered before and now
answers nothing, or refuses, is lost after one beat of silence (a partition, a node killed),
since a starved or stopped daemon's kernel still answers. A watched node whose daemon's held
connection ends with no word (links.py: its daemon died, on one host too) is lost at once.
A c10d store's host that refuses the connection is down, acted on at once. On the c10d store's
host, the liveness thread also answers the challenges of the nodes that would follow its run,
every ANSWER_EVERY between beats (run.answer).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable

from elasticd import logs
from elasticd.cluster import arrivals, hang_inquiry, links, probe, silence
from elasticd.cluster import kv as kvmod
from elasticd.cluster.errors import StoreLost, host_down_line
from elasticd.cluster.rendezvous import Rendezvous
from elasticd.cluster.rounds import Round
from elasticd.cluster.timing import (
    ANSWER_EVERY,
    BEAT_EVERY,
    GARBAGE_BACKOFF,
    LOST_SILENCE,
    WAIT_SLICE,
)
from elasticd.config import Config
from elasticd.lifecycle import supervise
from elasticd.lifecycle.states import Failure, RestartCause, Scale, node_lost
from elasticd.lifecycle.triage import FailureClass
from elasticd.worker.heartbeat import Beat

log = logs.get("elasticd.peers")

WATCHED = 2  # ring neighbours each node watches (and so each node is watched by as many)
WAITING_EVERY = 1.0  # seconds between reads of the nodes waiting to join
PROBE_TRIES = 3  # probes of a neighbour that never answered before it is judged by beats alone


class Peers:
    def __init__(self, cfg: Config, rdzv: Rendezvous, node: str, wake: Callable[[], None]) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.node = node
        self._wake = wake
        self._round: Round | None = None
        # the round watched, and its watched group ranks -> (beat count, when it last went up)
        self._seen: tuple[Round | None, dict[int, tuple[int, float]]] = (None, {})
        # the round probed: group ranks that answered, tries of those that never did, and those
        # that then stopped answering -> (when that probe began, its verdict)
        self._probed: tuple[Round | None, set[int], dict[int, int], dict[int, tuple[float, str]]]
        self._probed = (None, set(), {}, {})
        self._listener = _listener(cfg, rdzv)
        # held connections to the watched nodes' daemons, and our watchers' to us (links.py)
        self.links = _links(cfg, rdzv, self._listener, wake)
        # ours, and the store's (its TCPStore would look up the name of each probe's connection)
        self._not_probed = {rdzv.addr, *_addresses(cfg.rdzv_host)}
        self._restart: tuple[int, dict] | None = None  # (round number, reason) the waiter saw
        self._next_waiting_check = 0.0
        self.waiting: tuple[int, list[str]] = (-1, [])  # (round, ids of nodes waiting to join it)
        self.superseded = -1  # a round shrunk in place whose next one closed without this node
        self.unreachable_since: float | None = None  # when the store stopped answering our beats
        self._last_ok = time.monotonic()  # when it last answered (a beat, or a round formed)
        self.lost_store: str | None = None  # set when etcd refuses us (credentials): for good
        self.host_down = False  # the c10d store's host refused our last beat: its daemon is down
        self._problem = ""
        self._stop = threading.Event()
        self._waiters: list[threading.Thread] = []
        self._beat_kv = rdzv.kv.clone()
        self._wait_kv = rdzv.kv.clone()
        self._arrival_kv: kvmod.KV | None = None  # the arrival waiter's, made at its first round
        self.inquiries = hang_inquiry.Waiter(rdzv, wake)  # hangs judged across nodes, in place
        self._thread = supervise.thread(
            "liveness", self._beat_loop, risk="until it is back, peers may take this node for lost"
        )
        # a single-node c10d job has no one to beat for, and its store is in-process; on etcd the
        # beats also tell that the store still answers
        if cfg.max_nodes > 1 or cfg.etcd:
            self._thread.start()

    def close(self) -> None:
        """Stop both threads and wait (bounded) for them to leave their store calls: a thread
        still inside one when the interpreter exits would abort it. Their connections are closed
        first: an etcd call in progress then ends at once (a member that trickles its reply
        must not hold a stopping daemon up)."""
        self._stop.set()
        self._round = None
        self._beat_kv.close()
        self._wait_kv.close()
        self.inquiries.close()
        if self._arrival_kv is not None:
            self._arrival_kv.close()
        if self.links is not None:
            self.links.close()  # our listener's too
        elif self._listener is not None:
            self._listener.close()
        for t in (self._thread, *self._waiters):
            if t.ident is not None:
                t.join(timeout=WAIT_SLICE + 2 * getattr(self.rdzv.kv, "timeout", 2.5))

    def new_round(self, rnd: Round) -> None:
        """Watch this round's ring neighbours and wait for its restart request."""
        # the round was formed through the store: it answers (an outage's mark must not end this
        # round)
        self.unreachable_since, self._last_ok = None, time.monotonic()
        self._round = rnd
        if self.links is not None:  # its members arrived for it: alive, whatever came before
            self.links.forgive(m.node_id for m in rnd.members)
        self._seen = (rnd, {})
        self._probed = (rnd, set(), {}, {})
        self._restart = None
        self.waiting = (-1, [])
        self.superseded = -1
        self._next_waiting_check = time.monotonic() + WAITING_EVERY
        self._waiters = [t for t in self._waiters if t.is_alive()]
        self.inquiries.new_round(rnd)
        if rnd.group_world_size > 1:
            waiter = threading.Thread(
                target=self._wait_restart, args=(rnd,), name="elasticd-restart-wait", daemon=True
            )
            waiter.start()
            self._waiters.append(waiter)
        if rnd.group_world_size < self.cfg.max_nodes:  # (so more than one: the liveness runs)
            if self._arrival_kv is None:
                self._arrival_kv = self.rdzv.kv.clone()
            waiter = threading.Thread(
                target=self._wait_arrival, args=(rnd,), name="elasticd-arrival-wait", daemon=True
            )
            waiter.start()
            self._waiters.append(waiter)

    # --- the threads ---

    def _beat_loop(self) -> None:
        count = 0
        while not self._pause():
            count += 1
            try:
                self._beat(count)
                self.unreachable_since, self._last_ok = None, time.monotonic()
                self.host_down = False
            except kvmod.Unreachable as e:
                if self._stop.is_set():
                    return  # closed: the daemon stops
                self._problem = str(e)
                if e.refused and self.cfg.etcd:
                    self.lost_store = str(e)
                    self._wake()
                    return
                if self.unreachable_since is None:
                    self.unreachable_since = self._last_ok  # silent since it last answered us
                    log.warning("store_not_answering", why=str(e), host_down=e.refused)
                # a c10d host that refuses us is down: no need to wait out --peer-timeout
                self.host_down = e.refused
                if e.refused or time.monotonic() - self.unreachable_since >= self.cfg.peer_timeout:
                    self._wake()

    def _pause(self) -> bool:
        """Wait until the next beat; True once stopped. The c10d store's host meanwhile answers
        the challenges of the nodes that would follow its run every ANSWER_EVERY (run.answer)."""
        if not self.rdzv.hosts_run:
            return self._stop.wait(BEAT_EVERY)
        beat_at = time.monotonic() + BEAT_EVERY
        while (left := beat_at - time.monotonic()) > 0:
            if self._stop.wait(min(ANSWER_EVERY, left)):
                return True
            try:
                self.rdzv.answer(self._beat_kv)
            except kvmod.Unreachable:
                pass  # the beat says so
        return self._stop.is_set()

    def _beat(self, count: int) -> None:
        """One beat: ours written, then our own key read back with the watched neighbours' (a
        set is not answered by the store, so only a read tells that it still answers), their
        silences accounted (silence.py); once a second, the nodes waiting to join."""
        rnd = self._round
        if rnd is not self.rdzv.last:
            # the loop is between rounds: maybe a new run of a restarted store's host, whose keys
            # the old round's must never be written under (keep_master) or read for (waiting)
            rnd = None
        self.rdzv.beat(self._beat_kv, count)
        watched = rnd.neighbours(WATCHED) if rnd is not None else []
        if self.links is not None:
            self.links.watch({m.node_id: (m.addr, m.link) for m in watched if m.link})
        beats = self.rdzv.read_beats(
            self._beat_kv, [self.rdzv.node_id, *(m.node_id for m in watched)]
        )
        if rnd is None:
            return
        now = time.monotonic()
        ranks = [
            ((rnd.group_rank + k) % rnd.group_world_size, m.node_id)
            for k, m in enumerate(watched, 1)
        ]
        watching, seen = self._seen
        if watching is rnd:  # (not a round the loop has left since this beat began)
            seen.update(silence.account(seen, ranks, beats, now, self._last_ok))
            self._probe(rnd, seen, now)
        if now >= self._next_waiting_check:
            self._next_waiting_check = now + WAITING_EVERY
            if rnd.group_rank == 0 and rnd.group_world_size > 1:
                self.rdzv.keep_master(self._beat_kv, rnd)
            if rnd.group_world_size < self.cfg.max_nodes:
                waiting = self.rdzv.waiting_ids(self._beat_kv, rnd)
                self.waiting = (rnd.number, waiting)
                if waiting:
                    self._wake()
            # a round shrunk in place goes on with no rendezvous; the nodes it lost may have met
            # in the next one meanwhile, taking this one for lost (a partition, healed)
            if rnd.claimed and self.rdzv.closed_without_us(self._beat_kv, rnd.number + 1):
                self.superseded = rnd.number
                self._wake()

    def _probe(self, rnd: Round, seen: dict[int, tuple[int, float]], now: float) -> None:
        """Queued probes of us accepted; our watched neighbours probed at their own address
        (probe.py) where they never answered yet (up to PROBE_TRIES) or did not beat since our
        last read: a neighbour that answered before and no longer does is evidence it is gone."""
        if self.links is None:
            probe.drain(self._listener)  # else the links' thread accepts (and holds) them
        probed, answered, tries, unreachable = self._probed
        if probed is not rnd or self.cfg.etcd:  # on etcd no daemon listens (`_listener`)
            return
        targets = {}
        for g, (_, since) in seen.items():
            addr = rnd.members[g].addr
            fresh = g not in answered and tries.get(g, 0) < PROBE_TRIES
            if addr not in self._not_probed and (fresh or since < now):
                targets[(addr, self.cfg.rdzv_port)] = g
        if not targets:
            return
        began = time.monotonic()
        for target, verdict in probe.probe(targets).items():
            g = targets[target]
            if verdict == "answered":
                answered.add(g)
                unreachable.pop(g, None)
            elif g not in answered:
                tries[g] = tries.get(g, 0) + 1
            else:  # the latest failed probe: one made before the node beat again is stale
                said = "refused us" if verdict == "refused" else "gave no answer"
                new = g not in unreachable
                unreachable[g] = (began, f"its address {target[0]}:{target[1]} {said}")
                if new:
                    log.warning("peer_unreachable", group_rank=g, addr=target[0], verdict=verdict)
                    self._wake()

    def _wait_restart(self, rnd: Round) -> None:
        key = self.rdzv.restart_key(rnd)
        pause = 0.1
        while self._round is rnd and not self._stop.is_set():
            try:
                if self._wait_kv.wait(key, WAIT_SLICE):
                    reason = self.rdzv.read_restart(self._wait_kv, rnd)
                    if reason is not None:
                        self._restart = (rnd.number, reason)
                        self._wake()
                        return
                    self._stop.wait(pause)  # a forger's value: the real one may replace it
                    pause = min(2 * pause, GARBAGE_BACKOFF)
            except kvmod.Unreachable:
                time.sleep(min(1.0, BEAT_EVERY * 2))  # the liveness thread judges the store

    def _wait_arrival(self, rnd: Round) -> None:
        """Block on the key the next node to come claims its arrival record at; once it is
        there, the liveness thread's next beat reads the waiting nodes (a forger's value there
        costs one such read). Records found by listing (a counter raised past every number)
        are still read by the once-a-second look."""
        assert self._arrival_kv is not None
        index = arrivals.first_late(rnd)
        while self._round is rnd and not self._stop.is_set():
            try:
                if self._arrival_kv.wait(
                    self.rdzv.sealed.arrival_key(rnd.number, index), WAIT_SLICE
                ):
                    self._next_waiting_check = 0.0
                    index += 1
            except kvmod.Unreachable:
                time.sleep(min(1.0, BEAT_EVERY * 2))  # the liveness thread judges the store

    # --- the loop's view ---

    def silences(self, now: float) -> dict[int, float]:
        """Seconds since each watched neighbour's beat last went up, by group rank (status)."""
        return {r: round(now - t, 1) for r, (_, t) in sorted(dict(self._seen[1]).items())}

    def check(
        self,
        rnd: Round,
        now: float,
        beats: Callable[[], list[Beat | None]],
        died_at: float | None = None,
        died_of: str = silence.CLOSED,
    ) -> Failure | Scale | None:
        """Why this node must restart because of the others, if it must. `beats` reads our
        workers' heartbeats, only when a watched node is silent (the loop calls this every tick);
        `died_at`: when one of our workers died of a closed connection (monotonic), while the
        loop looks for the node whose going it follows (silence.judge); `died_of`: what that
        evidence was, for the cause (silence.WAITING: our ranks unwound, waiting in place)."""
        if self.lost_store is not None:
            raise StoreLost(
                f"the etcd cluster at {self.rdzv.endpoint} refused us ({self.lost_store}): check "
                "the credentials and the user's permissions on the elasticd/ prefix"
            )
        since = self.unreachable_since
        if since is not None and self.host_down:
            return Failure(
                RestartCause.STORE_UNREACHABLE,
                f"{host_down_line(self.rdzv.endpoint, self._problem)}; stopped the workers "
                "(their in-memory state kept), joining again once its daemon is back, for "
                f"--join-timeout {self.cfg.join_timeout:g}s",
                node=self.node,
            )
        if since is not None and now - since >= self.cfg.peer_timeout:
            return Failure(
                RestartCause.STORE_UNREACHABLE,
                f"cannot reach the rendezvous store at {self.rdzv.endpoint} for "
                f"{now - since:.1f}s ({self._problem}); stopped the workers, "
                "joining again once it answers",
                node=self.node,
            )
        if self._restart is not None and self._restart[0] == rnd.number:
            return told(self._restart[1])
        if self.superseded == rnd.number:
            return Failure(
                RestartCause.PEER,
                f"round {rnd.number + 1} closed without this node: the nodes this one recovered "
                "without in place met again and took it for lost (a partition that healed); "
                "joining them again",
                node=self.node,
            )
        lost = self.lost_neighbour(rnd, now, beats, died_at, died_of)
        if lost is not None:
            return lost
        number, waiting = self.waiting
        if waiting and number == rnd.number:
            return Scale(len(waiting), self.node, tuple(waiting))
        return None

    def lost_neighbour(
        self,
        rnd: Round,
        now: float,
        beats: Callable[[], list[Beat | None]],
        died_at: float | None = None,
        died_of: str = silence.CLOSED,
    ) -> Failure | None:
        """A watched node silent for --peer-timeout, or for long enough with our workers stuck
        or dead of a closed connection (silence.judge): the failure names it (its id, group rank
        and ranks) in its first words, and when it went quiet; one whose daemon died (its held
        connection closed, links.py) by its node id too."""
        watching, seen = self._seen
        seen = dict(seen) if watching is rnd else {}
        probed, _, _, unreachable = self._probed
        unreachable = dict(unreachable) if probed is rnd else {}
        limit = min(LOST_SILENCE, self.cfg.peer_timeout)
        if died_at is not None:
            limit = min(limit, 2 * BEAT_EVERY)
        if unreachable:
            limit = min(limit, BEAT_EVERY)
        gone = self._gone(rnd, seen)
        if not gone and not silence.anyone_silent(seen, now, limit):
            return None  # nobody silent: no need to read our workers' heartbeats
        progress, step = silence.pace(beats())
        found = silence.judge(
            seen,
            now,
            self.cfg.peer_timeout,
            progress,
            step,
            died_at=died_at,
            unreachable=unreachable,
            gone=gone,
            died_of=died_of,
        )
        if found is None:
            return None
        g, why = found
        member = rnd.members[g]
        first = sum(m.nproc for m in rnd.members[:g])
        quiet = min(seen[g][1], gone[g][0]) if g in gone else seen[g][1]
        said = f"group rank {g} ({ranks_text(first, member.nproc)})"
        said = f"{said}, node {member.node_id}:" if g in gone else said
        return Failure(
            RestartCause.NODE_LOST,
            f"lost: {said} {why}; seen by node {self.node}",
            node=member.node_id,
            lost=(member.node_id,),
            at=time.time() - (now - quiet),  # when it went quiet, Unix time
        )

    def _gone(self, rnd: Round, seen: dict[int, tuple[int, float]]) -> dict[int, tuple[float, str]]:
        """The watched nodes whose daemon's held connection ended with no word (links.py), by
        group rank: when, and why."""
        if self.links is None:
            return {}
        gone = dict(self.links.gone)
        return {g: gone[rnd.members[g].node_id] for g in seen if rnd.members[g].node_id in gone}


def _listener(cfg: Config, rdzv: Rendezvous):
    """Where our peers probe us (probe.py): our address at the rendezvous port, for a
    multi-node c10d job, but on the store's own address (the store is there)."""
    if cfg.etcd or cfg.max_nodes == 1 or rdzv.addr in ("", cfg.rdzv_host):
        return None
    return probe.listen(rdzv.addr, cfg.rdzv_port)


def _links(cfg: Config, rdzv: Rendezvous, listener, wake: Callable[[], None]):
    """Our links (links.py), for a job of several nodes: on the probe's listener where we have
    one, else on a port of our own address, which our arrival record carries (`rdzv.link`)."""
    if cfg.max_nodes == 1 or not rdzv.addr:
        return None
    sock = listener if listener is not None else links.listen(rdzv.addr)
    if sock is None:
        log.info("links_not_listening", addr=rdzv.addr)
        return None
    made = links.Links(sock, wake)
    rdzv.link = made.port
    log.info("links_listening", addr=rdzv.addr, port=made.port)
    return made


def _addresses(host: str) -> set[str]:
    """The addresses a host name stands for (itself if it does not resolve)."""
    try:
        return {host, *(str(a[4][0]) for a in socket.getaddrinfo(host, None))}
    except (OSError, UnicodeError):
        return {host}


def ranks_text(first: int, count: int) -> str:
    """A node's ranks as a cause names them: "rank 4", "ranks 4-7"."""
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def told(reason: dict) -> Failure:
    """The restart another node asked for, as this node's cause: where it names lost nodes, the
    first of them in its first words (class node_lost, states.node_lost), else the node that
    asked."""
    klass = _known_class(reason.get("class", ""))
    if reason.get("lost") and klass == FailureClass.NODE_LOST.value:
        return dataclasses.replace(node_lost(reason), kind=RestartCause.PEER)
    return Failure(
        RestartCause.PEER,
        f"peer asked for restart: {reason.get('summary', reason)}",
        node=reason.get("node", "?"),
        failure_class=klass,
    )


def _known_class(value: str) -> str:
    """A peer's failure class as its restart request says it; one we do not know is unknown."""
    known = {c.value for c in FailureClass}
    return value if value in known else FailureClass.UNKNOWN.value
