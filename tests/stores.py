"""The control plane's three stores for tests that run the same code against each: a c10d
TCPStore served in the test process, the shared etcd cluster (the `cluster` fixture of
etcd_cluster.py), or a single-node job's in-process store. `connections` is the body of a
parametrised fixture; each connection it makes is a new kv.KV to the same store."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator

import pytest

from elasticd.cluster import kv, tcpstore

BACKENDS = ["tcpstore", "etcd", "local"]


def connections(
    request: pytest.FixtureRequest, timeout: float = 5.0
) -> Iterator[tuple[Callable[[], kv.KV], str]]:
    """(a function making a new connection, the store's endpoint as a node's flags name it:
    "host:port", the etcd endpoints, or "" for the in-process store); the store and every
    connection made are closed after the test. `timeout`: a TCPStore call's."""
    if request.param == "local":
        first = kv.LocalKV()
        yield first.clone, ""
        return
    if request.param == "etcd":
        from elasticd.cluster import etcd

        endpoints = request.getfixturevalue("cluster").endpoints
        made: list[kv.KV] = []

        def open_etcd() -> kv.KV:
            made.append(etcd.connect(endpoints, timeout=5))
            return made[-1]

        yield open_etcd, endpoints
        for s in made:
            s.close()
        return
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    port = server.port

    def open_tcp() -> kv.KV:
        return tcpstore.TCPStoreKV(
            tcpstore.tcp_connector("127.0.0.1", port), f"127.0.0.1:{port}", timeout=timeout
        )

    yield open_tcp, f"127.0.0.1:{port}"
    del server
