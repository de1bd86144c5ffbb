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
"""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass, field

import tenacity
import torch.distributed as dist

from elasticd import logs, names
from elasticd.cluster import kv as kvmod
from elasticd.cluster import signing
from elasticd.cluster.tcpstore import TCPStoreKV, serve_store, tcp_connector
from elasticd.config import Config, ConfigError

log = logs.get("elasticd.rendezvous")

BEAT_EVERY = 0.25  # seconds between a node's liveness beats
LOST_SILENCE = 1.25  # seconds of silence that, with evidence, make a node lost (five beats missed)
CLOSE_POLL = 0.05  # how often the node closing a round looks at the arrivals
MAX_REASON = 8 * 1024  # bytes of a restart reason's JSON
MAX_COUNT = 1 << 62
BARRIER_GRACE = 2.0  # seconds before a node that was not last at the exit barrier checks it itself
WAIT_SLICE = 1.0  # seconds a blocking wait lasts before its caller looks around (stop, closed job)
# A key that nodes wait on is never read before a wait has said that it is there: torch's libuv
# TCPStore server (2.13) wakes every client waiting on a key when any client compare-and-sets it
# while it is missing, which is how kv.get reads. Such a read wakes all the waiters (the key still
# missing), each of them reads it in turn and wakes the others again: with N nodes waiting on a
# round's members that was a quarter of a million requests for one round of 1024 nodes
# (bench/scale.py). So the node closing a round pauses in a wait on the members key instead of
# reading it, the exit barrier looks for a restart request with a short wait, and a wait that
# returns without a value that verifies is followed by a pause.
LOOK_WAIT = 0.05  # seconds of a wait that only asks whether a key is there yet
CLOCK_SKEW = 60.0  # seconds nodes' clocks may differ: a job's end issued earlier than our start - this is old
REJECTED_LOGS = 20  # at most this many store_value_rejected lines per REJECTED_WINDOW seconds
REJECTED_WINDOW = 10.0
RUN_GRACE = (
    2.0  # seconds a node joining a c10d store waits for its host to begin the run before it does
)
GARBAGE_BACKOFF = (
    2.0  # the longest pause between reads of a key that holds a value that does not verify
)


class RendezvousFailed(Exception):
    """The job cannot form or go on (join timeout, closed, store gone): one clear line."""


class StoreLost(RendezvousFailed):
    """The store's host answers that nothing listens there any more: the job's store is gone."""


class BudgetSpent(RendezvousFailed):
    """The round that would have followed a failure found the job's restart budget spent."""


class StoreUnreachable(Exception):
    """The store did not answer in time (a partition, a lost etcd quorum): stop the workers, and
    join again once it answers."""


def _store_call(method):
    """A kv.Unreachable in a Rendezvous method becomes StoreLost (refused: the store is gone for
    good) or StoreUnreachable (silence), each one line naming the store."""

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


