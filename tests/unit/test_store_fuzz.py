"""What crosses the store's trust boundary: any value under any key of a job (on a c10d TCPStore,
on etcd, in a single-node job's in-process store) is garbage or a verdict sealed for this run,
never a crash or a hang; and a run never takes a value of an earlier run of the same --rdzv-id
for its own. Real stores (etcd: a real 3-member cluster on loopback), real Rendezvous objects."""

from __future__ import annotations

import datetime
import itertools
import time

import pytest
import structlog
import torch.distributed as dist

from elasticd import config, names
from elasticd.cluster import kv, rendezvous, tcpstore
from etcd_cluster import shared_cluster_fixture  # noqa: F401 (the fixture: cluster)
from harness import secret_flags

_jobs = itertools.count()


@pytest.fixture(params=["tcpstore", "etcd", "local"])
def store(request):
    """(a new KV connection to one store, the config a node of a job on it gets)."""
    secret = secret_flags()[1]

    def cfg(**extra):
        settings_ = {
            "entrypoint": "x.py",
            "nnodes": "1:2",
            "rdzv_id": f"fuzz{next(_jobs)}",
            "last_call_timeout": 0,
            "join_timeout": 4,
            "peer_timeout": 2,
            "rdzv_secret_file": secret,
            **extra,
        }
        if request.param == "etcd":
            settings_.update(
                rdzv_backend="etcd", rdzv_endpoint=request.getfixturevalue("cluster").endpoints
            )
        elif request.param == "tcpstore":
            settings_["rdzv_endpoint"] = f"127.0.0.1:{port}"
        else:
            settings_["nnodes"] = "1"
        return config.build(settings_, None, environ={})

    port, made = 0, []
    if request.param == "local":
        local = kv.LocalKV()
        yield local.clone, cfg
        return
    if request.param == "etcd":
        from elasticd.cluster import etcd

        endpoints = request.getfixturevalue("cluster").endpoints

        def connect():
            made.append(etcd.connect(endpoints, timeout=5))
            return made[-1]

        yield connect, cfg
        for s in made:
            s.close()
        return
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    port = server.port
    yield (
        (
            lambda: tcpstore.TCPStoreKV(
                tcpstore.tcp_connector("127.0.0.1", port), f"127.0.0.1:{port}", timeout=10
            )
        ),
        cfg,
    )
    del server


def test_rejections_are_rate_limited_overall(store):
    """A forger writing a thousand keys gets a line per key at first, then at most
    REJECTED_LOGS lines a window in all, each saying how many it stood for."""
    connect, make_cfg = store
    r = rendezvous.Rendezvous(make_cfg(), store=connect(), begins_run=True)
    with structlog.testing.capture_logs() as logged:
        for i in range(1000):
            assert r.open(f"{r.scope}/forged/{i}", b"not sealed", str) is None
    lines = [e for e in logged if e["event"] == "store_value_rejected"]
    assert len(lines) == rendezvous.REJECTED_LOGS, len(lines)
    r.kv.close()


def test_a_value_of_an_earlier_run_never_verifies_in_the_next(store):
    """Two runs of one --rdzv-id with one secret (a job started again): every value the first
    wrote, copied under the second's keys, fails; the second forms its rounds from its own."""
    connect, make_cfg = store
    cfg = make_cfg()
    a = rendezvous.Rendezvous(cfg, store=connect(), begins_run=True)
    rnd_a = a.next_round(1)
    a.close(True, "finished")
    recorded = {k: a.kv.get(k) for k in a.kv.keys(f"elasticd/{a.scope}/")}
    assert any(k.endswith("/closed") for k in recorded) and any(
        k.endswith("/master") for k in recorded
    )
    b = rendezvous.Rendezvous(cfg, store=connect(), begins_run=True)  # a new run (its store's host)
    assert b.run != a.run
    for k, v in recorded.items():
        b.kv.set(k.replace(a.scope, b.scope), v)
    rnd_b = b.next_round(1)  # no "the job has ended", members and master its own
    assert rnd_b.members[0].node_id == b.node_id and rnd_b.master_port != rnd_a.master_port
    assert b.signer.rejected >= 2
    rnd_a.close()
    rnd_b.close()


def test_a_job_end_issued_before_this_daemon_started_is_no_verdict(store):
    """A closing sealed for this run yet issued before the daemon started (less CLOCK_SKEW) is
    not about it; one issued since is, and the node leaves with it."""
    connect, make_cfg = store
    r = rendezvous.Rendezvous(make_cfg(), store=connect(), begins_run=True)
    key = names.job_key(r.scope, names.CLOSED)
    r.kv.set(key, r.seal(key, f"{time.time() - rendezvous.CLOCK_SKEW - 600:.3f} finished long ago"))
    r.next_round(1).close()
    r.close(True, "finished")
    with pytest.raises(rendezvous.RendezvousFailed, match=r"the job has ended \(finished\)"):
        r.next_round(1)


def test_on_etcd_a_node_begins_a_new_run_only_after_the_last_one_ended_before_it(store, request):
    """etcd's keys outlive runs: a node that finds a run still going joins it, one that ended
    while (or after) it started is the job's end, and one that ended before it started is an
    earlier run of the same --rdzv-id: it begins the next."""
    if "etcd" not in request.node.callspec.id:
        pytest.skip("etcd only: a c10d store is new every run")
    connect, make_cfg = store
    cfg = make_cfg()
    a = rendezvous.Rendezvous(cfg, store=connect())
    b = rendezvous.Rendezvous(cfg, store=connect())
    assert b.run == a.run  # the run going on
    a.close(True, "finished")
    c = rendezvous.Rendezvous(cfg, store=connect())
    assert c.run == a.run
    with pytest.raises(rendezvous.RendezvousFailed, match="has ended"):
        c.next_round(1)
    key = names.job_key(a.scope, names.CLOSED)
    a.kv.set(key, a.seal(key, f"{time.time() - rendezvous.CLOCK_SKEW - 600:.3f} finished"))
    d = rendezvous.Rendezvous(cfg, store=connect())
    assert d.run != a.run
    d.next_round(1).close()
