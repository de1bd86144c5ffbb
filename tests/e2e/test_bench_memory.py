"""bench/memory.py end to end, one worker, a second after its first step: every process of each
launcher's tree is read and named (elasticd: daemon, death guard, fork server, warm spare,
worker; torchrun: agent, worker), with figures that make sense."""

from __future__ import annotations

import json

from harness import bench


def test_memory_bench_names_every_process_of_both_launchers():
    args = ("--nproc", "1", "--settle", "1", "--timeout", "60", "--json")
    r = bench("memory.py", *args, timeout=180)
    got = json.loads(r.stdout.splitlines()[-1])
    ours, theirs = got["elasticd"]["processes"], got["torchrun"]["processes"]
    assert set(ours) == {"launcher", "guard", "fork server", "spare", "worker"}, ours
    assert set(theirs) == {"launcher", "worker"}, theirs
    assert len(ours["worker"]) == len(theirs["worker"]) == 1
    for launcher in got.values():
        rows = [row for rows in launcher["processes"].values() for row in rows]
        assert all(0 < row["uss"] <= row["pss"] <= row["rss"] for row in rows), rows
        assert launcher["total"]["pss"] == sum(row["pss"] for row in rows)
    assert "ratio elasticd/torchrun" in r.stderr