def local_address(host: str, port: int) -> str:
    """The address of ours that routes to the rendezvous host: what peers can reach us at."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if host != "::1" else "::1"
    try:
        with socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM
        ) as s:
            s.connect((host, port or 1))
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def op_timeout(cfg: Config) -> float:
    """How long one store call may take: half the peer timeout, so a node cut off from the store
    knows it within --peer-timeout."""
    return max(0.5, min(cfg.peer_timeout / 2, 30.0))


def open_etcd(cfg: Config) -> kvmod.KV:
    """The etcd cluster at --rdzv-endpoint (etcd.py), retried with backoff until --join-timeout
    while what failed may heal (refused, timed out, no leader), with the cause in each retry's
    line; one line at once for what cannot (names that do not resolve, certificates that do not
    verify, a cluster that refuses us, a bad TLS or password file)."""
    from elasticd.cluster import etcd

    deadline = time.monotonic() + cfg.join_timeout

    def connect() -> kvmod.KV:
        # the check of the last try ends with --join-timeout; the store's calls keep op_timeout
        check = max(min(op_timeout(cfg), deadline - time.monotonic()), 0.05)
        return etcd.connect(
            cfg.rdzv_endpoint,
            op_timeout(cfg),
            cacert=cfg.etcd_cacert or None,
            cert=cfg.etcd_cert or None,
            key=cfg.etcd_key or None,
            user=cfg.etcd_user or None,
            password_file=cfg.etcd_password_file or None,
            check_timeout=check,
        )

    def may_heal(e: BaseException) -> bool:
        return (
            isinstance(e, kvmod.Unreachable)
            and not e.refused
            and not isinstance(e, etcd.Misconfigured)
        )

    retry = tenacity.Retrying(
        stop=tenacity.stop_after_delay(cfg.join_timeout),
        wait=tenacity.wait_exponential_jitter(initial=0.1, max=2.0),
        retry=tenacity.retry_if_exception(may_heal),
        before_sleep=lambda st: log.info(
            "store_connect_retry",
            endpoint=cfg.rdzv_endpoint,
            attempt=st.attempt_number,
            why=str(st.outcome.exception()) if st.outcome else "",
        ),
        reraise=True,
    )
    try:
        for attempt in retry:
            with attempt:
                return connect()
    except ValueError as e:
        raise ConfigError(f"--rdzv-endpoint / --etcd-*: {e}") from None
    except etcd.Refused as e:
        raise RendezvousFailed(
            f"the etcd cluster refused us ({e}): check --etcd-user, --etcd-password-file and "
            "the user's permissions on the elasticd/ prefix"
        ) from None
    except etcd.Misconfigured as e:
        raise RendezvousFailed(
            f"cannot use the etcd cluster at {cfg.rdzv_endpoint} ({e}): {etcd_hint(e)}"
        ) from None
    except kvmod.Unreachable as e:
        raise RendezvousFailed(
            f"cannot reach the etcd cluster at {cfg.rdzv_endpoint} within {cfg.join_timeout:g}s "
            f"({e}): {etcd_hint(e)}"
        ) from None
    raise AssertionError("unreachable")


# What to check, by what the members' last attempts failed of (etcd.NoAnswer.causes).
_ETCD_HINTS = {
    "dns": "check the host names in --rdzv-endpoint",
    "tls": "check --etcd-cacert (the CA that signed the members' certificates) and that the members' "
    "certificates name the hosts in --rdzv-endpoint",
    "refused": "nothing listens there: check the ports in --rdzv-endpoint and that etcd runs on those hosts",
    "timeout": "check that the members run and that this node can reach them (firewall, routes)",
    "leader": "the members have no leader: check that a quorum of them runs",
    "reply": "what answers there is not etcd's client port: check --rdzv-endpoint",
}


def etcd_hint(e: BaseException) -> str:
    """What the operator should check, by the causes an etcd failure names."""
    causes = getattr(e, "causes", ())
    return (
        "; ".join(h for cause, h in _ETCD_HINTS.items() if cause in causes)
        or "check --rdzv-endpoint and that a quorum of members runs"
    )


def open_store(cfg: Config) -> tuple[kvmod.KV, dist.TCPStore | None]:
    """Host the c10d store when the endpoint is one of our addresses and its port is free, else
    connect to it (retried with backoff until --join-timeout). Returns the KV and, on the host, the
    server (kept alive for as long as the daemon runs). With --rdzv-backend etcd, the cluster; for
    a single-node c10d job, a KV in this process (nothing listens: no one else can touch it)."""
    if cfg.etcd:
        return open_etcd(cfg), None
    if cfg.max_nodes == 1:
        return kvmod.LocalKV(), None
    host, port = cfg.rdzv_host, cfg.rdzv_port
    server = None
    try:
        server = serve_store(host, port, max(cfg.join_timeout, 60.0))
        port = server.port
    except OSError as e:
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise RendezvousFailed(
                f"cannot use --rdzv-endpoint {host}:{port} ({e.strerror})"
            ) from None
    store = TCPStoreKV(tcp_connector(host, port), f"{host}:{port}", op_timeout(cfg))
    retry = tenacity.Retrying(
        stop=tenacity.stop_after_delay(cfg.join_timeout),
        wait=tenacity.wait_exponential_jitter(initial=0.1, max=2.0),
        retry=tenacity.retry_if_exception_type(kvmod.Unreachable),
        before_sleep=lambda st: log.info(
            "store_connect_retry", endpoint=store.endpoint, attempt=st.attempt_number
        ),
        reraise=True,
    )
    try:
        for attempt in retry:
            with attempt:
                store.get(names.job_key(cfg.rdzv_id, names.ROUND))
    except kvmod.Unreachable:
        raise RendezvousFailed(
            f"cannot reach the rendezvous store at {host}:{port} within {cfg.join_timeout:g}s: "
            "check --rdzv-endpoint and that elasticd runs on the host node"
        ) from None
    return store, server


@dataclass(frozen=True)
class Member:
    node_id: str
    nproc: int
    addr: str


@dataclass
class Round:
    """One closed round: this node's place in it, its members, the nodes found lost as it formed."""

    number: int
    group_rank: int
    members: list[Member]
    lost: list[str] = field(default_factory=list)  # node ids of the previous round that never came
    rank_base: int = 0
    world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    worker_store: dist.TCPStore | None = None  # held by group rank 0 for the round's workers
    # watched group rank -> (its beat count, the monotonic time it last went up): peers.py
    peer_seen: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def group_world_size(self) -> int:
        return len(self.members)

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


