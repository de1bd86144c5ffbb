"""Thin adapter over torch's public c10d rendezvous: join a round, watch peers, exit barrier.

We create the TCPStore ourselves so it binds to the endpoint's address only (torch's own helper
binds every interface) and so binding never races: the socket is bound once and handed to the
store as a listening fd. Each round then gets:
- a prefixed view of the store (torch's `torch.rendezvous.<run>.<round>`) for our per-round keys:
  restart requests, per-node liveness counters, the exit barrier;
- a brand-new worker store on a freshly bound port, hosted by group rank 0, for
  TORCHELASTIC_USE_AGENT_STORE workers. Nothing of an earlier attempt (keys such as gloo/NCCL
  addresses, a peer still shutting down) can be read by a later one.
"""

from __future__ import annotations

import datetime
import errno
import functools
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import tenacity
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    dynamic_rendezvous,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from elasticd import logs, names, signing
from elasticd.config import Config, ConfigError
from elasticd.signed_backend import SignedBackend

log = logs.get("elasticd.rendezvous")

# We build the worker store ourselves; stop torch's handler from also opening one on all interfaces.
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


def _method_name(depth: int = 2) -> str:
    """torch's dynamic_rendezvous.get_method_name, the same name at a fraction of the cost.

    torch names every rendezvous event after its caller with two inspect.stack() calls, which
    read source lines and scan sys.modules for every frame, even when events go nowhere. The
    keep-alive timer records several events a second while a job runs: that alone was a third of
    the daemon's CPU while watching. Frame 0 is this function, as in torch's."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


if hasattr(dynamic_rendezvous, "get_method_name"):
    dynamic_rendezvous.get_method_name = _method_name

MAX_REASON = 8 * 1024  # bytes of a restart reason's JSON
MAX_COUNT = 1 << 62


class RendezvousFailed(Exception):
    """The job cannot form (unreachable store, join timeout, closed): one clear line."""


class StoreLost(RendezvousFailed):
    """A store call failed while the job ran: the node hosting the store is gone or unreachable."""


def _store_call(method):
    """A store error in a Rendezvous method (torch raises DistNetworkError with a C++ stack when
    the store's host dies) becomes one line naming the store and what to do; the agent then stops
    its workers and exits 1."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (dist.DistError, TimeoutError, RendezvousConnectionError) as e:
            cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise StoreLost(f"lost the rendezvous store at {self.endpoint} ({cause}): the node hosting it "
                            "stopped or the network failed; start the job again on every node") from None

    return wrapper


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(1024)
    except OSError:
        s.close()
        raise
    return s


def serve_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A TCPStore server listening on host:port only; the store owns (and closes) the socket."""
    listener = bind_listener(host, port)
    bound = listener.getsockname()[1]
    return dist.TCPStore(host, bound, None, True, td(timeout), wait_for_workers=False,
                         master_listen_fd=listener.detach())


def connect_store(host: str, port: int, timeout: float, deadline_s: float) -> dist.TCPStore:
    """Client connection, retried with backoff until `deadline_s` (the join timeout)."""
    retry = tenacity.Retrying(
        stop=tenacity.stop_after_delay(deadline_s),
        wait=tenacity.wait_exponential_jitter(initial=0.1, max=2.0),
        retry=tenacity.retry_if_exception_type((RuntimeError, OSError, TimeoutError, dist.DistStoreError)),
        before_sleep=lambda st: log.info("store_connect_retry", endpoint=f"{host}:{port}",
                                         attempt=st.attempt_number),
        reraise=True,
    )
    try:
        for attempt in retry:
            with attempt:
                return dist.TCPStore(host, port, None, False, td(min(timeout, max(deadline_s, 1.0))))
    except (RuntimeError, OSError, TimeoutError, dist.DistStoreError) as e:
        raise RendezvousFailed(
            f"cannot reach the rendezvous store at {host}:{port} within {deadline_s:g}s ({type(e).__name__}): "
            "check --rdzv-endpoint and that elasticd runs on the host node"
        ) from None
    raise AssertionError("unreachable")


def local_address(host: str, port: int) -> str:
    """The address of ours that routes to the rendezvous host: what peers can reach us at."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if host != "::1" else "::1"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 1))
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def open_store(cfg: Config) -> tuple[dist.TCPStore, bool]:
    """Host the store when the endpoint is one of our addresses and its port is free; else join."""
    host, port = cfg.rdzv_host, cfg.rdzv_port
    store_timeout = max(cfg.join_timeout, 60.0)
    try:
        return serve_store(host, port, store_timeout), True
    except OSError as e:
        if cfg.max_nodes == 1:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--rdzv-endpoint port {port} on {host} is in use: pick a free port") from None
            raise ConfigError(f"--rdzv-endpoint {host}:{port} cannot be bound here ({e.strerror}): "
                              "a single-node job hosts its own store") from None
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise RendezvousFailed(f"cannot use --rdzv-endpoint {host}:{port} ({e.strerror})") from None
    return connect_store(host, port, store_timeout, cfg.join_timeout), False


@dataclass
class Round:
    """One completed rendezvous round: this node's place and the keys it shares with peers."""

    group_rank: int
    group_world_size: int
    store: dist.Store  # prefixed per round
    number: int = 0  # torch's round number: every value of ours in the round is signed for it
    rank_base: int = 0
    world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    worker_store: dist.TCPStore | None = None  # held by group rank 0 for the round's workers
    _alive_counter: int = 0
    # group rank -> (its liveness counter, the monotonic time the counter last moved)
    peer_seen: dict[int, tuple[int, float]] = field(default_factory=dict)

    def close(self) -> None:
        self.worker_store = None  # dropping the last reference stops the server


class Rendezvous:
    """One per daemon. Rounds come from torch's DynamicRendezvousHandler (c10d backend).

    Everything read back from the store is checked: torch's state by SignedBackend, our own
    values by `_open` (the job secret's HMAC for the round and key, then the value's form). A
    value that fails is logged and treated as absent, so a process that reaches the store's port
    without the secret can disturb the job as a network fault would, never run code in the
    daemon, point workers elsewhere or spend the restart budget."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.signer = signing.Signer(job_secret(cfg), cfg.rdzv_id)
        self.store, self.is_host = open_store(cfg)
        self.addr = cfg.local_addr or local_address(cfg.rdzv_host, cfg.rdzv_port)
        self.backend = SignedBackend(C10dRendezvousBackend(self.store, cfg.rdzv_id), self.signer)
        self.handler = DynamicRendezvousHandler.from_backend(
            run_id=cfg.rdzv_id,
            store=self.store,
            backend=self.backend,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            local_addr=self.addr,
            timeout=RendezvousTimeout(join=td(cfg.join_timeout), last_call=td(cfg.last_call_timeout),
                                      close=td(30), heartbeat=td(5)),
            keep_alive_interval=1,
            keep_alive_max_attempt=max(2, int(cfg.peer_timeout)),
        )
        self._restarts_seen = 0  # the budget counter only grows: an older value is a replay
        self._logged: dict[str, float] = {}

    @property
    def endpoint(self) -> str:
        return f"{self.cfg.rdzv_host}:{self.store.port}"

    @_store_call
    def next_round(self, nproc: int) -> Round:
        try:
            info = self.handler.next_rendezvous()
        except RendezvousClosedError:
            why = self.job_failure()
            raise RendezvousFailed(f"the job failed on another node: {why}" if why else
                                   "the job's rendezvous is closed: the job already finished or failed") from None
        except RendezvousConnectionError:
            raise  # the store is gone: _store_call says so
        except RendezvousError as e:
            hint = (f"; {self.signer.rejected} store value(s) failed verification: give every node the same "
                    "--rdzv-secret-file" if self.signer.rejected else "")
            raise RendezvousFailed(f"rendezvous failed: {e}{hint}") from None
        rnd = Round(group_rank=info.rank, group_world_size=info.world_size, store=info.store,
                    number=round_number(self.handler))
        keys = [names.nproc_key(r) for r in range(rnd.group_world_size)]
        rnd.store.set(keys[rnd.group_rank], self._seal(rnd, keys[rnd.group_rank], str(nproc)))
        counts = self._read_all(rnd, keys, _nproc)
        rnd.rank_base, rnd.world_size = sum(counts[: rnd.group_rank]), sum(counts)
        if rnd.group_rank == 0:
            rnd.worker_store = serve_store(self.addr, 0, max(self.cfg.join_timeout, 60.0))
            rnd.store.set(names.MASTER, self._seal(rnd, names.MASTER, f"{self.addr} {rnd.worker_store.port}"))
        rnd.master_addr, rnd.master_port = self._read_all(rnd, [names.MASTER], _master)[0]
        return rnd

    def _read_all(self, rnd: Round, keys: list[str], parse) -> list:
        """Wait for every key and return their values once all verify. A key whose value does
        not is read again (its writer's value may still replace a forger's) until --join-timeout;
        then the round fails with a line naming the likely cause."""
        deadline = time.monotonic() + self.cfg.join_timeout
        rnd.store.wait(keys, td(self.cfg.join_timeout))
        while True:
            values = [self._open(rnd, k, v, parse) for k, v in zip(keys, rnd.store.multi_get(keys))]
            if all(v is not None for v in values):
                return values
            if time.monotonic() > deadline:
                bad = [k for k, v in zip(keys, values) if v is None]
                raise RendezvousFailed(f"store values {', '.join(bad)} fail verification: give every node the same "
                                       "--rdzv-secret-file, and firewall the store's port to the job's nodes")
            time.sleep(0.1)

    def _seal(self, rnd: Round | None, key: str, payload: str) -> bytes:
        return self.signer.seal(f"{rnd.number if rnd else 'job'}/{key}", payload)

    def _open(self, rnd: Round | None, key: str, raw: bytes, parse):
        """The parsed value, or None (logged) when it is not sealed for this round and key with
        the job's secret or is not of its form."""
        data = self.signer.open(f"{rnd.number if rnd else 'job'}/{key}", raw)
        value = None
        if data is not None:
            try:
                value = parse(data.decode())
            except (ValueError, UnicodeDecodeError, RecursionError):
                value = None
        if value is None:
            now = time.monotonic()
            if now - self._logged.get(key, -60.0) >= 5.0:  # a forger in a loop must not flood the log
                self._logged[key] = now
                log.warning("store_value_rejected", key=key, rejected=self.signer.rejected,
                            why="bad signature" if data is None else "malformed")
        return value

    # --- restart propagation and peer liveness (per round) ---

    @_store_call
    def request_restart(self, rnd: Round, reason: dict) -> bool:
        """Ask every node to restart this round. True when we were first (we own the failure).
        A value in the way that does not verify is a forger's: ours replaces it."""
        sealed = self._seal(rnd, names.RESTART, json.dumps(reason))
        found = rnd.store.compare_set(names.RESTART, "", sealed)
        if found == sealed:
            return True
        if self._open(rnd, names.RESTART, found, _reason) is not None:
            return False
        rnd.store.set(names.RESTART, sealed)
        return True

    @_store_call
    def restart_reason(self, rnd: Round) -> dict | None:
        if rnd.group_world_size == 1 or not rnd.store.check([names.RESTART]):
            return None
        return self._open(rnd, names.RESTART, rnd.store.get(names.RESTART), _reason)

    def _beat(self, rnd: Round) -> None:
        rnd._alive_counter += 1
        key = names.alive_key(rnd.group_rank)
        rnd.store.set(key, self._seal(rnd, key, str(rnd._alive_counter)))

    @_store_call
    def beat_and_check_peers(self, rnd: Round, now: float) -> int | None:
        """Bump our liveness counter and return the group rank of a peer silent for peer_timeout.
        Only a counter that verifies and went up counts as a beat."""
        if rnd.group_world_size == 1:
            return None
        self._beat(rnd)
        peers = [r for r in range(rnd.group_world_size) if r != rnd.group_rank]
        keys = [names.alive_key(r) for r in peers]
        present = [k for k in keys if rnd.store.check([k])] if len(rnd.peer_seen) < len(peers) else keys
        values = dict(zip(present, rnd.store.multi_get(present))) if present else {}
        for r, k in zip(peers, keys):
            count = self._open(rnd, k, values[k], _count) if k in values else 0
            seen = rnd.peer_seen.get(r)
            if seen is None or (count is not None and count > seen[0]):
                rnd.peer_seen[r] = (count or 0, now)
            elif now - seen[1] > self.cfg.peer_timeout:
                return r
        return None

    @_store_call
    def nodes_waiting(self) -> int:
        return self.handler.num_nodes_waiting()

    @_store_call
    def exit_barrier(self, rnd: Round, timeout: float, poll: float = 0.05) -> bool:
        """Wait until every node of the round is done (or asked for a restart). False on timeout."""
        if rnd.group_world_size == 1:
            return True
        keys = [names.done_key(r) for r in range(rnd.group_world_size)]
        mine = keys[rnd.group_rank]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rnd.store.set(mine, self._seal(rnd, mine, "1"))  # again each time: a forger may have written over it
            self._beat(rnd)  # still here: peers still running must not think us lost
            if rnd.store.check(keys) and all(self._open(rnd, k, v, _done) for k, v in
                                             zip(keys, rnd.store.multi_get(keys))):
                return True
            if self.restart_reason(rnd) is not None:
                return True
            time.sleep(poll)
        return False

    # --- job-wide restart budget (shared by all nodes) ---

    @_store_call
    def restarts_used(self) -> int:
        key = names.restarts_key(self.cfg.rdzv_id)
        if self.store.check([key]):
            used = self._open(None, key, self.store.get(key), _count)
            self._restarts_seen = max(self._restarts_seen, used or 0)
        return self._restarts_seen

    @_store_call
    def spend_restart(self) -> int:
        """Add one to the job's signed counter: read, then compare-and-set, again if another
        node spent one meanwhile. A value that does not verify (or went down: a replay) counts
        as the highest this node has seen, and is written over."""
        key = names.restarts_key(self.cfg.rdzv_id)
        for _ in range(100):
            raw = self.store.get(key) if self.store.check([key]) else b""
            used = max(self._open(None, key, raw, _count) or 0, self._restarts_seen) if raw else self._restarts_seen
            sealed = self._seal(None, key, str(used + 1))
            if self.store.compare_set(key, raw, sealed) == sealed:
                self._restarts_seen = used + 1
                return used + 1
        raise RendezvousFailed("the restart budget in the store changed 100 times while one restart was "
                               "spent: something other than the job's nodes writes to the store")

    @_store_call
    def record_job_failure(self, summary: str) -> None:
        """Tell the other nodes why the job failed, before closing the rendezvous."""
        key = names.failure_key(self.cfg.rdzv_id)
        self.store.set(key, self._seal(None, key, summary[:MAX_REASON]))

    def job_failure(self) -> str | None:
        key = names.failure_key(self.cfg.rdzv_id)
        try:
            return self._open(None, key, self.store.get(key), str) if self.store.check([key]) else None
        except (RuntimeError, dist.DistStoreError):
            return None

    def close(self, job_finished: bool) -> None:
        """Best effort at exit; torch's keep-alive timer stops even when the store is gone."""
        try:
            if job_finished:
                self.handler.set_closed()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            log.warning("rendezvous_close_failed", error=str(e))
        try:
            self.handler.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            log.warning("rendezvous_shutdown_failed", error=str(e))


# --- the secret, the round, and the forms of our values ---


def job_secret(cfg: Config) -> bytes:
    """The key every value in the store is signed with: --rdzv-secret-file's content; for a
    single-node job without one, a random key only this daemon knows. A multi-node job without
    one says, once, that anyone reaching the store's port can steer it."""
    if cfg.rdzv_secret_file:
        return signing.load_secret(cfg.rdzv_secret_file)
    if cfg.max_nodes == 1:
        return signing.new_secret()
    log.warning("rdzv_no_secret", endpoint=cfg.rdzv_endpoint,
                fix="give every node --rdzv-secret-file (the same file): without it, anyone who reaches "
                    "the store's port can restart, stop or redirect the job")
    return b""


def round_number(handler: DynamicRendezvousHandler) -> int:
    """torch's number of the round just joined: the prefix of the round's keys. Read right after
    next_rendezvous: the round cannot move on before every participant, us included, leaves it.
    (torch has no public accessor; the handler's state is the one SignedBackend verified.)"""
    return int(handler._state_holder.state.round)


def _count(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) < 20 and int(text) < MAX_COUNT else None


def _nproc(text: str) -> int | None:
    n = _count(text)
    return n if n is not None and 1 <= n <= 1 << 20 else None


def _done(text: str) -> bool | None:
    return True if text == "1" else None


def _master(text: str) -> tuple[str, int] | None:
    addr, _, port = text.partition(" ")
    n = _count(port)
    if n is None or not 0 < n < 65536 or not addr or len(addr) > 255:
        return None
    if not all(c.isalnum() or c in ".-:_%" for c in addr):
        return None
    return addr, n


def _reason(text: str) -> dict | None:
    if len(text) > MAX_REASON:
        return None
    value = json.loads(text)
    if not isinstance(value, dict) or not isinstance(value.get("summary"), str):
        return None
    if not isinstance(value.get("node", ""), str) or not isinstance(value.get("scale", False), bool):
        return None
    return value
