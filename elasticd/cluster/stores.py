"""Opening the control plane's store for a config: the etcd cluster (--rdzv-backend etcd), the
c10d TCPStore this node hosts or connects to, or a dict in the daemon for a single-node job;
connections retried with backoff until --join-timeout, failures as one line with what to check.
Imports tcpstore.py, so torch.distributed, only for a multi-node c10d store.

The c10d store is hosted bound to the endpoint's address only. On the store's host, a rendezvous
port another user's process holds is one line, exit 2 (`refuse_squatter`: the listener's uid from
/proc/net/tcp, `listener_owner`); the daemon's own user or root is another node's daemon, which
this node joins. `op_timeout` and `local_address` serve the callers; `etcd_hint` turns an etcd
failure's causes into what to check.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import pwd
import socket
import struct
import time
from typing import TYPE_CHECKING

import tenacity

from elasticd import logs, names
from elasticd.cluster import kv as kvmod
from elasticd.cluster.errors import RendezvousFailed
from elasticd.config import Config, ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

log = logs.get("elasticd.rendezvous")


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
    """The etcd cluster at --rdzv-endpoint (etcd/), retried with backoff until --join-timeout
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
        wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=2.0),
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
    "tls": "check --etcd-cacert (the CA that signed the members' certificates) and that the "
    "members' certificates name the hosts in --rdzv-endpoint",
    "refused": "nothing listens there: check the ports in --rdzv-endpoint and that etcd runs on "
    "those hosts",
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
    # torch loads here, for a multi-node c10d store only (the rest of cluster/ is torch-free)
    from elasticd.cluster.tcpstore import TCPStoreKV, serve_store, tcp_connector

    host, port = cfg.rdzv_host, cfg.rdzv_port
    server = None
    try:
        server = serve_store(host, port, max(cfg.join_timeout, 60.0))
        port = server.port
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            refuse_squatter(host, port)  # else another node's daemon on this host: join it
        elif e.errno not in (errno.EADDRNOTAVAIL, errno.EACCES):
            raise RendezvousFailed(
                f"cannot use --rdzv-endpoint {host}:{port} ({e.strerror})"
            ) from None
    store = TCPStoreKV(tcp_connector(host, port), f"{host}:{port}", op_timeout(cfg))
    retry = tenacity.Retrying(
        stop=tenacity.stop_after_delay(cfg.join_timeout),
        wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=2.0),
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


def refuse_squatter(host: str, port: int) -> None:
    """The rendezvous port on one of our addresses is taken: by another node's daemon on this
    host (this user's, or root's: then this node is its client, as across hosts), or by another
    user's process, which would make this node, the store's host, that process's client. Then
    ConfigError: one line naming who holds it (exit 2)."""
    owner = listener_owner(host, port)
    if owner is None or owner[0] in (os.geteuid(), 0):
        return
    uid, inode = owner
    pid = _socket_pid(inode)
    try:
        who = f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        who = f"uid {uid}"
    if pid is not None:
        who += f", pid {pid}"
    raise ConfigError(
        f"--rdzv-endpoint port {port} on {host} is taken by another user's process ({who}): "
        "the store's host must bind it itself; free the port or pick another with "
        "--rdzv-endpoint"
    )


def listener_owner(host: str, port: int) -> tuple[int, str] | None:
    """(uid, socket inode) of the socket listening on `port` at `host`'s address or a wildcard
    one, as the kernel lists them (/proc/net/tcp, tcp6: this network namespace's); None when no
    such listener is listed."""
    try:
        wanted = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, port)}
    except (OSError, ValueError):
        return None
    wanted |= {ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
    wanted |= {ipaddress.ip_address(f"::ffff:{a}") for a in wanted if a.version == 4}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "0A":  # TCP_LISTEN
                continue
            address, _, hex_port = cols[1].partition(":")
            if int(hex_port, 16) == port and _proc_address(address) in wanted:
                return int(cols[7]), cols[9]
    return None


def _proc_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp writes it: 32-bit words in host byte order."""
    words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
    return ipaddress.ip_address(b"".join(struct.pack("=I", w) for w in words))


def _socket_pid(inode: str) -> int | None:
    """The process holding socket `inode`, where /proc lets us see its descriptors."""
    target = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return int(pid)
            except OSError:
                continue
    return None