class Rendezvous:
    """One per daemon: rounds, restart requests, the exit barrier, the job's budget and end."""

    def __init__(self, cfg: Config, store: kvmod.KV | None = None, begins_run: bool | None = None):
        """`store`: one opened already (else open_store); `begins_run`: whether this node writes
        the run's nonce (by default: the store is new, hosted here or in-process)."""
        self.cfg = cfg
        self.signer = signing.Signer(job_secret(cfg), cfg.rdzv_id)
        self.server = None
        if store is None:
            store, self.server = open_store(cfg)
        self.kv = store
        self.is_host = self.server is not None
        self.addr = cfg.local_addr or local_address(cfg.rdzv_host, cfg.rdzv_port)
        self.node_id = new_node_id()
        self.last: Round | None = None  # the last round this node was a member of
        self._restarts_seen = 0  # the budget counter only grows: an older value is a replay
        self._logged: dict[str, float] = {}
        self._log_window: list[float] = [0.0, 0, 0]  # window start, lines in it, lines suppressed
        self._bad: set[str] = set()  # arrival records that failed verification: never read again
        self._waiting_seen: tuple[int, dict[str, str | None]] = (
            -1,
            {},
        )  # waiting_ids' cache, per round
        self._listed = (
            0.0  # when the round's records were last listed (a counter past any real number)
        )
        self.started = (
            time.time()
        )  # a job's end issued before this (less CLOCK_SKEW) is of an earlier run
        self.run = self._join_run(
            self.is_host or store.endpoint == kvmod.LocalKV.endpoint
            if begins_run is None
            else begins_run
        )
        self.scope = f"{cfg.rdzv_id}/{self.run}"  # every key of this run is under elasticd/<scope>/
        log.info("rendezvous_run", run=self.run)

    @property
    def endpoint(self) -> str:
        return self.kv.endpoint

    def _job(self, name: str) -> str:
        return names.job_key(self.scope, name)

    def _key(self, number: int, name: str) -> str:
        return names.round_key(self.scope, number, name)

    def _tag(self, number: int) -> str:
        """Names the round's arrival keys: no one without the secret can make it, so no one can
        raise the counter or fill the records before the round's first node arrives."""
        return self.signer.mac(f"arrivals/{self.scope}/{number}", b"")[:16]

    def arrivals_key(self, number: int) -> str:
        return names.arrivals_key(self.scope, number, self._tag(number))

    def arrival_key(self, number: int, index: int) -> str:
        return names.arrival_key(self.scope, number, self._tag(number), index)

    # --- the run ---

    def _join_run(self, begins: bool) -> str:
        """This daemon's run: a nonce bound into every key, so nothing written in an earlier run of
        the same --rdzv-id (and the same secret) verifies in this one. A new store (hosted here, or
        in-process) is ours to begin: its host writes the run before any other node can join, and
        writes over anything found there. Elsewhere a node takes the run it finds, or begins one
        (create-only, so one node's wins) where there is none (an etcd cluster, whose keys outlive
        runs; a c10d store someone else hosts, after RUN_GRACE), where a value in the way does not
        verify, or (on etcd) where the run it finds ended before this daemon started. (On a c10d
        store whose host began the run, a value that does not verify is never written over: its
        writer has another secret, or is not one of the job's nodes.)"""
        deadline = time.monotonic() + self.cfg.join_timeout
        while True:
            run = self._answered(lambda: self._find_run(begins, deadline), deadline)
            if run is not None:
                return run

    def _answered(self, call, deadline: float):
        """call(), or None after a second's pause when the store did not answer it (a partition,
        an etcd election); RendezvousFailed once that goes on past the deadline."""
        try:
            return call()
        except StoreUnreachable as e:
            if time.monotonic() > deadline:
                raise RendezvousFailed(
                    f"{e}, for --join-timeout {self.cfg.join_timeout:g}s: check the "
                    "network and the store's host"
                ) from None
            log.warning("store_unreachable", why=str(e), retry_in=1.0)
            time.sleep(1.0)
            return None

    @_store_call
    def _find_run(self, begins: bool, deadline: float) -> str:
        """One try of _join_run (a store call that gets no answer ends it: StoreUnreachable)."""
        key = names.job_key(self.cfg.rdzv_id, names.RUN)
        mine = secrets.token_hex(8)
        sealed = self.seal(key, f"{mine} {time.time():.3f}")
        if begins:
            if not self.kv.compare_set(
                key, None, sealed
            ):  # someone wrote it before we could: ours stands
                self._rejected(key, "written before the store's host began the run")
                self.kv.set(key, sealed)
            return mine
        started = time.monotonic()
        pause = CLOSE_POLL
        while True:
            raw = self.kv.get(key)
            run = self.open(key, raw, _run)
            if run is not None and not (self.cfg.etcd and self._ended_before_us(run)):
                return run
            if raw is None and not self.cfg.etcd and time.monotonic() - started < RUN_GRACE:
                self.kv.wait(key, RUN_GRACE)  # the store's host writes it as it starts
                continue
            if (raw is None or self.cfg.etcd) and self.kv.compare_set(key, raw, sealed):
                log.info("rendezvous_new_run", run=mine, previous=run or "")
                return mine
            if time.monotonic() > deadline:
                raise RendezvousFailed(
                    f"no run of job {self.cfg.rdzv_id} to join at {self.endpoint} within "
                    f"--join-timeout {self.cfg.join_timeout:g}s: its record there does not verify "
                    "(give every node the same --rdzv-secret-file), or something other than the "
                    "job's nodes writes to the store"
                )
            time.sleep(pause)  # another node's run won, or a value changed under us: look again
            pause = min(2 * pause, GARBAGE_BACKOFF)

    def _ended_before_us(self, run: str) -> bool:
        """Whether that run (of this --rdzv-id, on etcd) ended before this daemon started."""
        key = names.job_key(f"{self.cfg.rdzv_id}/{run}", names.CLOSED)
        closed = self.open(key, self.kv.get(key), _closed)
        return closed is not None and closed[0] < self.started - CLOCK_SKEW

    # --- sealed values ---

    def seal(self, key: str, payload: str) -> bytes:
        return self.signer.seal(key, payload)

    def open(self, key: str, raw: bytes | None, parse):
        """The parsed value, or None: absent, or (logged) not sealed for this key with the job's
        secret, or not of its form."""
        if raw is None:
            return None
        data = self.signer.open(key, raw)
        value = None
        if data is not None:
            try:
                value = parse(data.decode())
            except (ValueError, UnicodeDecodeError, RecursionError):
                value = None
        if value is None:
            self._rejected(key, "bad signature" if data is None else "malformed")
        return value

    def _rejected(self, key: str, why: str) -> None:
        """One line per key per 5 s, and at most REJECTED_LOGS lines per REJECTED_WINDOW in all:
        a forger writing many keys in a loop must not flood the log."""
        now = time.monotonic()
        if now - self._logged.get(key, -60.0) < 5.0:
            return
        window = self._log_window
        if now - window[0] >= REJECTED_WINDOW:
            window[:] = [now, 0, window[2]]
        if window[1] >= REJECTED_LOGS:
            window[2] += 1
            return
        if len(self._logged) > 4096:
            self._logged.clear()
        self._logged[key] = now
        window[1] += 1
        log.warning(
            "store_value_rejected",
            key=key[:200],
            rejected=self.signer.rejected,
            why=why,
            suppressed=window[2],
        )
        window[2] = 0

    # --- rounds ---

    @_store_call
    def current_round(self) -> int:
        """Where a node joins: after its own last round, or the newest round any node entered."""
        newest = self.open(self._job(names.ROUND), self.kv.get(self._job(names.ROUND)), _count) or 0
        return max(newest, self.last.number + 1 if self.last else 0)

    def _enter(self, number: int) -> None:
        """Raise the job's round key to `number` (compare-and-set: it never goes down)."""
        key = self._job(names.ROUND)
        for _ in range(100):
            raw = self.kv.get(key)
            if (self.open(key, raw, _count) or -1) >= number:
                return
            if self.kv.compare_set(key, raw, self.seal(key, str(number))):
                return

    def next_round(self, nproc: int) -> Round:
        """Join rounds until this node is a member of one (a node that arrives after a round
        closed waits for that round's restart and joins the next). Raises RendezvousFailed when
        the job has ended or --join-timeout passes; a store that stops answering is retried
        until then."""
        deadline = time.monotonic() + self.cfg.join_timeout
        while True:
            rnd = self._answered(
                lambda: self._try_round(nproc, deadline), deadline
            )  # None: late, or no answer
            if rnd is not None:
                self.last = rnd
                return rnd

    @_store_call
    def _try_round(self, nproc: int, deadline: float) -> Round | None:
        self._check_open()
        number = self.current_round()
        self._bad.clear()  # keys of earlier rounds: never read again anyway
        self._enter(number)
        prev = self.last.group_rank if self.last and self.last.number == number - 1 else -1
        index = self._claim(
            number,
            json.dumps({"id": self.node_id, "nproc": nproc, "addr": self.addr, "prev": prev}),
        )
        closing = self._members(number, index, deadline)
        if closing["failed"]:
            raise BudgetSpent(closing["failed"])
        ids = [m.node_id for m in closing["members"]]
        if self.node_id not in ids:  # late: take part in the next round
            log.info("rendezvous_waiting", round=number, arrival=index)
            self._await_restart(number, deadline)
            self.last = None
            self._enter(number + 1)
            return None
        rnd = Round(
            number=number,
            group_rank=ids.index(self.node_id),
            members=closing["members"],
            lost=closing["lost"],
        )
        rnd.rank_base = sum(m.nproc for m in rnd.members[: rnd.group_rank])
        rnd.world_size = sum(m.nproc for m in rnd.members)
        master = self._key(number, names.MASTER)
        if rnd.group_rank == 0:
            rnd.worker_store = serve_store(self.addr, 0, max(self.cfg.join_timeout, 60.0))
            self.kv.set(master, self.seal(master, f"{self.addr} {rnd.worker_store.port}"))
        rnd.master_addr, rnd.master_port = self._await(master, _master, deadline)
        return rnd

    def _claim(self, number: int, record: str) -> int:
        """Take an arrival number and write our record there, create-only: a number whose key
        holds anything already (a forger's value) is skipped, so no one can make our record go
        unread by writing there first. The number is only a hint for finding records."""
        counter = self.arrivals_key(number)
        for _ in range(self.cfg.max_nodes + 64):
            index = self._counter(self.kv, counter, number, take=True)
            key = self.arrival_key(number, index)
            if self.kv.compare_set(key, None, self.seal(key, record)):
                return index
        raise RendezvousFailed(
            f"every arrival number of round {number} this node took was already written: something "
            f"other than the job's nodes writes to the store at {self.endpoint}"
        )

    def _counter(self, store: kvmod.KV, key: str, number: int, take: bool) -> int:
        """A counter's next number (take) or its count. One that holds no number, or one below
        zero (someone wrote over it: its numbers would fall outside every reader's range), is set
        back above every arrival record of round `number` (the barrier's counter, to 0)."""
        for _ in range(2):
            try:
                value = store.take(key) if take else store.taken(key)
                if value >= int(take):
                    return value
                raw = str(value).encode()
            except kvmod.BadCounter as e:
                raw = e.raw
            self._rejected(key, "not a count")
            floor = 0
            if key == self.arrivals_key(number):
                prefix = self.arrival_key(number, 0)[:-1]
                floor = max(
                    (
                        int(k[len(prefix) :])
                        for k in store.keys(prefix)
                        if k[len(prefix) :].isdigit()
                    ),
                    default=0,
                )
            store.compare_set(key, raw, str(min(floor, MAX_COUNT)).encode())
        raise kvmod.Unreachable(f"store {self.endpoint}: {key} keeps being overwritten")

    def _check_open(self) -> None:
        closed = self.open(self._job(names.CLOSED), self.kv.get(self._job(names.CLOSED)), _closed)
        if closed is None:
            return
        issued, why = closed
        if (
            issued < self.started - CLOCK_SKEW
        ):  # sealed for this run, yet older than us: never a verdict on us
            self._rejected(
                self._job(names.CLOSED),
                f"issued {self.started - issued:.0f}s before this daemon started",
            )
            return
        raise RendezvousFailed(
            f"the job has ended ({why}): nothing to join; give a new --rdzv-id to start a new job"
        )

    def _await(self, key: str, parse, deadline: float):
        """A sealed value someone else writes: wait for it (in slices, checking that the job
        still runs) and read it until it verifies, or fail at the deadline."""
        pause = 0.1
        while time.monotonic() < deadline:
            if self.kv.wait(key, min(WAIT_SLICE, max(0.01, deadline - time.monotonic()))):
                value = self.open(key, self.kv.get(key), parse)
                if value is not None:
                    return value
                time.sleep(pause)  # a forger's value: its writer's may still replace it
                pause = min(2 * pause, GARBAGE_BACKOFF)
            self._check_open()
        raise RendezvousFailed(
            f"timed out after --join-timeout {self.cfg.join_timeout:g}s waiting for {key} (a "
            "node of the round stopped, or values fail verification: give every node the same "
            "--rdzv-secret-file)"
        )

    def _await_restart(self, number: int, deadline: float) -> None:
        self._await(self._key(number, names.RESTART), _reason, deadline)

    def _members(self, number: int, index: int, deadline: float) -> dict:
        """The closed round's members: as the closer (the first arrival) or, after a wait that
        leaves time for the closer to have died, as any node (compare-and-set: one closing wins)."""
        key = self._key(number, names.MEMBERS)
        patience = (
            self.cfg.last_call_timeout
            + self.cfg.restart_grace
            + self.cfg.kill_timeout
            + 2 * LOST_SILENCE
        )
        wait_until = min(time.monotonic() + patience, deadline)
        pause = CLOSE_POLL
        while index != 1 and time.monotonic() < wait_until:
            if self.kv.wait(key, min(WAIT_SLICE, max(0.01, wait_until - time.monotonic()))):
                found = self.open(key, self.kv.get(key), _members)
                if found is not None:
                    return found
                time.sleep(
                    pause
                )  # woken with no value that verifies (see LOOK_WAIT); the closer replaces it
                pause = min(2 * pause, GARBAGE_BACKOFF)
            self._check_open()
        return self._close(number, deadline)

    def _new_records(
        self, number: int, known: set[str], store: kvmod.KV | None = None, first: int = 1
    ) -> list[str]:
        """Keys of round `number`'s arrival records from number `first` on not yet read (nor
        rejected). From the counter while it is believable; past MAX + 64 numbers someone raised
        it, and the records are found by listing the round's keys (at most every half second)."""
        store = store or self.kv
        cap = self.cfg.max_nodes + 64
        arrived = self._counter(store, self.arrivals_key(number), number, take=False)
        if arrived <= cap:
            keys = [self.arrival_key(number, i) for i in range(first, arrived + 1)]
        else:
            now = time.monotonic()
            if now - self._listed < 0.5:
                return []
            self._listed = now
            prefix = self.arrival_key(number, 0)[:-1]
            keys = sorted(store.keys(prefix), key=lambda k: (len(k), k))
        return [k for k in keys if k not in known and k not in self._bad]

    def _read_records(self, keys: list[str], store: kvmod.KV | None = None) -> dict[str, dict]:
        """The records at `keys` that verify; a key that holds one that does not joins _bad."""
        found = {}
        for key, raw in zip(keys, (store or self.kv).multi_get(keys)):
            if raw is None:
                continue  # taken, not written yet
            rec = self.open(key, raw, _record)
            if rec is None:
                self._bad.add(key)
            else:
                found[key] = rec
        return found

    def _close(self, number: int, deadline: float) -> dict:
        """Close the round once enough nodes are in, write its members, return what was written."""
        cfg = self.cfg
        key = self._key(number, names.MEMBERS)
        expected, gone, reason = self._expected(number)
        lost: set[str] = set(gone)
        records: dict[str, dict] = {}  # arrival key -> its record
        silence: dict[str, tuple[int, float]] = {}  # missing node -> (its beat count, since when)
        reached_min = None
        while True:
            now = time.monotonic()
            records.update(self._read_records(self._new_records(number, set(records))))
            ids = {r["id"] for r in records.values()}
            count = len(ids)
            if count >= cfg.min_nodes and reached_min is None:
                reached_min = now
            if expected is not None:
                missing = sorted(expected - ids - lost)
                beats = self.read_beats(self.kv, missing)
                for node_id in missing:
                    seen = silence.get(node_id)
                    if seen is None or (beats[node_id] is not None and beats[node_id] > seen[0]):
                        silence[node_id] = (beats[node_id] or 0, now)
                    elif (
                        now - seen[1] >= LOST_SILENCE
                    ):  # the round ended and it neither came nor beat
                        lost.add(node_id)
                        log.warning(
                            "node_lost", node=node_id, round=number, silent=round(now - seen[1], 2)
                        )
            full = count >= cfg.max_nodes
            everyone = (
                expected is not None and not (expected - ids - lost) and count >= cfg.min_nodes
            )
            late = (
                reached_min is not None
                and now - reached_min >= cfg.last_call_timeout
                and (
                    expected is None
                    or now - reached_min >= cfg.restart_grace + cfg.kill_timeout + LOST_SILENCE
                )
            )
            if full or everyone or late:
                chosen = sorted(
                    records.items(),
                    key=lambda kv: (
                        kv[1]["prev"] if kv[1]["prev"] >= 0 else MAX_COUNT,
                        len(kv[0]),
                        kv[0],
                    ),
                )
                members, seen_ids = [], set()
                for _, r in chosen:
                    if r["id"] not in seen_ids and len(members) < cfg.max_nodes:
                        seen_ids.add(r["id"])
                        members.append([r["id"], r["nproc"], r["addr"]])
                found_lost = sorted(lost & (expected or set()) | gone)
                verdict: dict = {"members": members, "lost": found_lost}
                if (
                    reason.get("spends") and not found_lost
                ):  # a failure, not a node lost: it costs the budget
                    used = self.spend_restart(number)
                    if used > cfg.max_restarts:
                        verdict["failed"] = (
                            f"restart budget spent ({used - 1} of --max-restarts {cfg.max_restarts} "
                            f"used) at: {reason.get('summary', '?')}"
                        )[:MAX_REASON]
                found = self._write_members(key, json.dumps(verdict))
                if found is not None:
                    return found
            if now > deadline:
                hint = (
                    f"; {self.signer.rejected} store value(s) failed verification: give every node the same "
                    "--rdzv-secret-file"
                    if self.signer.rejected
                    else ": start elasticd on the other nodes, or lower --nnodes"
                )
                raise RendezvousFailed(
                    f"only {count} of the {cfg.min_nodes} nodes needed joined within --join-timeout "
                    f"{cfg.join_timeout:g}s{hint}"
                )
            if self.kv.wait(
                key, CLOSE_POLL
            ):  # the pause between looks: another node closed the round
                found = self.open(key, self.kv.get(key), _members)
                if found is not None:
                    return found
                time.sleep(CLOSE_POLL)  # a value in the way that does not verify

    def _write_members(self, key: str, value: str) -> dict | None:
        """Write the round's members unless another closer did: what won, ours or theirs. A value
        in the way that does not verify is written over (compare-and-set against it)."""
        raw = None
        for _ in range(8):
            if self.kv.compare_set(key, raw, self.seal(key, value)):
                return _members(value)
            raw = self.kv.get(key)
            found = self.open(key, raw, _members)
            if found is not None:
                return found
        return None  # it changed under us each time: look again at the next poll

    def _expected(self, number: int) -> tuple[set[str] | None, set[str], dict]:
        """Whom a restarted round waits for: the previous round's members (as that round's
        closing wrote them) but those its restart request named lost, plus the nodes that were
        waiting to join; the lost; and the restart request. (None, {}, {}) for a first round."""
        if number == 0:
            return None, set(), {}
        restart = self._key(number - 1, names.RESTART)
        reason = self.open(restart, self.kv.get(restart), _reason) or {}
        prev = self._key(number - 1, names.MEMBERS)
        closed = self.open(prev, self.kv.get(prev), _members)
        if closed is not None:
            members = closed["members"]
        elif self.last is not None and self.last.number == number - 1:
            members = (
                self.last.members
            )  # what it was when we read it (a forger has written over it)
        else:
            return None, set(), reason
        gone = set(reason.get("lost", []))
        return {m.node_id for m in members} - gone | set(reason.get("waiting", [])), gone, reason

    # --- within a round ---

    @_store_call
    def request_restart(self, rnd: Round, reason: dict) -> bool:
        """Ask every node to restart this round. True when we were first (we own the failure).
        A value in the way that does not verify is a forger's: ours replaces it."""
        key = self._key(rnd.number, names.RESTART)
        sealed = self.seal(key, json.dumps(reason))
        if self.kv.compare_set(key, None, sealed):
            return True
        if self.open(key, self.kv.get(key), _reason) is not None:
            return False
        self.kv.set(key, sealed)
        return True

    def restart_key(self, rnd: Round) -> str:
        return self._key(rnd.number, names.RESTART)

    def read_restart(self, store: kvmod.KV, rnd: Round) -> dict | None:
        key = self.restart_key(rnd)
        return self.open(key, store.get(key), _reason)

    def beat(self, store: kvmod.KV, count: int) -> None:
        key = names.alive_key(self.scope, self.node_id)
        store.set(key, self.seal(key, str(count)))

    def keep_master(self, store: kvmod.KV, rnd: Round) -> None:
        """Group rank 0, once a second: its worker store's address put back if someone wrote over
        it (or removed it), since it is written once and a node still meeting the round waits for
        it: garbage left there would hold that node until --join-timeout."""
        key = self._key(rnd.number, names.MASTER)
        raw = store.get(key)
        if self.open(key, raw, _master) is None:
            store.compare_set(key, raw, self.seal(key, f"{rnd.master_addr} {rnd.master_port}"))

    def read_beats(self, store: kvmod.KV, node_ids: list[str]) -> dict[str, int | None]:
        keys = [names.alive_key(self.scope, n) for n in node_ids]
        return {
            n: self.open(k, raw, _count) for n, k, raw in zip(node_ids, keys, store.multi_get(keys))
        }

    def waiting_ids(self, store: kvmod.KV, rnd: Round) -> list[str]:
        """Nodes that arrived after the round closed and wait for the next one: records that
        verify, of nodes that are not members. Each record is read once (the liveness thread
        asks every second: a new arrival costs one read, none costs the counter's)."""
        if self._waiting_seen[0] != rnd.number:
            self._waiting_seen = (rnd.number, {})
        seen = self._waiting_seen[1]
        # members claimed the first numbers (a late node's number follows theirs)
        new = self._new_records(rnd.number, set(seen), store, first=rnd.group_world_size + 1)[:16]
        if new:
            found = self._read_records(new, store)
            seen.update({k: found[k]["id"] if k in found else None for k in new})
        ids = {m.node_id for m in rnd.members}
        return sorted({i for i in seen.values() if i is not None and i not in ids})

    @_store_call
    def exit_barrier(self, rnd: Round, timeout: float) -> bool:
        """Wait until every node of the round is done (or one asked for a restart). False on timeout."""
        if rnd.group_world_size == 1:
            return True
        job, n = self.scope, rnd.group_world_size
        mine = names.done_key(job, rnd.number, rnd.group_rank)
        self.kv.set(mine, self.seal(mine, "1"))
        arrival = count = self._counter(
            self.kv, self._key(rnd.number, names.DONE_COUNT), rnd.number, take=True
        )
        all_done = self._key(rnd.number, names.ALL_DONE)
        started = time.monotonic()
        deadline = started + timeout
        while True:
            # the last to arrive checks every node's done key, once: N nodes each reading N keys
            # would be O(N^2); the others do only if all_done is late (a forged count, a last
            # node that died), after BARRIER_GRACE
            if count >= n and (arrival >= n or time.monotonic() - started >= BARRIER_GRACE):
                keys = [names.done_key(job, rnd.number, g) for g in range(n)]
                if all(self.open(k, raw, _done) for k, raw in zip(keys, self.kv.multi_get(keys))):
                    self.kv.set(all_done, self.seal(all_done, "1"))
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.kv.wait(all_done, min(WAIT_SLICE, left)) and self.open(
                all_done, self.kv.get(all_done), _done
            ):
                return True
            if (
                self.kv.wait(self.restart_key(rnd), LOOK_WAIT)
                and self.read_restart(self.kv, rnd) is not None
            ):
                return True  # a node asked for a restart (looked for with a wait: see LOOK_WAIT)
            count = self._counter(
                self.kv, self._key(rnd.number, names.DONE_COUNT), rnd.number, take=False
            )

    # --- job-wide restart budget and end (shared by all nodes) ---

    def restarts_used(self) -> int:
        """The budget spent so far (the highest seen, if the store does not answer now)."""
        key = self._job(names.RESTARTS)
        try:
            used = self.open(key, self.kv.get(key), _budget)
        except kvmod.Unreachable:
            return self._restarts_seen
        self._restarts_seen = max(self._restarts_seen, used[0] if used else 0)
        return self._restarts_seen

    def spend_restart(self, number: int) -> int:
        """Spend one restart for round `number` (its closer does, once however many closers try):
        the job's signed counter holds the count and the round that last spent, and moves by
        compare-and-set. A value that does not verify (or went down: a replay) counts as the
        highest this node has seen, and is written over."""
        key = self._job(names.RESTARTS)
        for _ in range(100):
            raw = self.kv.get(key)
            used, spent_for = self.open(key, raw, _budget) or (0, -1)
            if spent_for >= number:
                self._restarts_seen = max(self._restarts_seen, used)
                return used
            used = max(used, self._restarts_seen)
            if self.kv.compare_set(key, raw, self.seal(key, f"{used + 1} {number}")):
                self._restarts_seen = used + 1
                return used + 1
        raise RendezvousFailed(
            "the restart budget in the store changed 100 times while one restart was "
            "spent: something other than the job's nodes writes to the store"
        )

    def close(self, job_finished: bool, why: str = "finished") -> None:
        """Best effort at exit: a finished or failed job is closed, so that nodes arriving later
        (or rejoining after a partition) leave with that line instead of waiting."""
        if not job_finished:
            return
        key = self._job(names.CLOSED)
        try:
            self.kv.set(key, self.seal(key, f"{time.time():.3f} {why[:MAX_REASON]}"))
        except kvmod.Unreachable as e:
            log.warning("rendezvous_close_failed", error=str(e))


