"""Where the etcd cluster's members are: `--rdzv-endpoint`'s list parsed (`parse_endpoints`,
`Endpoint`), the TLS settings of https members, the member this node talks to first
(`preferred_endpoint`: this machine's own, else one at random), and a member's addresses (name
resolution).
"""

from __future__ import annotations

import ipaddress
import random
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from elasticd.cluster.etcd.errors import Failed, one_line

DEFAULT_PORT = 2379


@dataclass(frozen=True)
class Endpoint:
    scheme: str  # "http" or "https"
    host: str
    port: int

    def __str__(self) -> str:
        return self.url if self.scheme == "https" else self.url.removeprefix("http://")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_endpoints(text: str | Sequence[str], tls: bool = False) -> list[Endpoint]:
    """Endpoints from "h1:2379,h2:2379" (or a list), each `[scheme://]host[:port]`; the scheme is
    https when TLS options are given, http otherwise; the port 2379 when left out. ValueError
    when malformed."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[Endpoint] = []
    for raw in items:
        item = raw.strip()
        if not item:
            raise ValueError(f"etcd endpoints {text!r}: an empty endpoint")
        scheme = "https" if tls else "http"
        if "://" in item:
            scheme, item = item.split("://", 1)
            if scheme not in ("http", "https"):
                raise ValueError(f"etcd endpoint {raw.strip()!r}: the scheme must be http or https")
        item = item.rstrip("/")
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ("" if not rest else None)
        elif item.count(":") == 1:
            host, port_text = item.split(":")
        elif ":" in item:
            host, port_text = item, ""  # a bare IPv6 address
        else:
            host, port_text = item, ""
        if port_text is None or not host or any(c in host for c in "/?#@ "):
            raise ValueError(f"etcd endpoint {raw.strip()!r}: expected host:port")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise ValueError(f"etcd endpoint {raw.strip()!r}: the port must be a number") from None
        if not 0 < port < 65536:
            raise ValueError(f"etcd endpoint {raw.strip()!r}: the port must be 1-65535")
        out.append(Endpoint(scheme, host, port))
    if not out:
        raise ValueError("etcd endpoints: none given")
    return out


def tls_context(
    cacert: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """The TLS settings of an https endpoint: the CA bundle that signed the members' certificates
    (the system's trust store when None), and this client's certificate and key when the cluster
    asks for one (--client-cert-auth). Hostnames (or IP addresses) are checked against the
    certificates. ValueError, one line, when a file cannot be loaded."""
    if key and not cert:
        raise ValueError("etcd TLS: a client key needs its certificate (--etcd-cert)")
    try:
        ctx = ssl.create_default_context(cafile=cacert) if cacert else ssl.create_default_context()
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"etcd TLS: cannot load {cacert if cacert and not cert else cert}: {one_line(e)}"
        ) from None
    return ctx


def preferred_endpoint(endpoints: Sequence[Endpoint]) -> int:
    """The member to talk to first: the first one on this machine (etcd run beside the node: its
    own member fails only with the node, and a partition that cuts a member off cuts off only
    that member's node), else one at random (the nodes spread over the members)."""
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    for i, ep in enumerate(endpoints):
        if _addresses(ep.host) & mine:
            return i
    return random.randrange(len(endpoints))


def _addresses(host: str) -> set[str]:
    """host's addresses (an IP literal as it is, a name as the resolver gives it; none if it
    cannot)."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {
            str(ai[4][0]).split("%")[0]
            for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        }
    except (OSError, UnicodeError):
        return set()


def resolve(ep: Endpoint) -> list[tuple]:
    """The addresses of ep's host; Failed when its name does not resolve (lasting, unless the
    resolver says to try again later)."""
    try:
        return socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise Failed(
            f"cannot resolve host {ep.host} ({e.strerror})",
            applied_maybe=False,
            cause="dns",
            lasting=e.errno != socket.EAI_AGAIN,
        ) from None
    except (OSError, UnicodeError) as e:
        raise Failed(
            f"cannot resolve host {ep.host} ({one_line(e)})",
            applied_maybe=False,
            cause="dns",
            lasting=True,
        ) from None
