"""bench/memory.py end to end, one worker, a second after its first step: every process of each
launcher's tree is read and named (elasticd: daemon, death guard, fork server, warm spare,
worker; torchrun: agent, worker), with figures that make sense; where torch can re-form a group
in place (2.14), the in-place path's column beside today's in the same run."""

from __future__ import annotations

import json

import torch.distributed as dist

from harness import bench

IN_PLACE = hasattr(dist, "_reconfigure")  # torch >= 2.14


def test_memory_bench_names_every_process_of_each_launcher():
    launchers = "elasticd,elasticd-in-place,torchrun" if IN_PLACE else "elasticd,torchrun"
    args = ("--nproc", "1", "--settle", "1", "--timeout", "60", "--json", "--launchers", launchers)
    r = bench("memory.py", *args, timeout=240)
    got = json.loads(r.stdout.splitlines()[-1])
    assert set(got) == set(launchers.split(",")), got.keys()
    for name, launcher in got.items():
        procs = launcher["processes"]
        if name == "torchrun":
            assert set(procs) == {"launcher", "worker"}, procs
        else:
            assert set(procs) == {"launcher", "guard", "fork server", "spare", "worker"}, procs
        assert len(procs["worker"]) == 1, procs
        rows = [row for rows in procs.values() for row in rows]
        assert all(0 < row["uss"] <= row["pss"] <= row["rss"] for row in rows), rows
        assert launcher["total"]["pss"] == sum(row["pss"] for row in rows)
    assert "ratio elasticd/torchrun" in r.stderr
    assert got["elasticd"]["path"] == "restart" and got["torchrun"]["path"] is None
    if IN_PLACE:  # the daemon took the path each column names
        assert got["elasticd-in-place"]["path"] == "in_place"
        assert "ratio elasticd-in-place/torchrun" in r.stderr
        assert "elasticd-in-place - elasticd, PSS" in r.stderr