# --- the secret and the forms of our values ---


def job_secret(cfg: Config) -> bytes:
    """The key every value in the store is signed with: --rdzv-secret-file's content; for a
    single-node job without one, a random key only this daemon knows. A multi-node job without
    one runs only with --insecure-no-secret (config.build), and says so once."""
    if cfg.rdzv_secret_file:
        return signing.load_secret(cfg.rdzv_secret_file)
    if cfg.max_nodes == 1:
        return signing.new_secret()
    log.warning(
        "rdzv_no_secret",
        endpoint=cfg.rdzv_endpoint,
        fix="give every node --rdzv-secret-file (the same file): with --insecure-no-secret, anyone who "
        "reaches the store can restart, stop or redirect the job",
    )
    return b""


def _run(text: str) -> str | None:
    nonce, _, created = text.partition(" ")
    return (
        nonce
        if len(nonce) == 16 and all(c in "0123456789abcdef" for c in nonce) and _time(created)
        else None
    )


def _time(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < 1e11 else None  # finite, after 1970, before year 5000


def _closed(text: str) -> tuple[float, str] | None:
    issued, _, why = text.partition(" ")
    when = _time(issued)
    return (when, why) if when is not None and len(why) <= MAX_REASON else None


def _count(text: str) -> int | None:
    return (
        int(text)
        if text.isascii() and text.isdigit() and len(text) < 20 and int(text) < MAX_COUNT
        else None
    )


def _budget(text: str) -> tuple[int, int] | None:
    used, _, number = text.partition(" ")
    a, b = _count(used), _count(number)
    return (a, b) if a is not None and b is not None else None


def _done(text: str) -> bool | None:
    return True if text == "1" else None


def _safe_name(text: object, limit: int = 255) -> bool:
    return (
        isinstance(text, str)
        and 0 < len(text) <= limit
        and all(c.isalnum() or c in ".-:_%" for c in text)
    )


def _master(text: str) -> tuple[str, int] | None:
    addr, _, port = text.partition(" ")
    n = _count(port)
    if n is None or not 0 < n < 65536 or not _safe_name(addr):
        return None
    return addr, n


def _record(text: str) -> dict | None:
    if len(text) > 1024:
        return None
    r = json.loads(text)
    if not isinstance(r, dict) or not _safe_name(r.get("id"), 128) or not _safe_name(r.get("addr")):
        return None
    nproc, prev = r.get("nproc"), r.get("prev")
    if (
        type(nproc) is not int
        or not 1 <= nproc <= 1 << 20
        or type(prev) is not int
        or not -1 <= prev < 1 << 20
    ):
        return None
    return r


def _members(text: str) -> dict | None:
    if len(text) > signing.MAX_VALUE:
        return None
    value = json.loads(text)
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("members"), list)
        or not value["members"]
    ):
        return None
    members = []
    for m in value["members"]:
        if not (
            isinstance(m, list)
            and len(m) == 3
            and _safe_name(m[0], 128)
            and type(m[1]) is int
            and 1 <= m[1] <= 1 << 20
            and _safe_name(m[2])
        ):
            return None
        members.append(Member(m[0], m[1], m[2]))
    lost = value.get("lost", [])
    if not isinstance(lost, list) or not all(_safe_name(x, 128) for x in lost):
        return None
    if len({m.node_id for m in members}) != len(members):
        return None
    failed = value.get("failed")
    if failed is not None and not isinstance(failed, str):
        return None
    return {"members": members, "lost": lost, "failed": failed}


def _reason(text: str) -> dict | None:
    if len(text) > MAX_REASON:
        return None
    value = json.loads(text)
    if not isinstance(value, dict) or not isinstance(value.get("summary"), str):
        return None
    if not isinstance(value.get("node", ""), str) or not all(
        isinstance(value.get(k, False), bool) for k in ("scale", "spends")
    ):
        return None
    for name in ("lost", "waiting"):
        ids = value.get(name, [])
        if (
            not isinstance(ids, list)
            or len(ids) > 1 << 16
            or not all(_safe_name(x, 128) for x in ids)
        ):
            return None
    return value
