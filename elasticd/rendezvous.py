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
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import tenacity
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from elasticd import logs
from elasticd.config import Config, ConfigError

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

_RESTART = "elasticd/restart"
_DONE = "elasticd/done"
_MASTER = "elasticd/master"


class RendezvousFailed(Exception):
    """The job cannot form (unreachable store, join timeout, closed): one clear line."""


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
    """One per daemon. Rounds come from torch's DynamicRendezvousHandler (c10d backend)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.store, self.is_host = open_store(cfg)
        self.addr = cfg.local_addr or local_address(cfg.rdzv_host, cfg.rdzv_port)
        backend = C10dRendezvousBackend(self.store, cfg.rdzv_id)
        self.handler = DynamicRendezvousHandler.from_backend(
            run_id=cfg.rdzv_id,
            store=self.store,
            backend=backend,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            local_addr=self.addr,
            timeout=RendezvousTimeout(join=td(cfg.join_timeout), last_call=td(cfg.last_call_timeout),
                                      close=td(30), heartbeat=td(5)),
            keep_alive_interval=1,
            keep_alive_max_attempt=max(2, int(cfg.peer_timeout)),
        )
        self._job_key = f"elasticd/{cfg.rdzv_id}"

    @property
    def endpoint(self) -> str:
        return f"{self.cfg.rdzv_host}:{self.store.port}"

    def next_round(self, nproc: int) -> Round:
        try:
            info = self.handler.next_rendezvous()
        except RendezvousClosedError:
            why = self.job_failure()
            raise RendezvousFailed(f"the job failed on another node: {why}" if why else
                                   "the job's rendezvous is closed: the job already finished or failed") from None
        except RendezvousError as e:
            raise RendezvousFailed(f"rendezvous failed: {e}") from None
        rnd = Round(group_rank=info.rank, group_world_size=info.world_size, store=info.store)
        rnd.store.set(f"elasticd/nproc/{rnd.group_rank}", str(nproc))
        keys = [f"elasticd/nproc/{r}" for r in range(rnd.group_world_size)]
        rnd.store.wait(keys, td(self.cfg.join_timeout))
        counts = [int(v) for v in rnd.store.multi_get(keys)]
        rnd.rank_base, rnd.world_size = sum(counts[: rnd.group_rank]), sum(counts)
        if rnd.group_rank == 0:
            rnd.worker_store = serve_store(self.addr, 0, max(self.cfg.join_timeout, 60.0))
            rnd.store.set(_MASTER, f"{self.addr} {rnd.worker_store.port}")
        rnd.store.wait([_MASTER], td(self.cfg.join_timeout))
        addr, port = rnd.store.get(_MASTER).decode().split()
        rnd.master_addr, rnd.master_port = addr, int(port)
        return rnd

    # --- restart propagation and peer liveness (per round) ---

    def request_restart(self, rnd: Round, reason: dict) -> bool:
        """Ask every node to restart this round. True when we were first (we own the failure)."""
        first = rnd.store.add("elasticd/restart_votes", 1) == 1
        if first:
            rnd.store.set(_RESTART, json.dumps(reason))
        return first

    def restart_reason(self, rnd: Round) -> dict | None:
        if rnd.group_world_size == 1 or not rnd.store.check([_RESTART]):
            return None
        return json.loads(rnd.store.get(_RESTART))

    def beat_and_check_peers(self, rnd: Round, now: float) -> int | None:
        """Bump our liveness counter and return the group rank of a peer silent for peer_timeout."""
        if rnd.group_world_size == 1:
            return None
        rnd._alive_counter = rnd.store.add(f"elasticd/alive/{rnd.group_rank}", 1)
        peers = [r for r in range(rnd.group_world_size) if r != rnd.group_rank]
        keys = [f"elasticd/alive/{r}" for r in peers]
        present = [k for k in keys if rnd.store.check([k])] if len(rnd.peer_seen) < len(peers) else keys
        values = dict(zip(present, rnd.store.multi_get(present))) if present else {}
        for r, k in zip(peers, keys):
            count = int(values.get(k, b"0") or 0)
            seen = rnd.peer_seen.get(r)
            if seen is None or count != seen[0]:
                rnd.peer_seen[r] = (count, now)
            elif now - seen[1] > self.cfg.peer_timeout:
                return r
        return None

    def nodes_waiting(self) -> int:
        return self.handler.num_nodes_waiting()

    def exit_barrier(self, rnd: Round, timeout: float, poll: float = 0.05) -> bool:
        """Wait until every node of the round is done (or asked for a restart). False on timeout."""
        if rnd.group_world_size == 1:
            return True
        rnd.store.add(_DONE, 1)
        alive = f"elasticd/alive/{rnd.group_rank}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rnd.store.add(alive, 1)  # still here: peers still running must not think us lost
            if int(rnd.store.add(_DONE, 0)) >= rnd.group_world_size or rnd.store.check([_RESTART]):
                return True
            time.sleep(poll)
        return False

    # --- job-wide restart budget (shared by all nodes) ---

    def restarts_used(self) -> int:
        return int(self.store.add(f"{self._job_key}/restarts", 0))

    def spend_restart(self) -> int:
        return int(self.store.add(f"{self._job_key}/restarts", 1))

    def record_job_failure(self, summary: str) -> None:
        """Tell the other nodes why the job failed, before closing the rendezvous."""
        self.store.set(f"{self._job_key}/failure", summary)

    def job_failure(self) -> str | None:
        key = f"{self._job_key}/failure"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except (RuntimeError, dist.DistStoreError):
            return None

    def close(self, job_finished: bool) -> None:
        try:
            if job_finished:
                self.handler.set_closed()
            self.handler.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            log.warning("rendezvous_shutdown_failed", error=str(e))
