"""bench/scale.py runs end to end at 16 simulated nodes: both systems on c10d, and elasticd on a
3-member etcd cluster; every phase bounded, one JSON object with the keys the benchmark promises
and values that make sense."""

from __future__ import annotations

import json

import pytest

from etcd_cluster import SKIP_REASON, etcd_binary
from harness import bench

KEYS = {
    "nodes",
    "round_s",
    "torchrun_round_s",
    "propagation_s",
    "detection_s",
    "recovery_s",
    "store_requests_per_s",
    "store_cpu",
}
# short windows, two processes
SHORT = [
    "--nodes",
    "16",
    "--json",
    "--procs",
    "2",
    "--window",
    "1",
    "--warmup",
    "0.5",
    "--timeout",
    "30",
]


def run_bench(*extra: str) -> tuple[dict, str]:
    proc = bench("scale.py", *SHORT, *extra, timeout=90)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    r = json.loads(lines[0])
    assert set(r) == KEYS, r
    assert r["nodes"] == 16
    return r, proc.stderr[-3000:]


def assert_elasticd_phases(r: dict, err: str) -> None:
    assert 0 < r["round_s"] < 10, (r, err)
    assert 0 <= r["propagation_s"] < 1, (r, err)
    assert 0.5 <= r["detection_s"] < 3, (
        r,
        err,
    )  # evidence path: LOST_SILENCE (1.25 s) after the last beat seen
    # detection, the restart request naming the lost node, the round of the 14 left
    assert 0.5 <= r["recovery_s"] < 6, (r, err)


def test_scale_bench_at_16_nodes():
    r, err = run_bench("--torch-window", "1")  # about 20 s on an idle 2-core machine
    assert_elasticd_phases(r, err)
    assert r["torchrun_round_s"] is not None and r["torchrun_round_s"] > 0, (r, err)
    # 16 nodes beat 4 times a second (a set and a read of 3 counters: 3 requests) and wait on the
    # restart key
    assert 100 < r["store_requests_per_s"] < 1000, r
    assert 0 <= r["store_cpu"] < 0.5, r


def test_scale_bench_on_etcd_at_16_nodes():
    if etcd_binary() is None:
        pytest.skip(SKIP_REASON)
    r, err = run_bench("--backend", "etcd")  # about 17 s on an idle 2-core machine
    assert_elasticd_phases(r, err)
    assert r["torchrun_round_s"] is None, (
        r
    )  # torch's etcd backend (python-etcd, etcd's v2 API) is not run
    # HTTP requests: per node 4 puts and 4 reads of 3 counters a second, a read and a watch on the
    # restart key, the waiting-nodes check
    assert 100 < r["store_requests_per_s"] < 1000, r
    assert 0 < r["store_cpu"] < 2, r  # three members' CPU, each write fsynced by all three
