"""bench/sharded.py end to end at a tiny size: the costs of every method under torchrun and one
kill -9 under `elasticd run` and one node lost of two, resumed from elasticd's sharded in-memory
state (the lost node's shards from the survivor's replica); one JSON row with
the figures the benchmark promises and values that make sense."""

from __future__ import annotations

import json

import pytest

from harness import bench

pytest.importorskip("torch.distributed.fsdp")


def test_sharded_bench_at_a_tiny_size(tmp_path):
    r = bench(
        "sharded.py",
        *("--worlds", "2", "--sizes", "1", "--saves", "2", "--every", "4"),
        *("--launchers", "elasticd", "--timeout", "60", "--recovery-timeout", "20"),
        *("--workdir", str(tmp_path), "--json"),
        timeout=210,
    )
    (row,) = json.loads(r.stdout.splitlines()[-1])
    costs = row["costs"]
    assert 0.8e6 < costs["state_bytes"] < 1.2e6, costs
    for method in ("dcp", "dcp-async", "elasticd"):
        c = costs[method]
        assert 0 < c["stall_s"] <= c["write_s"] < 10 and 0 < c["load_s"] < 10, (method, c)
    assert 0 < costs["elasticd"]["refresh_s"] < 10, costs  # the sharded in-memory refresh
    e = row["elasticd"]
    assert e["recovered"] == "1/1" and 0 < e["recovery_s"] < 20, e
    # killed at step 10: the in-memory state (refreshed every step or few at this size) resumes
    # it, not the disk checkpoint of step 8
    assert e["source"] == "memory" and 0 <= e["steps_lost"] <= 2, e
    assert "kill -9 resume   elasticd" in r.stdout and "torchrun" not in r.stdout
    # two nodes of one rank, the non-host's SIGKILLed: the survivor resumes alone from its own
    # shards and its replica of the lost rank's, sent in the background at every refresh. An
    # exchange (both ranks' MACs) spans a step or two of this size on a loaded 2-core box, so the
    # newest replica can trail by that; it still loses less than the disk interval would
    n = row["node_loss"]
    assert n["source"] == "memory" and 0 < n["recovery_s"] < 30, n
    assert 0 <= n["steps_lost"] <= 4, n  # --every 4: disk would lose up to 4 plus the kill's lag
    assert 0.2e6 < n["replica_bytes"] < 1.2e6 and n["replica_ms"] > 0, n
    assert "node lost        elasticd" in r.stdout


@pytest.mark.skipif(
    not hasattr(__import__("torch").distributed, "_reconfigure"),
    reason="in-place recovery needs torch>=2.14",
)
def test_sharded_bench_in_place_times_the_survivors_part_and_the_replacements(tmp_path):
    """--launchers elasticd-in-place: the kill recovered with the survivor's pid kept, from
    memory, and its two parts (the survivor's own phases, the replacement's) each timed."""
    r = bench(
        "sharded.py",
        *("--worlds", "2", "--sizes", "1", "--every", "4", "--no-costs"),
        *("--launchers", "elasticd-in-place", "--timeout", "60", "--recovery-timeout", "20"),
        *("--workdir", str(tmp_path), "--json"),
        timeout=150,
    )
    (row,) = json.loads(r.stdout.splitlines()[-1])
    x = row["elasticd-in-place"]
    assert x["recovered"] == "1/1" and x["kept"] == "1/1" and x["source"] == "memory", x
    assert 0 < x["survivors_s"] < 20 and 0 < x["replacement_s"] < 20, x
    assert 0 <= x["steps_lost"] <= 2, x
    assert "kill -9 in place" in r.stdout and "node lost" not in r.stdout
